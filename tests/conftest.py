"""Multi-process tests: keep worker groups alive and send them test bodies.

``run(n, fn, *args)`` runs ``fn(*args)`` on every rank of an n-process gloo group
and returns each rank's result (rank order), or raises the failing rank's
traceback. Groups start once per session, so a test costs its own work, not
torch's import; a group in which anything failed is discarded and started afresh
for the next test. Every call is bounded: collectives time out after
PARDIST_TIMEOUT seconds, and a call that does not return in time kills its group.

The ranks differ as torchrun's do: each is a fresh interpreter ('spawn') with a
PYTHONHASHSEED of its own, so anything that follows a set's order (which follows
the hash seed) differs between ranks here as it does under torchrun. The seeds
are drawn per session and shown in pytest's header; PARDIST_TEST_HASH_SEEDS=a,b,..
replays them.
"""

from __future__ import annotations

import concurrent.futures
import os
import random

import pytest

os.environ.setdefault("PARDIST_TIMEOUT", "30")
# The multi-process tests are CPU tests (gloo and shared memory): one GPU cannot
# hold two nccl ranks. The CUDA path runs in tests/test_cuda.py, at world size 1.
os.environ.setdefault("PARDIST_DEVICE", "cpu")

from pardist.launch._spawn import SpawnError, Workers  # noqa: E402

# Scripts run as processes of their own (python, torchrun); importing them would run them.
collect_ignore_glob = ["scripts/*"]

CALL_TIMEOUT = 120.0


def _hash_seeds() -> list[int]:
    given = os.environ.get("PARDIST_TEST_HASH_SEEDS")
    if given:
        return [int(s) for s in given.split(",")]
    return random.Random().sample(range(1, 2**32 - 1), 4)


HASH_SEEDS = _hash_seeds()


def pytest_report_header(config):
    return f"rank hash seeds: PARDIST_TEST_HASH_SEEDS={','.join(map(str, HASH_SEEDS))}"


@pytest.fixture(scope="session")
def _groups():
    groups: dict[int, Workers] = {}
    yield groups
    # All groups at once: a worker's interpreter takes seconds to exit after torch, and
    # one group after another (a dozen, by the end of the suite) took 39 s of CI.
    with concurrent.futures.ThreadPoolExecutor(max(len(groups), 1)) as pool:
        list(pool.map(Workers.close, groups.values()))


@pytest.fixture
def run(_groups):
    def run(nprocs: int, fn, *args, timeout: float = CALL_TIMEOUT, env=None, **kwargs):
        key = (nprocs, tuple(sorted((env or {}).items())))
        if key not in _groups:
            _groups[key] = Workers(
                nprocs,
                start_method="spawn",
                env=env,
                timeout=CALL_TIMEOUT,
                hash_seeds=HASH_SEEDS[:nprocs],
            )
        try:
            return _groups[key].run(fn, *args, timeout=timeout, **kwargs)
        except SpawnError:
            _groups.pop(key).close()
            raise

    return run


@pytest.fixture
def world1():
    """pardist initialised in this (pytest) process, as a plain python script would be."""
    import pardist

    mesh = pardist.init()
    yield mesh
    pardist.shutdown()
