"""docs/porting.md's Accelerate script and its pardist port train alike (the zoo's environment).

examples/porting/lm_accelerate.py (Hugging Face Accelerate: HF batches padded per
micro-batch, a token-weighted loss over gradient accumulation, a linear warm-up
schedule, clipping, ``gather_for_metrics``, ``save_state`` by step) and
examples/porting/lm_pardist.py run under torchrun at 2 ranks on the same micro-batches
from the same weights, in float64.

How close they must be: the forward and backward are float64 in both, except for
Hugging Face's loss, which casts the logits to float32 (``ForCausalLMLoss``:
``logits.float()``) and divides in float32; the port asks it for the sum
(``num_items_in_batch=1``) and divides in float64. So every update's gradient differs
between them by a few float32 roundings of the per-token loss gradient, a relative
2^-21 at most, and so does every printed loss (float32 values). AdamW's step is a smooth
function of the gradient (its normalised update changes by at most a few times that
relative amount), and over the ~9 updates compared the weights' difference stays below
1e-4 of how far they moved from their start; a real porting mistake (a token weighed
twice, another schedule, clipping left out) is off by percents.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
SCRIPTS = {s: ROOT / "examples" / "porting" / f"lm_{s}.py" for s in ("accelerate", "pardist")}
# 288 training lines: 18 global batches of 2 x 8 rows, 9 updates of 2 micro-batches
ARGS = [
    "--dtype",
    "float64",
    "--epochs",
    "1",
    "--max-lines",
    "320",
    "--checkpointing-steps",
    "8",
    "--cpu",
]
LOSS = re.compile(r"epoch (\d+) step (\d+): loss ([0-9.e+-]+)")
EVAL = re.compile(r"epoch (\d+): eval loss ([0-9.e+-]+)")
F32 = 2.0**-21  # a few float32 roundings, relative (see the module docstring)


def _run(script: str, out: Path, *more: str) -> str:
    pytest.importorskip("accelerate")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    argv += [str(SCRIPTS[script]), *ARGS, "--output-dir", str(out), *more]
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(argv, env=env, cwd=out, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{script}: {done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("lm")
    return base, {s: _run(s, base / s) for s in SCRIPTS}


def _weights(base: Path, step: int) -> tuple[dict, dict]:
    """Both scripts' weights after ``step`` micro-batches: pardist's checkpoint (a DCP
    directory, converted) and Accelerate's ``model.safetensors``."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = base / f"ours_{step}.pt"
    dcp_to_torch_save(str(base / "pardist" / f"step_{step}"), str(saved))
    prefix = "tree['params']['"
    ours = {
        key[len(prefix) : -2]: value
        for key, value in torch.load(saved, weights_only=True).items()
        if key.startswith(prefix)
    }
    return ours, load_file(str(base / "accelerate" / f"step_{step}" / "model.safetensors"))


def test_the_port_trains_as_the_accelerate_script(runs):
    base, out = runs
    want, got = LOSS.findall(out["accelerate"]), LOSS.findall(out["pardist"])
    assert len(want) == len(got) == 9
    for (e, s, a), (e2, s2, b) in zip(want, got):
        assert (e, s) == (e2, s2)
        assert abs(float(a) - float(b)) <= 4 * F32 * abs(float(a)), (s, a, b)
    [(_, a)], [(_, b)] = EVAL.findall(out["accelerate"]), EVAL.findall(out["pardist"])
    assert abs(float(a) - float(b)) <= 4 * F32 * abs(float(a))
    _, before = _weights(base, 8)
    ours, theirs = _weights(base, 16)
    assert set(ours) <= set(theirs) and len(ours) >= len(theirs) - 1  # (lm_head: tied)
    for name, w in ours.items():
        moved = (theirs[name] - before[name]).norm()  # four updates' worth
        assert (w - theirs[name]).norm() <= 1e-4 * moved, name


def test_the_port_resumes_exactly(runs):
    base, out = runs
    again = _run(
        "pardist", base / "resumed", "--resume-from-checkpoint", str(base / "pardist" / "step_8")
    )
    assert "Resumed from checkpoint" in again
    assert LOSS.findall(again) == LOSS.findall(out["pardist"])[4:]  # updates 5-9, bit for bit
    assert EVAL.findall(again) == EVAL.findall(out["pardist"])
