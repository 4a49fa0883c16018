"""pardist.spawn: from a script and from stdin (a notebook cell), failures, ports, CUDA safety."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pardist
from pardist.launch._spawn import SpawnError, Workers

pytestmark = pytest.mark.timeout(300)

SCRIPTS = Path(__file__).parent / "scripts"
ENV = {**os.environ, "PARDIST_TIMEOUT": "10"}


def test_spawn_from_a_script():
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "spawn_script.py")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr
    assert "result [2, 30.0, 7]" in out.stdout


CELL = """
import pardist, torch

def train(lr):                     # defined in __main__, which has no file here
    w = pardist.pmean(torch.tensor(float(pardist.rank())), 'gpu')
    return float(w) * lr

print('result', pardist.spawn(train, 3, 2.0))

def broken():
    if pardist.rank() == 1:
        return {'loss': 1.0}['acc']
    return 0

try:
    pardist.spawn(broken, 2)
except pardist.SpawnError as e:
    print('failed rank', e.rank, 'KeyError' in str(e), 'in broken' in str(e))

try:
    pardist.spawn(train, 2, 1.0, start_method='spawn')
except ValueError as e:
    print('refused', 'no file to import' in str(e))
"""


def test_spawn_from_stdin_as_a_notebook_cell_would():
    out = subprocess.run(
        [sys.executable, "-"], input=CELL, env=ENV, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "result 2.0" in out.stdout  # mean of ranks 0, 1, 2 is 1.0, times lr
    assert "failed rank 1 True True" in out.stdout  # the worker's traceback came back
    assert "refused True" in out.stdout


def _fails_on_rank_1(x):
    if pardist.rank() == 1:
        raise ZeroDivisionError(f"rank one divides {x} by zero")
    return x


def test_a_failing_rank_raises_its_traceback_in_the_caller():
    t = time.monotonic()
    with pytest.raises(SpawnError) as info:
        pardist.spawn(_fails_on_rank_1, 2, 5, env={"PARDIST_TIMEOUT": "5"})
    assert info.value.rank == 1 and list(info.value.errors) == [1]
    msg = str(info.value)
    assert "rank 1 failed during _fails_on_rank_1" in msg
    assert "ZeroDivisionError: rank one divides 5 by zero" in msg
    assert "_fails_on_rank_1" in msg.split("Traceback")[1]  # the frame, not only the message
    assert time.monotonic() - t < 30


def _dies_on_rank_0():
    if pardist.rank() == 0:
        os._exit(3)
    torch.distributed.barrier()  # waits for rank 0, which is gone


def test_a_rank_that_dies_is_named_and_the_others_are_stopped():
    t = time.monotonic()
    with pytest.raises(SpawnError, match="rank 0 exited with code 3 without answering"):
        pardist.spawn(_dies_on_rank_0, 2, env={"PARDIST_TIMEOUT": "30"})
    assert time.monotonic() - t < 20  # the survivor was stopped, not waited for


def _master_port():
    return int(os.environ["MASTER_PORT"])


def test_spawn_picks_its_own_port_when_master_port_is_busy(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        with Workers(2, timeout=60) as workers:
            used = workers.run(_master_port)
        assert used == [workers.port] * 2 and workers.port != port


def test_cuda_used_before_spawn_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is already initialised.*inside the spawned"):
        pardist.spawn(pardist.rank, 2)


def _loader_with_workers():
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=1)
    return sum(float(b[0].sum()) for b in loader)


def test_the_function_may_start_processes_of_its_own():
    assert pardist.spawn(_loader_with_workers, 2) == 28.0  # DataLoader workers


def _sleep(seconds):
    time.sleep(seconds)


def test_a_call_that_does_not_return_is_stopped_at_its_timeout():
    workers = Workers(2, timeout=60)
    t = time.monotonic()
    with pytest.raises(SpawnError, match=r"rank\(s\) \[0, 1\] did not finish _sleep within 1 s"):
        workers.run(_sleep, 60, timeout=1)
    assert time.monotonic() - t < 15 and not workers._procs


_AFTER_WORK = """
import torch, pardist
a = torch.randn(512, 512)
(a @ a).sum()  # the parent's OpenMP threads in use before the fork
def f():
    b = torch.randn(512, 512)
    return bool((b @ b).isfinite().all())
print(pardist.spawn(f, 1, timeout=100))
"""


def test_a_forked_worker_runs_after_the_parent_computed(tmp_path):
    # A forked worker given 2 threads hung in its first matmul: OpenMP cannot start the
    # threads of a parent that used them before the fork.
    script = tmp_path / "after_work.py"
    script.write_text(_AFTER_WORK)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=200
    )
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
