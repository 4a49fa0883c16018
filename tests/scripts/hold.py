"""Start the process group, say so in a file, and hold until told to go (tests/test_loopback.py)."""

import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

import pardist

folder = Path(sys.argv[1])
pardist.init()
(folder / f"ready{pardist.rank()}").touch()
deadline = time.monotonic() + 120
while not (folder / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
dist.barrier()
env = os.environ
print(
    f"rank {pardist.rank()} MASTER_ADDR {env['MASTER_ADDR']} GLOO {env.get('GLOO_SOCKET_IFNAME')}"
)
