"""Sharded optimizer state (ZeRO) against plain data parallelism and torch's ZeRO optimizer.

    python benchmarks/zero.py                  # 2 ranks, the two MLPs of vs_ddp.py
    python benchmarks/zero.py --ranks 4 --models mlp3m

Each variant trains with AdamW (state = 2x the parameters), interleaved step by
step in one process group; reported: median ms per step and the bytes of
optimizer state each rank holds.

    dp          pardist.data_parallel + pardist.optim.adamw (state replicated)
    sharded     the same with pardist.optim.sharded(adamw): ZeRO-2, one line changed
    torch_zero  DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from vs_ddp import MODELS, interleaved_ms

import pardist


def state_bytes(tree) -> int:
    leaves = pardist.runtime._tree.tree_leaves(tree)
    local = [t.to_local() if isinstance(t, DTensor) else t for t in leaves]
    return sum(t.numel() * t.element_size() for t in local if isinstance(t, torch.Tensor))


def variants(name: str):
    make, shape, batch = MODELS[name]
    g = torch.Generator().manual_seed(pardist.rank())
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)
    out, memory = {}, {}
    for label, shard in (("dp", False), ("sharded", True)):
        torch.manual_seed(0)
        apply, params, buffers = pardist.functional(make(), sync_bn=False)
        opt = pardist.optim.adamw(1e-3)
        opt = pardist.optim.sharded(opt) if shard else opt
        state = {"all": (params, opt.init(params))}
        memory[label] = state_bytes(state["all"][1])

        def loss_fn(params, x, y, apply=apply):
            return F.cross_entropy(apply(params, {}, x)[0], y)

        def train_step(params, opt_state, batch, opt=opt, loss_fn=loss_fn):
            grads = pardist.grad(loss_fn)(params, *batch)
            return opt.update(grads, opt_state, params)

        step = pardist.data_parallel(train_step, donate_argnums=(0, 1))

        def run(step=step, state=state):
            state["all"] = step(*state["all"], (x, y))

        out[label] = run
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(make())
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)

    def torch_step():
        zero.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        zero.step()

    out["torch_zero"] = torch_step
    torch_step()  # torch's ZeRO creates its state on the first step
    memory["torch_zero"] = sum(state_bytes(list(s.values())) for s in zero.optim.state.values())
    return out, memory


def worker(names, steps, warmup):
    torch.set_num_threads(1)
    rows = []
    for name in names:
        fns, memory = variants(name)
        ms = interleaved_ms(fns, steps, warmup)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, memory)
        bytes_ = {k: max(m[k] for m in everyone) for k in memory}
        rows.append({"model": name, "ms": ms, "bytes": bytes_})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["mlp3m", "mlp25m"], choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    rows = pardist.spawn(worker, args.ranks, args.models, args.steps, args.warmup)
    print(
        f"| model | ranks | dp ms | sharded ms | torch ZeRO ms | sharded/dp | sharded/torch ZeRO "
        f"| dp state MB | sharded state MB | torch ZeRO state MB |\n|{'---|' * 10}"
    )
    for r in rows:
        ms, mb = r["ms"], {k: v / 2**20 for k, v in r["bytes"].items()}
        print(
            f"| {r['model']} | {args.ranks} | {ms['dp']:.1f} | {ms['sharded']:.1f} | "
            f"{ms['torch_zero']:.1f} | {ms['sharded'] / ms['dp']:.2f} | "
            f"{ms['sharded'] / ms['torch_zero']:.2f} | {mb['dp']:.1f} | {mb['sharded']:.1f} | "
            f"{mb['torch_zero']:.1f} |"
        )


if __name__ == "__main__":
    main()
