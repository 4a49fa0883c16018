"""Running a function in N local processes: ``pardist.spawn``, and the worker groups behind it.

The parent process hosts the rendezvous store on a port the OS picks (as
torchrun's agent does), so no free-port guess can race with another program and a
busy ``MASTER_PORT`` does not matter; the workers join it as clients
(``TORCHELASTIC_USE_AGENT_STORE``) and start their process group with
``pardist.init``. A :class:`Workers` group stays alive between calls, which is
what the test suite uses to avoid paying torch's import for every test.

Workers are forked by default, because only fork runs functions defined in a
notebook or on stdin (the 'spawn' start method re-imports ``__main__``, which has
no file there). Fork is unsafe once the parent has used CUDA, so nothing here
touches CUDA in the parent, and a parent that did is refused with the fix.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import secrets
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch

from pardist.runtime import _join, _listen, _survive
from pardist.transport import _alive, _segments

__all__ = ["SpawnError", "Workers", "spawn"]

try:  # closures and notebook functions pickle by value with cloudpickle
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover
    _pickler = pickle

# Once a rank has failed, how long the others get to finish or fail on their own
# before they are stopped: they are usually waiting for the failed rank in a
# collective, and their own errors only add detail.
GRACE_S = 5.0
_STORE_TIMEOUT = datetime.timedelta(seconds=300)  # torch's default


class SpawnError(RuntimeError):
    """A rank failed (or did not answer); the message holds its traceback.

    Attributes:
        rank: the first failing rank (None if the failure was not one rank's).
        errors: every failing rank's traceback (or reason), by rank.
    """

    def __init__(self, message: str, rank: int | None = None, errors: dict[int, str] | None = None):
        super().__init__(message)
        self.rank = rank
        self.errors = dict(errors or {})


def _worker(rank: int, world: int, conn, env: dict, threads: int) -> None:
    try:
        port = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            **env,
        }
    )
    torch.set_num_threads(threads)
    from pardist.runtime import _mesh, _process

    try:
        _mesh.init()
        conn.send_bytes(pickle.dumps(("ok", None)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
        return
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break
        try:
            fn, args, kwargs = pickle.loads(message)
            reply = ("ok", fn(*args, **kwargs))
            payload = _pickler.dumps(reply)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            payload = pickle.dumps(("err", "".join(traceback.format_exception(exc))))
        conn.send_bytes(payload)
    _process.shutdown()


def _main_has_file() -> bool:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return bool(path) and os.path.exists(path)


def _start_method(requested: str | None) -> str:
    if requested is None:
        return "fork" if sys.platform != "win32" else "spawn"
    if requested not in ("fork", "forkserver", "spawn"):
        raise ValueError(
            f"pardist.spawn: start_method={requested!r}; use 'fork' (the "
            "default), 'forkserver' or 'spawn'."
        )
    if requested != "fork" and not _main_has_file():
        raise ValueError(
            f"pardist.spawn: start_method={requested!r} re-imports __main__ in every worker, "
            "and this __main__ (a notebook, stdin or -c) has no file to import. Use the "
            "default start method, fork, or move the function into a module."
        )
    return requested


def _check_cuda_untouched(method: str) -> None:
    if method != "fork":
        return
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "pardist.spawn: CUDA is already initialised in this process, and forked workers "
            "cannot use it. Do not touch the GPU before spawn (no .cuda(), .to('cuda') or "
            "torch.cuda calls in earlier cells): create models and tensors inside the spawned "
            "function, or restart the kernel."
        )
    # torch.cuda.is_available() checks through NVML with this set, which leaves
    # the parent fork-safe if a later cell asks before the next spawn.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def _stop(procs: list, conns: list, wait: float = 3.0) -> None:
    for conn in conns:
        conn.close()  # an idle worker sees EOF and shuts down cleanly
    deadline = time.monotonic() + wait
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:  # the rest are stuck (in a collective, or in user code)
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(5)
    _segments.clean_stale()  # left by a worker killed while setting one up


@contextlib.contextmanager
def _hash_seed(seed: int | None):
    """``PYTHONHASHSEED=seed`` in this process's environment while a worker starts."""
    if seed is None:
        yield
        return
    before = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = str(seed)
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = before


class Workers:
    """``nprocs`` local processes with a process group, running functions on request.

    Args:
        nprocs: the world size.
        start_method: 'fork' (default on Linux: works from notebooks and stdin),
            'forkserver' or 'spawn' (these two need ``__main__`` to be a file).
        env: extra environment variables for the workers.
        timeout: seconds to wait for each call before the group is killed.
        hash_seeds: one ``PYTHONHASHSEED`` per rank ('spawn' only: a forked process
            keeps its parent's), so that the ranks order sets differently, as
            torchrun's ranks do (each is a fresh interpreter with its own seed).
        keep_going: a rank that dies is left behind (``lost``: rank to how it died) and
            the others go on without it, inside the call of the step that saw it go
            (``runtime._survive``); its result is None.
    """

    def __init__(
        self,
        nprocs: int,
        *,
        start_method: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 300.0,
        hash_seeds: list[int] | None = None,
        keep_going: bool = False,
    ):
        if not isinstance(nprocs, int) or nprocs < 1:
            raise ValueError(f"pardist.spawn: nprocs={nprocs!r}; give at least 1 process.")
        method = _start_method(start_method)
        if hash_seeds is not None and (method != "spawn" or len(hash_seeds) != nprocs):
            raise ValueError(
                f"pardist.spawn: hash_seeds={hash_seeds!r} needs start_method='spawn' (a "
                f"forked process keeps its parent's hash seed) and one seed per rank ({nprocs})."
            )
        _check_cuda_untouched(method)
        self.nprocs, self.timeout = nprocs, timeout
        ctx = multiprocessing.get_context(method)
        # A forked worker computes on one thread: OpenMP cannot start the threads of a
        # parent that used them before the fork (its first parallel region would hang).
        threads = 1 if method == "fork" else max(1, (os.cpu_count() or 1) // nprocs)
        self._conns, self._procs = [], []
        # The run's store secret (runtime._join.secret_keys): the same for every rank.
        secret = {_join.SECRET: os.environ.get(_join.SECRET) or secrets.token_hex(16)}
        self.keep_going, self.lost = keep_going, {}  # lost: rank -> how it died
        self._stopped, self._fenced = _alive.Stopped(), {}
        if keep_going:
            secret[_survive.ENV] = "1"
        for rank in range(nprocs):
            parent, child = ctx.Pipe()
            # Not daemonic, so that the function may start processes of its own
            # (DataLoader workers); the finalizer below stops them instead.
            proc = ctx.Process(
                target=_worker,
                name=f"pardist-rank{rank}",
                args=(rank, nprocs, child, {**secret, **(env or {})}, threads),
            )
            with _hash_seed(None if hash_seeds is None else hash_seeds[rank]):
                proc.start()  # (a spawned interpreter reads its seed from the environment)
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns)
        # The store's server thread starts after the fork: a process forked while
        # another thread holds a lock (in the allocator, an import) can hang.
        self._store = _listen.store_server(
            "127.0.0.1",
            0,
            single_node=True,
            timeout=_STORE_TIMEOUT,
            world_size=nprocs,
            wait_for_workers=False,
        )
        self._port = self._store.port
        self._word = _survive.launcher_view(self._store, secret[_join.SECRET])
        for conn in self._conns:
            conn.send_bytes(pickle.dumps(self._port))
        self._collect("start")

    @property
    def port(self) -> int:
        """The port of the rendezvous store (picked by the OS)."""
        return self._port

    def _collect(self, what: str, timeout: float | None = None) -> list[Any]:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        waiting = {r: c for r, c in enumerate(self._conns) if r not in self.lost}
        results: list[Any] = [None] * self.nprocs
        errors: dict[int, str] = {}
        while waiting:
            left = max(0.0, deadline - time.monotonic())
            ready = mpc.wait(list(waiting.values()), timeout=min(left, 0.2))
            if not ready and self.keep_going:
                self._fence(waiting)
            if not ready and time.monotonic() < deadline:
                continue
            if not ready:
                seconds = self.timeout if timeout is None else timeout
                self.close(wait=0.5)
                stuck = sorted(waiting)
                raise SpawnError(
                    f"pardist.spawn: rank(s) {stuck} did not finish {what} within "
                    f"{seconds:.0f} s{_summary(errors)}; the workers were stopped."
                    if not errors
                    else f"pardist.spawn: rank {min(errors)} failed during {what}:\n"
                    f"{errors[min(errors)]}{_summary(errors, skip=min(errors))}\n(rank(s) "
                    f"{stuck} were still waiting, probably for it, and were stopped.)",
                    rank=min(errors) if errors else min(stuck),
                    errors=errors,
                )
            for rank, conn in list(waiting.items()):
                if conn not in ready:
                    continue
                del waiting[rank]
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    code = self._procs[rank].exitcode
                    self._procs[rank].join(1)
                    code = self._procs[rank].exitcode if code is None else code
                    if self.keep_going and len(self.lost) + 1 < self.nprocs:
                        self._publish(rank, self._fenced.get(rank) or _survive.how_it_died(code))
                        continue
                    status, value = (
                        "err",
                        (
                            f"rank {rank} exited with code {code} without "
                            "answering (killed, or os._exit / a crash)."
                        ),
                    )
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
            if errors and waiting:
                deadline = min(deadline, time.monotonic() + GRACE_S)
        if errors:
            first = min(errors)
            self.close(wait=0.5)
            raise SpawnError(
                f"pardist.spawn: rank {first} failed during {what}:\n"
                f"{errors[first]}{_summary(errors, skip=first)}",
                rank=first,
                errors=errors,
            )
        return results

    def _fence(self, waiting: dict) -> None:
        """Kill a rank stopped (SIGSTOP) for long: the others then go on without it."""
        for rank in waiting:
            if self._stopped.held(rank, _alive.state(self._procs[rank].pid) == "T"):
                self._procs[rank].kill()
                self._fenced[rank] = _alive.fenced("pardist.spawn")

    def _publish(self, rank: int, how: str) -> None:
        """Tell the survivors (``runtime._survive``) that ``rank`` is gone and who is left."""
        self.lost[rank] = how
        members = [r for r in range(self.nprocs) if r not in self.lost]
        _survive.publish(self._word, len(self.lost), members, self.lost)

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; each rank's result, in rank order.

        Raises:
            SpawnError: a rank raised (its traceback is in the message), died, or did
                not answer within ``timeout``; the group is then closed.
        """
        if not self._procs:
            raise RuntimeError("pardist.spawn: these workers were closed; start new ones.")
        payload = _pickler.dumps((fn, args, kwargs))
        try:
            for rank, conn in enumerate(self._conns):
                if rank not in self.lost:
                    conn.send_bytes(payload)
            return self._collect(f"{getattr(fn, '__name__', 'the call')}", timeout)
        except (KeyboardInterrupt, BrokenPipeError):
            self.close()  # the workers are mid-call; they cannot be reused
            raise

    def close(self, wait: float = 3.0) -> None:
        """Stop the workers: idle ones shut down cleanly; those busy after ``wait`` s are killed."""
        if self._finalizer.detach():
            _stop(self._procs, self._conns, wait)
        self._conns, self._procs = [], []
        self._store = None  # stops its server thread, so later forks start from fewer threads

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _summary(errors: dict[int, str], skip: int | None = None) -> str:
    others = {r: e.strip().splitlines()[-1] for r, e in errors.items() if r != skip}
    return "".join(f"\n(rank {r}: {line})" for r, line in sorted(others.items()))


def spawn(
    fn: Callable,
    nprocs: int,
    *args: Any,
    start_method: str | None = None,
    timeout: float = 3600.0,
    env: dict[str, str] | None = None,
    keep_going: bool = False,
) -> Any:
    """Run ``fn(*args)`` in ``nprocs`` local processes and return rank 0's result.

    The notebook launcher: works from a script, a notebook cell or stdin. Each
    process has its process group started (``pardist.init``), so ``fn`` can use
    ``data_parallel`` directly. The rendezvous port is picked by the OS. If any
    rank fails, the others are stopped and a :class:`SpawnError` carrying the
    failing rank's traceback is raised here. Do not use CUDA in the calling
    process before this (forked workers could not); create models inside ``fn``.

    Args:
        fn: the function; a closure or a notebook function is fine.
        nprocs: how many processes (the world size).
        *args: its arguments, the same on every rank.
        start_method: 'fork' by default (see :class:`Workers`).
        timeout: seconds before a call that has not returned is stopped.
        env: extra environment variables for the workers (e.g. ``PARDIST_TIMEOUT``).
        keep_going: a rank that dies is left behind and the others train on without it,
            inside the step that saw it go (docs/keep_going.md); the result is then the
            first surviving rank's (the new rank 0's).

    Returns:
        ``fn``'s result on rank 0.

    Raises:
        SpawnError: a rank raised, died or timed out; its traceback is in the message.

    Example:
        >>> import pardist
        >>> pardist.spawn(pardist.world_size, 2)
        2
    """
    with Workers(
        nprocs, start_method=start_method, env=env, timeout=timeout, keep_going=keep_going
    ) as workers:
        results = workers.run(fn, *args)
        return results[min(set(range(nprocs)) - set(workers.lost))]
