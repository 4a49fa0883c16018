"""Elastic resume, exactly: a loader's position survives a checkpoint and a world-size change.

A deterministic run killed at step 7 at 2 ranks and resumed at 3 (by hand), at 1
and at 4 (in-process), or at 2 by the launcher's restart path ends ``torch.equal``
to an uninterrupted run, and sees the same global batches, sample by sample.
The loader's state on its own: every world size reads the same global batches,
and a position saved at one world size continues at another.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pardist

SCRIPT = Path(__file__).parent / "scripts" / "train_elastic.py"
ROOT = Path(__file__).parents[1]


def _train(*args, **kwargs):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_elastic", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.train(*args, **kwargs)


def launch(*argv, timeout: float = 150):
    return subprocess.run(
        [sys.executable, "-m", "pardist.launch", *map(str, argv)],
        cwd=ROOT,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def orders(path: Path) -> dict[int, list[int]]:
    """Each step's global batch; a step run twice (before a kill and after) must agree."""
    seen: dict[int, list[int]] = {}
    for line in path.read_text().splitlines():
        step, *rows = map(int, line.split())
        assert seen.setdefault(step, rows) == rows, f"step {step} saw other rows on resuming"
    return seen


def assert_equal(a, b) -> None:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), (x - y).abs().max()
        else:
            assert x == y


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (one process) and its global batches."""
    d = tmp_path_factory.mktemp("reference")
    out = launch("--nproc", 1, SCRIPT, d / "ckpt", "--out", d / "params.pt")
    assert out.returncode == 0, out.stderr[-3000:]
    return torch.load(d / "params.pt", weights_only=False), orders(d / "order.txt")


@pytest.mark.timeout(300)
def test_killed_at_2_resumed_at_3_then_1_and_4(run, tmp_path, reference):
    params, order = reference
    out = launch("--nproc", 2, SCRIPT, tmp_path / "ckpt", "--kill-step", 7)
    assert out.returncode != 0 and "SIGKILL" in out.stderr
    assert pardist.checkpoint.steps(tmp_path / "ckpt") == [3, 6]
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "ckpt", killed)
    out = launch("--nproc", 3, SCRIPT, tmp_path / "ckpt", "--out", tmp_path / "params.pt")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from step 6 at world size 3" in out.stdout
    assert_equal(torch.load(tmp_path / "params.pt", weights_only=False), params)
    assert orders(tmp_path / "order.txt") == order  # sample by sample, every step
    for n in (1, 4):  # the killed run's checkpoint, resumed in-process at 1 and 4 ranks
        ckpt = tmp_path / f"at{n}"
        shutil.copytree(killed, ckpt)
        for result in run(n, _train, str(ckpt)):
            assert_equal(result, params)


@pytest.mark.timeout(300)
def test_launcher_restart_path(tmp_path, reference):
    params, order = reference
    argv = ["--nproc", 2, "--max-restarts", 1, SCRIPT, tmp_path / "ckpt", "--kill-step", 7]
    out = launch(*argv, "--out", tmp_path / "params.pt")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from step 6 at world size 2" in out.stdout
    assert_equal(torch.load(tmp_path / "params.pt", weights_only=False), params)
    assert orders(tmp_path / "order.txt") == order


def loaders(world: int, split: bool = True, seed: int = 3):
    data = TensorDataset(torch.arange(100))
    loader = DataLoader(data, batch_size=12, shuffle=True, drop_last=True)
    return [
        pardist.data.shard(loader, r, world, split_batches=split, seed=seed, device=None)
        for r in range(world)
    ]


def global_batches(shards, epochs: int = 1) -> list[list[int]]:
    out = []
    for _ in range(epochs):
        for parts in zip(*shards):
            out.append(torch.cat([p[0] for p in parts]).tolist())
    return out


def test_every_world_size_reads_the_same_global_batches():
    one = global_batches(loaders(1), epochs=2)
    for world in (2, 3, 4):
        assert global_batches(loaders(world), epochs=2) == one


@pytest.mark.parametrize("before, after", [(2, 3), (3, 1), (1, 4), (4, 2)])
def test_position_continues_at_another_world_size(before, after):
    one = global_batches(loaders(1), epochs=2)  # 8 batches per epoch
    shards = loaders(before)
    iters = [iter(s) for s in shards]
    seen = [torch.cat([next(it)[0] for it in iters]).tolist() for _ in range(5)]
    state = shards[0].state_dict()
    assert all(s.state_dict() == state for s in shards)  # the same on every rank
    assert (state["epoch"], state["batches"]) == (0, 5)
    resumed = loaders(after)
    for s in resumed:
        s.load_state_dict(state)
    assert len(resumed[0]) == 8 and resumed[0].remaining == 3  # an epoch's, and what is left
    assert seen + global_batches(resumed, epochs=2) == one
    assert [s.remaining for s in resumed] == [8] * after  # a pass from the start


@pytest.mark.parametrize("stop", [5, 8, 13])
def test_epoch_arithmetic_written_for_a_dataloader_resumes_right(stop):
    """Accelerate's examples resume with ``epoch = step // len(loader)`` and skip the rest of
    that epoch's batches; a resumed sharded loader skips them itself, and len() must stay the
    epoch's length or the loop starts in a later epoch (and may train nothing)."""

    def train(shard, start_step: int, until: int | None) -> tuple[list, dict | None]:
        seen, step = [], start_step
        for epoch in range(start_step // len(shard), 3):  # the DataLoader-style arithmetic
            shard.set_epoch(epoch)
            for (batch,) in shard:
                seen.append((epoch, batch.tolist()))
                step += 1
                if step == until:
                    return seen, {"step": step, "loader": shard.state_dict()}
        return seen, None

    whole, _ = train(loaders(2)[0], 0, None)  # rank 0 of a run never stopped: 3 epochs of 8
    first, saved = train(loaders(2)[0], 0, stop)
    resumed = loaders(2)[0]
    resumed.load_state_dict(saved["loader"])
    rest, _ = train(resumed, saved["step"], None)
    assert len(whole) == 24
    assert first + rest == whole  # the same epochs and rows: none skipped, none repeated


def test_positions_that_cannot_continue_exactly_are_errors():
    shards = loaders(2, split=False)
    it = iter(shards[0])
    next(it)
    state = shards[0].state_dict()
    with pytest.raises(ValueError, match="only at world size 2.*split_batches=True"):
        loaders(3, split=False)[0].load_state_dict(state)
    loaders(2, split=False)[1].load_state_dict(state)  # the same world size: fine
    with pytest.raises(ValueError, match="seed 3 then, 4 now"):
        loaders(2, split=False, seed=4)[0].load_state_dict(state)
    for shard in shards:  # between epochs, any world size
        for _ in shard:
            pass
    assert shards[0].state_dict()["batches"] == 0
    loaders(3, split=False)[0].load_state_dict(shards[0].state_dict())
