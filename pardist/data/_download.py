"""``untar``: download an archive and extract it once, atomically (fastai's ``untar_data``).

Every rank calls it; under :func:`pardist.rank0_first` rank 0 downloads and
extracts while the others wait, then they find the finished copy (on a shared
filesystem) or make their own (on a node of their own). Nothing half-done ever
looks finished: the archive is streamed into a temporary file and extracted into
a temporary directory beside the destination, and only a complete extraction is
renamed into place. A process killed part-way leaves a ``.<name>.*.partial``
folder, which is never used (and may be deleted), and the next call starts over.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from tqdm.autonotebook import tqdm

from pardist.runtime import _process, rank0_first

__all__ = ["untar"]

_WHERE = "pardist.data.untar"
_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar")
_CHUNK = 1 << 20


def _as_url(url: str | os.PathLike) -> str:
    """``url`` itself, or a local path as a ``file://`` URL."""
    text = os.fspath(url)
    if urllib.parse.urlsplit(text).scheme in ("http", "https", "file", "ftp"):
        return text
    return Path(text).expanduser().resolve().as_uri()


def _name(url: str) -> str:
    """The archive's file name without its extension: what the extracted folder is called."""
    base = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).name
    for suffix in _SUFFIXES:
        if base.endswith(suffix) and len(base) > len(suffix):
            return base[: -len(suffix)]
    raise ValueError(
        f"{_WHERE}: url={url!r} does not name a tar archive (a file ending in "
        f"{', '.join(_SUFFIXES)}). Give the URL of the archive itself."
    )


def _download(url: str, dest: Path, timeout: float) -> None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(dest, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=f"downloading {Path(urllib.parse.urlsplit(url).path).name}",
                disable=not _process.is_main() or url.startswith("file:"),
                leave=False,
            )
            with bar:
                while chunk := response.read(_CHUNK):
                    out.write(chunk)
                    bar.update(len(chunk))
            if total is not None and out.tell() != total:
                raise OSError(f"the connection closed after {out.tell()} of {total} bytes")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise OSError(
            f"{_WHERE}: could not download {url!r}: {reason}. Check the URL and the network "
            "connection, or fetch the archive yourself and pass its path or file:// URL."
        ) from exc


def _check_members(tar: tarfile.TarFile) -> None:
    """Refuse members that would land outside the folder (for Pythons without filters)."""
    for member in tar.getmembers():
        if member.name.startswith("/") or ".." in Path(member.name).parts:
            raise OSError(f"the member {member.name!r} would be written outside the folder")


def _extract(archive: Path, into: Path, url: str) -> Path:
    """Extract ``archive`` into ``into``; return its single top folder, or ``into``."""
    try:
        with tarfile.open(archive) as tar:
            _check_members(tar)
            # The 'data' filter (Python >= 3.10.12) refuses absolute paths, '..', device files.
            tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise OSError(
            f"{_WHERE}: could not extract the archive downloaded from {url!r}: {exc}. "
            "It may be truncated or not a tar archive; check the URL."
        ) from exc
    entries = list(into.iterdir())
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else into


def _fetch(url: str, cache: Path, timeout: float) -> Path:
    final = cache / _name(url)
    if final.is_dir():  # only ever created by the rename below: it is complete
        return final
    cache.mkdir(parents=True, exist_ok=True)
    # One temporary folder beside the destination (same filesystem, so the rename
    # is atomic) holds both the download and the extraction.
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=cache))
    try:
        archive, extracted = staging / "archive", staging / "extracted"
        _download(url, archive, timeout)
        extracted.mkdir()
        top = _extract(archive, extracted, url)
        try:
            top.rename(final)  # atomic: the folder appears complete or not at all
        except OSError:
            if not final.is_dir():  # another process finishing first is fine
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def untar(url: str | os.PathLike, cache_dir: str | os.PathLike, *, timeout: float = 60.0) -> Path:
    """Download the tar archive at ``url`` and extract it into ``cache_dir``, once.

    fastai's ``untar_data``: the folder ``cache_dir/<archive name>`` (the file name
    without ``.tgz``, ``.tar.gz``...) is returned at once if it exists; otherwise
    rank 0 downloads and extracts it first (:func:`pardist.rank0_first`) and the
    other ranks then reuse it. An archive with a single top folder (as
    ``imagenette2-160.tgz`` has) becomes that folder; otherwise its contents are
    the folder. Download and extraction go to temporary names and the result is
    renamed into place, so an interrupted run never leaves a folder that looks
    complete. To download again, delete the folder.

    Do not use it for archives that change at the same URL: a finished folder is
    reused whatever the URL now serves.

    Args:
        url: an ``http(s)://``, ``ftp://`` or ``file://`` URL, or a local path, of a
            tar archive (optionally gzip-, bz2- or xz-compressed).
        cache_dir: the folder that receives the extracted folder (created if needed).
        timeout: seconds to wait for the server before giving up.

    Returns:
        The path of the extracted folder, the same on every rank.

    Raises:
        OSError: the download or the extraction failed (the message names the URL).

    Example:
        >>> import io, pathlib, tarfile, tempfile, pardist
        >>> tmp = pathlib.Path(tempfile.mkdtemp())
        >>> with tarfile.open(tmp / 'toy.tgz', 'w:gz') as tar:
        ...     info = tarfile.TarInfo('toy/hello.txt'); info.size = 2
        ...     tar.addfile(info, io.BytesIO(b'hi'))
        >>> path = pardist.data.untar((tmp / 'toy.tgz').as_uri(), tmp / 'cache')
        >>> path.name, (path / 'hello.txt').read_text()
        ('toy', 'hi')
    """
    full = _as_url(url)
    _name(full)  # a bad URL is an error on every rank, before anyone waits
    cache = Path(cache_dir).expanduser()
    return rank0_first(_fetch, full, cache, timeout)
