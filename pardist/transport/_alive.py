"""Whether the peer ranks of a shared-memory group are still alive.

Over gloo a rank that dies closes its sockets, and its peers' reads fail at once. Over
shared memory nothing tells the others: a peer that was killed leaves its counter where it
was, and under a launcher the launcher notices and stops the rest, but ranks started by
hand (or by another launcher) waited the whole collective timeout. So the ranks of a
shared-memory group exchange their pids when they map the segment, and a rank that waits
for another looks, five times a second, whether that process still exists (``kill(pid, 0)``)
and is not a zombie (``/proc/<pid>/stat``). A pid means the same process only within one
PID namespace: where the ranks are in different ones (containers sharing ``/dev/shm``),
the check is off and the collective timeout bounds the wait, as before.

A peer that is stopped (SIGSTOP, state ``T``) holds the others up as long as it stays
stopped; once it has been seen stopped for ``STOPPED_S`` the waiting ranks give up on it
too, in seconds instead of at the timeout. The launchers of ``--keep-going`` look at
their children the same way, and kill one stopped that long, so that the others can go
on without it.
"""

from __future__ import annotations

import os
import platform
import time

from pardist.runtime import _faults

__all__ = ["STOPPED_S", "Peers", "Stopped", "fenced", "host", "me", "state"]

_EVERY_S = 0.2  # how often a waiting rank looks
STOPPED_S = 3.0  # how long a peer may be stopped (SIGSTOP) before the others give up on it
_GONE = ("Z", "X")  # a zombie (killed, not yet reaped) is gone


def host() -> tuple[str, int]:
    """This machine and network namespace: ranks with the same can share memory."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return platform.node(), netns


def me() -> tuple[int, int]:
    """This process: its pid and its PID namespace (0 where there is no /proc)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return os.getpid(), namespace


class Peers:
    """The processes of a group's ranks (``me()`` of each, by group index)."""

    def __init__(self, processes: list[tuple[int, int]]):
        namespaces = {ns for _, ns in processes}
        same = len(namespaces) == 1 and 0 not in namespaces
        self.pids = [pid for pid, _ in processes] if same else None
        self._next = 0.0
        self.stopped = Stopped()

    def gone(self, waited_for: list[int]) -> int | None:
        """One of the group indices ``waited_for`` whose process no longer runs, or has been
        stopped for STOPPED_S, or None (looked at most every 0.2 s; never where the pids
        cannot be trusted)."""
        if self.pids is None:
            return None
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + _EVERY_S
        for k in waited_for:
            letter = state(self.pids[k])
            if letter in _GONE or self.stopped.held(k, letter == "T"):
                return k
        return None

    def lost(self, gone: int, ranks: list[int], index: int, doing: str):
        """The error of rank ``ranks[index]``, waiting in ``doing``: ``ranks[gone]`` is gone."""
        stopped = self.stopped.held(gone, state(self.pids[gone]) == "T")
        how = (
            f"has been stopped for {STOPPED_S:.0f} s (SIGSTOP, or its terminal's Ctrl-Z); "
            "it holds the others up, so they stop"
            if stopped
            else "is gone, killed or exited while the others waited for it; its own output says why"
        )
        return _faults.CollectiveTimeout(
            f"pardist: {doing} (shared memory) lost rank {ranks[gone]} on rank "
            f"{ranks[index]}: its process (pid {self.pids[gone]}) {how}.",
            [ranks[gone]],
            doing,
            stopped_s=STOPPED_S if stopped else None,
        )


def fenced(by: str) -> str:
    """How a rank killed for being stopped STOPPED_S died, in its launcher's words."""
    return f"stopped (SIGSTOP) for {STOPPED_S:.0f} s, then killed by {by}"


class Stopped:
    """Which processes have been seen stopped (state ``T``) at every look for STOPPED_S.

    A debugger's stop is state ``t`` and never counts. Held means seen stopped at three
    looks at least, over STOPPED_S of this process's own time: a rank that was itself
    stopped along with the others (a terminal's Ctrl-Z stops the whole job) sees the
    others running again when it resumes, not stopped for the time it slept.
    """

    def __init__(self):
        self._since: dict = {}

    def held(self, key, stopped: bool) -> bool:
        if not stopped:
            self._since.pop(key, None)
            return False
        first, looks = self._since.get(key, (time.monotonic(), 0))
        self._since[key] = (first, looks + 1)
        return looks + 1 >= 3 and time.monotonic() - first >= STOPPED_S


def state(pid: int) -> str:
    """The process's state letter from /proc (``R``, ``S``, ``T`` stopped...), ``X`` if it
    is gone, ``?`` where it cannot be read (counted as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "X"
    except PermissionError:  # it exists (another user's: not ours, but not gone)
        return "?"
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "X"
    except (OSError, IndexError):
        return "?"
