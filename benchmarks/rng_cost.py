"""What the step's random streams cost: one stage of the per-step overhead, measured alone.

    python benchmarks/rng_cost.py            # deep and deep_bn of benchmarks/overhead.py

Every step seeds torch's, NumPy's and Python's global generators for this rank and
step, and gives the caller's back afterwards (``pardist.runtime._rng.stream``).
This runs the README's step (benchmarks/overhead.py's) on a dispatch-bound model at
world size 1, interleaved step by step in one process, three ways:

    numpy get/set  NumPy's state saved and restored by np.random.get_state / set_state
    memmove        the same state copied by one memmove (pardist's way, exact)
    no stream      the step without its streams (not a way pardist runs: the floor)

and prints the median ms per step of each, and the difference to the floor in us.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from overhead import deep, pardist_step

import pardist
from pardist.runtime import _numpy_rng
from pardist.step import _shard_map

WAYS = ("numpy get/set", "memmove", "no stream")


def measure(name: str, steps: int, warmup: int) -> dict:
    net = deep(name == "deep_bn")
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    run = pardist_step(net, x, y)
    stream = _shard_map._rng.stream
    times: dict = {way: [] for way in WAYS}
    try:
        for i in range(warmup + steps):
            for way in WAYS:
                _numpy_rng._fast = way == "memmove"
                _shard_map._rng.stream = (
                    (lambda index: contextlib.nullcontext()) if way == "no stream" else stream
                )
                start = time.perf_counter()
                run()
                if i >= warmup:
                    times[way].append(time.perf_counter() - start)
    finally:
        _shard_map._rng.stream, _numpy_rng._fast = stream, None
    return {way: statistics.median(t) * 1e3 for way, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["deep", "deep_bn"])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pardist.init()
    print(
        "| model | " + " | ".join(f"{w} ms" for w in WAYS) + " | streams, us | NumPy's copy, us |"
    )
    print("|---" * (len(WAYS) + 3) + "|")
    for name in args.models:
        ms = measure(name, args.steps, args.warmup)
        cells = " | ".join(f"{ms[w]:.3f}" for w in WAYS)
        streams = (ms["memmove"] - ms["no stream"]) * 1e3
        copy = (ms["numpy get/set"] - ms["memmove"]) * 1e3
        print(f"| {name} | {cells} | {streams:.0f} | {copy:.0f} |")
    pardist.shutdown()


if __name__ == "__main__":
    main()
