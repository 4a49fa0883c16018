"""Activation checkpointing (remat): the activation bytes a training step keeps, and its time.

    python benchmarks/memory.py            # 40 rounds: 10 min on 2 vCPUs at load 10, less idle
    torchrun --standalone --nproc_per_node=2 benchmarks/memory.py
    python benchmarks/memory.py --d-model 512 --seq 256 --batch 2 --steps 10 --threads 2

A GPT-like pre-norm transformer (embeddings; ``--layers`` blocks of LayerNorm, causal
F.scaled_dot_product_attention, LayerNorm, 4x GELU MLP; LayerNorm, LM head) trains one SGD
step (forward, backward, update) each way below, ``--batch`` sequences per rank: pardist's
data_parallel step on functional(model) with no remat (its baseline), remat=
'nothing_saveable' (every block recomputed), 'dots_saveable' (matmul and attention outputs
kept), Remat(every=2) (every other block); plain torch's module with loss.backward() (DDP at
2+ ranks, so that both reduce gradients) and with torch.utils.checkpoint(block, x,
use_reentrant=False) around every block.

Bytes, from one step of each (the largest over ranks): on CPU the distinct storages that
the forward keeps for the backward, seen by one saved_tensors_hooks around every variant's
forward, plus what selective checkpointing caches itself; on CUDA max_memory_allocated
during the forward less the memory allocated before it. Time: the median over rounds of
the slowest rank's step, the variants taking turns (vs_ddp's interleaved_ms).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils import checkpoint as ckpt
from torch.utils._pytree import tree_leaves

import pardist

sys.path.insert(0, os.path.dirname(__file__))
from vs_ddp import interleaved_ms  # noqa: E402  (the same interleaving as vs_ddp)

GOAL = (
    "full recompute keeps <= 30% of the activation bytes at <= 1.4x the step time, within 5% "
    "of plain torch's own checkpointing"
)
LABELS = {  # variant: (label, remat for pardist)
    "pardist": ("pardist, no remat", None),
    "full": ("pardist, remat='nothing_saveable'", "nothing_saveable"),
    "dots": ("pardist, remat='dots_saveable'", "dots_saveable"),
    "every2": ("pardist, Remat(every=2)", pardist.Remat(every=2)),
    "torch": ("torch, no checkpoint", None),
    "torch_ckpt": ("torch, checkpoint(block) every block", None),
}


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int, ckpt=False):
        super().__init__()
        self.ckpt = ckpt  # torch's own checkpointing around every block
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = ckpt.checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return self.head(self.ln(x))


class Meter:
    """The activation bytes of the forward run under ``meter.forward(params)`` while
    ``meter.on``; the same for every variant, so pardist and torch count the same thing."""

    def __init__(self):
        self.on, self.bytes = False, 0

    def measure(self, step) -> int:
        """The bytes that the forward of one ``step()`` keeps."""
        gc.collect()  # the last graph gone (the hook's references make cycles): not counted
        self.on = True
        try:
            step()
        finally:
            self.on = False
        gc.collect()
        return self.bytes

    @contextlib.contextmanager
    def forward(self, params):
        if not self.on:
            yield
            return
        if pardist.device().type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            yield
            self.bytes = torch.cuda.max_memory_allocated() - before
            return
        # Parameters, and views of them (a linear saves weight.t()), are kept whether or
        # not anything is recomputed: excluded by their storage's address.
        params = {p.untyped_storage().data_ptr() for p in params}
        kept = {}  # storage address -> bytes: each storage counted once

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                kept[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        # Selective checkpointing (dots) keeps its saved outputs in torch's dispatch mode
        # (private, torch 2.4+), not through autograd, so no saved-tensor hook sees them:
        # read them there. `type is`, not isinstance: that would touch deprecated objects.
        for mode in gc.get_objects():
            if type(mode) is ckpt._CachedTorchDispatchMode:
                for entry in tree_leaves([list(d.values()) for d in mode.storage.values()]):
                    t = getattr(entry, "val", None)  # a _VersionWrapper of the output
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
                        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.bytes = sum(kept.values())


def loss_of(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def pardist_step(model, x, y, lr, remat, meter):
    apply, params, buffers = pardist.functional(model, remat=remat)
    sgd = pardist.optim.sgd(lr=lr, momentum=0.9)
    state = {"all": (params, buffers, sgd.init(params))}

    def loss_fn(params, buffers, x, y):
        with meter.forward(params.values()):
            logits, buffers = apply(params, buffers, x)
            return loss_of(logits, y), buffers

    @pardist.data_parallel(donate_argnums=(0, 2))
    def step(params, buffers, opt_state, batch):
        grads, buffers = pardist.grad(loss_fn, has_aux=True)(params, buffers, *batch)
        params, opt_state = sgd.update(grads, opt_state, params)
        return params, buffers, opt_state

    def run():
        state["all"] = step(*state["all"], (x, y))

    return run


def torch_step(model, x, y, lr, meter):
    net = nn.parallel.DistributedDataParallel(model) if pardist.world_size() > 1 else model
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)

    def run():
        opt.zero_grad(set_to_none=True)
        with meter.forward(net.parameters()):
            loss = loss_of(net(x), y)
        loss.backward()
        opt.step()

    return run


def variants(args, meter: Meter) -> dict:
    device = pardist.device()
    g = torch.Generator().manual_seed(pardist.rank())  # each rank its own batch
    x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def make(ckpt=False):
        torch.manual_seed(0)  # every variant starts from the same weights
        return GPT(args.vocab, args.seq, args.d_model, args.layers, args.heads, ckpt)

    pardists = [k for k in LABELS if not k.startswith("torch")]
    out = {k: pardist_step(make(), x, y, args.lr, LABELS[k][1], meter) for k in pardists}
    out["torch"] = torch_step(make().to(device), x, y, args.lr, meter)
    out["torch_ckpt"] = torch_step(make(ckpt=True).to(device), x, y, args.lr, meter)
    return out


def table(kept: dict, ms: dict) -> str:
    base = {k: "torch" if k.startswith("torch") else "pardist" for k in kept}
    like = {"pardist": "torch", "full": "torch_ckpt"}  # the same work in plain torch
    lines = [
        "| variant | activation MB | bytes / no remat | ms / step | time / no remat "
        "| time / plain torch's like |",
        "|---|---|---|---|---|---|",
    ]
    for k, (label, _) in LABELS.items():
        vs = f"{ms[k] / ms[like[k]]:.2f}" if k in like else "-"
        lines.append(
            f"| {label} | {kept[k] / 2**20:.1f} | {kept[k] / kept[base[k]]:.2f} | {ms[k]:.1f} "
            f"| {ms[k] / ms[base[k]]:.2f} | {vs} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = {"layers": 12, "d-model": 256, "heads": 4, "seq": 128, "batch": 4, "vocab": 256}
    # --threads: torch threads per rank; one, as vs_ddp: on a loaded machine a second
    # OpenMP thread waits at every op for its descheduled partner (5 s steps seen here).
    for flag, default in {**sizes, "lr": 1e-3, "steps": 40, "warmup": 3, "threads": 1}.items():
        parser.add_argument(f"--{flag}", type=type(default), default=default)
    args = parser.parse_args()
    pardist.init()
    torch.set_num_threads(args.threads)
    meter = Meter()
    fns = variants(args, meter)
    ms = interleaved_ms(fns, args.steps, args.warmup)
    kept = {k: meter.measure(fn) for k, fn in fns.items()}  # after warm steps: caches made
    ranks = [None] * pardist.world_size()
    dist.all_gather_object(ranks, kept)
    kept = {k: max(r[k] for r in ranks) for k in kept}
    full = kept["full"] / kept["pardist"], ms["full"] / ms["pardist"], ms["full"] / ms["torch_ckpt"]
    pardist.print0(
        f"memory.py: {args.layers}-block GPT (d_model {args.d_model}, seq {args.seq}, batch "
        f"{args.batch} per rank, vocab {args.vocab}), {pardist.world_size()} rank(s), "
        f"{pardist.device()}, {torch.get_num_threads()} thread(s), median of {args.steps} "
        f"steps. Goal: {GOAL}."
    )
    pardist.print0(table(kept, ms))
    met = full[0] <= 0.30 and full[1] <= 1.4 and full[2] <= 1.05
    pardist.print0(
        f"full recompute: {full[0]:.2f} of the bytes, {full[1]:.2f}x the time, {full[2]:.2f}x "
        f"torch's checkpointing: goal {'met' if met else 'NOT met'}."
    )
    pardist.shutdown()


if __name__ == "__main__":
    main()
