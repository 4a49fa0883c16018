"""Rank 1 is stopped (SIGSTOP) in the middle of training, as a debugger or a frozen host would.

    PARDIST_TIMEOUT=30 python -m pardist.launch --nproc 2 stop_rank.py SECONDS

Rank 1 stops itself at step 2 and is continued SECONDS later by a child it left
behind. Rank 0 times out waiting for it; the launcher must name rank 1, the rank
that stopped, not rank 0, the healthy rank that gave up first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch

import pardist


def main() -> None:
    pardist.init()
    seconds = float(sys.argv[1])

    @pardist.data_parallel(axis="gpu")
    def step(w, batch):
        return w - 0.1 * pardist.grad(lambda w, b: (b @ w).square().mean())(w, batch)

    w = torch.ones(3)
    for s in range(4):
        if s == 2 and pardist.rank() == 1:
            subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        w = step(w, torch.ones(2, 3))
    pardist.shutdown()


if __name__ == "__main__":
    main()
