"""pardist's data-parallel step against torch DDP, measured side by side in one run.

    python benchmarks/vs_ddp.py                      # 1 and 2 ranks, all three models
    python benchmarks/vs_ddp.py --ranks 2 --steps 40 --models mlp3m

For every model and world size, one process group runs these variants
interleaved step by step (so machine noise hits all of them alike) and reports
the median milliseconds per step:

    local      plain torch: forward, backward, optimizer step; no communication
    allreduce  a standalone all-reduce of a flat buffer the size of the gradients,
               through the backend (gloo or nccl), as DDP reduces
    allreduce_own  the same all-reduce through pardist's own transport: shared
               memory between CPU ranks on one host (else the backend again)
    ddp        torch DistributedDataParallel, default settings
    ddp_half   DDP with its bf16_compress_hook (fp16_compress_hook on CPU, where
               DDP refuses bf16)
    pardist    pardist.data_parallel + pardist.grad + pardist.optim, params donated
    pardist_half  the same with compression in that half dtype

The no-overlap limit is local + the all-reduce pardist uses (allreduce_own);
the table shows the backend's limit (local + allreduce) too. Every number is the median over rounds
of the slowest rank's time in that round: a synchronous step is as slow as its
slowest rank, step by step. Each rank runs one thread. On CUDA the
same script runs with nccl (and reports CUDA-synchronised times). ``PARDIST_SHM=0``
makes pardist reduce through gloo like DDP; ``--overlap off`` waits for the whole
backward before reducing (the default, on, starts each bucket as it fills).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import pardist
from pardist.transport import _shmgroups


def mlp(width: int, hidden: int, depth: int) -> nn.Module:
    layers, d = [], width
    for _ in range(depth):
        layers += [nn.Linear(d, hidden), nn.ReLU()]
        d = hidden
    return nn.Sequential(*layers, nn.Linear(d, 10))


def convnet() -> nn.Module:
    def block(cin, cout, stride):
        return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, 32, 1),
        *block(32, 64, 2),
        *block(64, 128, 2),
        *block(128, 192, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(192, 10),
    )


# name: (model factory, input shape per sample, per-rank batch)
MODELS = {
    "mlp3m": (lambda: mlp(1024, 1536, 2), (1024,), 64),
    "convnet": (convnet, (3, 32, 32), 32),
    "mlp25m": (lambda: mlp(2048, 4096, 2), (2048,), 16),
}


def HALF() -> str:  # noqa: N802
    """DDP's bf16 hook needs NCCL; elsewhere the comparison is in fp16."""
    return "bf16" if pardist.device().type == "cuda" else "fp16"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


OVERLAP = {"on": True, "off": False}


def variants(name: str, world: int, overlap: str = "on"):
    """{variant: step function} for one model, each with its own state."""
    make, shape, batch = MODELS[name]
    device = pardist.device()
    g = torch.Generator().manual_seed(pardist.rank())
    x = torch.randn(batch, *shape, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    out = {}

    torch.manual_seed(0)
    local = make().to(device)
    out["local"] = torch_step(local, x, y)
    flat = torch.zeros(sum(p.numel() for p in local.parameters()), device=device)
    out["allreduce"] = lambda: dist.all_reduce(flat)
    # pardist's transport, measured directly (an internal: there is no public
    # in-place all-reduce outside a step, and psum's copy would inflate the limit).
    own = _shmgroups.for_collectives(dist.group.WORLD) if device.type == "cpu" else None
    out["allreduce_own"] = (lambda: own.all_reduce(flat)) if own else out["allreduce"]
    half = HALF()
    hooks = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
    for hook in (None, hooks[half]):
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(make().to(device))
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        out["ddp" if hook is None else "ddp_half"] = torch_step(ddp, x, y)
    for compression in (None, half):
        torch.manual_seed(0)
        run = pardist_step(
            make().to(device), x, y, compression=compression, overlap=OVERLAP[overlap]
        )
        out["pardist" if compression is None else "pardist_half"] = run
    return out


def torch_step(net: nn.Module, x, y, opt=None):
    """Plain torch's training step on ``(x, y)`` as a function of nothing: forward,
    backward, ``opt.step()`` (SGD with momentum, as pardist_step's, unless ``opt`` is given)."""
    opt = opt or torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()

    return step


def pardist_step(net: nn.Module, x, y, sync_bn: bool = False, compile_loss=False, **options):
    """pardist's step on ``net`` (SGD with momentum, params and state donated) as a
    function of nothing that trains one step on ``(x, y)``; ``options`` go to
    ``data_parallel``. The same step for every benchmark that compares with it.
    ``compile_loss``: the loss function given to ``pardist.grad`` is
    ``torch.compile(loss_fn, dynamic=False)``, the rest of the step eager."""
    apply, params, buffers = pardist.functional(net, sync_bn=sync_bn)
    sgd = pardist.optim.sgd(lr=1e-3, momentum=0.9)
    state = {"all": (params, buffers, sgd.init(params))}

    def loss_fn(params, buffers, x, y):
        logits, buffers = apply(params, buffers, x)
        return F.cross_entropy(logits, y), buffers

    if compile_loss:
        loss_fn = torch.compile(loss_fn, dynamic=False)

    def train_step(params, buffers, opt_state, batch):
        grads, buffers = pardist.grad(loss_fn, has_aux=True)(params, buffers, *batch)
        params, opt_state = sgd.update(grads, opt_state, params)
        return params, buffers, opt_state

    step = pardist.data_parallel(train_step, donate_argnums=(0, 2), **options)

    def run():
        state["all"] = step(*state["all"], (x, y))

    return run


def interleaved_ms(fns: dict, steps: int, warmup: int) -> dict[str, float]:
    """Median ms per step of each function, run in turn, one round at a time.

    A synchronous step waits for its slowest rank in every step: the time of a
    round is the max over ranks, and the median is taken over rounds, for every
    variant alike (the local step and the all-reduce too, so the limit is fair).
    """
    times = {k: [] for k in fns}
    for i in range(warmup + steps):
        for k, fn in fns.items():  # every variant once per round: noise hits all alike
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return {
        k: 1e3 * statistics.median(max(step) for step in zip(*(g[k] for g in gathered)))
        for k in times
    }


def measure(names: list[str], steps: int, warmup: int, overlap: str) -> dict:
    world = dist.get_world_size()
    return {name: interleaved_ms(variants(name, world, overlap), steps, warmup) for name in names}


def worker(names, steps, warmup, threads, overlap):
    torch.set_num_threads(threads)
    return measure(names, steps, warmup, overlap)


def limits(r: dict) -> tuple[float, float]:
    """The no-overlap limits: local + pardist's all-reduce, and local + the backend's."""
    if r["ranks"] == 1:
        return r["local"], r["local"]
    return r["local"] + r.get("allreduce_own", r["allreduce"]), r["local"] + r["allreduce"]


def table(rows: list[dict]) -> str:
    half = HALF()
    head = (
        f"| model | ranks | local | all-reduce (pardist / backend) | limit (pardist / backend) "
        f"| DDP | DDP {half} | pardist | pardist {half} | pardist/DDP | pardist/limit "
        f"| {half}: pardist/DDP |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        limit, backend = limits(r)
        own = r.get("allreduce_own", r["allreduce"])
        lines.append(
            f"| {r['model']} | {r['ranks']} | {r['local']:.1f} | {own:.1f} / {r['allreduce']:.1f} "
            f"| {limit:.1f} / {backend:.1f} | {r['ddp']:.1f} | {r['ddp_half']:.1f} "
            f"| {r['pardist']:.1f} | {r['pardist_half']:.1f} | {r['pardist'] / r['ddp']:.2f} "
            f"| {r['pardist'] / limit:.2f} | {r['pardist_half'] / r['ddp_half']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:  # an optional package: the table above is the result
        print(f"(no plot: matplotlib is not installed; pip install matplotlib for {path})")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.4), squeeze=False)
    axes = list(axes[0])
    keys = ["local", "ddp", "pardist", "ddp_half", "pardist_half"]
    colors = ["#999999", "#d62728", "#1f77b4", "#ff9896", "#aec7e8"]
    for ax, r in zip(axes, rows):
        ax.bar(range(len(keys)), [r[k] for k in keys], color=colors)
        if r["ranks"] > 1:
            ax.axhline(limits(r)[0], ls="--", c="k", lw=1, label="limit")
        ax.set_xticks(range(len(keys)), keys, rotation=60, fontsize=8)
        ax.set_title(f"{r['model']}, {r['ranks']} rank(s)", fontsize=9)
        ax.set_ylabel("ms / step" if ax is axes[0] else "")
        if r["ranks"] > 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--overlap", choices=list(OVERLAP), default="on")
    parser.add_argument("--name", default="vs_ddp", help="file name of the .json and .png")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    rows = []
    for ranks in args.ranks:
        got = pardist.spawn(
            worker, ranks, args.models, args.steps, args.warmup, args.threads, args.overlap
        )
        rows += [{"model": m, "ranks": ranks, **got[m]} for m in args.models]
    print(table(rows))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(table(rows) + "\n")
    shm = os.environ.get("PARDIST_SHM", "1")
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(
            {"device": str(pardist.device()), "PARDIST_SHM": shm, "rows": rows, "args": vars(args)},
            f,
            indent=1,
        )
    plot(rows, os.path.join(args.out, f"{args.name}.png"))


if __name__ == "__main__":
    main()
