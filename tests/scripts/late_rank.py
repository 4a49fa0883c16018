"""The last rank arrives late (a slow import on a loaded machine), with a short PARDIST_TIMEOUT."""

import os
import sys
import time

late = float(sys.argv[1])
if os.environ["RANK"] == str(int(os.environ["WORLD_SIZE"]) - 1):
    time.sleep(late)  # before the process group starts

import torch  # noqa: E402

import pardist  # noqa: E402

pardist.init()
total = pardist.psum(torch.ones(1), "gpu")
print(f"rank {pardist.rank()}: started, psum {total.item():.0f}", flush=True)
