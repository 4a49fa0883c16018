"""Ranks started by hand that cannot make a world: a pardist error within the join timeout.

Each case starts processes as a user does without a launcher (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` by hand, each with its own hash seed) and waits for them
to exit: a ``RANK`` outside the world at once, a world that never fills (``WORLD_SIZE=3``
with two processes) and a rank started twice within the join timeout, each naming the
ranks. Without these checks the cases were silent until killed, or torch's ``EADDRINUSE``
and gloo's ``enforce fail ... rank < size``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest
from helpers import ranks_by_hand

JOIN = 8  # seconds: the join timeout (and the collective timeout) of these runs
SCRIPT = "import pardist; pardist.init(); pardist.shutdown(); print('joined')"
pytestmark = pytest.mark.timeout(240)


def _start(ranks: list[int], world: int) -> list[tuple[int, str]]:
    """Every process's exit status and output (stderr included), started together."""
    procs = ranks_by_hand(
        SCRIPT, ranks, world, PARDIST_JOIN_TIMEOUT=str(JOIN), PARDIST_TIMEOUT=str(JOIN)
    )
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=200)  # the join timeout bounds them: 8 s and start-up
        out.append((p.returncode, text))
    return out


def test_a_rank_outside_the_world_is_named_at_once():
    ((code, text),) = _start([2], world=2)
    assert code != 0 and "RANK=2 is outside a world of WORLD_SIZE=2 (ranks 0 to 1)" in text, text
    assert "enforce fail" not in text


def test_a_world_that_never_fills_names_the_missing_rank():
    results = _start([0, 1], world=3)
    assert all(code != 0 for code, _ in results), results
    said = "\n".join(text for _, text in results)
    assert "pardist.init" in said and "WORLD_SIZE=3" in said, said
    assert "joined" not in said.splitlines()  # (the script's line: no process got past init)


def test_a_rank_started_twice_is_refused_and_named():
    results = _start([0, 1, 1], world=3)
    assert all(code != 0 for code, _ in results), results
    said = "\n".join(text for _, text in results)
    assert "pardist.init: rank 1 is here twice" in said, said
    assert "rank(s) 0, 1 arrived, rank(s) 2 never did; started twice: rank 1" in said, said


def test_two_processes_of_rank_0_are_named():
    results = _start([0, 0], world=2)
    assert all(code != 0 for code, _ in results), results
    said = "\n".join(text for _, text in results)
    assert "the port is in use" in said and "a second process with RANK=0" in said, said
    assert "pardist.init: rank 0: not every rank of WORLD_SIZE=2 connected" in said, said


HOLD = r"""
import os, pathlib, time
import pardist
pardist.init()
pathlib.Path(os.environ["READY"] + os.environ["RANK"]).touch()
while not pathlib.Path(os.environ["READY"] + "done").exists():
    time.sleep(0.05)
pardist.shutdown()
"""

PROBE = r"""
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                      timeout=datetime.timedelta(seconds=30))
print(store.check(["pardist/here/1/all", "pardist/here/1/rank/1"]))
"""


@pytest.mark.parametrize("secret", ["with a secret", "without"])
def test_a_client_without_the_runs_secret_reads_none_of_its_keys(tmp_path, secret):
    """Anyone on the machine can connect to rank 0's store (torch's TCPStore has no
    authentication); with the run's secret (PARDIST_STORE_SECRET, drawn by the launcher and
    by pardist.spawn) every key the run uses is behind it, and a client without it finds
    none. Without one, the same probe reads the run's join keys: the probe can see them."""
    ready = str(tmp_path / "ready-")
    key = "0123456789abcdef0123456789abcdef" if secret == "with a secret" else None
    procs = ranks_by_hand(HOLD, [0, 1], 2, piped=False, READY=ready, PARDIST_STORE_SECRET=key)
    try:
        for rank in (0, 1):  # both past init: the join keys are set
            path = pathlib.Path(ready + str(rank))
            while not path.exists():
                assert all(p.poll() is None for p in procs), "a rank exited before init ended"
                time.sleep(0.05)
        env = {k: v for k, v in os.environ.items() if k != "PARDIST_STORE_SECRET"}
        probe = subprocess.run(
            [sys.executable, "-c", PROBE, str(procs[0].port)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert probe.returncode == 0, probe.stderr
        assert probe.stdout.strip() == ("False" if secret == "with a secret" else "True")
    finally:
        pathlib.Path(ready + "done").touch()
        for p in procs:
            p.wait(timeout=120)
    assert all(p.returncode == 0 for p in procs)
