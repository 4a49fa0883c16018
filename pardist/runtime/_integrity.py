"""A checkpoint's integrity: its commit, the CRC-32 of each file it wrote, pardist's error.

Every rank writes into ``<path>.tmp``; rank 0 then writes the commit marker (with the
files' checksums), fsyncs it, renames the directory into place and fsyncs its parent,
so that a crash at any point leaves either the previous checkpoint or the new one
whole. One run at a time saves into a directory: rank 0 holds its lock.

torch.distributed.checkpoint raises ``CheckpointException``, a ``BaseException`` that
``except Exception`` does not catch; pardist raises :class:`CheckpointError` from it,
naming the file or the path, and saying when the disk was full.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import zlib
from pathlib import Path

import torch.distributed as dist

__all__ = [
    "MARKER",
    "CheckpointError",
    "cause",
    "checksums",
    "claim_folder",
    "commit",
    "committed_steps",
    "marker",
    "verify",
]

MARKER = "pardist.json"  # written last: a checkpoint without it is not one


class CheckpointError(Exception):
    """A checkpoint could not be written or read back whole (names the file or path).

    torch.distributed.checkpoint raises ``CheckpointException``, a ``BaseException``
    that ``except Exception`` does not catch; pardist raises this instead, from it.
    """


def checksums(folder: Path) -> dict[str, int]:
    """CRC-32 of every file a save wrote into ``folder`` that this host can see."""
    return {f.name: crc(f) for f in sorted(folder.iterdir()) if f.is_file() and f.name != MARKER}


def marker(path: Path) -> dict:
    """The commit marker's contents, or a CheckpointError naming the file."""
    try:
        with open(path / MARKER) as f:
            found = json.load(f)
        if not isinstance(found, dict) or not isinstance(found.get("checksums"), dict):
            raise ValueError("not a pardist commit marker")
    except (OSError, ValueError) as e:  # (json.JSONDecodeError is a ValueError)
        raise CheckpointError(
            f"pardist.checkpoint: {path / MARKER} cannot be read ({type(e).__name__}: {e}): "
            "the checkpoint's commit marker is damaged. Load an earlier checkpoint "
            "(pardist.checkpoint.steps(dir) lists them)."
        ) from None
    return found


def verify(path: Path, files: bool = True) -> None:
    """The marker reads, and every file it lists still has the checksum it was saved with
    (``files=False``: the marker only)."""
    saved = marker(path)["checksums"]
    for name, want in saved.items() if files else ():
        file = path / name
        if file.is_file() and crc(file) != want:
            raise CheckpointError(
                f"pardist.checkpoint.load: {file} does not have the checksum it was saved "
                "with: the file changed on disk (a flipped bit, a partial copy). Load an "
                "earlier checkpoint (pardist.checkpoint.steps(dir) lists them)."
            )


def crc(file: Path) -> int:
    """The CRC-32 of a file, read in 4 MB chunks."""
    value = 0
    with open(file, "rb") as data:
        while chunk := data.read(1 << 22):
            value = zlib.crc32(chunk, value)
    return value


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def cause(exc: BaseException) -> tuple[str, str]:
    """What failed inside DCP: the first rank's exception, and whether the disk was full."""
    failures = getattr(exc, "failures", None) or {}
    inner = [  # DCP keeps (exception, traceback summary) per rank
        f[0] if isinstance(f, tuple) else f for f in failures.values()
    ]
    inner = [e for e in inner if isinstance(e, BaseException)] or [exc]
    chain = []
    for e in inner:
        while e is not None and e not in chain:
            chain.append(e)
            e = e.__cause__ or e.__context__
    full = any(isinstance(e, OSError) and e.errno in _FULL for e in chain) or any(
        "No space left" in str(e) or "File too large" in str(e) for e in chain
    )
    first = f"{type(inner[0]).__name__}: {str(inner[0]).strip().splitlines()[0][:300]}"
    return ("full", first) if full else ("", first)


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
