"""Running a function in N local processes: ``pardist.spawn``, and the worker groups behind it.

The parent process hosts the rendezvous store on a port the OS picks (as
torchrun's agent does), so no free-port guess can race with another program;
the workers join it as clients (``TORCHELASTIC_USE_AGENT_STORE``) and start
their process group with ``pardist.init``. A :class:`Workers` group stays alive
between calls, which is what the test suite uses to avoid paying torch's import
for every test.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SpawnError", "Workers", "spawn"]

try:  # closures and notebook functions pickle by value with cloudpickle
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover
    _pickler = pickle


class SpawnError(RuntimeError):
    """A rank failed (or did not answer); the message holds its traceback."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def _worker(rank: int, world: int, port: int, conn, env: dict, threads: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "TORCHELASTIC_USE_AGENT_STORE": "True", **env})
    torch.set_num_threads(threads)
    import pardist

    try:
        pardist.init()
        conn.send_bytes(pickle.dumps(("ok", None)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
        return
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break
        fn, args, kwargs = pickle.loads(message)
        try:
            reply = ("ok", fn(*args, **kwargs))
            payload = _pickler.dumps(reply)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            payload = pickle.dumps(("err", "".join(traceback.format_exception(exc))))
        conn.send_bytes(payload)
    pardist.shutdown()


def _start_method(requested: str | None) -> str:
    if requested:
        return requested
    # fork runs functions defined in a notebook or on stdin, which the spawn
    # start method cannot import; it is only unsafe once CUDA is initialised.
    return "fork" if sys.platform != "win32" else "spawn"


class Workers:
    """``nprocs`` local processes with a process group, running functions on request.

    Args:
        nprocs: the world size.
        start_method: 'fork' (default on Linux: works from notebooks), 'forkserver'
            or 'spawn'.
        env: extra environment variables for the workers.
        timeout: seconds to wait for each call before the group is killed.
    """

    def __init__(self, nprocs: int, *, start_method: str | None = None,
                 env: dict[str, str] | None = None, timeout: float = 300.0):
        if nprocs < 1:
            raise ValueError(f"pardist.spawn: nprocs={nprocs}; give at least 1 process.")
        method = _start_method(start_method)
        if method == "fork" and torch.cuda.is_initialized():
            raise RuntimeError(
                "pardist.spawn: CUDA is already initialised in this process, and forked "
                "workers cannot use it. Do not touch the GPU before spawn (no .cuda(), no "
                "torch.cuda calls): create models and tensors inside the spawned function.")
        self.nprocs, self.timeout = nprocs, timeout
        self._store = dist.TCPStore("127.0.0.1", 0, nprocs, is_master=True,
                                    wait_for_workers=False)
        ctx = multiprocessing.get_context(method)
        threads = max(1, (os.cpu_count() or 1) // nprocs)
        self._conns, self._procs = [], []
        for rank in range(nprocs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, daemon=True, name=f"pardist-rank{rank}",
                               args=(rank, nprocs, self._store.port, child, dict(env or {}),
                                     threads))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect("start")

    def _collect(self, what: str, timeout: float | None = None) -> list[Any]:
        import multiprocessing.connection as mpc

        deadline = self.timeout if timeout is None else timeout
        waiting = dict(enumerate(self._conns))
        results: list[Any] = [None] * self.nprocs
        errors: dict[int, str] = {}
        while waiting:
            ready = mpc.wait(list(waiting.values()), timeout=deadline)
            if not ready:
                self.close()
                raise SpawnError(
                    f"pardist.spawn: rank(s) {sorted(waiting)} did not finish {what} within "
                    f"{deadline:.0f} s{self._error_summary(errors)}; the workers were stopped.",
                    rank=min(waiting))
            for rank, conn in list(waiting.items()):
                if conn not in ready:
                    continue
                del waiting[rank]
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    status, value = "err", f"rank {rank} exited (code {self._procs[rank].exitcode})"
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
            if errors and waiting:
                deadline = min(deadline, 30.0)  # the rest are likely stuck on the failed one
        if errors:
            first = min(errors)
            self.close()
            raise SpawnError(f"pardist.spawn: rank {first} failed during {what}:\n"
                             f"{errors[first]}{self._error_summary(errors, skip=first)}",
                             rank=first)
        return results

    @staticmethod
    def _error_summary(errors: dict[int, str], skip: int | None = None) -> str:
        others = {r: e.strip().splitlines()[-1] for r, e in errors.items() if r != skip}
        return "".join(f"\n(rank {r}: {line})" for r, line in sorted(others.items()))

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; each rank's result, in rank order."""
        if not self._procs:
            raise RuntimeError("pardist.spawn: these workers were closed.")
        payload = _pickler.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(payload)
        return self._collect(f"{getattr(fn, '__name__', 'the call')}", timeout)

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._conns, self._procs = [], []

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def spawn(fn: Callable, nprocs: int, *args: Any, start_method: str | None = None,
          timeout: float = 3600.0, env: dict[str, str] | None = None) -> Any:
    """Run ``fn(*args)`` in ``nprocs`` local processes and return rank 0's result.

    The notebook launcher: works from a script, a notebook or stdin. Each process
    has its process group started (``pardist.init``), so ``fn`` can use
    ``data_parallel`` directly. If any rank fails, the others are stopped and a
    :class:`SpawnError` carrying the failing rank's traceback is raised here.

    Example:
        >>> import pardist
        >>> pardist.spawn(pardist.world_size, 2)
        2
    """
    with Workers(nprocs, start_method=start_method, env=env, timeout=timeout) as workers:
        return workers.run(fn, *args)[0]
