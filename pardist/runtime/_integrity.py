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
        if not found["checksums"]:
            raise ValueError("it lists no file")
    except (OSError, ValueError) as e:  # (json.JSONDecodeError is a ValueError)
        raise CheckpointError(
            f"pardist.checkpoint: {path / MARKER} cannot be read ({type(e).__name__}: {e}): "
            "the checkpoint's commit marker is damaged. Load an earlier checkpoint "
            "(pardist.checkpoint.steps(dir) lists them)."
        ) from None
    return found


def verify(path: Path, files: bool = True) -> None:
    """The checkpoint is as it was committed, before any of its files is read: the marker
    reads and lists files, every file it lists is there, none it does not list, and (with
    ``files``) each still has the checksum it was saved with. A CheckpointError names the
    first file that is not."""
    saved = marker(path)["checksums"]
    damaged = "Load an earlier checkpoint (pardist.checkpoint.steps(dir) lists them)."
    present = {f.name for f in path.iterdir() if f.name != MARKER}
    for name in sorted(set(saved) - present):
        raise CheckpointError(
            f"pardist.checkpoint: {path / name} is missing: the commit marker lists it. " + damaged
        )
    for name in sorted(present - set(saved)):
        raise CheckpointError(
            f"pardist.checkpoint: {path / name} is not one of the files the commit marker "
            "lists (a file put there after the save). " + damaged
        )
    for name, want in sorted(saved.items()) if files else ():
        file = path / name
        if not file.is_file() or crc(file) != want:
            raise CheckpointError(
                f"pardist.checkpoint.load: {file} does not have the checksum it was saved "
                "with: the file changed on disk (a flipped bit, a partial copy). " + damaged
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


_runs: dict[str, int] = {}  # directory -> the descriptor of this run's file in it
_warned: set[tuple[str, str]] = set()  # (directory, other run) already warned of
_RUN = "pardist.run."  # + pid: a run saving into the directory (its file, locked by it)


def claim_folder(folder: Path) -> str:
    """Mark ``folder`` as saved into by this run (rank 0), and warn of any other live run
    that saves into it too, at every save (so both runs learn of each other); the
    name of this run's temporary folders (its pid).

    Each run holds an ``flock`` (the kernel drops it when the process dies) on a file of
    its own, ``pardist.run.<pid>``, made with ``O_EXCL | O_NOFOLLOW``: pardist never
    follows a link someone put there, nor truncates or writes a file it did not create.
    Another run's file that no process holds is a dead run's: it is removed, with the
    temporary folders that run left. Each run saves into temporary folders named by its
    pid, so two runs never write into one.
    """
    import fcntl

    key = str(folder.resolve())
    me = str(os.getpid())
    if key not in _runs:
        mine = folder / f"{_RUN}{me}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            if mine.is_symlink() or mine.exists():  # a dead process's pid, reused
                mine.unlink()
            fd = os.open(mine, flags, 0o644)
        except OSError as e:
            raise CheckpointError(
                f"pardist.checkpoint.save: cannot make {mine} ({e}); the directory must be "
                "writable, and pardist follows no link in it."
            ) from None
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, me.encode())
        _runs[key] = fd
    for other in sorted(folder.glob(f"{_RUN}*")):
        pid = other.name[len(_RUN) :]
        if pid == me or other.is_symlink() or not other.is_file():
            continue
        if _held(other):
            if (key, pid) not in _warned:
                _warned.add((key, pid))
                import warnings

                warnings.warn(
                    f"pardist.checkpoint.save: another running process (pid {pid}) saves "
                    f"checkpoints into {folder} too; their steps would mix, and latest() "
                    "would pick either run's. Give each run a directory of its own.",
                    stacklevel=4,
                )
        else:  # a dead run's: its file and its unfinished saves
            other.unlink(missing_ok=True)
            for left in folder.glob(f"*.tmp-{pid}"):
                shutil.rmtree(left, ignore_errors=True)
    return me


def _held(file: Path) -> bool:
    """Whether a live process holds ``file``'s flock (tried without waiting or following)."""
    import fcntl

    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False
