"""The price of bit-identical training: ``deterministic=G`` against the default step.

    python benchmarks/deterministic.py                 # 1, 2 and 4 ranks, G = 12
    python benchmarks/deterministic.py --ranks 1 2 --groups 24

The same global batch (48 rows) at every world size, each rank on its slice, one
thread per rank. Each model runs, interleaved step by step in one process group, as:

    default        the README's step: value_and_grad(has_aux) + optim.adamw
    deterministic  the same step with data_parallel(..., deterministic=G)

Models: ``convnet`` (two conv + batch-norm blocks on 3x32x32 images), ``mlp``
(3 x Linear(512, 512) with dropout) and ``transformer`` (two encoder layers,
width 128, 32 tokens). Reports the median ms per step of the slowest rank and the
ratio; prints a Markdown table and writes benchmarks/results/deterministic.{md,json}.
More ranks than cores (4 on a 2-core machine) share the cores: compare ratios
within a row, not across rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import pardist

sys.path.insert(0, os.path.dirname(__file__))
from overhead import pardist_step  # noqa: E402  (the README's step)
from vs_ddp import interleaved_ms  # noqa: E402  (the same interleaving as vs_ddp)

ROWS = 48


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.1, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.body(self.embed(x)).mean(1))


def convnet() -> nn.Module:
    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.MaxPool2d(2)]  # fmt: skip

    return nn.Sequential(*block(3, 32), *block(32, 64), nn.Flatten(), nn.Linear(64 * 64, 10))


def mlp() -> nn.Module:
    layers = [nn.Linear(64, 512), nn.ReLU()]
    for _ in range(3):
        layers += [nn.Linear(512, 512), nn.ReLU(), nn.Dropout(0.1)]
    return nn.Sequential(*layers, nn.Linear(512, 10))


MODELS = {
    "convnet": (convnet, lambda g: torch.randn(ROWS, 3, 32, 32, generator=g)),
    "mlp": (mlp, lambda g: torch.randn(ROWS, 64, generator=g)),
    "transformer": (Transformer, lambda g: torch.randint(0, 256, (ROWS, 32), generator=g)),
}


def make_step(name: str, groups: int | None):
    build, inputs = MODELS[name]
    torch.manual_seed(0)
    net = build()
    g = torch.Generator().manual_seed(1)
    x, y = inputs(g), torch.randint(0, 10, (ROWS,), generator=g)
    r, n = pardist.rank(), pardist.world_size()
    mine = slice(r * ROWS // n, (r + 1) * ROWS // n)
    return pardist_step(net, x[mine], y[mine], loss=F.cross_entropy, deterministic=groups)


def worker(names: list[str], groups: int, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name in names:
        fns = {"default": make_step(name, None), "deterministic": make_step(name, groups)}
        out[name] = interleaved_ms(fns, steps, warmup)
    return out


def table(rows: list[dict], groups: int) -> str:
    lines = [
        f"| model | ranks | default ms | deterministic (G={groups}) ms | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['ranks']} | {r['default']:.2f} | {r['deterministic']:.2f} "
            f"| {r['deterministic'] / r['default']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    rows = []
    for ranks in args.ranks:
        got = pardist.spawn(worker, ranks, args.models, args.groups, args.steps, args.warmup)
        rows += [{"model": m, "ranks": ranks, **got[m]} for m in args.models]
    print(table(rows, args.groups))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "deterministic.md"), "w") as f:
        f.write(table(rows, args.groups) + "\n")
    with open(os.path.join(args.out, "deterministic.json"), "w") as f:
        json.dump({"rows": rows, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
