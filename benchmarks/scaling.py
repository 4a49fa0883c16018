"""pardist's step time from 2 to 1,024 GPUs: a model calibrated and checked on this machine.

    python benchmarks/scaling.py                  # calibrate, check, project (about 10 min)
    python benchmarks/scaling.py --project-only   # projections from results/scaling.json

The model is benchmarks/scaling_model.py. Here:

1. **Calibrate** its constants on this machine: each link's latency and bandwidth from
   all-reduces of 4 KiB to 16 MiB (shared memory and gloo at 2 ranks; gloo between two
   network namespaces joined by a veth pair limited to ``--rate`` Mbit/s, see
   twonodes.py), each net's FLOP rate from one process's plain torch step (FLOPs counted
   by torch's FlopCounterMode), and the overlap CPU ranks achieve from one data-parallel
   step (mlp23m, 2 ranks, shared memory).
2. **Check**: predicted against measured step time for the other configurations
   (data parallelism, ZeRO-2, FSDP on one host at 2 and 4 ranks, on gloo, and across the
   two namespaces: data parallelism, HSDP, DiLoCo). The goal is within 20%.
3. **Project** to GPU clusters (H100 nodes of 8 with NVLink and 400 Gb/s per GPU; V100
   nodes of 8 with 100 Gb/s per node) from 8 to 1,024 GPUs, beside published numbers.

Writes results/scaling.{json,md} and results/scaling.png (with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from scaling_model import Cluster, Link, Plan, Workload, step_time
from vs_ddp import interleaved_ms, mlp, torch_step

import pardist
from pardist.transport import _shmgroups

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = [2**k for k in range(12, 25, 2)]  # bytes: 4 KiB .. 16 MiB
NETS = {"mlp3m": ((1024, 1536, 2), 64), "mlp23m": ((1024, 2048, 6), 32)}  # mlp(...), batch


def units(name: str) -> int:
    return NETS[name][0][2] + 1  # FSDP's units of an MLP: its Linear layers


# -- measured on every rank (pardist.spawn or the two namespaces); rank 0's result is kept


def sweep(reps: int = 20) -> dict:
    """Median seconds of an all-reduce of each size (pardist's own transport on one host)."""
    torch.set_num_threads(1)
    own = _shmgroups.for_collectives(dist.group.WORLD)
    reduce, out = own.all_reduce if own else dist.all_reduce, {}
    for size in SIZES:
        flat = torch.ones(size // 4)
        out[size] = interleaved_ms({"r": lambda f=flat: reduce(f)}, reps, 3)["r"] / 1e3
    return out


def _batch(name: str):
    (width, _, _), batch = NETS[name]
    g = torch.Generator().manual_seed(pardist.rank())
    return torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _step(name: str, mode: str, every: int = 8):
    """One training step (SGD with momentum, donated) in ``mode``, as a function of nothing."""
    torch.manual_seed(0)
    net = mlp(*NETS[name][0])
    x, y = _batch(name)
    if mode == "local":  # plain torch: the compute the model is calibrated on
        return torch_step(net, x, y)
    apply, params, _ = pardist.functional(net)
    sgd = pardist.optim.sgd(1e-3, momentum=0.9)
    nodes = int(os.environ.get("PARDIST_BENCH_NODES", "1"))
    mesh = pardist.Mesh({"node": nodes, "gpu": -1})
    axis = ("node", "gpu")
    if mode in ("fsdp", "hsdp"):
        params = pardist.fsdp(params, axis if mode == "fsdp" else "gpu", mesh=mesh)
    opt = pardist.optim.sharded(sgd) if mode == "zero" else sgd

    def inner(params, opt_state, batch):
        grads = pardist.grad(lambda p: F.cross_entropy(apply(p, {}, batch[0])[0], batch[1]))
        return opt.update(grads(params), opt_state, params)

    if mode == "diloco":  # data parallelism within a node, DiLoCo across
        within = pardist.data_parallel(inner, mesh=mesh.part("gpu"))
        outer = pardist.optim.sgd(0.7, momentum=0.9, nesterov=True)
        run = pardist.diloco(within, outer, every=every, axis="node")
        state = {"s": run.init(params, sgd.init(params))}

        def step():
            with mesh:
                state["s"] = run.step(state["s"], (x, y))[0]

        return step
    step = pardist.data_parallel(inner, axis=axis, mesh=mesh, donate_argnums=(0, 1))
    state = {"s": (params, opt.init(params))}

    def run_step():
        state["s"] = step(*state["s"], (x, y))

    return run_step


def steps(configs: list[tuple[str, str]], reps: int = 15, warmup: int = 3) -> dict:
    """Median seconds per step of each (net, mode), interleaved round by round."""
    torch.set_num_threads(1)
    fns = {f"{name}/{mode}": _step(name, mode) for name, mode in configs}
    return {k: v / 1e3 for k, v in interleaved_ms(fns, reps, warmup).items()}


def flops(name: str) -> float:
    """FLOPs of one sample's forward and backward (torch's counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    net, (x, y) = mlp(*NETS[name][0]), _batch(name)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(net(x), y).backward()
    return counter.get_total_flops() / len(x)


# -- calibration and check


def fit(times: dict, n: int) -> Link:
    """Least squares of t = S * 2(n-1)/n / beta + 2 log2(n) alpha over the sizes."""
    xs, ys = [float(s) for s in times], list(times.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    steps_ = 2 * max(1, (n - 1).bit_length())
    return Link(alpha=max(0.0, my - slope * mx) / steps_, beta=2 * (n - 1) / n / slope)


def on_host(fn, ranks: int, *args, shm: bool = True):
    os.environ["PARDIST_SHM"] = "1" if shm else "0"
    try:
        return pardist.spawn(fn, ranks, *args)
    finally:
        os.environ.pop("PARDIST_SHM")


def calibrate(rate: float) -> dict:
    from twonodes import TwoNodes

    shm, gloo = fit(on_host(sweep, 2), 2), fit(on_host(sweep, 2, shm=False), 2)
    with TwoNodes(rate) as nodes:
        veth = fit({int(k): v for k, v in nodes.run("scaling", "sweep", {}, 1).items()}, 2)
    local = on_host(steps, 1, [(net, "local") for net in NETS])  # one process, each net
    rates = {net: flops(net) * NETS[net][1] / local[f"{net}/local"] for net in NETS}
    machine = Cluster("this machine", rates["mlp23m"], 2, shm, veth, 1.0, cores=os.cpu_count())
    ddp = on_host(steps, 2, [("mlp23m", "ddp")])["mlp23m/ddp"]
    w = workload("mlp23m")
    full, none = (step_time(w, replace(machine, overlap=o), 2, Plan())["step"] for o in (1, 0))
    overlap = min(1.0, max(0.0, (none - ddp) / (none - full))) if none > full else 1.0
    return {"machine": asdict(replace(machine, overlap=overlap)), "gloo": asdict(gloo),
            "flops": rates, "fitted_on": {"ddp": ddp}}  # fmt: skip


def workload(name: str) -> Workload:
    net = mlp(*NETS[name][0])
    params = sum(p.numel() for p in net.parameters())
    return Workload(name, params, flops(name), NETS[name][1], units=units(name))


def _cluster(d: dict) -> Cluster:
    return Cluster(**{**d, "intra": Link(**d["intra"]), "inter": Link(**d["inter"])})


CHECKS = [  # (where, ranks, net, mode): the fitted one (mlp23m ddp on shm at 2) is not here
    ("shm", 2, "mlp3m", "ddp"), ("shm", 2, "mlp3m", "zero"), ("shm", 2, "mlp23m", "zero"),
    ("shm", 2, "mlp3m", "fsdp"), ("shm", 2, "mlp23m", "fsdp"), ("shm", 4, "mlp23m", "ddp"),
    ("gloo", 2, "mlp3m", "ddp"), ("gloo", 2, "mlp23m", "ddp"),
    ("2 nodes", 2, "mlp3m", "ddp"), ("2 nodes", 2, "mlp23m", "ddp"),
    ("2 nodes", 2, "mlp23m", "diloco"), ("2 nodes", 4, "mlp23m", "hsdp"),
    ("2 nodes", 4, "mlp23m", "ddp"),
]  # fmt: skip


def check(cal: dict, rate: float) -> list[dict]:
    from twonodes import TwoNodes

    machine = _cluster(cal["machine"])
    measured = {}
    for where, ranks in sorted({(c[0], c[1]) for c in CHECKS}):
        configs = [(net, mode) for w, r, net, mode in CHECKS if (w, r) == (where, ranks)]
        if where == "2 nodes":
            os.environ["PARDIST_BENCH_NODES"] = "2"
            with TwoNodes(rate) as nodes:
                got = nodes.run("scaling", "steps", {"configs": configs}, ranks // 2)
            os.environ.pop("PARDIST_BENCH_NODES")
        else:
            got = on_host(steps, ranks, configs, shm=where == "shm")
        measured |= {(where, ranks, *k.split("/")): v for k, v in got.items()}
    rows = []
    for (where, ranks, net, mode), seconds in measured.items():
        c = replace(machine, flops=cal["flops"][net], per_node=ranks)  # the net's own rate
        if where == "gloo":
            c = replace(c, intra=Link(**cal["gloo"]))
        if where == "2 nodes":
            c = replace(c, per_node=ranks // 2)
        plan = Plan(mode, every=8) if mode == "diloco" else Plan(mode)
        model = step_time(workload(net), c, ranks, plan)
        rows.append({"where": where, "ranks": ranks, "net": net, "mode": mode,
                     "measured": seconds, **model})  # fmt: skip
    return rows


# -- projections to GPU clusters (constants from vendors' figures, stated in docs/scaling.md)

GB = 1e9
H100 = Cluster("H100, 8 per node, NVLink, 8 x 400 Gb/s per node", 0.4 * 989e12, 8,
               Link(5e-6, 450 * GB), Link(10e-6, 340 * GB))  # fmt: skip
V100 = Cluster("V100, 8 per node, NVLink, 100 Gb/s per node", 12.3e9 * 380, 8,
               Link(5e-6, 120 * GB), Link(10e-6, 11 * GB))  # fmt: skip
LLAMA8B = Workload("Llama 3 8B, 8192 tokens per GPU", 8.03e9,
                   6 * 8.03e9 + 12 * 32 * 4096 * 8192, 8192, units=32, param_bytes=2)  # fmt: skip
RESNET50 = Workload("ResNet-50, 32 images per GPU", 25.6e6, 12.3e9, 32, units=16)
WORLDS = [8, 16, 32, 64, 128, 256, 512, 1024]
SITES = Cluster("H100 nodes between sites, 100 Gb/s and 1 ms per node", 0.4 * 989e12, 8,
                Link(5e-6, 450 * GB), Link(1e-3, 11 * GB))  # fmt: skip
PLANS = {
    "ddp": Plan("ddp"), "ddp, bf16 gradients": Plan("ddp", grad_bytes=2),
    "zero": Plan("zero"), "fsdp": Plan("fsdp", grad_bytes=4), "hsdp": Plan("hsdp"),
    "diloco H=32": Plan("diloco", every=32), "diloco H=128": Plan("diloco", every=128),
}  # fmt: skip
PUBLISHED = [  # (cluster, workload, plan, gpus, what was published, its value)
    (H100, LLAMA8B, "fsdp", 8, "torchtitan: tokens/s per GPU, FSDP, bf16", 5762.0),
    (V100, RESNET50, "ddp", 32, "DDP paper: fraction of the step not hidden", 0.03),
]


def project() -> list[dict]:
    rows = []
    runs = [(H100, LLAMA8B, ["fsdp", "hsdp", "diloco H=32"])]
    runs += [(SITES, LLAMA8B, ["fsdp", "hsdp", "diloco H=32", "diloco H=128"])]
    runs += [(V100, RESNET50, ["ddp", "ddp, bf16 gradients", "zero"])]
    for cluster, w, plans in runs:
        for name in plans:
            for n in WORLDS:
                r = step_time(w, cluster, n, PLANS[name])
                rows.append({"cluster": cluster.name, "workload": w.name, "plan": name,
                             "gpus": n, **r, "per_gpu_per_s": w.batch / r["step"]})  # fmt: skip
    return rows


def published() -> list[dict]:
    out = []
    for cluster, w, plan, n, what, value in PUBLISHED:
        r = step_time(w, cluster, n, PLANS[plan])
        model = w.batch / r["step"] if "tokens" in what else r["exposed"] / r["step"]
        out.append({"what": what, "gpus": n, "published": value, "model": model})
    return out


# -- output


def tables(cal: dict | None, rows: list[dict] | None, proj: list[dict], pub: list[dict]) -> str:
    out = []
    if cal:
        m = cal["machine"]
        out += ["| link | alpha (us) | beta (MB/s) |", "|---|---|---|"]
        for name, link in (("shared memory", m["intra"]), ("gloo, one host", cal["gloo"]),
                           ("gloo, two namespaces (tbf)", m["inter"])):  # fmt: skip
            out.append(f"| {name} | {link['alpha'] * 1e6:.0f} | {link['beta'] / 1e6:.0f} |")
        rates = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in cal["flops"].items())
        out.append(f"\nGFLOP/s per rank: {rates}; overlap {m['overlap']:.2f}\n")
    if rows:
        out += ["| where | ranks | net | mode | measured ms | model ms | model/measured |"
                " compute | exposed |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            out.append(
                f"| {r['where']} | {r['ranks']} | {r['net']} | {r['mode']} | "
                f"{r['measured'] * 1e3:.1f} | {r['step'] * 1e3:.1f} | "
                f"{r['step'] / r['measured']:.2f} | {r['compute'] * 1e3:.1f} | "
                f"{r['exposed'] * 1e3:.1f} |"
            )
        out.append("")
    for w, where in dict.fromkeys((r["workload"], r["cluster"]) for r in proj):
        sel = [r for r in proj if (r["workload"], r["cluster"]) == (w, where)]
        out += [f"{w} on {where}: scaling efficiency (compute / step)\n",
                "| plan | " + " | ".join(map(str, WORLDS)) + " |",
                "|---|" + "---|" * len(WORLDS)]  # fmt: skip
        for plan in dict.fromkeys(r["plan"] for r in sel):
            eff = [f"{r['efficiency']:.2f}" for r in sel if r["plan"] == plan]
            out.append(f"| {plan} | " + " | ".join(eff) + " |")
        out.append("")
    out += ["| published | GPUs | published value | model |", "|---|---|---|---|"]
    out += [f"| {p['what']} | {p['gpus']} | {p['published']:g} | {p['model']:.3g} |" for p in pub]
    return "\n".join(out)


def plot(proj: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"(no plot: matplotlib is not installed; pip install matplotlib for {path})")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["workload"], r["cluster"]) for r in proj))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2))
    for ax, (w, where) in zip(axes, panels):
        sel = [r for r in proj if (r["workload"], r["cluster"]) == (w, where)]
        for plan in dict.fromkeys(r["plan"] for r in sel):
            pts = [(r["gpus"], r["efficiency"]) for r in sel if r["plan"] == plan]
            ax.plot(*zip(*pts), marker="o", label=plan)
        title = f"{w}\n{where}"
        ax.set(xscale="log", xlabel="GPUs", ylabel="scaling efficiency", ylim=(0, 1.05))
        ax.set_title(title, fontsize=9)
        ax.set_xticks(WORLDS, [str(n) for n in WORLDS])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1000, help="Mbit/s between the namespaces")
    parser.add_argument("--project-only", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    path = os.path.join(args.out, "scaling.json")
    cal = rows = None
    if args.project_only:
        if os.path.exists(path):
            with open(path) as f:
                saved = json.load(f)
            cal, rows = saved["calibration"], saved["checks"]
    else:
        t = time.time()
        cal = calibrate(args.rate)
        rows = check(cal, args.rate)
        print(f"(measured in {time.time() - t:.0f} s)")
    proj, pub = project(), published()
    text = tables(cal, rows, proj, pub)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scaling.md"), "w") as f:
        f.write(text + "\n")
    if not args.project_only:
        with open(path, "w") as f:
            json.dump({"calibration": cal, "checks": rows, "rate_mbit": args.rate}, f, indent=1)
    plot(proj, os.path.join(args.out, "scaling.png"))


if __name__ == "__main__":
    main()
