"""pardist.data.untar: download and extract once, atomically, over file:// and http."""

from __future__ import annotations

import http.server
import io
import tarfile
import threading
from pathlib import Path

import pytest

import pardist
from pardist.data import _download

FILES = {"toy/train/a/1.txt": b"one", "toy/train/b/2.txt": b"two", "toy/val/a/3.txt": b"three"}


def make_archive(folder: Path, name: str = "toy.tgz", files: dict = FILES) -> Path:
    archive = folder / name
    with tarfile.open(archive, "w:gz") as tar:
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


def assert_complete(path: Path) -> None:
    for name, data in FILES.items():
        assert (path.parent / name).read_bytes() == data


def no_partials(cache: Path) -> bool:
    return not [p for p in cache.iterdir() if p.name.endswith(".partial")]


class Server:
    """A local HTTP server for one folder that counts the GET requests."""

    def __init__(self, folder: Path, truncate: bool = False):
        counts = self.counts = []

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(folder), **kwargs)

            def do_GET(self):
                counts.append(self.path)
                if not truncate:
                    return super().do_GET()
                self.send_response(200)  # promises 1000 bytes, sends 10, hangs up
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.write(b"x" * 10)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_file_url_extracts_once_and_reuses(tmp_path: Path):
    archive, cache = make_archive(tmp_path), tmp_path / "cache"
    path = pardist.data.untar(archive.as_uri(), cache)
    assert path == cache / "toy" and path.is_dir()
    assert_complete(path)
    assert [p.name for p in cache.iterdir()] == ["toy"]  # no temporary left behind
    stamp = path.stat().st_ino
    archive.unlink()  # a second call must not need the archive
    assert pardist.data.untar(archive.as_uri(), cache) == path
    assert path.stat().st_ino == stamp


def test_local_path_and_archive_without_top_folder(tmp_path: Path):
    flat = make_archive(tmp_path, "flat.tar.gz", {"x.txt": b"x", "y.txt": b"y"})
    path = pardist.data.untar(str(flat), tmp_path / "cache")  # a plain path is a file:// URL
    assert path.name == "flat" and sorted(p.name for p in path.iterdir()) == ["x.txt", "y.txt"]


def test_interrupted_extraction_is_never_used(tmp_path: Path, monkeypatch):
    archive, cache = make_archive(tmp_path), tmp_path / "cache"
    # A run killed mid-way left a half-extracted folder under a temporary name.
    leftover = cache / ".toy.abc123.partial" / "extracted" / "toy" / "train" / "a"
    leftover.mkdir(parents=True)
    (leftover / "1.txt").write_bytes(b"on")

    real = tarfile.TarFile.extract

    def extract_one_then_fail(self, path, *args, **kwargs):
        first = self.getmembers()[0]
        real(self, first, path, filter="data")
        raise OSError("disk full")

    monkeypatch.setattr(tarfile.TarFile, "extractall", extract_one_then_fail)
    with pytest.raises(OSError, match=r"pardist\.data\.untar: could not extract .*disk full"):
        pardist.data.untar(archive.as_uri(), cache)
    assert not (cache / "toy").exists()  # nothing that looks complete
    assert [p.name for p in cache.iterdir()] == [".toy.abc123.partial"]  # only the old leftover

    monkeypatch.undo()
    path = pardist.data.untar(archive.as_uri(), cache)
    assert_complete(path)


def test_corrupt_archive_is_an_error_and_leaves_nothing(tmp_path: Path):
    bad = tmp_path / "toy.tgz"
    bad.write_bytes(make_archive(tmp_path, "good.tgz").read_bytes()[:40])  # truncated
    cache = tmp_path / "cache"
    with pytest.raises(OSError, match="could not extract the archive downloaded from"):
        pardist.data.untar(bad.as_uri(), cache)
    assert list(cache.iterdir()) == []


def test_members_outside_the_folder_are_refused(tmp_path: Path):
    evil = make_archive(tmp_path, "evil.tgz", {"evil/ok.txt": b"ok", "../escaped.txt": b"x"})
    with pytest.raises(OSError, match="could not extract.*escaped"):
        pardist.data.untar(evil.as_uri(), tmp_path / "cache")
    assert not (tmp_path / "escaped.txt").exists() and list((tmp_path / "cache").iterdir()) == []


def test_interrupted_http_download_is_an_error_and_leaves_nothing(tmp_path: Path):
    cache = tmp_path / "cache"
    with Server(tmp_path, truncate=True) as server:
        with pytest.raises(OSError, match=r"could not download .*toy\.tgz.*10 of 1000 bytes"):
            pardist.data.untar(f"{server.url}/toy.tgz", cache)
    assert list(cache.iterdir()) == []


def test_errors_name_the_url_and_the_fix(tmp_path: Path):
    with pytest.raises(ValueError, match=r"pardist\.data\.untar: url=.*page\.html.*tar archive"):
        pardist.data.untar("https://example.com/page.html", tmp_path)
    with pytest.raises(OSError, match=r"could not download 'http://127\.0\.0\.1:9/toy\.tgz'"):
        pardist.data.untar("http://127.0.0.1:9/toy.tgz", tmp_path / "cache", timeout=5)
    assert no_partials(tmp_path / "cache")


def _untar_on_every_rank(url: str, cache: str) -> str:
    return str(pardist.data.untar(url, cache))


def test_two_ranks_download_once_over_http(run, tmp_path: Path):
    make_archive(tmp_path)
    cache = tmp_path / "cache"
    with Server(tmp_path) as server:
        paths = run(2, _untar_on_every_rank, f"{server.url}/toy.tgz", str(cache))
    assert paths == [str(cache / "toy")] * 2
    assert server.counts == ["/toy.tgz"]  # rank 0 downloaded; rank 1 reused its folder
    assert_complete(cache / "toy")


def test_name_strips_tar_suffixes():
    assert _download._name("https://h/x/imagenette2-160.tgz") == "imagenette2-160"
    assert _download._name("file:///d/a.b.tar.xz") == "a.b"
