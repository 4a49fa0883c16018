"""Sleeping on a word of shared memory until another process changes it (Linux futexes).

A rank that waits for the others in a shared-memory collective must not hold a core
they need: after a short spin it sleeps in the kernel on the segment's wake word,
and the last rank to arrive wakes every sleeper. Shared (not private) futexes, so
that processes, not only threads, wake each other. x86-64 Linux system call numbers.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["crowded", "futex_wait", "futex_wake"]

_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # x86-64 Linux; shared (not private) futexes
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(address: int, expected: int, seconds: float) -> None:
    """Sleep while the int32 at ``address`` equals ``expected`` (or until woken / timed out)."""
    timeout = _Timespec(int(seconds), int((seconds % 1) * 1e9))
    _libc.syscall(
        _SYS_FUTEX,
        ctypes.c_void_p(address),
        _FUTEX_WAIT,
        ctypes.c_int(expected),
        ctypes.byref(timeout),
        None,
        0,
    )


def futex_wake(address: int) -> None:
    """Wake every process sleeping on the int32 at ``address``."""
    _libc.syscall(
        _SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int(2**31 - 1), None, None, 0
    )


_LOAD = {"checked": -1.0, "crowded": False}


def crowded(now: float) -> bool:
    """Whether more processes want a core than there are cores (read once a second).

    A waiting rank then sleeps at once instead of spinning: on a machine it shares (two
    jobs, more ranks than cores) the spin takes the core that the rank it waits for needs.
    """
    if now - _LOAD["checked"] > 1.0:
        _LOAD["checked"] = now
        try:
            _LOAD["crowded"] = os.getloadavg()[0] > (os.cpu_count() or 1)
        except OSError:
            _LOAD["crowded"] = False
    return _LOAD["crowded"]
