"""A job that runs until one of its nodes is lost: all-reduces in a loop.

Each rank writes its pid to PID_DIR/<rank>.<restart> after its first all-reduce, so
the test knows the job is up and can check afterwards that every worker is gone.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import pardist


def main() -> None:
    pardist.init()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for i in range(600):
        pardist.psum(torch.ones(1), "gpu")
        if i == 0:
            Path(sys.argv[1], f"{pardist.rank()}.{restart}").write_text(str(os.getpid()))
        time.sleep(0.1)
    pardist.shutdown()


if __name__ == "__main__":
    main()
