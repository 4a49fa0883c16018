"""docs/porting.md's two scripts: the DDP script and its pardist port train alike.

examples/porting/ddp_train.py (torch DDP) and examples/porting/pardist_train.py (its
port) run under python and under torchrun at 2 ranks, as processes of their own.

In one process the two must be equal, bit for bit: they see the same batches in the
same order (DistributedSampler's and pardist.data.shard's shuffles are one
permutation), and run the same kernels (torch's fused AdamW, the same bf16 autocast,
the same schedule function), so anything that differs is a porting mistake.

In two processes they cannot be: DDP's DistributedSampler deals each rank every other
row of an update's rows, pardist.data.shard gives each rank a contiguous half, and each
rank's batch norm normalizes by its own rows. They are two trainings on other groupings
of the same batches, and their held-out accuracies are compared within a bound derived
from the number of held-out images (see ``_bound``).

A port stopped part-way (SIGTERM to torchrun, as a preemption sends) and run again
resumes from its last checkpoint and must end bit-identical to a run never stopped.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
SCRIPTS = {s: ROOT / "examples" / "porting" / f"{s}_train.py" for s in ("ddp", "pardist")}
LAUNCHERS = {
    "python": [sys.executable],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    + ["--nproc_per_node=2"],
}
EPOCHS = 5  # of the scripts' 6: each run costs ~3 s an epoch here
HELD_OUT = 360  # images: 20% of scikit-learn's 1797 digits
LINE = re.compile(r"held-out accuracy: ([0-9.]+), ema ([0-9.]+) \((\d) process")
EPOCH = re.compile(r"epoch \d+: loss [0-9.]+, lr \S+, accuracy [0-9.]+, ema [0-9.]+")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""  # both scripts on the CPU: DDP would take a GPU
    return env


def _start(script: str, launcher: str, ckpt: Path) -> subprocess.Popen:
    argv = [*LAUNCHERS[launcher], str(SCRIPTS[script]), "--epochs", str(EPOCHS)]
    with open(ckpt.with_suffix(".err"), "a") as err:  # a file: a full pipe would block it
        return subprocess.Popen(
            [*argv, "--ckpt", str(ckpt)],
            cwd=ckpt.parent,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, as a preemption sends: torchrun passes it on to its ranks and waits for them."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _finish(proc: subprocess.Popen, ckpt: Path) -> str:
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            _stop(proc)
    assert proc.returncode == 0, out[-2000:] + ckpt.with_suffix(".err").read_text()[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{(script, launcher): (stdout, checkpoint dir)}; the python pair at once (a core each)."""
    root, done = tmp_path_factory.mktemp("porting"), {}
    for group in (
        [("ddp", "python"), ("pardist", "python")],
        [("ddp", "torchrun")],
        [("pardist", "torchrun")],
    ):
        procs = {key: _start(*key, root / "-".join(key)) for key in group}
        done |= {
            key: (_finish(p, root / "-".join(key)), root / "-".join(key))
            for key, p in procs.items()
        }
    return done


def _result(out: str) -> tuple[float, float, int]:
    found = LINE.search(out)
    assert found, out
    return float(found[1]), float(found[2]), int(found[3])


def _ema(ckpt: Path) -> dict:
    """The EMA's weights and buffers that the script saved as a plain state_dict."""
    return torch.load(ckpt / "model.pt")


def _bound(a: float, b: float) -> float:
    """How far apart two trainings' accuracies on HELD_OUT images may be, at 3 sigma.

    Two models of accuracy p whose mistakes fell on the held-out images independently
    would differ by k / HELD_OUT, k a difference of two binomial counts: standard
    deviation sqrt(2 p (1 - p) / HELD_OUT), 0.010 at p = 0.98 (3.8 images). Trainings of
    one model on the same batches make more of the same mistakes, so this overstates
    their spread, never understates it.
    """
    p = (a + b) / 2
    return 3 * math.sqrt(2 * p * (1 - p) / HELD_OUT)


@pytest.mark.timeout(600)
def test_one_process_the_port_ends_bit_identical_to_the_ddp_script(runs):
    (ddp_out, ddp_dir), (port_out, port_dir) = runs["ddp", "python"], runs["pardist", "python"]
    # Every epoch's accuracy and learning rate, not only the last: same schedule, same EMA
    accuracies = [re.sub(r"loss [0-9.]+, ", "", m) for m in EPOCH.findall(ddp_out)]
    assert len(accuracies) == EPOCHS, ddp_out
    assert accuracies == [re.sub(r"loss [0-9.]+, ", "", m) for m in EPOCH.findall(port_out)]
    assert _result(ddp_out) == _result(port_out), (ddp_out, port_out)
    assert _result(port_out)[0] > 0.95, port_out  # and it learnt
    ddp, port = _ema(ddp_dir), _ema(port_dir)
    assert ddp.keys() == port.keys()
    for name, value in ddp.items():
        # AveragedModel averages the integer batch counts too (truncating them); the port
        # copies them. Batch norm with a momentum never reads them.
        if value.is_floating_point():
            assert torch.equal(value, port[name]), name


@pytest.mark.timeout(600)
def test_two_processes_reach_the_one_process_accuracy_within_the_bound(runs):
    one = _result(runs["ddp", "python"][0])  # the port's too, by the test above
    for script in SCRIPTS:
        out = runs[script, "torchrun"][0]
        two = _result(out)
        assert two[2] == 2, out
        for i, what in enumerate(("accuracy", "EMA's accuracy")):
            bound = _bound(one[i], two[i])
            assert abs(one[i] - two[i]) <= bound, f"{script}: {what} {two[i]} vs {one[i]}"
    ddp, port = _result(runs["ddp", "torchrun"][0]), _result(runs["pardist", "torchrun"][0])
    for i in range(2):
        assert abs(ddp[i] - port[i]) <= _bound(ddp[i], port[i]), (ddp, port)


@pytest.mark.timeout(600)
def test_a_stopped_port_resumes_and_ends_where_an_uninterrupted_run_does(runs, tmp_path):
    ckpt = tmp_path / "ckpt"
    stopped = _start("pardist", "torchrun", ckpt)
    try:
        for line in stopped.stdout:  # stopped once epoch 2 is done and saved
            if line.startswith("epoch 2:"):
                break
        else:
            pytest.fail("it ended before epoch 2:\n" + ckpt.with_suffix(".err").read_text())
    finally:
        _stop(stopped)
        stopped.stdout.close()
    resumed = _finish(_start("pardist", "torchrun", ckpt), ckpt)
    at = re.search(r"resumed from \S+ at epoch (\d)", resumed)
    assert at and 3 <= int(at[1]) < EPOCHS, resumed
    whole, whole_dir = runs["pardist", "torchrun"]
    # the epochs after the restart print what the uninterrupted run printed (times aside)
    tail = [m for m in EPOCH.findall(whole) if int(m.split()[1][:-1]) >= int(at[1])]
    assert EPOCH.findall(resumed) == tail, (resumed, whole)
    assert _result(resumed) == _result(whole)
    ema, whole_ema = _ema(ckpt), _ema(whole_dir)
    assert all(torch.equal(v, whole_ema[k]) for k, v in ema.items())
