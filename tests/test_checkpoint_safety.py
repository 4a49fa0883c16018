"""A checkpoint is data, never code; any damaged file is skipped, by name.

An attacker who can write a checkpoint folder can also write a commit marker whose
checksums match (CRC-32 is no signature), so the tests write their payloads *and* a
matching marker: what stops them is that pardist reads the index (``.metadata``, a
pickle) with an unpickler that knows only DCP's metadata classes, every non-tensor value
with ``torch.load(weights_only=True)``, and refuses to save what could not be read so.
Each payload, if it ran, would create a file; none may exist afterwards.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from pardist import checkpoint
from pardist.runtime import _integrity


class Payload:
    """Unpickling this runs ``os.system`` (a command that leaves a file behind)."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def _reseal(path: Path) -> None:
    """What an attacker can do too: a marker whose checksums match the folder as it is."""
    marker = json.loads((path / checkpoint.MARKER).read_text())
    marker["checksums"] = _integrity.checksums(path)
    (path / checkpoint.MARKER).write_text(json.dumps(marker))


def _saved(tmp_path: Path, step: int = 1, **extra) -> Path:
    state = {"w": torch.arange(4.0) * step, "epoch": step, **extra}
    return Path(checkpoint.save(tmp_path, state, step=step))


LIKE = {"w": torch.zeros(4), "epoch": 0}


def test_a_payload_in_the_index_never_runs(tmp_path):
    path = _saved(tmp_path)
    sentinel = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(sentinel)))
    _reseal(path)
    with pytest.raises(checkpoint.CheckpointError, match=r"\.metadata cannot be read.*system"):
        checkpoint.load(path, LIKE)
    with pytest.warns(UserWarning, match="Skipped"):
        assert checkpoint.resume(tmp_path, LIKE) is LIKE  # nothing else to resume from
    assert not sentinel.exists()


def test_a_payload_in_a_value_never_runs(tmp_path):
    """A data file that holds a pickled object where a plain value belongs (written by DCP
    itself, past pardist's check, as a crafted folder would be)."""
    import torch.distributed.checkpoint as dcp

    sentinel = tmp_path / "ran"
    path = tmp_path / "1"
    state = {"tree['w']": torch.ones(4), "tree['epoch']": Payload(sentinel)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    (path / checkpoint.MARKER).write_text(json.dumps({"checksums": {}}))
    _reseal(path)
    assert not sentinel.exists()  # (saving ran nothing either)
    with pytest.raises(checkpoint.CheckpointError, match=r"tree\['epoch'\].*not plain data"):
        checkpoint.load(path, LIKE)
    assert not sentinel.exists()


def test_a_value_that_would_need_code_to_load_is_refused_when_saving(tmp_path):
    with pytest.raises(TypeError, match=r"tree\['hook'\] is a Payload, which a checkpoint cannot"):
        checkpoint.save(tmp_path, {"w": torch.ones(2), "hook": Payload(tmp_path / "x")}, step=1)
    with pytest.raises(TypeError, match=r"tree\['f'\] is a builtin_function"):
        checkpoint.save(tmp_path, {"f": len}, step=1)
    assert checkpoint.steps(tmp_path) == []  # nothing committed
    ok = {"n": 3, "s": "x", "d": {"a": [1, 2.5, None]}, "t": (True, b"\x00")}
    back = checkpoint.load(checkpoint.save(tmp_path, ok, step=2), ok)
    assert back == ok


DAMAGE = {
    "the index missing": lambda p: (p / ".metadata").unlink(),
    "the index cut short": lambda p: (p / ".metadata").write_bytes(
        (p / ".metadata").read_bytes()[:20]
    ),
    "a data file changed": lambda p: _flip(next(p.glob("*.distcp"))),
    "a data file missing": lambda p: next(p.glob("*.distcp")).unlink(),
    "a file the marker does not list": lambda p: (p / "extra.distcp").write_bytes(b"x"),
    "a marker that lists nothing": lambda p: (p / checkpoint.MARKER).write_text(
        json.dumps({"checksums": {}})
    ),
}
NAMED = {
    "the index missing": ".metadata is missing",
    "the index cut short": ".metadata does not have the checksum",
    "a data file changed": ".distcp does not have the checksum",
    "a data file missing": ".distcp is missing",
    "a file the marker does not list": "extra.distcp is not one of the files",
    "a marker that lists nothing": "it lists no file",
}


def _flip(file: Path) -> None:
    raw = bytearray(file.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    file.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_any_damaged_file_is_skipped_for_the_checkpoint_before(tmp_path, damage):
    _saved(tmp_path, 1)
    newest = _saved(tmp_path, 2)
    DAMAGE[damage](newest)
    with pytest.raises(checkpoint.CheckpointError, match=NAMED[damage]):
        checkpoint.load(newest, LIKE)
    with pytest.warns(UserWarning, match=NAMED[damage]) as caught:
        state = checkpoint.resume(tmp_path, LIKE)
    assert state["epoch"] == 1 and torch.equal(state["w"], torch.arange(4.0))
    assert len([w for w in caught if "Skipped" in str(w.message)]) == 1  # one warning


def test_the_run_file_follows_no_link_and_overwrites_nothing(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / f"pardist.run.{os.getpid()}").symlink_to(victim)  # an older pardist's name
    (folder / "pardist.run.999999-0badc0de").symlink_to(victim)  # as another run's
    (folder / "pardist.lock").symlink_to(victim)  # an older pardist's lock name
    checkpoint.save(folder, {"w": torch.ones(2)}, step=1)
    assert victim.read_text() == "keep me"
    (mine,) = [f for f in folder.glob(f"pardist.run.{os.getpid()}-*") if not f.is_symlink()]
    assert mine.is_file() and mine.read_text() == mine.name[len("pardist.run.") :]


def _a_folder_per_rank(base: str):
    import tempfile

    import pardist

    mine = tempfile.mkdtemp(dir=base)  # the mistake: a different folder on every rank
    out = []
    for call in (
        lambda: checkpoint.save(mine, {"w": torch.ones(2)}, step=1),
        lambda: checkpoint.resume(mine, {"w": torch.zeros(2)}),
        lambda: checkpoint.load(mine, {"w": torch.zeros(2)}),
    ):
        try:
            call()
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return mine, out, pardist.rank()


def test_a_folder_per_rank_is_an_error_naming_both(run, tmp_path):
    results = run(2, _a_folder_per_rank, str(tmp_path))
    paths = [mine for mine, _, _ in results]
    for _, messages, _ in results:
        for what, message in zip(("save", "resume", "load"), messages):
            assert message is not None, what
            assert f"pardist.checkpoint.{what}: the ranks were given different paths" in message
            assert f"rank 0: {paths[0]}; rank 1: {paths[1]}" in message
