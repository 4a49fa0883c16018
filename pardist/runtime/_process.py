"""The process group: starting it, tearing it down, and who this process is.

Everything here reads the torchrun environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). A plain ``python`` process has
none of it and counts as world size 1, so one script runs under both launchers.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import itertools
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from pardist.runtime import _faults, _join, _listen, _survive
from pardist.runtime._faults import DEFAULT_TIMEOUT_S

__all__ = [
    "device",
    "start",
    "is_initialized",
    "is_main",
    "local_rank",
    "require_init",
    "rank",
    "shutdown",
    "world_size",
]


def _die_with_launcher() -> None:
    """A rank of ``python -m pardist.launch`` (or of torchrun) is killed when the launcher dies.

    Linux's parent-death signal: without it a ``kill -9`` of the launcher (as of torchrun)
    leaves its ranks running under PID 1, holding their GPUs and ports. Only for the
    launcher's own children (not their DataLoader workers); a rank whose launcher died
    before it got here exits at once.
    """
    launcher = os.environ.get("PARDIST_LAUNCHER_PID")
    torchrun = launcher is None and "TORCHELASTIC_RUN_ID" in os.environ
    if (launcher is None and not torchrun) or not sys.platform.startswith("linux"):
        return
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        return  # a worker of a rank (a DataLoader's): its parent is the rank
    if torchrun:  # torchrun's agent is the parent (unless it is PID 1: a container's init)
        if os.getppid() == 1:
            return
        launcher = str(os.getppid())
    if os.getppid() != int(launcher):
        if os.environ.get("LOCAL_RANK") is not None and os.getppid() == 1:
            os._exit(1)  # the launcher is gone already
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(launcher):  # it died between the two checks
        os._exit(1)


_die_with_launcher()

_owns_group = False
_shutdown_hooks: list[Callable[[], None]] = []
_atexit_registered = False
_debug_level_before = None  # torch's debug level before PARDIST_DEBUG=1 raised it
_started: dict = {}  # the backend and timeout init_process_group was given


class GroupRef:
    """A process group held by name, so that holding one never keeps the group alive.

    A gloo group that outlives ``destroy_process_group`` (because some object still
    refers to it) is torn down during interpreter exit, where its worker threads can
    abort the process ("terminate called without an active exception"). pardist's
    long-lived objects (gradient buckets, meshes) therefore keep names, not groups.
    """

    __slots__ = ("name",)

    def __init__(self, group: dist.ProcessGroup):
        self.name = group.group_name

    def get(self) -> dist.ProcessGroup:
        return dist.distributed_c10d._resolve_process_group(self.name)


def on_shutdown(hook: Callable[[], None], *, first: bool = False) -> None:
    """Run ``hook`` at :func:`shutdown`, before the group goes: to drop cached references."""
    if hook not in _shutdown_hooks:
        _shutdown_hooks.insert(0 if first else len(_shutdown_hooks), hook)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def rank() -> int:
    """This process's global rank (0 in a plain ``python`` process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _env_int("RANK", 0)


def world_size() -> int:
    """How many processes take part (1 in a plain ``python`` process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _env_int("WORLD_SIZE", 1)


def local_rank() -> int:
    """This process's rank on its own machine, as torchrun sets ``LOCAL_RANK``."""
    return _env_int("LOCAL_RANK", 0)


def is_main() -> bool:
    """True on global rank 0, the process that should print and write files."""
    return rank() == 0


def _accelerator_type() -> str | None:
    """The accelerator's device type ('cuda', 'xpu', ...) if one is usable, else None."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return accelerator.current_accelerator().type
    if torch.cuda.is_available():
        return "cuda"
    return None


def device() -> torch.device:
    """The device this process computes on: its local accelerator, else the CPU.

    Example:
        >>> import pardist
        >>> pardist.device().type in ("cpu", "cuda", "xpu", "mps")
        True
    """
    kind = _accelerator_type()
    if kind is None or os.environ.get("PARDIST_DEVICE") == "cpu":
        return torch.device("cpu")
    count = getattr(torch, kind).device_count()
    return torch.device(kind, local_rank() % max(count, 1))


def _default_backend(dev: torch.device) -> str:
    if dev.type == "cpu":
        return "gloo"
    # The accelerator's own backend for its tensors, gloo beside it so that
    # CPU tensors (object gathers, checkpoint metadata) can be reduced too.
    get = getattr(dist, "get_default_backend_for_device", None)
    accel = get(dev) if get is not None else ("nccl" if dev.type == "cuda" else "gloo")
    return f"cpu:gloo,{dev.type}:{accel}"


def _timeout(timeout: float | datetime.timedelta | None) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if timeout is None:
        timeout = float(os.environ.get("PARDIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    return datetime.timedelta(seconds=float(timeout))


def is_initialized() -> bool:
    """Whether a process group is running (started by ``init`` or by the user)."""
    return dist.is_available() and dist.is_initialized()


def start(backend: str | None = None, *, timeout: float | datetime.timedelta | None = None):
    """Start the process group from the torchrun environment (see :func:`pardist.init`)."""
    global _owns_group, _debug_level_before
    if not is_initialized():
        # torch 2.13: torch.distributed.checkpoint imported *after* the group starts
        # keeps the group alive past destroy_process_group; its gloo threads are then
        # torn down at interpreter exit, which sometimes aborts the process
        # ("terminate called without an active exception"). Imported first, it does not.
        import torch.distributed.checkpoint  # noqa: F401

        dev = device()
        if dev.type != "cpu":
            getattr(torch, dev.type).set_device(dev)
        chosen = backend or _default_backend(dev)
        kwargs = dict(backend=chosen, timeout=_timeout(timeout))
        if _debug() and dist.get_debug_level() == dist.DebugLevel.OFF:
            # torch's own check that every rank's collective has the same shapes
            # (shared memory checks always): gloo would abort, NCCL could hang.
            _debug_level_before = dist.get_debug_level()
            dist.set_debug_level(dist.DebugLevel.DETAIL)
        _faults.set_timeout(kwargs["timeout"].total_seconds())
        _started.update(kwargs)
        _listen.gloo_on_loopback()
        _faults.record_uncaught()
        if os.environ.get(_survive.ID):  # a replacement for a lost rank (--keep-going)
            from pardist.runtime import _rejoin

            _rejoin.wait_to_join(_join.secret_keys(_attempt_store(kwargs["timeout"])))
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            rank_, world = _join.rank_in_world()
            store = _attempt_store(kwargs["timeout"]) or _env_store(kwargs["timeout"])
            if store is not None:
                store = _join.secret_keys(store)
                start = next(_starts)
                _join.all_here(store, world, kwargs["timeout"], f"pardist/here/{start}", rank_)
                dist.init_process_group(store=store, rank=rank_, world_size=world, **kwargs)
                # gloo's start is no barrier: a rank that returned from it and left at
                # once closed a pair its peer was still connecting ("connectFullMesh
                # failed ... Connection closed by peer", seen on a loaded machine).
                _join.all_here(store, world, kwargs["timeout"], f"pardist/connected/{start}", rank_)
                _survive.remember(store, world)
            else:
                dist.init_process_group(**kwargs)
        else:
            # A plain python process: a group of one over an in-memory store, so
            # meshes, checkpoints and collectives behave as under torchrun.
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        _owns_group = True
        global _atexit_registered
        if not _atexit_registered:  # torn down while the interpreter is whole, not during exit
            atexit.register(shutdown)
            _atexit_registered = True


def leave() -> None:
    """Leave the default group for good (a peer was lost: ``_survive``): what was cached
    for it is dropped and its connections close, so a rank still waiting in one of its
    collectives learns at once that this one has gone."""
    for hook in _shutdown_hooks:
        hook()
    _faults.forget_labels()
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if is_initialized() and "nccl" in str(dist.get_backend()) and abort is not None:
        abort()  # NCCL: a communicator with a dead peer is aborted (a destroy would wait)
    elif is_initialized():
        dist.destroy_process_group()
    gc.collect()  # what held the old group in reference cycles


def join(store, rank_: int, world: int) -> None:
    """A new default group over ``store`` with the backend and timeout of the first."""
    dist.init_process_group(store=store, rank=rank_, world_size=world, **_started)
    _join.all_here(store, world, _started["timeout"], "pardist/connected", rank_)


def _debug() -> bool:
    return os.environ.get("PARDIST_DEBUG", "") not in ("", "0")


_starts = itertools.count(1)  # groups started by this process (alike on every rank)


def _attempt_store(timeout: datetime.timedelta):
    """Under torchrun's agent store: the store seen through a prefix for this restart.

    torchrun (2.13) keeps its rendezvous store across ``--max-restarts``, and the
    restarted group then finds the dead attempt's gloo keys and fails (``Gloo
    connectFullMesh failed ... Connection refused``) or hangs. A prefix per attempt
    gives every restart fresh keys. Elsewhere None: torch's env:// does the rest.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"pardist/attempt_{attempt}/", store)


def _env_store(timeout: datetime.timedelta):
    """env://'s store, but rank 0 waits for the others as long as they may take to start.

    torch's env:// store waits for every worker with the collective timeout: with a
    short ``PARDIST_TIMEOUT`` on a loaded machine, a worker that starts late failed the
    job ("Timed out after 6 seconds waiting for clients. 3/4 clients joined"). The wait
    for workers is bounded by the launcher's join timeout (``--join-timeout``, passed as
    ``PARDIST_JOIN_TIMEOUT``; else 600 s); every later wait by the collective timeout.
    """
    if not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        return None
    host, port, world = (
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
    )
    kwargs = dict(
        timeout=max(timeout, _join.join_timeout()),
        wait_for_workers=True,
        multi_tenant=True,  # as env:// (another group in this process may share the port)
    )
    try:
        if int(os.environ["RANK"]) == 0:  # loopback when the run is on one machine
            single = _listen.single_node()
            store = _listen.store_server(host, port, single_node=single, world_size=world, **kwargs)
        else:
            store = dist.TCPStore(host, port, world, is_master=False, **kwargs)
    except (RuntimeError, OSError) as e:  # (torch's DistNetworkError, DistStoreError)
        raise _join.store_error(e, host, port, world) from None
    store.set_timeout(timeout)
    return store


def shutdown() -> None:
    """Tear down the process group started by :func:`init` (a no-op otherwise)."""
    global _owns_group, _debug_level_before
    for hook in _shutdown_hooks:
        hook()
    _faults.forget_labels()
    if _owns_group and is_initialized():
        dist.destroy_process_group()
        if _debug_level_before is not None:
            dist.set_debug_level(_debug_level_before)
        if _backend_threads():
            # Garbage still holds the group: a torch DDP model sits in a reference cycle
            # until the collector runs, and its reducer keeps the group (and its threads)
            # alive. Left to the collection at interpreter exit, its threads are joined
            # while the interpreter is half gone: the process hangs or aborts.
            gc.collect()
    _owns_group, _debug_level_before = False, None


def _backend_threads() -> int:
    """This process's gloo / NCCL threads (all threads, where /proc cannot tell them apart)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read()
        except OSError:
            continue
        count += "gloo" in name or "nccl" in name
    return count


def require_init(where: str) -> None:
    """Raise a clear error if the process group has not been started."""
    if not is_initialized():
        raise RuntimeError(
            f"pardist.{where}: the process group is not started. Call pardist.init() "
            "first; it works under torchrun and in a plain python process (world size 1)."
        )
