"""Rank 1 aborts inside its own process (as a failed C++ assertion does); rank 0 waits."""

import os
import sys

import torch

import pardist

pardist.init()
if pardist.rank() == 1:
    print("about to abort: a native assertion failed here", file=sys.stderr, flush=True)
    os.abort()
pardist.psum(torch.ones(1), "gpu")
