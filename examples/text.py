"""A byte-level transformer language model, data parallel, on Python's own source code.

    python examples/text.py                                         # one process
    torchrun --standalone --nproc_per_node=2 examples/text.py       # two processes

fastai's text example in pardist's shape, on real text that every machine has and that
needs no download: the standard library's ``.py`` files (nanoGPT's shakespeare_char in
spirit, bytes instead of characters). A small causal transformer learns to predict the
next byte; the script prints the held-out loss in bits per byte against the unigram
baseline (the bytes' own entropy), computed exactly over every held-out window with
pardist.gather, whatever the number of processes.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pardist


class ByteLM(nn.Module):
    def __init__(self, context: int, width: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 256)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.position[:n]
        return self.head(self.blocks(h, mask=self.mask[:n, :n], is_causal=True))


def corpus(limit: int) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def windows(data: torch.Tensor, context: int) -> TensorDataset:
    """Non-overlapping windows: inputs and the next bytes."""
    n = (len(data) - 1) // context
    x = data[: n * context].view(n, context)
    y = data[1 : n * context + 1].view(n, context)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=300_000, help="corpus size")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--bs", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    pardist.init()
    pardist.seed_everything(0)
    data = corpus(args.bytes)
    cut = int(0.9 * len(data))
    train_set, valid_set = windows(data[:cut], args.context), windows(data[cut:], args.context)
    counts = torch.bincount(data[:cut], minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    unigram = -(p * p.log2()).sum().item()  # bits per byte of the best context-free guess

    train = pardist.data.shard(
        DataLoader(train_set, batch_size=args.bs, shuffle=True, drop_last=True),
        split_batches=True,
    )
    valid = pardist.data.shard(DataLoader(valid_set, batch_size=128))
    apply, params, buffers = pardist.functional(ByteLM(args.context))
    steps = args.epochs * len(train)
    schedule = pardist.optim.warmup_cosine(args.lr, warmup_steps=steps // 10, total_steps=steps)
    opt = pardist.optim.chain(
        pardist.optim.clip_by_global_norm(1.0), pardist.optim.adamw(schedule, weight_decay=0.1)
    )
    opt_state = opt.init(params)

    def loss_fn(params, buffers, x, y):
        logits, _ = apply(params, buffers, x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    @pardist.data_parallel(donate_argnums=(0, 2))
    def step(params, buffers, opt_state, batch):
        loss, grads = pardist.value_and_grad(loss_fn)(params, buffers, *batch)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, opt_state, loss

    for epoch in range(args.epochs):
        train.set_epoch(epoch)
        for batch in train:
            params, opt_state, loss = step(params, buffers, opt_state, batch)
        pardist.print0(f"epoch {epoch}: training loss {loss.item() / math.log(2):.3f} bits/byte")
    sums = []
    for x, y in valid:  # this rank's held-out windows: each one's summed loss
        logits, _ = apply(params, buffers, x, train=False)
        nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        sums.append(nll.view(len(x), -1).sum(1))
    every = pardist.gather(torch.cat(sums), total=len(valid_set))
    bits = every.sum().item() / (len(valid_set) * args.context) / math.log(2)
    pardist.print0(
        f"held-out: {bits:.3f} bits/byte (unigram baseline: {unigram:.3f}; "
        f"{len(valid_set)} windows, {pardist.world_size()} process(es))"
    )
    pardist.shutdown()


if __name__ == "__main__":
    main()
