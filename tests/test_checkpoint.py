"""pardist.checkpoint: round trips, who writes, other world sizes, DTensor reshards, atomicity."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import helpers
import pytest
import torch

import pardist
from pardist import checkpoint

pytestmark = pytest.mark.timeout(120)


def _state(seed: int = 0):
    """What a training loop checkpoints: params, optimizer state, step, RNG, data position."""
    apply, params, buffers = pardist.functional(helpers.convnet())
    opt = pardist.optim.adamw(1e-2)
    opt_state = opt.init(params)
    g = torch.Generator().manual_seed(seed)
    params = {k: v + torch.randn(v.shape, generator=g) for k, v in params.items()}
    return {
        "params": params,
        "buffers": buffers,
        "opt_state": opt_state,
        "step": 7 + seed,
        "rng": torch.get_rng_state(),
        "data": {"epoch": 1, "batch": 12},
        "lr": 0.5,
    }


def _like(state):
    return pardist.runtime._tree.tree_map(
        lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else type(x)(), state
    )


def _assert_equal(a, b):
    flat_a, spec_a = pardist.runtime._tree.tree_flatten(a)
    flat_b, spec_b = pardist.runtime._tree.tree_flatten(b)
    assert spec_a == spec_b
    for x, y in zip(flat_a, flat_b):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


def test_round_trip_in_one_process(tmp_path):
    state = _state()
    like = _like(state)
    before = [
        t.clone() for t in pardist.runtime._tree.tree_leaves(like) if isinstance(t, torch.Tensor)
    ]
    path = checkpoint.save(tmp_path, state, step=state["step"])
    assert path == str(tmp_path / "7") and checkpoint.latest(tmp_path) == path
    loaded = checkpoint.load(path, like)
    _assert_equal(loaded, state)
    assert type(loaded["opt_state"]) is type(state["opt_state"])  # NamedTuples come back
    after = [t for t in pardist.runtime._tree.tree_leaves(like) if isinstance(t, torch.Tensor)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))  # like is not mutated


def test_keep_and_latest(tmp_path):
    for step in (1, 2, 10, 3):
        checkpoint.save(tmp_path, {"step": step}, step=step, keep=2)
    assert checkpoint.steps(tmp_path) == [3, 10]
    assert checkpoint.latest(tmp_path) == str(tmp_path / "10")
    assert checkpoint.latest(tmp_path / "missing") is None


def test_load_errors_say_what_is_wrong(tmp_path):
    path = checkpoint.save(tmp_path, {"w": torch.ones(3)}, step=1)
    with pytest.raises(KeyError, match=r"tree\['v'\] is not in the checkpoint"):
        checkpoint.load(path, {"v": torch.ones(3)})
    with pytest.raises(
        ValueError,
        match=r"tree\['w'\] has shape \(3,\) in the checkpoint .* "
        r"shape \(4,\) in `like`",
    ):
        checkpoint.load(path, {"w": torch.ones(4)})
    with pytest.raises(FileNotFoundError, match=r"holds checkpoints \[1\].*latest"):
        checkpoint.load(tmp_path, {"w": torch.ones(3)})


def _save_replicated(path: str):
    state = _state()
    checkpoint.save(path, state, step=state["step"])
    return sorted(os.listdir(Path(path) / str(state["step"])))


def _load(path: str):
    return checkpoint.load(checkpoint.latest(path), _like(_state()))


def test_only_rank0_writes_replicated_state_and_any_world_size_loads_it(run, tmp_path):
    files = run(2, _save_replicated, str(tmp_path))
    assert files[0] == [".metadata", "__0_0.distcp", checkpoint.MARKER]  # rank 1 wrote nothing
    # DCP deduplicated the replicas: two ranks write what one process writes
    _save_replicated(str(tmp_path / "alone"))
    alone = tmp_path / "alone" / "7"
    assert (tmp_path / "7" / "__0_0.distcp").stat().st_size == (
        alone / "__0_0.distcp"
    ).stat().st_size
    _assert_equal(checkpoint.load(checkpoint.latest(tmp_path), _like(_state())), _state())
    for loaded in run(3, _load, str(tmp_path)):
        _assert_equal(loaded, _state())


def _save_diverged(path: str):
    try:
        checkpoint.save(path, {"w": torch.full((2,), float(pardist.rank())), "step": 1})
    except ValueError as e:
        return str(e)


def test_replicated_leaves_that_differ_are_named(run, tmp_path):
    for msg in run(2, _save_diverged, str(tmp_path / "c")):
        assert "tree['w'] differs between rank 0 and rank 1" in msg and "DTensor" in msg
    assert not (tmp_path / "c").exists()


def _dtensor(world: int, global_numel: int = 7):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = pardist.Mesh({"gpu": world}).device_mesh
    return distribute_tensor(torch.arange(float(global_numel)), mesh, [Shard(0)])


def _save_sharded(path: str):
    checkpoint.save(path, {"mu": _dtensor(2), "step": 3})
    return sorted(os.listdir(path))


def _load_sharded(path: str, world: int):
    state = checkpoint.load(path, {"mu": _dtensor(world) * 0, "step": 0})
    return state["mu"].to_local(), state["step"]


def test_sharded_dtensor_state_reshards_to_another_world_size(run, tmp_path):
    files = run(2, _save_sharded, str(tmp_path / "c"))[0]
    assert "__0_0.distcp" in files and "__1_0.distcp" in files  # each rank wrote its shard
    expected = torch.arange(7.0).chunk(3)
    for r, (local, step) in enumerate(run(3, _load_sharded, str(tmp_path / "c"), 3)):
        assert torch.equal(local, expected[r]) and step == 3
    # ...and as a plain tensor in one process: the whole of it
    whole = checkpoint.load(tmp_path / "c", {"mu": torch.zeros(7), "step": 0})["mu"]
    assert torch.equal(whole, torch.arange(7.0))


def _save_then_die_in_commit(path: str, conn) -> None:
    checkpoint.save(path, {"w": torch.ones(3), "step": 1}, step=1)

    def stuck(*args):
        conn.send("committing")
        signal.pause()

    checkpoint.commit = stuck  # the data of step 2 is written; the commit never happens
    checkpoint.save(path, {"w": torch.full((3,), 2.0), "step": 2}, step=2)


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_save_then_die_in_commit, args=(str(tmp_path), child))
    proc.start()
    assert parent.poll(60), "the child never reached the commit"
    assert parent.recv() == "committing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    (killed,) = tmp_path.glob(f"2.tmp-{proc.pid}-*")  # the run's own: its pid and a random name
    assert (killed / ".metadata").exists()  # step 2's data was written...
    assert checkpoint.latest(tmp_path) == str(tmp_path / "1")  # ...but never committed
    loaded = checkpoint.load(checkpoint.latest(tmp_path), {"w": torch.zeros(3), "step": 0})
    assert torch.equal(loaded["w"], torch.ones(3)) and loaded["step"] == 1
    with pytest.raises(FileNotFoundError, match="interrupted"):
        checkpoint.load(killed, {"w": torch.zeros(3), "step": 0})
    checkpoint.save(tmp_path, {"w": torch.full((3,), 2.0), "step": 2}, step=2)  # retry works
    assert checkpoint.steps(tmp_path) == [1, 2]
    assert not killed.exists()  # the dead run's leftovers, removed by the next save


def test_a_flipped_bit_is_caught_naming_the_file(tmp_path):
    state = {"w": torch.arange(1000.0), "step": 1}
    path = Path(checkpoint.save(tmp_path, state, step=1))
    data = next(f for f in path.iterdir() if f.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # one bit, inside the tensor's bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(checkpoint.CheckpointError, match=f"{data}.*checksum"):
        checkpoint.load(path, {"w": torch.zeros(1000), "step": 0})
    assert issubclass(checkpoint.CheckpointError, Exception)


def _save_past_a_size_limit(folder: str) -> str:
    """In a process of its own: a small save, then a large one past RLIMIT_FSIZE (the
    kernel refuses the write, as on a full disk)."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing
    checkpoint.save(folder, {"w": torch.ones(4)}, step=1)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
    try:
        checkpoint.save(folder, {"w": torch.ones(1 << 20)}, step=2)
    except checkpoint.CheckpointError as e:
        return str(e)
    return "no error"


def test_a_full_disk_is_named_and_keeps_the_last_checkpoint(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        message = pool.apply_async(_save_past_a_size_limit, (str(tmp_path),)).get(timeout=240)
    assert "the disk is full" in message and f"{tmp_path / '2.tmp-'}" in message, message
    assert f"the last good checkpoint, {tmp_path / '1'}, is intact" in message, message
    assert checkpoint.latest(tmp_path) == str(tmp_path / "1")
    got = checkpoint.load(checkpoint.latest(tmp_path), {"w": torch.zeros(4)})
    assert torch.equal(got["w"], torch.ones(4))
    assert not list(tmp_path.glob("2.tmp*"))


def test_resume_says_what_it_did(tmp_path, capsys):
    like = {"w": torch.zeros(2), "epoch": 0, "total": 3}
    assert checkpoint.resume(tmp_path, like, total=3) is like
    assert f"no checkpoint in {tmp_path}: starting afresh" in capsys.readouterr().out
    checkpoint.save(tmp_path, {"w": torch.ones(2), "epoch": 2, "total": 3}, step=2)
    state = checkpoint.resume(tmp_path, like, total=3)
    assert state["epoch"] == 2 and torch.equal(state["w"], torch.ones(2))
    assert f"resumed from {tmp_path / '2'} at epoch 2" in capsys.readouterr().out
    checkpoint.save(tmp_path, {"w": torch.ones(2), "epoch": 3, "total": 3}, step=3)
    checkpoint.resume(tmp_path, like, total=3)
    assert "nothing left to do: epoch 3 of 3 already done" in capsys.readouterr().out
    with pytest.warns(UserWarning, match="the run's length changed .* 3 epochs then, 5 now"):
        checkpoint.resume(tmp_path, like, total=5)


def test_a_damaged_newest_checkpoint_is_skipped_naming_it(tmp_path):
    # F10: a commit marker that is not JSON gave a raw JSONDecodeError with no path, and
    # latest/resume kept returning it: every restart failed on the same file.
    for step in (1, 2):
        checkpoint.save(tmp_path, {"w": torch.full((2,), float(step)), "epoch": step}, step=step)
    (tmp_path / "2" / checkpoint.MARKER).write_text("{not json")
    with pytest.warns(UserWarning, match=f"{tmp_path / '2' / checkpoint.MARKER} cannot be read"):
        assert checkpoint.latest(tmp_path) == str(tmp_path / "1")
    with pytest.raises(checkpoint.CheckpointError, match="commit marker is damaged"):
        checkpoint.load(tmp_path / "2", {"w": torch.zeros(2), "epoch": 0})
    with pytest.warns(UserWarning, match="Skipped, for the checkpoint before it"):
        state = checkpoint.resume(tmp_path, {"w": torch.zeros(2), "epoch": 0})
    assert state["epoch"] == 1


def test_resume_skips_a_checkpoint_whose_data_changed(tmp_path):
    for step in (1, 2):
        checkpoint.save(tmp_path, {"w": torch.arange(1000.0) * step, "epoch": step}, step=step)
    data = next(f for f in (tmp_path / "2").iterdir() if f.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match=f"{data}.*checksum"):
        state = checkpoint.resume(tmp_path, {"w": torch.zeros(1000), "epoch": 0})
    assert state["epoch"] == 1 and torch.equal(state["w"], torch.arange(1000.0))


def _save_and_wait(folder: str, started, again, done, told, pid: int | None) -> None:
    import warnings

    if pid is not None:  # another container (PID namespace), where this run's pid is the same
        os.getpid = lambda: pid
    checkpoint.save(folder, {"w": torch.ones(2)}, step=1)
    started.set()
    again.wait(120)  # the other run has saved into the folder too
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.save(folder, {"w": torch.ones(2)}, step=3)
    told.send([str(w.message) for w in caught])
    done.wait(120)


@pytest.mark.parametrize("pids", ["their own pids", "one pid in two containers"])
def test_two_runs_saving_into_one_directory_are_warned_of(tmp_path, pids):
    # F11: another live process holds the directory; a finished (or crashed) one does not.
    # Two containers: the same pid in each (PID namespaces), one directory between them.
    ctx = multiprocessing.get_context("spawn")
    started, again, done = ctx.Event(), ctx.Event(), ctx.Event()
    told, tell = ctx.Pipe()
    same = os.getpid() if pids == "one pid in two containers" else None
    args = (str(tmp_path), started, again, done, tell, same)
    other = ctx.Process(target=_save_and_wait, args=args)
    other.start()
    try:
        assert started.wait(240)
        theirs = same or other.pid
        (their_file,) = tmp_path.glob(f"pardist.run.{theirs}-*")
        with pytest.warns(UserWarning, match=f"another running process \\(run {theirs}-"):
            checkpoint.save(tmp_path, {"w": torch.ones(2)}, step=2)
        assert their_file.is_file()  # the other run's lock file is its own still
        again.set()
        assert told.poll(240)
        said = told.recv()  # and the first run is told of the second
        assert any(f"another running process (run {os.getpid()}-" in m for m in said), said
        assert len(list(tmp_path.glob("pardist.run.*"))) == 2
    finally:
        done.set()
        other.join(60)
    for step in (1, 2, 3):  # each checkpoint is whole, one run's
        assert checkpoint.load(tmp_path / str(step), {"w": torch.zeros(2)})["w"].sum() == 2
    later = tmp_path / "later"
    checkpoint.save(later, {"w": torch.ones(2)}, step=1)  # (this process's own: no warning)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.save(later, {"w": torch.ones(2)}, step=2)
    assert not [w for w in caught if "another running process" in str(w.message)]
