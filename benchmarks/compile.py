"""Compiled data-parallel steps: pardist's whole-step graph against DDP + torch.compile.

    python benchmarks/compile.py                        # 1 and 2 ranks, all three models
    python benchmarks/compile.py --ranks 2 --models convnet --steps 20

For every model and world size, one process group runs these variants
interleaved step by step (machine noise hits all alike) and reports the median
milliseconds per step of the slowest rank, and each compiled variant's first
call (tracing and compiling included; caches off, so it is what a first run pays):

    pardist           data_parallel + pardist.grad + pardist.optim.sgd, eager, donated
    pardist_compiled  the same step with compile=True: forward, backward, gradient
                      mean and update in one graph; collectives through shared
                      memory (CPU ranks of one host), called from the graph
    pardist_compiled_gloo  the same graph with torch's functional collectives over
                      gloo instead (what runs where shared memory cannot, and what
                      nccl runs on GPUs): each bucket's all-reduce issued during the
                      backward and waited for where the update reads it
    pardist_compiled_gloo_in_order  that graph without the overlap scheduling
                      (inductor's own order: each bucket waited for where it is issued)
    pardist_loss_compiled  the eager step, its loss function given to pardist.grad as
                      torch.compile(loss_fn, dynamic=False): forward and backward
                      compiled as torch.compile(model) compiles them (AOTAutograd's
                      joint graph), the gradient mean and the update eager
    ddp               torch DistributedDataParallel, torch.optim.SGD
    ddp_compiled      torch.compile(DDP(model)), torch.optim.SGD (DDPOptimizer
                      splits the graph at the gradient buckets)
    torch             one process, no DDP (world size 1 only)
    torch_compiled    one process, torch.compile(model) (world size 1 only)
    torch_func_compiled  one process, no pardist: torch.compile of a whole functional
                      step, torch.func.grad_and_value over functional_call and
                      torch's SGD in one graph, what pardist compiles (world size 1)

Memory: each variant's peak during one step, above what was allocated when the step
began (MiB, the largest over ranks): on CUDA max_memory_allocated, on CPU the total
that torch's CPU allocator reports to the profiler (``profile_memory``).

Batch norm uses per-rank statistics in every variant (sync_bn=False, as DDP
without SyncBatchNorm). Each rank runs one thread. On CUDA the script runs
unchanged with nccl.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.sgd import sgd as torch_sgd
from vs_ddp import MODELS, interleaved_ms, pardist_step, sync

import pardist

# The gloo graph as inductor orders it by itself: each bucket waited for where it is issued.
IN_ORDER = {"reorder_for_compute_comm_overlap": False}


def _first_call(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def peak_mib(fn) -> float:
    """MiB allocated at the peak of one call of ``fn``, above what was allocated before."""
    device = pardist.device()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        sync()
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        with open(os.path.join(tmp, "trace.json")) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    if not events:
        return 0.0
    events.sort(key=lambda e: e["ts"])
    start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return (max(e["args"]["Total Allocated"] for e in events) - start) / 2**20


def torch_func_step(net: nn.Module, x, y):
    """Plain torch compiling a pure step as pardist does: the gradient by torch.func
    inside the graph, SGD with momentum (foreach, as compiled torch.optim) in it too."""
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    buffers = {k: v.clone() for k, v in net.named_buffers()}
    momentum = [torch.zeros_like(v) for v in params.values()]

    def loss(p, b):
        return F.cross_entropy(torch.func.functional_call(net, (p, b), (x,)), y)

    @torch.compile(fullgraph=True)
    def step(p, b, m):
        grads, value = torch.func.grad_and_value(loss)(p, b)
        torch_sgd(
            list(p.values()),
            list(grads.values()),
            m,
            weight_decay=0.0,
            momentum=0.9,
            lr=1e-3,
            dampening=0.0,
            nesterov=False,
            maximize=False,
            foreach=True,
        )
        return value

    return lambda: step(params, buffers, momentum)


def variants(name: str, world: int) -> tuple[dict, dict]:
    """{variant: one training step} for one model, and each compiled variant's first call."""
    make, shape, batch = MODELS[name]
    device = pardist.device()
    g = torch.Generator().manual_seed(pardist.rank())
    x = torch.randn(batch, *shape, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    steps, first = {}, {}

    def torch_step(net):
        opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)

        def step():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            opt.step()

        return step

    labels = ("pardist", "pardist_compiled", "pardist_compiled_gloo", "pardist_loss_compiled")
    for label in labels + ("pardist_compiled_gloo_in_order",):
        torch.manual_seed(0)
        whole = label.startswith("pardist_compiled")
        compile = {"options": IN_ORDER} if label.endswith("_in_order") else whole
        run = pardist_step(
            make().to(device), x, y, compile=compile, compile_loss=label == "pardist_loss_compiled"
        )
        if label == "pardist_loss_compiled":
            first[label] = _first_call(run)
        elif label.startswith("pardist_compiled_gloo"):
            os.environ["PARDIST_SHM"] = "0"  # read when the step is planned, on its first call
            first[label] = _first_call(run)
            del os.environ["PARDIST_SHM"]
        elif label == "pardist_compiled":
            first[label] = _first_call(run)
        steps[label] = run
    for label in ("ddp", "ddp_compiled"):
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(make().to(device))
        steps[label] = torch_step(torch.compile(ddp) if label == "ddp_compiled" else ddp)
    first["ddp_compiled"] = _first_call(steps["ddp_compiled"])
    if world == 1:
        for label in ("torch", "torch_compiled"):
            torch.manual_seed(0)
            net = make().to(device)
            steps[label] = torch_step(torch.compile(net) if label == "torch_compiled" else net)
        first["torch_compiled"] = _first_call(steps["torch_compiled"])
        torch.manual_seed(0)
        steps["torch_func_compiled"] = torch_func_step(make().to(device), x, y)
        first["torch_func_compiled"] = _first_call(steps["torch_func_compiled"])
    return steps, first


def worker(names: list[str], steps: int, warmup: int, threads: int) -> dict:
    # By name: cloudpickle, which ships this function to the ranks, cannot pickle them.
    aot_config = importlib.import_module("torch._functorch.config")
    inductor_config = importlib.import_module("torch._inductor.config")
    torch.set_num_threads(threads)
    # Cold compiles, as a first run pays them (a rerun hits torch's caches).
    inductor_config.fx_graph_cache = False
    aot_config.enable_autograd_cache = False
    inductor_config.compile_threads = 1
    torch.compile(lambda t: t + 1)(torch.ones(2))  # inductor's one-off start-up, for nobody
    out = {}
    for name in names:
        fns, first = variants(name, dist.get_world_size())
        ms = interleaved_ms(fns, steps, warmup)
        peaks = {f"peak_mib_{k}": peak_mib(fn) for k, fn in fns.items()}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {**first, **peaks})
        ms.update({f"compile_s_{k}": max(g[k] for g in gathered) for k in first})
        ms.update({k: max(g[k] for g in gathered) for k in peaks})
        out[name] = ms
    return out


def ratio(r: dict, a: str, b: str) -> str:
    return f"{r[a] / r[b]:.2f}" if a in r and b in r else "-"


def table(rows: list[dict]) -> str:
    head = (
        "| model | ranks | pardist | pardist compiled | compiled, gloo | gloo, in order "
        "| pardist, loss compiled "
        "| DDP | DDP + compile | torch | torch.compile | torch, func step compiled "
        "| compiled/eager | compiled/DDP+compile | gloo: overlap/in order, /DDP+compile "
        "| compiled/torch.compile "
        "| compiled/torch func step | loss compiled/torch.compile "
        "| loss compiled/DDP+compile | compile s: pardist / DDP / torch "
        "| peak MiB: pardist / compiled / compiled, gloo / DDP / DDP + compile |"
    )
    lines = [head, "|" + "---|" * 21]
    for r in rows:
        cell = lambda k, r=r: f"{r[k]:.1f}" if k in r else "-"  # noqa: E731
        compiled = ("pardist_compiled", "ddp_compiled", "torch_compiled")
        secs = " / ".join(
            f"{r[f'compile_s_{k}']:.0f}" if f"compile_s_{k}" in r else "-" for k in compiled
        )
        kinds = ("pardist", "pardist_compiled", "pardist_compiled_gloo", "ddp", "ddp_compiled")
        peaks = " / ".join(
            f"{r[f'peak_mib_{k}']:.0f}" if f"peak_mib_{k}" in r else "-" for k in kinds
        )
        lines.append(
            f"| {r['model']} | {r['ranks']} | {cell('pardist')} | {cell('pardist_compiled')} "
            f"| {cell('pardist_compiled_gloo')} | {cell('pardist_compiled_gloo_in_order')} "
            f"| {cell('pardist_loss_compiled')} "
            f"| {cell('ddp')} | {cell('ddp_compiled')} "
            f"| {cell('torch')} | {cell('torch_compiled')} | {cell('torch_func_compiled')} "
            f"| {ratio(r, 'pardist_compiled', 'pardist')} "
            f"| {ratio(r, 'pardist_compiled', 'ddp_compiled')} "
            f"| {ratio(r, 'pardist_compiled_gloo', 'pardist_compiled_gloo_in_order')}, "
            f"{ratio(r, 'pardist_compiled_gloo', 'ddp_compiled')} "
            f"| {ratio(r, 'pardist_compiled', 'torch_compiled')} "
            f"| {ratio(r, 'pardist_compiled', 'torch_func_compiled')} "
            f"| {ratio(r, 'pardist_loss_compiled', 'torch_compiled')} "
            f"| {ratio(r, 'pardist_loss_compiled', 'ddp_compiled')} | {secs} | {peaks} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--name", default="compile", help="file name of the .md and .json")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    rows = []
    for ranks in args.ranks:
        got = pardist.spawn(worker, ranks, args.models, args.steps, args.warmup, args.threads)
        rows += [{"model": m, "ranks": ranks, **got[m]} for m in args.models]
        print(table(rows), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(table(rows) + "\n")
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({"device": str(pardist.device()), "rows": rows, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
