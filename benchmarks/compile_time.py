"""How long a compiled step takes to compile: pardist's whole step against DDP + torch.compile.

    python benchmarks/compile_time.py                    # 2 ranks, a 4-layer GPT
    python benchmarks/compile_time.py --layers 2 --ranks 1
    python benchmarks/compile_time.py --repeat 3         # three interleaved rounds

For a GPT-style model (examples/porting/gpt_model.py), each way runs three steps in a
fresh process group, twice: first with empty compile caches (a cold start), then in new
processes that find the caches the first ones wrote (inductor's FX graph cache and
AOTAutograd's cache, in one directory for the run: a restarted job). Reported per way and
start, in seconds of the slowest rank:

    first      the first step: tracing, compiling and running it
    second     the second step: a recompilation, if any, and a run
    third      the third step: the step alone, for scale
    phases     where the first step's time went, by torch's own timers
               (torch._dynamo.utils.compile_times): dynamo's tracing, AOTAutograd, inductor's
               lowering and code generation, the C++/Triton compile of the kernels

The ways: ``pardist`` (data_parallel(step, compile=True): forward, backward, gradient mean
and SGD update in one graph) and ``ddp`` (torch.compile(DDP(model)) and torch.optim.SGD:
DDPOptimizer's graphs split at the buckets, the optimizer eager). Each rank runs one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import pardist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "porting"))
from gpt_model import GPT, GPTConfig  # noqa: E402


def model(args) -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPTConfig(
        block_size=args.block, vocab_size=args.vocab, n_layer=args.layers, n_embd=args.dim
    )
    return GPT(config).to(pardist.device())


def batch(args, step: int):
    g = torch.Generator().manual_seed(100 * pardist.rank() + step)
    x = torch.randint(0, args.vocab, (args.bs, args.block), generator=g)
    return x.to(pardist.device()), torch.roll(x, -1, 1).to(pardist.device())


def pardist_way(args):
    net = model(args)
    apply, params, _ = pardist.functional(net)
    opt = pardist.optim.sgd(1e-3, momentum=0.9)
    state = [params, opt.init(params)]

    @pardist.data_parallel(compile=True, donate_argnums=(0, 1))
    def step(p, s, xy):
        loss, g = pardist.value_and_grad(lambda p, x, y: apply(p, {}, x, y)[0][1])(p, *xy)
        return (*opt.update(g, s, p), loss)

    def run(i):
        state[0], state[1], loss = step(state[0], state[1], batch(args, i))
        return loss

    return run


def ddp_way(args):
    net = model(args)
    if pardist.world_size() > 1:
        net = torch.nn.parallel.DistributedDataParallel(net)
    compiled = torch.compile(net)
    opt = torch.optim.SGD(net.parameters(), 1e-3, momentum=0.9)

    def run(i):
        x, y = batch(args, i)
        _, loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return run


def phases() -> dict:
    """Seconds of what was compiled so far, by torch's own timers: dynamo's tracing (its
    compile less the backend's), AOTAutograd (the backend less inductor's modules, the
    backward's compiler included), inductor's modules (lowering, code generation and what
    of the kernels' builds runs inside them) and the kernels' C++ compile (``compile_file``,
    all of it: on torch 2.13 much of it runs outside the modules' timer, so the last two
    overlap and are not to be added)."""
    from torch._dynamo.utils import compile_times

    table = {}
    for line in (compile_times(repr="str", aggregate=True) or "").splitlines()[2:]:
        name, _, value = line.rpartition(",")
        try:
            table[name.strip()] = table.get(name.strip(), 0.0) + float(value)
        except ValueError:
            continue
    get = lambda *names: sum(table.get(n, 0.0) for n in names)  # noqa: E731
    backend = get("OutputGraph.call_user_compiler", "compile_fx.<locals>.bw_compiler")
    modules, kernels = get("GraphLowering.compile_to_module"), get("compile_file")
    return {
        "dynamo": round(get("_compile.compile_inner") - get("OutputGraph.call_user_compiler"), 2),
        "aot": round(backend - modules, 2),
        "inductor": round(modules, 2),
        "kernels": round(kernels, 2),
    }


def worker(way: str, args) -> dict:
    pardist.init()  # (spawn's ranks have started it; one process starts it here)
    torch.set_num_threads(1)
    run = {"pardist": pardist_way, "ddp": ddp_way}[way](args)
    out = {}
    for i, name in enumerate(("first", "second", "third")):
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        start = time.perf_counter()
        loss = run(i)
        float(loss)
        seconds = torch.tensor(time.perf_counter() - start)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
        out[name] = round(float(seconds), 2)
        if i == 0:
            out["phases"] = phases()
    return out


def start(way: str, args, cache: str) -> dict:
    """One start of ``way``: a fresh process group whose caches live in ``cache``."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "1"
    return pardist.spawn(worker, args.ranks, way, args) if args.ranks > 1 else worker(way, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--bs", type=int, default=8)
    parser.add_argument("--ways", nargs="+", default=["ddp", "pardist"])
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of all ways, interleaved (a shared "
        "machine's load shifts: compare within a round, report the median)",
    )
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    rows = []
    for round_ in range(args.repeat):
        for way in args.ways:
            with tempfile.TemporaryDirectory() as cache:
                for when in ("cold", "warm"):
                    got = start(way, args, cache)
                    rows.append({"round": round_, "way": way, "start": when, **got})
                    print(round_, way, when, got, flush=True)
    lines = [
        f"{args.ranks} rank(s), GPT {args.layers}x{args.dim}, block {args.block}, batch "
        f"{args.bs} a rank, {pardist.device().type}, torch {torch.__version__}",
        "",
        "| round | way | start | first step (s) | second (s) | third (s) | dynamo "
        "| AOTAutograd | inductor | kernels |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["phases"]
        lines.append(
            f"| {r['round']} | {r['way']} | {r['start']} | {r['first']} | {r['second']} | "
            f"{r['third']} | {p['dynamo']} | {p['aot']} | {p['inductor']} | {p['kernels']} |"
        )
    if {"ddp", "pardist"} <= set(args.ways):  # pardist's first step over DDP's, per round
        first = {(r["round"], r["way"], r["start"]): r["first"] for r in rows}
        for when in ("cold", "warm"):
            ratios = [first[i, "pardist", when] / first[i, "ddp", when] for i in range(args.repeat)]
            shown = ", ".join(f"{x:.2f}x" for x in ratios)
            lines.append(
                f"\n{when}: pardist / DDP {shown} (median {statistics.median(ratios):.2f}x)"
            )
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"compile_time_{args.ranks}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, f"compile_time_{args.ranks}.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
