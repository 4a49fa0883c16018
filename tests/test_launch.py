"""python -m pardist.launch: the command line, what workers see, and the checks before launching."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pardist import launch
from pardist.launch._ports import check_endpoint, port_owner

ROOT = Path(__file__).parents[1]


@pytest.mark.timeout(300)
def test_launch_runs_a_script_per_gpu_with_its_arguments():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pardist.launch",
            "--gpus",
            "0,1",
            "tests/scripts/hello.py",
            "--epochs",
            "3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PARDIST_DEVICE": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    env = "{'TORCH_DISABLE_SHARE_RDZV_TCP_STORE': '1', 'CUDA_VISIBLE_DEVICES': '0,1'}"
    for rank in (0, 1):
        assert f"rank {rank} of 2 args ['--epochs', '3'] env {env}" in out.stdout


def test_one_machine_needs_no_port(monkeypatch):
    monkeypatch.delenv("PARDIST_STORE_SECRET", raising=False)
    args, env = launch.prepare(["--nproc", "3", "--max-restarts", "2", "train.py", "-x"])
    assert (args.nproc_per_node, args.max_restarts) == ("3", 2)  # torchrun's options pass
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", "localhost:0")
    secret = env.pop("PARDIST_STORE_SECRET")  # the run's store secret, drawn per run
    assert re.fullmatch("[0-9a-f]{32}", secret), secret
    assert env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PARDIST_JOIN_TIMEOUT": "300"}
    assert launch.prepare(["t.py"])[1]["PARDIST_STORE_SECRET"] != secret  # never reused
    assert launch.prepare(["--nproc-per-node=4", "t.py"])[0].nproc_per_node == "4"
    with socket.socket() as s:  # a port given by hand: torchrun's static rendezvous on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args, _ = launch.prepare(["--master-port", str(port), "t.py"])
    assert (args.rdzv_backend, args.master_port) == ("static", port)


def test_several_machines_use_c10d_with_a_bounded_join():
    args, _ = launch.prepare(
        [
            "--nnodes",
            "2",
            "--nproc",
            "2",
            "--rdzv-endpoint",
            "10.254.0.1:29400",
            "--join-timeout",
            "30",
            "t.py",
        ],
        check_ports=False,
    )
    assert args.rdzv_backend == "c10d" and "join_timeout=30" in args.rdzv_conf
    args, _ = launch.prepare(
        [
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            "10.254.0.1:29400",
            "--rdzv-conf",
            "join_timeout=5,is_host=0",
            "t.py",
        ],
        check_ports=False,
    )
    assert args.rdzv_conf == "join_timeout=5,is_host=0"  # the user's choices stand
    assert args.join_timeout == 5  # and bound the watch on the first node too
    with pytest.raises(SystemExit, match="needs --rdzv-endpoint"):
        launch.prepare(["--nnodes", "2", "--rdzv-backend", "c10d", "t.py"])


def test_the_node_that_owns_the_endpoint_hosts_the_store():
    with socket.socket() as s:  # a free port on an address of this machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args, _ = launch.prepare(["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "t.py"])
    assert "is_host" not in args.rdzv_conf  # torch's own guess is right for loopback
    assert port_owner("127.0.0.1", port) == "free"
    assert port_owner("192.0.2.1", port, timeout=0.5) == "free"  # not up yet: no objection


def test_a_torch_store_on_the_port_is_joined_not_refused():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert port_owner("127.0.0.1", store.port) == "store"
    assert (
        check_endpoint(
            "127.0.0.1", store.port, must_host=False, where="t", option="--rdzv-endpoint"
        )
        == "store"
    )
    with pytest.raises(RuntimeError, match="the torch rendezvous store of another job"):
        check_endpoint("127.0.0.1", store.port, must_host=True, where="t", option="--rdzv-endpoint")


def _failure(
    tmp_path, local_rank: int, exitcode: int, message: str | None, timestamp: int, **pardist
):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"error{local_rank}.json"
    if message is not None:  # what a worker that raised writes (torch's record format)
        extra = {"py_callstack": message, "timestamp": str(timestamp), **pardist}
        error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))
    return ProcessFailure(local_rank, 1000 + local_rank, exitcode, str(error_file))


def test_a_killed_rank_is_named_though_its_peer_lost_the_connection_in_an_earlier_second(
    tmp_path,
):
    # Rank 0 is killed; rank 1's collective ends at once (connection lost, late ranks
    # unknown), and torch orders failures by whole seconds: rank 1's can read earlier.
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from pardist.launch._failures import explain

    lost = (
        "CollectiveTimeout: pardist: pardist.psum over axis 'gpu' lost the connection to "
        "another rank (it exited or was killed) on rank 1. Which rank is late is unknown"
    )
    killed = _failure(tmp_path, 0, -9, None, 0)
    failures = {0: killed, 1: _failure(tmp_path, 1, 1, lost, killed.timestamp - 1)}
    exc = ChildFailedError("train.py", failures)
    assert exc.get_first_failure()[0] == 1  # torch's own choice
    line, code = explain(exc, "pardist.launch")
    assert line.startswith("pardist.launch: rank 0 (local rank 0, pid 1000) was killed by SIGKILL")
    assert code == 1
    # A rank that raised on its own is still named when it came first.
    own = _failure(tmp_path, 0, 1, "ValueError: bad batch", killed.timestamp - 1)
    line, _ = explain(ChildFailedError("train.py", {0: own}), "pardist.launch")
    assert line.startswith(
        "pardist.launch: rank 0 (local rank 0, pid 1000) failed first: ValueError"
    )


def test_a_stopped_rank_that_comes_back_is_named_not_what_it_then_saw(tmp_path):
    # Rank 1 was stopped (SIGSTOP) and rank 0 timed out waiting for it, then left the
    # step; rank 1, continued before the launcher stopped it (a loaded machine), found
    # rank 0 gone from the call and raised StepMismatch. That is what the timeout did,
    # not a fault of its own: the line names rank 1 as the rank that stopped responding.
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from pardist.launch._failures import explain

    timeout = _failure(
        tmp_path, 0, 1, "CollectiveTimeout: pardist: pardist.grad waited 30 s for rank 1", 10,
        pardist_late_ranks=[1], pardist_timeout_s=30, pardist_waited_in="pardist.grad",
    )  # fmt: skip
    for then in (
        "StepMismatch: pardist: rank 0 left call 3 of the step without it while rank 1 waits",
        "CollectiveTimeout: pardist: pardist.grad lost the connection to another rank",
    ):
        line, code = explain(
            ChildFailedError("t.py", {0: timeout, 1: _failure(tmp_path, 1, 1, then, 25)}), "l"
        )
        assert line.startswith("l: rank 1 (local rank 1, pid 1001) stopped responding"), line
        assert "rank 0 (local rank 0, pid 1000) waited 30 s (PARDIST_TIMEOUT) in pardist" in line
        assert code == 1
    # A late rank that raised an error of its own is named with it.
    own = _failure(tmp_path, 1, 1, "ValueError: bad batch", 25)
    line, _ = explain(ChildFailedError("t.py", {0: timeout, 1: own}), "l")
    assert line.startswith("l: rank 1 (local rank 1, pid 1001) failed first: ValueError"), line


_LATE = """
import sys, torch, pardist
pardist.init()
t = torch.ones(1)
torch.distributed.all_reduce(t)
print(f"rank {pardist.rank()}: {t.item():.0f}", flush=True)
pardist.shutdown()
"""


@pytest.mark.timeout(300)
def test_a_worker_that_starts_late_still_joins(tmp_path):
    # Rank 1 starts after rank 0 has waited longer than the collective timeout (2 s), as
    # a worker on a loaded machine does: the wait for workers is bounded by the join
    # timeout, not by PARDIST_TIMEOUT ("Timed out after 6 seconds waiting for clients").
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "late.py"
    script.write_text(_LATE)
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    base.update(PARDIST_TIMEOUT="2", PARDIST_JOIN_TIMEOUT="60", LOCAL_RANK="0")
    run = lambda r: subprocess.Popen(  # noqa: E731
        [sys.executable, str(script)], env=dict(base, RANK=str(r)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    first = run(0)
    time.sleep(5)  # longer than PARDIST_TIMEOUT: the old store gave up after it
    second = run(1)
    outs = [p.communicate(timeout=240) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outs
    assert "rank 0: 2" in outs[0][0] and "rank 1: 2" in outs[1][0]


_WAITER = """
import os, sys, time
import pardist
pardist.init()
open(sys.argv[1] + f".{pardist.rank()}", "w").write(str(os.getpid()))
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (dead, not yet reaped) is not alive
        return f.read().split(")")[-1].split()[0] != "Z"


LAUNCHERS = {
    "pardist.launch": [sys.executable, "-m", "pardist.launch", "--nproc", "2"],
    "torchrun": [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
    ],
}


def _launch_waiters(
    tmp_path, launcher: str = "pardist.launch"
) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "wait.py"
    script.write_text(_WAITER)
    command = [*LAUNCHERS[launcher], str(script)]
    launcher = subprocess.Popen(
        [*command, str(tmp_path / "pid")],
        cwd=ROOT, env={**os.environ, "PARDIST_DEVICE": "cpu"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    files = [tmp_path / f"pid.{r}" for r in range(2)]
    deadline = time.monotonic() + 120  # bounded by the event: both ranks started
    while not all(f.exists() and f.read_text() for f in files):
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.2)
    return launcher, [int(f.read_text()) for f in files]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_ranks_die_with_a_killed_launcher(tmp_path, launcher):
    # F6: ranks outlived a kill -9 of their launcher (under PID 1); pardist's ranks die too.
    launcher, pids = _launch_waiters(tmp_path, launcher)
    launcher.kill()
    launcher.wait(30)
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    for p in left:  # (not left behind by the test either)
        os.kill(p, 9)
    assert not left, f"ranks {left} outlived the launcher"


@pytest.mark.timeout(240)
def test_ctrl_c_of_the_launcher_exits_130(tmp_path):
    import signal

    launcher, pids = _launch_waiters(tmp_path)
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, err[-2000:]
    assert "stopped by SIGINT" in err
