"""A checkpoint directory's commit: the marker written last, the rename, the lock.

Every rank writes into ``<path>.tmp``; rank 0 then writes the commit marker (with the
files' checksums), fsyncs it, renames the directory into place and fsyncs its parent,
so that a crash at any point leaves either the previous checkpoint or the new one
whole. One run at a time saves into a directory: rank 0 holds its lock.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from pardist.runtime._integrity import MARKER, checksums

__all__ = ["claim_folder", "commit", "committed_steps"]

_FORMAT = 1


def committed_steps(path: str | os.PathLike) -> list[int]:
    """The steps of the committed checkpoints in ``path``, oldest first (``[]`` if none)."""
    root = Path(path)
    if not root.is_dir():
        return []
    found = [int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / MARKER).is_file()]
    return sorted(found)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path, step: int | None, keys: int, keep: int | None) -> str:
    with open(tmp / MARKER, "w") as f:
        json.dump(
            {
                "format": _FORMAT,
                "step": step,
                "leaves": keys,
                "time": time.time(),
                "world_size": dist.get_world_size()
                if dist.is_available() and dist.is_initialized()
                else 1,
                "checksums": checksums(tmp),
            },
            f,
        )
        f.flush()
        os.fsync(f.fileno())
    old = final.with_name(final.name + ".old")
    if final.exists():  # saving a step again: the new one replaces it
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    if step is not None and keep is not None:
        for stale in committed_steps(final.parent)[:-keep]:
            shutil.rmtree(final.parent / str(stale), ignore_errors=True)
    return str(final)


_claimed: dict[str, int] = {}  # directory -> the descriptor holding its lock


def claim_folder(folder: Path) -> None:
    """Hold ``folder``'s lock while this process lives (rank 0); warn if another does.

    Two runs saving into one directory would mix their steps (``latest`` then picks
    either). A lock the kernel drops when its process dies (``flock``), so a run that
    restarts after a crash finds the directory free.
    """
    import fcntl

    key = str(folder.resolve())
    if key in _claimed:
        return
    fd = os.open(folder / "pardist.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        other = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        _claimed[key] = -1
        import warnings

        warnings.warn(
            f"pardist.checkpoint.save: another running process (pid {other}) saves "
            f"checkpoints into {folder} too; their steps would mix, and latest() would pick "
            "either run's. Give each run a directory of its own.",
            stacklevel=4,
        )
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _claimed[key] = fd
