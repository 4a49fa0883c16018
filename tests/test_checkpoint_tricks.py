"""Every pickle trick known, in a checkpoint's index, runs nothing; every damaged file is a
pardist error; a leaf of another type is an error naming it, never a fresh start.

The index (``.metadata``) is a pickle that DCP writes; an attacker who can write the folder
can also write a matching commit marker (CRC-32 is no signature), so each trick below is
written with a resealed marker. Each would create a file if it ran; none may exist after.
The pickles are written opcode by opcode, as an attacker writes them, not by ``pickle``.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest
import torch

from pardist import checkpoint
from pardist.runtime import _integrity

LIKE = {"w": torch.zeros(4), "epoch": 0}


def _s(text: str) -> bytes:  # SHORT_BINUNICODE
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _global4(module: str, name: str) -> bytes:  # protocol 4's STACK_GLOBAL
    return _s(module) + _s(name) + b"\x93"


def _global0(module: str, name: str) -> bytes:  # protocol 0-3's GLOBAL
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _call(fn: bytes, *args: str) -> bytes:  # fn(*args): MARK, the strings, TUPLE, REDUCE
    return fn + b"(" + b"".join(_s(a) for a in args) + b"tR"


def _pickle(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."


DCP = "torch.distributed.checkpoint.metadata"


def tricks(sentinel: Path) -> dict[str, bytes]:
    cmd = f"touch {sentinel}"
    props = _global4(DCP, "TensorProperties")  # a class with a __setstate__
    meta = _global4(DCP, "Metadata")  # one without
    return {
        # names that reach os.system through an allowed module (protocol 4 walks dots)
        "dotted name in DCP's module": _pickle(_call(_global4(DCP, "os.system"), cmd)),
        "dotted name in torch": _pickle(_call(_global4("torch", "os.system"), cmd)),
        "dotted name after a class": _pickle(
            _call(_global4(DCP, "Metadata.__init__.__globals__.get"), "os")
        ),
        "dotted name after a dtype": _pickle(_call(_global4("torch", "float32.__class__"), "x")),
        "GLOBAL of protocol 0": _pickle(_call(_global0("os", "system"), cmd)),
        "GLOBAL, dotted": _pickle(_call(_global0(DCP, "os.system"), cmd)),
        # other names of the allowed modules
        "torch.load": _pickle(_call(_global4("torch", "load"), str(sentinel))),
        "torch.serialization.load": _pickle(_call(_global4("torch.serialization", "load"), "x")),
        "pathlib.os": _pickle(_call(_global4("pathlib", "os"), cmd)),
        "collections.namedtuple": _pickle(_call(_global4("collections", "namedtuple"), "a", "b")),
        "builtins.eval": _pickle(_call(_global4("builtins", "eval"), f"os.system('{cmd}')")),
        "a module's name as a prefix": _pickle(_call(_global4(DCP + ".os", "system"), cmd)),
        # allowed classes, called with what they do not expect
        "torch.Size of strings": _pickle(_call(_global4("torch", "Size"), cmd)),
        "_get_layout of a name": _pickle(
            _call(_global4("torch.serialization", "_get_layout"), cmd)
        ),
        "an enum of no value": _pickle(
            _global4(DCP, "_MEM_FORMAT_ENCODING") + b"(K\x63tR"  # _MEM_FORMAT_ENCODING(99)
        ),
        # __setstate__ and BUILD on allowed classes
        "__setstate__ with a payload": _pickle(
            props + b")\x81" + b"(" + _s(cmd) + b"t" + b"b"  # NEWOBJ, then BUILD with a tuple
        ),
        "BUILD that sets __setstate__": _pickle(
            meta
            + b")\x81"
            + b"N}"
            + _s("__setstate__")
            + _global4("torch.serialization", "_get_layout")
            + b"s\x86b"  # BUILD (None, {'__setstate__': _get_layout}): a slot state
            + _s(cmd)
            + b"b"  # BUILD again: would call it
        ),
        "BUILD that sets __class__": _pickle(
            meta
            + b")\x81"
            + b"N}"
            + _s("__class__")
            + _global4("collections", "OrderedDict")
            + b"s\x86b"
        ),
        "an OrderedDict of the wrong things": _pickle(
            _global4("collections", "OrderedDict") + b")R" + _s("k") + _s(cmd) + b"s"
        ),
        # opcodes a data pickle never has
        "PERSID": _pickle(b"P" + cmd.encode() + b"\n"),
        "BINPERSID": _pickle(_s(cmd) + b"Q"),
        "EXT1": _pickle(b"\x82\x01"),
        "INST": b"(i" + b"os\nsystem\n" + _s(cmd) + b".",
        "OBJ": _pickle(b"(" + _global4("os", "system") + _s(cmd) + b"o"),
        # sizes meant to exhaust memory before anything is checked
        "a memo index of 2**32 - 1": _pickle(b"N" + b"r" + struct.pack("<I", 2**32 - 1)),
        "a bytes of 2**62": _pickle(b"\x8e" + struct.pack("<Q", 2**62) + b"xx"),
        # data, but not DCP's index
        "a dict, not Metadata": _pickle(b"}" + _s("a") + b"K\x01s"),
        "Metadata of strings": _pickle(
            _global4(DCP, "Metadata")
            + b")\x81"
            + b"}"
            + _s("state_dict_metadata")
            + b"}"
            + _s("tree['w']")
            + _s(cmd)
            + b"ss"
            + b"b"
        ),
        "random bytes": b"\x80\x04" + random.Random(0).randbytes(512),
        "an empty file": b"",
    }


def _reseal(path: Path) -> None:
    marker = json.loads((path / checkpoint.MARKER).read_text())
    marker["checksums"] = _integrity.checksums(path)
    (path / checkpoint.MARKER).write_text(json.dumps(marker))


def _saved(folder: Path, step: int) -> Path:
    return Path(checkpoint.save(folder, {"w": torch.arange(4.0) * step, "epoch": step}, step=step))


@pytest.mark.parametrize("trick", list(tricks(Path("x"))))
def test_no_pickle_trick_in_the_index_runs(tmp_path, trick):
    _saved(tmp_path, 1)
    path = _saved(tmp_path, 2)
    sentinel = tmp_path / "ran"
    (path / ".metadata").write_bytes(tricks(sentinel)[trick])
    _reseal(path)
    with pytest.raises(checkpoint.CheckpointError, match=r"\.metadata cannot be read"):
        checkpoint.load(path, LIKE)
    with pytest.warns(UserWarning, match="Skipped, for the checkpoint before it"):
        state = checkpoint.resume(tmp_path, LIKE)
    assert state["epoch"] == 1 and torch.equal(state["w"], torch.arange(4.0))
    assert not sentinel.exists()


def test_a_real_index_reads(tmp_path):
    """The allow-list is DCP's whole index: tensors of every dtype and layout DCP writes,
    channels-last, Python values, nested trees."""
    state = {
        "w": torch.randn(3, 2),
        "h": torch.ones(2, dtype=torch.bfloat16),
        "i": torch.arange(3),
        "c": torch.randn(1, 3, 4, 4).to(memory_format=torch.channels_last),
        "nested": {"n": 3, "s": "x", "f": 1.5, "l": [1, None, {"a": (1, 2)}]},
    }
    path = checkpoint.save(tmp_path, state, step=1)
    like = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    got = checkpoint.load(path, like)
    assert all(torch.equal(got[k], state[k]) for k in ("w", "h", "i", "c"))
    assert got["nested"] == state["nested"]


def _damaged_markers() -> dict[str, bytes]:
    rng = random.Random(1)
    return {
        "random bytes": rng.randbytes(256),
        "not UTF-8": b'{"checksums": {"\xff\xfe": 1}}',
        "nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
        "nested dicts": b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        "a number of 10,000 digits": b'{"checksums": {"a": ' + b"9" * 10_000 + b"}}",
        "a path out of the folder": b'{"checksums": {"../../etc/passwd": 1}}',
        "a checksum that is no CRC": b'{"checksums": {"a.distcp": -1}}',
        "a list": b"[1, 2]",
        "truncated": b'{"checksums": {"a',
        "empty": b"",
    }


@pytest.mark.parametrize("damage", list(_damaged_markers()))
def test_a_damaged_marker_is_skipped_by_name(tmp_path, damage):
    _saved(tmp_path, 1)
    path = _saved(tmp_path, 2)
    (path / checkpoint.MARKER).write_bytes(_damaged_markers()[damage])
    with pytest.warns(UserWarning, match=f"{path / checkpoint.MARKER} cannot be read"):
        assert checkpoint.latest(tmp_path) == str(tmp_path / "1")
    with pytest.warns(UserWarning, match="Skipped"):
        assert checkpoint.resume(tmp_path, LIKE)["epoch"] == 1
    with pytest.raises(checkpoint.CheckpointError, match="commit marker is damaged"):
        checkpoint.load(path, LIKE)


def test_a_huge_marker_is_not_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(_integrity, "_MARKER_BYTES", 1 << 10)
    path = _saved(tmp_path, 1)
    (path / checkpoint.MARKER).write_bytes(b" " * (2 << 10) + b"{}")
    with pytest.raises(checkpoint.CheckpointError, match="over 1,024 bytes"):
        checkpoint.load(path, LIKE)


@pytest.mark.parametrize("cut", [0.1, 0.5, 0.9, 0.999])
def test_truncated_data_whose_checksum_matches_is_a_pardist_error(tmp_path, cut):
    """A truncated data file resealed (as a copy that stopped, and a marker rewritten)
    fails inside DCP with messages that may be empty (EOFError()): a CheckpointError
    naming the checkpoint, and resume goes back one."""
    _saved(tmp_path, 1)
    path = _saved(tmp_path, 2)
    for data in path.glob("*.distcp"):
        raw = data.read_bytes()
        data.write_bytes(raw[: int(len(raw) * cut)])
    _reseal(path)
    with pytest.raises(checkpoint.CheckpointError, match=f"reading {path} failed"):
        checkpoint.load(path, LIKE)
    with pytest.warns(UserWarning, match="Skipped"):
        assert checkpoint.resume(tmp_path, LIKE)["epoch"] == 1


def test_an_exception_without_a_message_is_named():
    assert _integrity.described(EOFError()) == "EOFError"
    assert _integrity.cause(EOFError())[1] == "EOFError"
    assert _integrity.described(OSError(28, "No space left")) == "OSError: [Errno 28] No space left"


@pytest.mark.parametrize(
    "saved, like",
    [({"x": torch.ones(2)}, {"x": 0.0}), ({"x": 1.5}, {"x": torch.zeros(1)})],
    ids=["a float where a tensor was saved", "a tensor where a float was saved"],
)
def test_a_leaf_of_another_type_is_an_error_never_a_fresh_start(tmp_path, saved, like):
    checkpoint.save(tmp_path, {**saved, "epoch": 1}, step=1)
    checkpoint.save(tmp_path, {**saved, "epoch": 2}, step=2)
    match = r"tree\['x'\] is a (tensor|Python value) in the checkpoint .* but a"
    with pytest.raises(TypeError, match=match):
        checkpoint.resume(tmp_path, {**like, "epoch": 0})
    with pytest.raises(TypeError, match=match):
        checkpoint.load(tmp_path / "2", {**like, "epoch": 0})


def _full(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("moment", ["data", "index", "marker", "rename"])
def test_a_full_disk_at_any_moment_of_a_save_is_a_checkpoint_error(tmp_path, monkeypatch, moment):
    """The kernel's ENOSPC where each part of a save is written: a CheckpointError that
    says the disk is full, no temporary folder left on it, the last checkpoint intact."""
    from pathlib import Path as P

    from pardist.runtime import _safe_dcp

    checkpoint.save(tmp_path, {"w": torch.ones(4), "epoch": 1}, step=1)
    writer = _safe_dcp.writer_class()
    if moment == "data":
        monkeypatch.setattr(writer, "write_data", _full)
    elif moment == "index":
        monkeypatch.setattr(writer, "finish", _full)
    elif moment == "marker":
        monkeypatch.setattr(_integrity, "_write_marker", _full)
    else:
        real = P.rename
        monkeypatch.setattr(
            P, "rename", lambda self, to: _full() if ".tmp-" in self.name else real(self, to)
        )
    with pytest.raises(checkpoint.CheckpointError, match="the disk is full") as caught:
        checkpoint.save(tmp_path, {"w": torch.ones(4) * 2, "epoch": 2}, step=2)
    assert "Errno 28" in str(caught.value)
    monkeypatch.undo()
    assert not list(tmp_path.glob("2.tmp*")) and not (tmp_path / "2").exists()
    assert checkpoint.latest(tmp_path) == str(tmp_path / "1")
    assert checkpoint.load(tmp_path / "1", LIKE)["epoch"] == 1


def test_saving_a_step_again_keeps_the_old_one_if_the_rename_fails(tmp_path, monkeypatch):
    from pathlib import Path as P

    checkpoint.save(tmp_path, {"w": torch.ones(4), "epoch": 1}, step=1)
    real = P.rename
    monkeypatch.setattr(
        P, "rename", lambda self, to: _full() if ".tmp-" in self.name else real(self, to)
    )
    with pytest.raises(checkpoint.CheckpointError, match="the disk is full"):
        checkpoint.save(tmp_path, {"w": torch.ones(4) * 2, "epoch": 5}, step=1)
    monkeypatch.undo()
    assert checkpoint.load(tmp_path / "1", LIKE)["epoch"] == 1
    assert not list(tmp_path.glob("1.*"))  # no 1.old, no 1.tmp-: the old one put back


def test_fuzzed_indexes_and_markers_give_pardist_errors_only(tmp_path):
    """200 seeded mutations of a real checkpoint's index and marker (bytes flipped, cut,
    spliced, repeated), each with a resealed marker for the index: every load returns the
    saved values or raises one of pardist's documented errors, never a raw traceback, and
    resume never starts afresh while an intact checkpoint is there (it goes back one, or
    raises the error a `like` of another structure gets)."""
    rng = random.Random(58)
    good = _saved(tmp_path, 1)
    path = _saved(tmp_path, 2)
    index, mark = (path / ".metadata").read_bytes(), (path / checkpoint.MARKER).read_bytes()
    allowed = (checkpoint.CheckpointError, KeyError, ValueError, TypeError)
    for trial in range(200):
        target = index if trial % 2 == 0 else mark
        data = bytearray(target)
        kind = rng.choice(["flip", "cut", "splice", "repeat"])
        at = rng.randrange(len(data))
        if kind == "flip":
            data[at] ^= 1 << rng.randrange(8)
        elif kind == "cut":
            del data[at:]
        elif kind == "splice":
            data[at:at] = rng.randbytes(rng.randrange(1, 64))
        else:
            data[at:at] = data[at : at + rng.randrange(1, 200)] * rng.randrange(2, 50)
        (path / ".metadata").write_bytes(bytes(data) if target is index else index)
        (path / checkpoint.MARKER).write_bytes(bytes(data) if target is mark else mark)
        if target is index:
            _reseal(path)
        try:
            got = checkpoint.load(path, LIKE)
        except allowed:
            pass
        else:  # what loaded is what was saved, or the index's damage changed no value
            assert got["epoch"] in (1, 2) and got["w"].shape == (4,), (trial, kind)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:  # damage skipped for the checkpoint before; a renamed key (a resealed
                state = checkpoint.resume(tmp_path, LIKE)  # index) raises as `like`'s does
            except (KeyError, ValueError, TypeError):
                continue
        assert state is not LIKE and state["epoch"] in (1, 2), (trial, kind)
    assert good.exists()
