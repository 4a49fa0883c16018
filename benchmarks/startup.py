"""How long a run takes to start: pardist's launcher against torchrun, side by side.

    python benchmarks/startup.py                 # 5 rounds, 2 processes
    python benchmarks/startup.py --rounds 9 --nproc 4

Each round runs, one after the other in an order that alternates, a script that only
starts and stops the process group, three ways:

    pardist.launch   python -m pardist.launch --nproc N hello.py   (hello: pardist.init())
    torchrun         torchrun --standalone --nproc_per_node=N hello.py
    torchrun+torch   torchrun ... plain.py (plain: torch.distributed.init_process_group)

and, in a fresh interpreter, ``import torch`` and ``import pardist``. Prints the median
seconds of each and the ratio of pardist's launcher to torchrun's (the same script under
both); writes benchmarks/results/startup.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HELLO = "import pardist\npardist.init()\npardist.shutdown()\n"
PLAIN = (
    "import torch.distributed as dist\n"
    "dist.init_process_group('gloo')\n"
    "dist.barrier()\n"
    "dist.destroy_process_group()\n"
)


def _seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    hello, plain = os.path.join(folder, "hello.py"), os.path.join(folder, "plain.py")
    with open(hello, "w") as f:
        f.write(HELLO)
    with open(plain, "w") as f:
        f.write(PLAIN)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    ways = {
        "pardist.launch": [
            sys.executable,
            "-m",
            "pardist.launch",
            "--nproc",
            str(args.nproc),
            hello,
        ],
        "torchrun": [*torchrun, f"--nproc_per_node={args.nproc}", hello],
        "torchrun+torch": [*torchrun, f"--nproc_per_node={args.nproc}", plain],
        "import torch": [sys.executable, "-c", "import torch"],
        "import pardist": [sys.executable, "-c", "import pardist"],
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for name in order:
            times[name].append(_seconds(ways[name]))
    median = {name: statistics.median(ts) for name, ts in times.items()}
    ratio = median["pardist.launch"] / median["torchrun"]
    lines = [
        f"| way | median s ({args.rounds} rounds, {args.nproc} processes) | all |",
        "|---|---|---|",
        *(
            f"| {name} | {median[name]:.2f} | {', '.join(f'{t:.2f}' for t in ts)} |"
            for name, ts in times.items()
        ),
        f"| pardist.launch / torchrun | {ratio:.2f} | |",
    ]
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "startup.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "startup.json"), "w") as f:
        json.dump({"times": times, "median": median, "ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
