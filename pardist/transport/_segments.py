"""Files in /dev/shm that ranks map: pages reserved up front, named by owner, never left behind.

Three things go wrong with such files, and each is handled here:

* A tmpfs file's pages are allocated when first touched. When something else fills
  /dev/shm during a run, the first touch of a page nobody has used yet kills the
  process with SIGBUS, with no message. So the creator reserves every page when it
  creates the file (``posix_fallocate``); when it cannot, the caller uses gloo.
* A process killed between creating a file and unlinking it leaves the file behind.
  The caller unlinks it as soon as every rank has mapped it (the mappings stay), and
  every file is named by its creator (pid namespace, pid, start time), so that any
  later pardist process on the host, and the launchers when a job ends, can remove
  the files whose creator is gone (:func:`clean_stale`).
* /dev/shm is often small (Docker gives containers 64 MB): :func:`room` keeps
  pardist to half of what is free.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import uuid

import torch
import torch.distributed as dist

from pardist.runtime import _faults

__all__ = ["PREFIX", "clean_stale", "create", "map_shared", "room", "say_fallback"]

DIR = "/dev/shm"
PREFIX = "pardist-"


def room(nbytes: int) -> bool:
    """Whether /dev/shm can hold ``nbytes`` more without crowding it."""
    try:
        stat = os.statvfs(DIR)
    except OSError:
        return False
    return nbytes <= 0.5 * stat.f_bavail * stat.f_frsize


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the command name (field 2) may hold spaces; the start time is field 22
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner() -> str:
    return f"{_pid_namespace()}-{os.getpid()}-{_start_time(os.getpid())}"


def create(nbytes: int) -> tuple[str | None, str]:
    """A new zero-filled file of ``nbytes`` in /dev/shm, every page reserved.

    Returns:
        ``(path, '')``, or ``(None, why)`` when it cannot be made (nothing is left behind).
    """
    path = f"{DIR}/{PREFIX}{_owner()}-{uuid.uuid4().hex[:16]}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return None, f"cannot create a file in {DIR} ({exc.strerror})"
    try:
        os.posix_fallocate(fd, 0, nbytes)  # tmpfs hands out zeroed pages
        return path, ""
    except OSError as exc:
        os.unlink(path)
        if exc.errno == errno.ENOSPC:
            return None, f"{DIR} has no room for {nbytes / 2**20:.1f} MiB more"
        return None, f"cannot reserve {nbytes / 2**20:.1f} MiB in {DIR} ({exc.strerror})"
    finally:
        os.close(fd)


def _stale(name: str, namespace: int) -> bool:
    """Whether ``name`` is a segment whose creator, in this pid namespace, is gone."""
    parts = name[len(PREFIX) :].split("-")
    if len(parts) != 4 or not parts[0].isdigit() or not parts[1].isdigit():
        return False  # not ours to judge (another format, another tool)
    if int(parts[0]) != namespace:
        return False  # made in another pid namespace: its creator's pid means nothing here
    return _start_time(int(parts[1])) != parts[2]  # gone, or the pid now names another process


def clean_stale() -> list[str]:
    """Remove the segments whose creator has exited (killed mid-set-up); return their paths."""
    namespace, removed = _pid_namespace(), []
    try:
        names = [n for n in os.listdir(DIR) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        if _stale(name, namespace):
            try:
                os.unlink(f"{DIR}/{name}")
                removed.append(f"{DIR}/{name}")
            except OSError:
                continue  # another process removed it first
    return removed


_said = False


def say_fallback(why: str, nbytes: int) -> None:
    """One line, once per process: shared memory was wanted and could not be had."""
    global _said
    if not _said:
        _said = True
        print(
            f"pardist: {why}, so a {nbytes / 2**20:.1f} MiB shared-memory segment was not "
            "made; these ranks use a slower transport (gloo, or a smaller staging segment). "
            "Give /dev/shm more room (docker run --shm-size=2g), or set PARDIST_SHM=0.",
            file=sys.stderr,
            flush=True,
        )


def map_shared(group: dist.ProcessGroup, nbytes: int, what: str) -> torch.Tensor | None:
    """One new file of ``nbytes``, mapped by every rank of ``group`` (on one host), or None.

    The group's first rank makes it (after removing stale ones) and names it to the
    others; its name goes as soon as every rank has mapped it, or failed, or died. None
    on every rank when any rank could not map it (the caller then uses gloo); ``what``
    names the set-up in a collective's error.
    """
    index, ranks = dist.get_rank(group), dist.get_process_group_ranks(group)
    path, why = None, ""
    if index == 0:
        clean_stale()  # left by a job killed while setting one up
        if room(nbytes):
            path, why = create(nbytes)
        else:
            why = f"{DIR} is short of room (pardist takes at most half of what is free)"
    try:
        shared = [path, why]
        with _faults.collective_errors(what, group):
            dist.broadcast_object_list(shared, src=ranks[0], group=group)
        path, why = shared
        if path is None:
            if index == 0:
                say_fallback(why, nbytes)
            return None
        try:
            region = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except RuntimeError:
            region = None
        opened: list = [None] * len(ranks)
        with _faults.collective_errors(what, group):
            dist.all_gather_object(opened, region is not None, group=group)
    finally:
        if index == 0 and path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # the mappings stay, the name goes
    return region if all(opened) else None
