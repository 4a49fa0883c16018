"""Prints what a launched worker sees: its rank, the world, its arguments, its environment.

With ``PARDIST_TEST_SLEEP=s`` in the environment it then stays up ``s`` seconds (a job
that holds its port).
"""

import os
import sys
import time

import pardist


def main() -> None:
    pardist.init()
    names = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "CUDA_VISIBLE_DEVICES")
    env = {k: os.environ.get(k) for k in names}
    print(
        f"rank {pardist.rank()} of {pardist.world_size()} args {sys.argv[1:]} env {env}", flush=True
    )
    time.sleep(float(os.environ.get("PARDIST_TEST_SLEEP", "0")))
    pardist.shutdown()


if __name__ == "__main__":
    main()
