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
    "described",
    "marker",
    "save_error",
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


_MARKER_BYTES = 64 << 20  # a marker lists a checksum per file: kilobytes, even at 10k ranks


def _listed(found: object) -> None:
    """A marker's shape: a dict whose checksums map plain file names to CRC-32s."""
    if not isinstance(found, dict) or not isinstance(found.get("checksums"), dict):
        raise ValueError("not a pardist commit marker")
    if not found["checksums"]:
        raise ValueError("it lists no file")
    for name, value in found["checksums"].items():
        if not name or "/" in name or "\\" in name or name in (".", "..") or name == MARKER:
            raise ValueError(f"it lists {name[:80]!r}, which is not a file of the checkpoint")
        if type(value) is not int or not 0 <= value < 1 << 32:
            raise ValueError(f"the checksum of {name[:80]!r} is {str(value)[:40]}, not a CRC-32")


def marker(path: Path) -> dict:
    """The commit marker's contents, or a CheckpointError naming the file."""
    try:
        with open(path / MARKER, "rb") as f:
            raw = f.read(_MARKER_BYTES + 1)
        if len(raw) > _MARKER_BYTES:
            raise ValueError(f"it is over {_MARKER_BYTES:,} bytes")
        found = json.loads(raw)
        _listed(found)
    except RecursionError:  # a marker nested thousands deep
        e = ValueError("it is nested too deep")
    except (OSError, ValueError) as exc:  # (JSONDecodeError, UnicodeDecodeError: ValueErrors)
        e = exc
    else:
        return found
    raise CheckpointError(
        f"pardist.checkpoint: {path / MARKER} cannot be read ({described(e)}): the "
        "checkpoint's commit marker is damaged. Load an earlier checkpoint "
        "(pardist.checkpoint.steps(dir) lists them)."
    ) from None


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
    return ("full" if full else ""), described(inner[0])


def save_error(exc: BaseException, tmp: Path, last: str | None, group) -> Exception:
    """What a failed DCP save raises: a lost rank's CollectiveTimeout (a peer died while
    the ranks wrote), else a CheckpointError saying whether the disk was full."""
    kind, first = cause(exc)
    from pardist.runtime import _faults

    lost = _faults.lost_peer("pardist.checkpoint.save", group, first)
    if lost is not None:
        return lost
    kept = f"the last good checkpoint, {last}, is intact" if last else "nothing was lost"
    if kind == "full":
        return CheckpointError(
            f"pardist.checkpoint.save: the disk is full (or a file-size limit was hit) "
            f"while writing {tmp} ({first}); {kept}. Free space, or save fewer "
            "checkpoints (keep=)."
        )
    return CheckpointError(f"pardist.checkpoint.save: writing {tmp} failed ({first}); {kept}.")


def described(exc: BaseException) -> str:
    """``Type: the first line of its message`` (an EOFError() has none: ``EOFError``)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


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
    """Rank 0's end of a save: the marker into ``tmp``, then ``tmp`` renamed to ``final``.
    An OSError at either (a full disk) removes ``tmp`` and is a CheckpointError; the
    checkpoints committed before are as they were."""
    try:
        _write_marker(tmp, step, keys)
        _replace(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)  # (what it took of a full disk, back)
        full = e.errno in _FULL
        raise CheckpointError(
            f"pardist.checkpoint.save: committing {final} failed ({described(e)})"
            + ("; the disk is full (or a file-size limit was hit)" if full else "")
            + f"; the checkpoints committed before it are intact, and {tmp} is removed."
            + (" Free space, or save fewer checkpoints (keep=)." if full else "")
        ) from e
    if step is not None and keep is not None:
        for stale in committed_steps(final.parent)[:-keep]:
            shutil.rmtree(final.parent / str(stale), ignore_errors=True)
    return str(final)


def _write_marker(tmp: Path, step: int | None, keys: int) -> None:
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    found = {"format": _FORMAT, "step": step, "leaves": keys, "time": time.time()}
    found.update(world_size=world, checksums=checksums(tmp))
    with open(tmp / MARKER, "w") as f:
        json.dump(found, f)
        f.flush()
        os.fsync(f.fileno())


def _replace(tmp: Path, final: Path) -> None:
    """``tmp`` renamed to ``final``; a ``final`` saved before (the same step again) is
    put back if the rename fails."""
    old = final.with_name(final.name + ".old")
    if final.exists():  # saving a step again: the new one replaces it
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    try:
        tmp.rename(final)
    except OSError:
        if old.exists() and not final.exists():
            old.rename(final)
        raise
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


_runs: dict[str, tuple[int, str]] = {}  # directory -> this run's (locked descriptor, name)
_warned: set[tuple[str, str]] = set()  # (directory, other run) already warned of
_RUN = "pardist.run."  # + the run's name: a run saving into the directory (locked by it)


def claim_folder(folder: Path) -> str:
    """Mark ``folder`` as saved into by this run (rank 0), and warn of any other live run
    that saves into it too, at every save (so both runs learn of each other); the
    name of this run, which names its temporary folders.

    A run's name is its pid and 8 random hex digits: two runs in two containers (PID
    namespaces) with the same pid still have two names. Each run holds an ``flock`` (the
    kernel's, across PID namespaces, dropped when the process dies) on a file of its own,
    ``pardist.run.<name>``, made with ``O_EXCL | O_NOFOLLOW``: pardist never follows a
    link someone put there, nor truncates, writes or removes a file a live run holds.
    Another run's file that no process holds is a dead run's: it is removed, with the
    temporary folders that run left.
    """
    import fcntl
    import secrets

    key = str(folder.resolve())
    if key not in _runs:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        for _ in range(8):
            name = f"{os.getpid()}-{secrets.token_hex(4)}"
            mine = folder / f"{_RUN}{name}"
            try:
                fd = os.open(mine, flags, 0o644)
                break
            except FileExistsError:  # (a name taken: draw another)
                continue
            except OSError as e:
                raise CheckpointError(
                    f"pardist.checkpoint.save: cannot make {mine} ({e}); the directory must "
                    "be writable, and pardist follows no link in it."
                ) from None
        else:
            raise CheckpointError(f"pardist.checkpoint.save: cannot make a run file in {folder}.")
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, name.encode())
        _runs[key] = fd, name
    me = _runs[key][1]
    for other in sorted(folder.glob(f"{_RUN}*")):
        name = other.name[len(_RUN) :]
        if name == me or other.is_symlink() or not other.is_file():
            continue
        if _held(other):
            if (key, name) not in _warned:
                _warned.add((key, name))
                import warnings

                warnings.warn(
                    f"pardist.checkpoint.save: another running process (run {name}) saves "
                    f"checkpoints into {folder} too; their steps would mix, and latest() "
                    "would pick either run's. Give each run a directory of its own.",
                    stacklevel=4,
                )
        else:  # a dead run's: its file and its unfinished saves
            other.unlink(missing_ok=True)
            for left in folder.glob(f"*.tmp-{name}"):
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
