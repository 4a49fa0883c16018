"""Lockstep: run n copies of a function one at a time, meeting where they must share.

The deterministic mode runs each row group's forward on its own, with the
kernels of its own shape, yet batch norm needs the statistics of every group
before any group can go on. So each group runs on a thread of its own, and only
one runs at a time: group 0 until it reaches a meeting point (a batch-norm
call), then group 1 up to the same point, and so on; the last one computes the
joint result for all of them, and group 0 goes on. Everything a group does
happens in group order, as coroutines would, and with no meeting point at all
the groups simply run one after another.

Each group draws random numbers from its own generator state: the global
generators are saved and restored at every hand-over. What a thread does not
inherit from the caller (autocast, the CUDA device and stream) is set up again
on each thread.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["Lockstep", "current", "switching"]

_local = threading.local()


def current() -> tuple[Lockstep, int] | None:
    """``(lockstep, group)`` when called from a lockstep group's thread, else None."""
    return getattr(_local, "at", None)


@contextlib.contextmanager
def switching(save: Callable[[], Any], restore: Callable[[Any], None]) -> Iterator[None]:
    """While inside, a group that hands over its turn calls ``save()``, and ``restore(saved)``
    when it gets the turn back: for state shared by the groups (a module's attributes)."""
    if current() is None:
        yield
        return
    hooks = _local.__dict__.setdefault("hooks", [])
    hooks.append([save, restore, None])
    try:
        yield
    finally:
        hooks.pop()


class _Worker(threading.Thread):
    """A thread kept for the next step: torch's first calls on a new thread cost
    milliseconds (per-thread state of its kernels), so groups reuse their threads."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="pardist-row-group")
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            self.tasks.get()()


_pool: list[_Worker] = []
os.register_at_fork(after_in_child=_pool.clear)  # (threads do not survive a fork)


def _workers(n: int) -> list[_Worker]:
    while len(_pool) < n:
        _pool.append(_Worker())
    return _pool[:n]


class _Abort(BaseException):
    """Unwinds a waiting group after another group failed."""


def _thread_state() -> Callable[[], list]:
    """The caller's thread-local torch state, as a function that re-enters it on another thread."""
    kinds = ["cpu"] + (
        ["cuda"] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    )
    autocast = [(k, torch.get_autocast_dtype(k)) for k in kinds if torch.is_autocast_enabled(k)]
    grad = torch.is_grad_enabled()
    cuda = None
    if "cuda" in kinds:
        cuda = (torch.cuda.current_device(), torch.cuda.current_stream())

    def enter() -> list:
        torch.set_grad_enabled(grad)
        contexts: list = [torch.autocast(k, dtype=d) for k, d in autocast]
        if cuda is not None:
            torch.cuda.set_device(cuda[0])
            contexts.append(torch.cuda.stream(cuda[1]))
        for c in contexts:
            c.__enter__()
        return contexts

    return enter


class Lockstep:
    """``n`` groups run ``fn(j)`` in turn; :meth:`meet` is where they wait for each other.

    ``seeds[j]`` seeds group j's random numbers (torch's on the CPU and the current CUDA
    device, NumPy's and Python's ``random``).
    """

    def __init__(self, n: int, seeds: list[int], where: str):
        self.n, self.where = n, where
        lock = threading.RLock()  # guards everything below
        self._cond = threading.Condition(lock)
        self._turns = [threading.Condition(lock) for _ in range(n)]  # one per group: wake one
        self._turn = 0
        self._slots: list = [None] * n
        self._outs: list = [None] * n
        self._finished = [False] * n
        self._arrived = 0  # groups waiting at a meeting whose joint result is not made yet
        self._failed: BaseException | None = None
        self._failed_group = -1
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._rng: list = []
        self._caller = self._generators()
        for s in seeds:
            torch.default_generator.manual_seed(s)
            if self._cuda:
                torch.cuda.manual_seed(s)
            np.random.seed(s % 2**32)
            random.seed(s)
            self._rng.append(self._generators())

    def _generators(self) -> tuple:
        """The global generators' states: torch's (CPU, CUDA), NumPy's, Python's."""
        cuda = torch.cuda.get_rng_state() if self._cuda else None
        return torch.default_generator.get_state(), cuda, np.random.get_state(), random.getstate()

    # -- the caller's side ---------------------------------------------------------

    def run(self, fn: Callable[[int], Any]) -> list:
        """Each group's ``fn(j)``, run in lockstep; the first error (in group order) is raised."""
        results: list = [None] * self.n
        enter = _thread_state()

        def body(j: int) -> None:
            _local.at = (self, j)
            contexts = enter()
            try:
                self._wait(j)
                self._restore(j)
                results[j] = fn(j)
            except _Abort:
                pass
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                with self._cond:
                    if self._failed is None:
                        self._failed, self._failed_group = e, j
                    self._wake_all()
            finally:
                for c in reversed(contexts):
                    c.__exit__(None, None, None)
                _local.at = None
                with self._cond:
                    self._finished[j] = True
                    if self._failed is None and self._arrived:
                        self._failed = self._diverged(j)
                    if self._failed is None and self._turn == j:
                        self._save(j)
                        self._pass(j)
                    if self._failed is not None:
                        self._wake_all()
                    self._cond.notify_all()  # the caller counts the finished groups

        if current() is not None:
            raise RuntimeError(f"{self.where}: a deterministic gradient inside another one.")
        for j, worker in enumerate(_workers(self.n)):
            worker.tasks.put(functools.partial(body, j))
        with self._cond:
            try:
                while not all(self._finished):
                    self._cond.wait()
            except BaseException as e:  # Ctrl-C here: the groups must not wait on forever
                self._failed = self._failed or e
                self._wake_all()
                raise
        self._rng.append(self._caller)
        self._restore(self.n)  # the caller's generators, as they were
        if self._failed is not None:
            raise self._failed
        return results

    # -- the groups' side ----------------------------------------------------------

    def meet(self, value: Any, joint: Callable[[list], list], what: str) -> Any:
        """Group j hands ``value``; once every group has, ``joint(values)`` gives each its
        output, and group j gets ``outputs[j]``. ``what`` names the meeting for errors."""
        j = current()[1]
        with self._cond:
            if any(self._finished):
                self._failed = self._diverged(self._finished.index(True))
                self._wake_all()
                raise _Abort
            self._slots[j] = (what, value)
            if j < self.n - 1:
                self._arrived += 1
                self._save(j)
                self._pass(j)
                self._wait_locked(j)
                self._restore(j)
                return self._outs[j]
        names = {w for w, _ in self._slots}
        if len(names) > 1:
            raise RuntimeError(
                f"{self.where}: the row groups of the deterministic mode reached different "
                f"calls ({sorted(names)}); every group must run the same operations in the "
                "same order (no Python control flow on the batch's values)."
            )
        self._outs = list(joint([v for _, v in self._slots]))
        with self._cond:
            self._arrived = 0
            self._save(j)
            self._pass(j)
            self._wait_locked(j)
            self._restore(j)
            return self._outs[j]

    # -- hand-overs (under the condition's lock) -----------------------------------

    def _diverged(self, done: int) -> RuntimeError:
        waiting = [k for k in range(self.n) if not self._finished[k]]
        return RuntimeError(
            f"{self.where}: row group {done} finished its forward while groups {waiting} "
            "met at a batch norm: the groups of the deterministic mode must run the same "
            "operations in the same order (no Python control flow on the batch's values)."
        )

    def _pass(self, j: int) -> None:
        """Give the turn to the next group."""
        self._turn = (j + 1) % self.n
        self._turns[self._turn].notify()  # wake that group only

    def _wake_all(self) -> None:
        for turn in self._turns:
            turn.notify_all()

    def _wait(self, j: int) -> None:
        with self._cond:
            self._wait_locked(j)

    def _wait_locked(self, j: int) -> None:
        while self._turn != j and self._failed is None:
            self._turns[j].wait()
        if self._failed is not None:
            raise _Abort

    def _save(self, j: int) -> None:
        for hook in getattr(_local, "hooks", ()):
            hook[2] = hook[0]()
        self._rng[j] = self._generators()

    def _restore(self, j: int) -> None:
        cpu, cuda, np_state, py_state = self._rng[j]
        torch.default_generator.set_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        np.random.set_state(np_state)
        random.setstate(py_state)
        for hook in getattr(_local, "hooks", ()) if j < self.n else ():
            hook[1](hook[2])
