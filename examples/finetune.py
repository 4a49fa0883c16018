"""Fine-tuning as users do it: a frozen lower half, recomputed blocks, a loss over tokens.

    python examples/finetune.py                                     # one process
    torchrun --standalone --nproc_per_node=2 examples/finetune.py   # two processes

The byte-level language model of ``examples/text.py`` is pretrained briefly on the
standard library's sources, as a stand-in for a downloaded checkpoint. It is then
fine-tuned on another kind of text, the standard library's docstring-like comment
lines, one line per row: rows of different lengths, right-padded, so the loss is a
sum over the real bytes divided by their count over every rank and micro-batch
(``mean='tokens'``). The lower half is frozen (its parameters travel with the
buffers and never change); the trainable upper blocks are recomputed in the
backward instead of kept (``remat``). The script prints the held-out bits per byte
of the comment lines before and after, and the activation bytes the forward kept
with and without the recomputation.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from text import ByteLM, corpus, windows  # the same directory: examples/text.py
from torch.utils.data import DataLoader, TensorDataset

import pardist


def comment_lines(limit: int, context: int) -> TensorDataset:
    """Comment lines of the standard library, right-padded: (inputs, labels; -100 = none)."""
    text = bytes(corpus(4 * limit).to(torch.uint8).tolist())
    lines = [s.strip() for s in text.split(b"\n") if s.strip().startswith(b"#")][: limit // 40]
    x = torch.zeros(len(lines), context, dtype=torch.long)
    y = torch.full((len(lines), context), -100)
    for i, line in enumerate(lines):
        row = torch.tensor(list(line[: context + 1]))
        x[i, : len(row) - 1], y[i, : len(row) - 1] = row[:-1], row[1:]
    return TensorDataset(x, y)


def train(apply, params, buffers, loader, steps, lr, loss_fn, mean, accumulate=1):
    """``steps`` AdamW steps over ``loader`` (cycled); the trained params."""
    opt = pardist.optim.adamw(lr, weight_decay=0.01)
    opt_state = opt.init(params)
    vg = pardist.value_and_grad(loss_fn, mean=mean, accumulate=accumulate)

    @pardist.data_parallel(donate_argnums=(0, 1))
    def step(params, opt_state, buffers, batch):
        loss, grads = vg(params, buffers, *batch)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, opt_state, loss

    done, epoch = 0, 0
    while done < steps:
        loader.set_epoch(epoch)
        for batch in loader:
            params, opt_state, loss = step(params, opt_state, buffers, batch)
            done += 1
            if done == steps:
                break
        epoch += 1
    pardist.print0(
        f"  after {steps} steps: training loss {loss.item() / math.log(2):.3f} bits/byte"
    )
    return params


def held_out_bits(apply, params, buffers, valid, total) -> float:
    """Bits per byte over every held-out row's real bytes (exact at any world size)."""
    sums, counts = [], []
    for x, y in valid:
        logits, _ = apply(params, buffers, x, train=False)
        nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        sums.append(nll.view(len(x), -1).sum(1))
        counts.append((y != -100).sum(1))
    nll, n = pardist.gather((torch.cat(sums), torch.cat(counts)), total=total)
    return nll.sum().item() / n.sum().item() / math.log(2)


def kept_bytes(apply, params, buffers, x) -> int:
    """The bytes the forward keeps for the backward (parameters, kept anyway, left out)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    inputs = {k: v.detach().requires_grad_() for k, v in params.items()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        apply(inputs, buffers, x)
    mine = {t.untyped_storage().data_ptr() for t in [*inputs.values(), *buffers.values()]}
    return sum(n for ptr, n in seen.items() if ptr not in mine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=200_000, help="pretraining corpus size")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pretrain-steps", type=int, default=150)
    parser.add_argument("--steps", type=int, default=100, help="fine-tuning steps")
    parser.add_argument("--bs", type=int, default=32, help="global batch size")
    args = parser.parse_args()

    pardist.init()
    pardist.seed_everything(0)
    model = ByteLM(args.context, layers=args.layers)

    def mean_loss(params, buffers, x, y):  # pretraining: every window is full
        return F.cross_entropy(apply(params, buffers, x)[0].flatten(0, 1), y.flatten())

    pardist.print0(f"pretraining {args.layers} blocks on {args.bytes} bytes of sources")
    apply, params, buffers = pardist.functional(model)
    loader = DataLoader(windows(corpus(args.bytes), args.context), batch_size=args.bs)
    params = train(
        apply, params, buffers, pardist.data.shard(loader, split_batches=True),
        args.pretrain_steps, 3e-3, mean_loss, "ranks",
    )  # fmt: skip
    model.load_state_dict(pardist.state_dict(params, buffers, model))  # the "checkpoint"

    lines = comment_lines(args.bytes, args.context)
    cut = int(0.9 * len(lines))
    train_set, valid_set = TensorDataset(*lines[:cut]), TensorDataset(*lines[cut:])
    valid = pardist.data.shard(DataLoader(valid_set, batch_size=128))
    half = args.layers // 2
    for module in (model.embed, *model.blocks.layers[:half]):
        module.requires_grad_(False)  # the lower half: frozen
    model.position.requires_grad_(False)
    upper = [f"blocks.layers.{i}" for i in range(half, args.layers)]
    apply, params, buffers = pardist.functional(model, remat=pardist.Remat(blocks=upper))
    plain = pardist.functional(model)  # the same model, every activation kept
    before = held_out_bits(apply, params, buffers, valid, len(valid_set))
    pardist.print0(
        f"fine-tuning the upper {args.layers - half} blocks on {len(train_set)} comment "
        f"lines (held-out before: {before:.3f} bits/byte)"
    )

    def token_loss(params, buffers, x, y):  # a sum over the real bytes, and their count
        logits, _ = apply(params, buffers, x)
        total = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        return total, (y != -100).sum()

    loader = DataLoader(train_set, batch_size=args.bs, shuffle=True, drop_last=True)
    params = train(
        apply, params, buffers, pardist.data.shard(loader, split_batches=True),
        args.steps, 1e-3, token_loss, "tokens", accumulate=2,
    )  # fmt: skip
    after = held_out_bits(apply, params, buffers, valid, len(valid_set))
    x = train_set[: args.bs // pardist.world_size()][0]
    kept, full = kept_bytes(apply, params, buffers, x), kept_bytes(*plain, x)
    pardist.print0(
        f"held-out comment lines: {after:.3f} bits/byte (before fine-tuning: {before:.3f}; "
        f"{len(valid_set)} lines, {pardist.world_size()} process(es))"
    )
    pardist.print0(
        f"activations kept for the backward: {kept / 2**20:.2f} MiB with the upper blocks "
        f"recomputed, {full / 2**20:.2f} MiB without ({kept / full:.0%})"
    )
    pardist.shutdown()


if __name__ == "__main__":
    main()
