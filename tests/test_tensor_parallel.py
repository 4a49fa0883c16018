"""examples/tensor_parallel.py: a 2x2 mesh takes the same steps as one process.

Tensor parallelism over 'model' and data parallelism over 'data' change how the
work is split, not the numbers: with 4 ranks the example's losses must be those
of one process on the same global batches (AdamW, donated state, vocabulary-
parallel cross-entropy). Once in the kept-alive 4-rank group, once under torchrun.
Both sides run in float64 (the example's tensors follow torch's default dtype), so
that they agree up to float64 rounding (numerics.py) on any CPU.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from numerics import assert_close64

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "tensor_parallel.py"
STEPS = ["--steps", "4"]
# The example under torchrun, in float64: run as a script after setting the default dtype.
IN_FLOAT64 = (
    "import runpy, sys, torch; torch.set_default_dtype(torch.float64); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def _example(argv: list[str]) -> list[float]:
    spec = importlib.util.spec_from_file_location("tensor_parallel_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return module.main(argv)
    finally:
        torch.set_default_dtype(default)


def test_four_ranks_equal_one_process(run, world1):
    one = _example(STEPS)
    assert one[-1] < one[0]  # it learns
    for losses in run(4, _example, STEPS):
        assert_close64(losses, one, "losses")


def test_torchrun_four_processes(world1):
    one = _example(["--steps", "3"])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
        + ["--no-python", sys.executable, "-c", IN_FLOAT64, str(SCRIPT), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    final = re.search(
        r"^final: loss=(\S+) mesh=\{'data': 2, 'model': 2\} ranks=4$", out.stdout, re.M
    )
    assert final, out.stdout
    # The script prints 4 decimals: at most 5e-5 off, float64 rounding aside.
    assert abs(float(final.group(1)) - one[-1]) <= 5e-5 + 1e-10
