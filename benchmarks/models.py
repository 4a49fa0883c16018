"""Cross-replica batch norm on real models: pardist sync BN against per-rank BN and DDP.

    python benchmarks/models.py                 # resnet18, efficientnet_b0, the conv net; 2 ranks
    python benchmarks/models.py --models resnet18 --steps 20

Needs timm (the model-zoo environment). For each model one process group runs
these variants interleaved step by step (machine noise hits all alike) and
reports the median milliseconds per step of the slowest rank:

    sync       pardist.functional(model) (cross-replica batch norm, the default)
    nosync     pardist.functional(model, sync_bn=False): per-rank statistics
    ddp        torch DistributedDataParallel, per-rank statistics
    ddp_sync   DDP with nn.SyncBatchNorm, where it runs (CUDA; torch's SyncBatchNorm
               refuses CPU tensors)

Every variant takes SGD steps with momentum on the same data; pardist donates
its parameters and optimizer state. Writes results/models.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn
from vs_ddp import convnet, interleaved_ms, pardist_step  # the same net, step and timing

import pardist

# name: (model factory, image side, per-rank batch)
MODELS = {
    "resnet18": (lambda: __import__("timm").create_model("resnet18", num_classes=10), 64, 16),
    "efficientnet_b0": (
        lambda: __import__("timm").create_model("efficientnet_b0", num_classes=10),
        64,
        16,
    ),
    "convnet": (convnet, 32, 32),
}


def variants(name: str) -> dict:
    make, side, batch = MODELS[name]
    device = pardist.device()
    g = torch.Generator().manual_seed(pardist.rank())
    x = torch.randn(batch, 3, side, side, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    out = {}
    for sync_bn in (True, False):
        torch.manual_seed(0)
        run = pardist_step(make().to(device), x, y, sync_bn=sync_bn)
        out["sync" if sync_bn else "nosync"] = run
    for converted in (False, True) if device.type == "cuda" else (False,):
        torch.manual_seed(0)
        net = make().to(device)
        if converted:
            net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        ddp = nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)

        def torch_step(ddp=ddp, opt=opt):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()

        out["ddp_sync" if converted else "ddp"] = torch_step
    return out


def worker(names: list[str], steps: int, warmup: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    return {name: interleaved_ms(variants(name), steps, warmup) for name in names}


def table(rows: list[dict]) -> str:
    lines = [
        "| model | input | ranks | pardist sync BN | pardist sync_bn=False | DDP "
        "| DDP+SyncBatchNorm | sync / no-sync | sync / DDP |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        _, side, batch = MODELS[r["model"]]
        ddp_sync = f"{r['ddp_sync']:.1f}" if "ddp_sync" in r else "n/a (CPU)"
        lines.append(
            f"| {r['model']} | {batch}x3x{side}x{side} per rank | {r['ranks']} | {r['sync']:.1f} "
            f"| {r['nosync']:.1f} | {r['ddp']:.1f} | {ddp_sync} "
            f"| {r['sync'] / r['nosync']:.2f} | {r['sync'] / r['ddp']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--name", default="models", help="file name of the .md and .json")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    got = pardist.spawn(worker, args.ranks, args.models, args.steps, args.warmup, args.threads)
    rows = [{"model": m, "ranks": args.ranks, **got[m]} for m in args.models]
    print(table(rows))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(table(rows) + "\n")
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({"device": str(pardist.device()), "rows": rows, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
