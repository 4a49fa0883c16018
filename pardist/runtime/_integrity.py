"""A checkpoint's integrity: the CRC-32 of each file it wrote, and pardist's own error.

torch.distributed.checkpoint raises ``CheckpointException``, a ``BaseException`` that
``except Exception`` does not catch; pardist raises :class:`CheckpointError` from it,
naming the file or the path, and saying when the disk was full.
"""

from __future__ import annotations

import errno
import json
import zlib
from pathlib import Path

__all__ = ["MARKER", "CheckpointError", "cause", "checksums", "marker", "verify"]

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
