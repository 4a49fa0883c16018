"""The CUDA path at world size 1 (nccl): skipped where no GPU is visible.

The rest of the suite runs its processes on the CPU (tests/conftest.py), since
one GPU cannot hold two nccl ranks. Here a whole training step runs on the GPU
and is compared with plain torch on the same GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "cuda_step.py"

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_a_step_on_cuda_equals_plain_torch():
    env = {k: v for k, v in os.environ.items() if k != "PARDIST_DEVICE"}
    out = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = dict(line.rsplit(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert "nccl" in lines["device cuda:0 backend"], out.stdout
    assert float(lines["float32 worst relative difference"]) <= 1e-5, out.stdout
    assert float(lines["bf16 worst relative difference"]) <= 2e-2, out.stdout


def test_two_ranks_on_one_gpu_over_gloo_equal_one_process():
    script = SCRIPT.with_name("cuda_two_ranks.py")
    env = {k: v for k, v in os.environ.items() if k != "PARDIST_DEVICE"} | {"PARDIST_SHM": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = subprocess.run([*cmd, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line.split() for line in out.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2, out.stdout
    for words in lines:
        assert words[3] == "gloo" and words[5].startswith("cuda"), words
        assert float(words[8]) <= 1e-5 and float(words[11]) <= 1e-5, words
