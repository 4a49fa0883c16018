"""The seeds' other examples (fastai's tabular and text), end to end under python and torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
LAUNCHERS = {
    "python": [sys.executable],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    + ["--nproc_per_node=2"],
}


def _run(script: str, launcher: str, *args: str, cwd: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [*LAUNCHERS[launcher], str(ROOT / "examples" / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_tabular_learns_beyond_the_majority_class(launcher, tmp_path):
    out = _run("tabular.py", launcher, cwd=tmp_path)
    found = re.search(r"held-out accuracy: ([0-9.]+) \(majority class: ([0-9.]+), 89", out)
    assert found, out
    accuracy, majority = map(float, found.groups())
    assert accuracy > majority + 0.15, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_text_model_beats_the_unigram_baseline(launcher, tmp_path):
    out = _run("text.py", launcher, "--bytes", "120000", "--epochs", "1", cwd=tmp_path)
    found = re.search(r"held-out: ([0-9.]+) bits/byte \(unigram baseline: ([0-9.]+);", out)
    assert found, out
    bits, unigram = map(float, found.groups())
    assert bits < unigram - 0.5, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_finetuning_improves_the_held_out_lines_and_keeps_fewer_activations(launcher, tmp_path):
    args = ("--bytes", "100000", "--pretrain-steps", "60", "--steps", "40")
    out = _run("finetune.py", launcher, *args, cwd=tmp_path)
    found = re.search(
        r"held-out comment lines: ([0-9.]+) bits/byte \(before fine-tuning: ([0-9.]+)", out
    )
    assert found, out
    after, before = map(float, found.groups())
    assert after < before - 0.2, out
    kept = re.search(r"recomputed, [0-9.]+ MiB without \(([0-9]+)%\)", out)
    assert kept and int(kept.group(1)) <= 30, out
