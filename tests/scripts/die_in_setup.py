"""Rank 0 is killed (SIGKILL) right after it creates a shared-memory segment, before anyone maps it.

    python -m pardist.launch --nproc 2 die_in_setup.py

A killed process cannot remove its own files; the launcher must, when the job ends.
"""

import os
import signal

import torch

import pardist


def main() -> None:
    pardist.init()
    print(f"rank {pardist.rank()} pid {os.getpid()}", flush=True)
    if pardist.rank() == 0:
        reserve = os.posix_fallocate

        def reserve_then_die(*args):
            reserve(*args)
            os.kill(os.getpid(), signal.SIGKILL)

        os.posix_fallocate = reserve_then_die
    pardist.psum(torch.ones(2), "gpu")  # the collectives' segment is made here


if __name__ == "__main__":
    main()
