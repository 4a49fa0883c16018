"""Multi-process tests: keep worker groups alive and send them test bodies.

``run(n, fn, *args)`` runs ``fn(*args)`` on every rank of an n-process gloo group
and returns each rank's result (rank order), or raises the failing rank's
traceback. Groups start once per session from a forkserver that has torch
imported, so a test costs its own work, not torch's import; a group in which
anything failed is discarded and started afresh for the next test. Every call is
bounded: collectives time out after PARDIST_TIMEOUT seconds, and a call that
does not return in time kills its group.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest

os.environ.setdefault("PARDIST_TIMEOUT", "30")
# The multi-process tests are CPU tests (gloo and shared memory): one GPU cannot
# hold two nccl ranks. The CUDA path runs in tests/test_cuda.py, at world size 1.
os.environ.setdefault("PARDIST_DEVICE", "cpu")

from pardist.launch._spawn import SpawnError, Workers  # noqa: E402

# Scripts run as processes of their own (python, torchrun); importing them would run them.
collect_ignore_glob = ["scripts/*"]

CALL_TIMEOUT = 120.0


@pytest.fixture(scope="session")
def _groups():
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "pardist"])
    groups: dict[int, Workers] = {}
    yield groups
    for workers in groups.values():
        workers.close()


@pytest.fixture
def run(_groups):
    def run(nprocs: int, fn, *args, timeout: float = CALL_TIMEOUT, env=None, **kwargs):
        key = (nprocs, tuple(sorted((env or {}).items())))
        if key not in _groups:
            _groups[key] = Workers(nprocs, start_method="forkserver", env=env, timeout=CALL_TIMEOUT)
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
