"""Fine-tuning as users do it: a Hugging Face GPT-2 with a LoRA adapter (peft) and
gradient checkpointing, in bf16, pardist's step against the loop it replaces.

    python benchmarks/finetune.py                          # one process (the GPU if any)
    torchrun --nproc-per-node 2 benchmarks/finetune.py     # against DDP at 2 ranks
    python benchmarks/finetune.py --dim 64 --layers 2 --seq 32 --steps 4   # a quick try

The reference is plain torch on one process (``loss.backward()``, torch's fused AdamW
where the device has it) or DDP around the same loop at more ranks; pardist trains the
same model from the same weights with ``data_parallel``, ``value_and_grad`` and its
AdamW, donated. Both run under bf16 autocast with ``activation_checkpointing_enable``
(``use_reentrant=False``) and only the LoRA weights trainable, on the same batches,
interleaved step by step. Prints milliseconds per step (medians over steps after a
warm-up; CUDA-synchronised), the losses' largest relative difference, and how far
the trained LoRA weights are apart, relative to how far they moved (relative L2),
beside the same two numbers for a second torch run from the same start: on a GPU,
torch's bf16 attention backward is not deterministic, so that run is the noise floor.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from vs_ddp import sync

import pardist


def build(args) -> torch.nn.Module:
    import peft
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=args.vocab, n_embd=args.dim, n_layer=args.layers, n_head=args.dim // 64 or 1,
        n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = tf.GPT2LMHeadModel(config)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True)
    model = peft.get_peft_model(model, lora).to(pardist.device())
    model.train()
    return model


def batches(args, steps: int) -> list[torch.Tensor]:
    """This rank's rows of every step's batch (the same global batches at any world size)."""
    g = torch.Generator().manual_seed(1)
    rank, world = pardist.rank(), pardist.world_size()
    out = []
    for _ in range(steps):
        ids = torch.randint(0, args.vocab, (args.bs * world, args.seq), generator=g)
        out.append(ids[rank * args.bs : (rank + 1) * args.bs].to(pardist.device()))
    return out


def bf16():
    return torch.autocast(pardist.device().type, dtype=torch.bfloat16)


def torch_loop(args):
    model = build(args)
    if pardist.world_size() > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = pardist.device().type == "cuda"
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0, fused=fused)
    names = [k for k, p in model.named_parameters() if p.requires_grad]

    def step(ids):
        opt.zero_grad(set_to_none=True)
        with bf16():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.detach()

    def weights():
        return {k.removeprefix("module."): p.detach() for k, p in zip(names, trainable)}

    return step, weights


def pardist_loop(args):
    model = build(args)
    apply, params, buffers = pardist.functional(model)  # frozen weights are buffers
    opt = pardist.optim.adamw(args.lr, weight_decay=0.0)
    state = {"all": (params, opt.init(params))}

    def loss_fn(params, ids):
        with bf16():
            return apply(params, buffers, input_ids=ids, labels=ids)[0].loss

    @pardist.data_parallel(donate_argnums=(0, 1))
    def train_step(params, opt_state, ids):
        loss, grads = pardist.value_and_grad(loss_fn)(params, ids)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, opt_state, loss

    def step(ids):
        params, opt_state, loss = train_step(*state["all"], ids)
        state["all"] = (params, opt_state)
        return loss

    return step, lambda: state["all"][0]


def rel_l2(a: dict, b: dict, start: dict) -> float:
    num = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in b)
    den = sum(((b[k].double() - start[k].double()) ** 2).sum() for k in b)
    return (num / den).sqrt().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bs", type=int, default=8, help="rows per rank")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    pardist.init()
    data = batches(args, args.warmup + args.steps)
    ref_step, ref_weights = torch_loop(args)
    our_step, our_weights = pardist_loop(args)
    again_step, again_weights = torch_loop(args)  # torch's own run-to-run difference
    start = {k: v.clone() for k, v in ref_weights().items()}
    times: dict[str, list] = {"torch": [], "pardist": [], "again": []}
    losses: dict[str, list] = {"torch": [], "pardist": [], "again": []}
    for i, ids in enumerate(data):
        for name, step in (("torch", ref_step), ("pardist", our_step), ("again", again_step)):
            if dist.is_initialized():
                dist.barrier()
            sync()
            t0 = time.perf_counter()
            loss = step(ids)
            sync()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            if name != "pardist" and pardist.world_size() > 1:  # DDP's loss is its rank's
                dist.all_reduce(loss := loss.float())  # pardist's is the global batch's
                loss /= pardist.world_size()
            losses[name].append(loss.float().item())
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    worst = {
        k: max(abs(a - b) / abs(b) for a, b in zip(losses[k], losses["torch"]))
        for k in ("pardist", "again")
    }
    apart = {
        k: rel_l2(w(), ref_weights(), start)
        for k, w in (("pardist", our_weights), ("again", again_weights))
    }
    if pardist.rank() == 0:
        ref = "DDP" if pardist.world_size() > 1 else "plain torch"
        dev = torch.cuda.get_device_name() if pardist.device().type == "cuda" else "CPU"
        print(f"{dev}, torch {torch.__version__}, {pardist.world_size()} rank(s), {vars(args)}")
        print(f"| loop | ms/step | tokens/s per rank | vs {ref} |\n|---|---|---|---|")
        for k in ("torch", "pardist"):
            tokens = args.bs * args.seq / ms[k] * 1e3
            print(f"| {k if k == 'pardist' else ref} | {ms[k]:.1f} | {tokens:.0f} "
                  f"| {ms[k] / ms['torch']:.2f} |")  # fmt: skip
        print(f"losses: first {losses['torch'][0]:.4f}, last {losses['torch'][-1]:.4f} (torch); "
              f"largest relative difference {worst['pardist']:.2e}; LoRA weights apart "
              f"{apart['pardist']:.2e} of how far they moved; a second torch run from the "
              f"same start: {worst['again']:.2e} and {apart['again']:.2e}")  # fmt: skip
    pardist.shutdown()


if __name__ == "__main__":
    main()
