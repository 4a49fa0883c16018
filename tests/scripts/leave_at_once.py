"""Every rank leaves as soon as ``pardist.init()`` returns; rank 0's start is slow.

    python -m pardist.launch --nproc 2 leave_at_once.py FOLDER

Rank 0's ``init_process_group`` takes 3 s longer than rank 1's (as one rank's connect
may, on a loaded machine), and writes FOLDER/started when it returns. gloo's start is no
barrier: rank 1 could return at once, leave, and close the pair rank 0 was still
connecting. ``pardist.init()`` returns on no rank before every rank's start is done.
"""

import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

import pardist

started = Path(sys.argv[1]) / "started"
real = dist.init_process_group


def slow_on_rank_0(*args, **kwargs):
    real(*args, **kwargs)
    if os.environ["RANK"] == "0":
        time.sleep(3)  # still starting: this rank's pairs not yet used
        started.touch()


dist.init_process_group = slow_on_rank_0
pardist.init()
print(f"rank {pardist.rank()}: init returned, rank 0 started: {started.exists()}", flush=True)
pardist.shutdown()
