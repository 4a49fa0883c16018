"""pardist on one GPU: the model zoo's numbers and the flagship model's throughput.

    python benchmarks/gpu.py zoo          # functional(m) equals m on CUDA, float32 and bf16
    python benchmarks/gpu.py throughput   # xresnet18 images/s: plain torch, DDP, pardist

``zoo`` builds every model of the test zoo (tests/models/zoo.py) on the GPU and
compares pardist's ``apply`` with the module's own forward and backward: the loss
and the gradients (relative L2), in float32 and under bf16 autocast. ``throughput``
trains examples/imagenette.py's xresnet18 (examples/xresnet.py) on device-resident
random images (so the data loader is not measured) at world size 1: a plain torch
loop with a fused AdamW, DDP around the same loop, and pardist's data_parallel step
with its AdamW, bf16 autocast in all three, CUDA-synchronised, interleaved rounds.
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pardist
from pardist import P

ROOT = Path(__file__).resolve().parents[1]
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only to try the script out


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def device_name() -> str:
    return torch.cuda.get_device_name() if DEV == "cuda" else "CPU"


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def zoo() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import zoo as models

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    pardist.init()

    print("| model | float32: loss diff | gradient rel L2 | bf16: loss diff | gradient rel L2 |")
    print("|---|---|---|---|---|")
    for name, entry in models.MODELS.items():
        row = [name]
        for autocast in (False, True):
            module = models.build(name).to(DEV)
            apply, params, buffers = pardist.functional(models.build(name).to(DEV))
            b = {k: v.to(DEV) for k, v in models.batch(name, 0).items()}
            with torch.autocast(DEV, torch.bfloat16, enabled=autocast):
                want = models.loss_of(models.forward(module, entry.kind, b), entry.kind, b)
            want_g = torch.autograd.grad(want, list(module.parameters()), allow_unused=True)
            names = [k for k, _ in module.named_parameters()]

            def loss_fn(p, b=b, entry=entry, apply=apply, buffers=buffers, autocast=autocast):
                def call(*a, **kw):
                    return apply(p, buffers, *a, **kw)[0]

                with torch.autocast(DEV, torch.bfloat16, enabled=autocast):
                    return models.loss_of(models.forward(call, entry.kind, b), entry.kind, b)

            # In a step, as users run it (outside one, pardist.grad is torch.func's,
            # which fails on T5 under autocast: a torch bug, plain torch.func fails too).
            step = pardist.data_parallel(
                lambda p, f=loss_fn: pardist.value_and_grad(f)(p),
                axis="gpu",
                in_specs=(P(),),
                out_specs=(P(), P()),
            )
            try:
                got, got_g = step(params)
            except RuntimeError as exc:  # reported in the table, the other models go on
                row += [f"error: {str(exc).splitlines()[0][:80]}", ""]
                continue
            # Over the whole gradient: some tensors' true gradients are 0 (a bias that a
            # later batch norm subtracts again), and their rounding noise has no scale.
            pairs = [(got_g[k], w) for k, w in zip(names, want_g) if w is not None and k in got_g]
            whole = rel_l2(*(torch.cat([p[i].flatten() for p in pairs]) for i in (0, 1)))
            row += [f"{abs(got.item() - want.item()):.1e}", f"{whole:.1e}"]
        print("| " + " | ".join(row) + " |", flush=True)


def xresnet(width: int = 64):
    sys.path.insert(0, str(ROOT / "examples"))
    from xresnet import xresnet18

    torch.manual_seed(0)
    return xresnet18(10, width).to(DEV).to(memory_format=torch.channels_last)


def throughput(size: int, bs: int, steps: int, rounds: int) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    pardist.init()
    x = torch.randn(bs, 3, size, size, device=DEV).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (bs,), device=DEV)

    def torch_loop(model):
        opt = torch.optim.AdamW(model.parameters(), 1e-3, fused=DEV == "cuda")

        def step():
            with torch.autocast(DEV, torch.bfloat16):
                loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    plain = torch_loop(xresnet())
    ddp = torch_loop(torch.nn.parallel.DistributedDataParallel(xresnet()))
    apply, params, buffers = pardist.functional(xresnet())
    opt = pardist.optim.adamw(1e-3)
    state = {"p": params, "b": buffers, "o": opt.init(params)}

    def loss_fn(p, b, x, y):
        with pardist.amp.autocast("bf16"):
            logits, b = apply(p, b, x)
        return F.cross_entropy(logits.float(), y), b

    @pardist.data_parallel(axis="gpu", donate_argnums=(0, 2))
    def train_step(p, b, o, batch):
        (loss, b), g = pardist.value_and_grad(loss_fn, has_aux=True)(p, b, *batch)
        p, o = opt.update(g, o, p)
        return p, b, o, loss

    def ours():
        state["p"], state["b"], state["o"], _ = train_step(
            state["p"], state["b"], state["o"], (x, y)
        )

    fns = {"plain torch": plain, "torch DDP": ddp, "pardist": ours}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: cuDNN autotuning, allocator, first-call checks
        for _ in range(5):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            sync()
            times[name].append((time.perf_counter() - start) / steps)
    print(f"\nxresnet18, {size}px, batch {bs}, bf16, channels_last, {device_name()}")
    print("| loop | ms/step (median) | images/s | vs plain torch |")
    print("|---|---|---|---|")
    base = statistics.median(times["plain torch"])
    for name, t in times.items():
        ms = statistics.median(t)
        print(f"| {name} | {ms * 1e3:.1f} | {bs / ms:.0f} | {ms / base:.3f} |")
    dist.barrier()
    pardist.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["zoo", "throughput"])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--bs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.what == "zoo":
        zoo()
    else:
        throughput(args.size, args.bs, args.steps, args.rounds)


if __name__ == "__main__":
    main()
