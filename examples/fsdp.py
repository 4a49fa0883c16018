"""A small GPT trained with FSDP: parameters, gradients and AdamW state sharded over the ranks.

    torchrun --standalone --nproc_per_node=2 examples/fsdp.py     # or: python examples/fsdp.py

The model learns to continue sequences that count up by a fixed step (mod the
vocabulary), from random starts and steps. Its token embedding is also its output
layer (tied, as in GPT-2). Compared with plain data parallelism two lines change:
``params = pardist.fsdp(params)`` and, optionally, which modules are gathered
together (``fsdp_units={nn.TransformerEncoderLayer}``); the step is the same.
Prints the loss every 20 steps and the memory each rank holds.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import pardist


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, 0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: used by the first and the last module
        for table in (self.wte, self.wpe):  # GPT-2's initialisation: small logits at first
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        for block in self.h:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.ln(x))


def batch(step: int, size: int, vocab: int, ctx: int):
    """Sequences start + k * stride (mod vocab): each rank draws its own part of the batch."""
    g = torch.Generator().manual_seed(step * 1000 + pardist.rank())
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 5, (size, 1), generator=g)
    seq = (start + stride * torch.arange(ctx + 1)) % vocab
    return seq[:, :-1], seq[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--bs", type=int, default=16, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    vocab, ctx = 64, 16
    pardist.init()
    pardist.seed_everything(0)  # the same initial parameters on every rank, before sharding
    model = GPT(vocab, d=64, layers=4, heads=4, ctx=ctx)
    apply, params, _ = pardist.functional(model, fsdp_units={nn.TransformerEncoderLayer})
    del model
    params = pardist.fsdp(params)  # each rank keeps 1/N of every parameter
    opt = pardist.optim.adamw(args.lr, weight_decay=0.0)
    opt_state = opt.init(params)  # sharded like the parameters

    def loss_fn(params, x, y):
        logits, _ = apply(params, {}, x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    @pardist.data_parallel(donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        loss, grads = pardist.value_and_grad(loss_fn)(params, *batch)  # grads: shards
        params, opt_state = opt.update(grads, opt_state, params)
        return params, opt_state, loss

    per_rank = args.bs // pardist.world_size()
    for step in range(args.steps):
        params, opt_state, loss = train_step(params, opt_state, batch(step, per_rank, vocab, ctx))
        if step % 20 == 0 or step == args.steps - 1:
            pardist.print0(f"step {step:4d}  loss {float(loss):.4f}")
    mine = sum(p.to_local().numel() for p in params.values())
    total = sum(p.numel() for p in params.values())
    pardist.print0(
        f"final loss {float(loss):.4f}; parameters per rank: {mine} of {total} "
        f"({pardist.world_size()} process(es))"
    )
    pardist.shutdown()


if __name__ == "__main__":
    main()
