"""examples/tensor_parallel.py: a 2x2 mesh takes the same steps as one process.

Tensor parallelism over 'model' and data parallelism over 'data' change how the
work is split, not the numbers: with 4 ranks the example's losses must be those
of one process on the same global batches (AdamW, donated state, vocabulary-
parallel cross-entropy). Once in the kept-alive 4-rank group, once under torchrun.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "tensor_parallel.py"
STEPS = ["--steps", "4"]


def _example(argv: list[str]) -> list[float]:
    spec = importlib.util.spec_from_file_location("tensor_parallel_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_four_ranks_equal_one_process(run, world1):
    one = _example(STEPS)
    assert one[-1] < one[0]  # it learns
    for losses in run(4, _example, STEPS):
        assert losses == pytest.approx(one, rel=1e-5)


def test_torchrun_four_processes(world1):
    one = _example(["--steps", "3"])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
        + [str(SCRIPT), "--steps", "3"],
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
    assert float(final.group(1)) == pytest.approx(one[-1], abs=1e-4)
