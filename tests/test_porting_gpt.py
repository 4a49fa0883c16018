"""docs/porting.md's GPT scripts: a nanoGPT-style DDP script and its pardist port train alike.

examples/porting/gpt_ddp.py (torch DDP: per-rank seeds, micro-steps under
``require_backward_grad_sync``, clipping, a learning rate set by hand, ``torch.save``
checkpoints) and examples/porting/gpt_pardist.py (the port) run under torchrun at 2
ranks in float64. Each rank draws its own batches from its own seeded stream in both,
and the port copies rank 0's weights as DDP's wrap does, so the two train on the same
micro-batches from the same weights: their checkpoints (the DDP script's own format,
which the port writes too) must agree within float64 rounding (``numerics``), and their
held-out losses print alike. Then each resumes the other's checkpoint and both go on
as the DDP script resuming its own.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from numerics import assert_close64

ROOT = Path(__file__).parents[1]
SCRIPTS = {s: ROOT / "examples" / "porting" / f"gpt_{s}.py" for s in ("ddp", "pardist")}
ARGS = ["--dtype", "float64", "--eval-interval", "6", "--eval-iters", "2", "--batch-size", "4"]
VAL = re.compile(r"step (\d+): train loss ([0-9.]+), val loss ([0-9.]+)")
# Each run is a torchrun of two processes (each one bounded by its subprocess timeout);
# the resume test makes three. On a loaded 2-core machine that is more than the suite's
# default 300 s, so the bound is the runs' own, not the machine's speed.
pytestmark = pytest.mark.timeout(3 * 600 + 60)


def _run(script: str, out: Path, iters: int, resume: bool = False) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    argv += [str(SCRIPTS[script]), *ARGS, "--max-iters", str(iters), "--out-dir", str(out)]
    done = subprocess.run(
        argv + (["--resume"] if resume else []),
        env=env,
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{script}: {done.stderr[-3000:]}"
    return done.stdout


def _checkpoint(out: Path) -> dict:
    """The weights and AdamW's moments (float64); its step counts apart (float32, exact)."""
    saved = torch.load(out / "ckpt.pt", weights_only=True)
    state = saved["optimizer"]["state"]
    moments = {i: {k: v for k, v in s.items() if k != "step"} for i, s in state.items()}
    steps = sorted(float(s["step"]) for s in state.values())
    return {"model": saved["model"], "optimizer": moments, "steps": steps}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpt")
    out = {s: _run(s, base / s, 12) for s in SCRIPTS}
    return base, out


def test_the_port_trains_as_the_ddp_script(runs):
    base, out = runs
    want, got = _checkpoint(base / "ddp"), _checkpoint(base / "pardist")
    assert_close64(got, want, "the port's checkpoint")
    assert VAL.findall(out["pardist"]) == VAL.findall(out["ddp"]) != []
    assert set(got["steps"]) == {12.0}  # torch's own format, every parameter's


def test_each_resumes_the_others_checkpoint(runs):
    base, _ = runs
    for name, script, source in [
        ("ref", "ddp", "ddp"),
        ("p_of_d", "pardist", "ddp"),
        ("d_of_p", "ddp", "pardist"),
    ]:
        shutil.copytree(base / source, base / name)
        _run(script, base / name, 18, resume=True)
    want = _checkpoint(base / "ref")
    assert_close64(_checkpoint(base / "p_of_d"), want, "pardist resuming DDP's checkpoint")
    assert_close64(_checkpoint(base / "d_of_p"), want, "DDP resuming pardist's checkpoint")
