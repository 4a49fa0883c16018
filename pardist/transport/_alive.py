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
"""

from __future__ import annotations

import os
import platform
import time

from pardist.runtime import _faults

__all__ = ["Peers", "host", "me"]

_EVERY_S = 0.2  # how often a waiting rank looks


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

    def gone(self, waited_for: list[int]) -> int | None:
        """One of the group indices ``waited_for`` whose process no longer runs, or None
        (looked at most every 0.2 s; never where the pids cannot be trusted)."""
        if self.pids is None:
            return None
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + _EVERY_S
        return next((k for k in waited_for if not _running(self.pids[k])), None)

    def lost(self, gone: int, ranks: list[int], index: int, doing: str):
        """The error of rank ``ranks[index]``, waiting in ``doing``: ``ranks[gone]`` is gone."""
        return _faults.CollectiveTimeout(
            f"pardist: {doing} (shared memory) lost rank {ranks[gone]} on rank "
            f"{ranks[index]}: its process (pid {self.pids[gone]}) is gone, killed or exited "
            "while the others waited for it; its own output says why.",
            [ranks[gone]],
            doing,
        )


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists (another user's: not ours, but not gone)
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")  # a zombie (killed, not yet reaped) is gone
