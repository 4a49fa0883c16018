"""Randomness inside a step: per rank, per step, reproducible across restarts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pardist


def _masks(steps: int, start: int = 0) -> list[torch.Tensor]:
    pardist.seed_everything(0)  # as the README says: the same seed on every rank
    pardist.set_rng_count(start)
    masks = []

    @pardist.data_parallel
    def step(w, x):
        masks.append(F.dropout(torch.ones(64), 0.5) != 0)
        return pardist.pmean((x * w).sum(), "gpu")

    rank, world = pardist.rank(), pardist.world_size()
    for _ in range(steps):
        step(torch.ones(3), torch.ones(2 * world, 3).chunk(world)[rank])
    return masks


def _per_rank(tmp: str):
    masks = _masks(3)
    count = pardist.rng_count()
    outside = torch.rand(4)  # the step streams leave the global generator alone
    pardist.seed_everything(0)
    untouched = torch.rand(4)
    # a restart: the count saved with the checkpoint, loaded by a fresh run
    pardist.checkpoint.save(tmp, {"rng": torch.tensor(2)}, step=2)
    saved = int(pardist.checkpoint.load(tmp + "/2", {"rng": torch.tensor(0)})["rng"])
    resumed = _masks(1, start=saved)
    return masks, count, resumed, torch.equal(outside, untouched)


def test_masks_differ_per_rank_and_step_and_replay_after_a_restart(run, tmp_path):
    results = run(2, _per_rank, str(tmp_path))
    for masks, count, resumed, untouched in results:
        assert count == 3 and untouched
        assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
        assert torch.equal(resumed[0], masks[2])  # the same stream after a restart at step 2
    (a, *_), (b, *_) = results
    for s in range(3):
        assert not torch.equal(a[s], b[s]), f"step {s}: both ranks drew the same dropout mask"


def _twice():
    return _masks(2), _masks(2)


def test_the_same_seed_gives_the_same_masks(run):
    for first, second in run(2, _twice):
        assert all(torch.equal(x, y) for x, y in zip(first, second))


def test_set_rng_count_checks_its_argument():
    import pytest

    with pytest.raises(TypeError, match="pardist.set_rng_count"):
        pardist.set_rng_count(-1)


def test_nested_streams_reseed_by_index():
    from pardist.runtime import _rng

    pardist.seed_everything(0)
    with _rng.stream(0):
        with _rng.stream(5):
            a = torch.rand(3)
        with _rng.stream(5):
            b = torch.rand(3)
        with _rng.stream(6):
            c = torch.rand(3)
    assert torch.equal(a, b) and not torch.equal(a, c)


def _compiled_masks():
    pardist.seed_everything(0)
    pardist.set_rng_count(0)

    @pardist.data_parallel(compile=True)
    def step(w, x):
        return pardist.all_gather(F.dropout(x * w, 0.5), "gpu") != 0

    x = torch.ones(4, 16).chunk(2)[pardist.rank()]
    masks = [step(torch.ones(16), x) for _ in range(3)]
    pardist.set_rng_count(1)
    return masks, step(torch.ones(16), x)


def test_a_compiled_step_draws_per_rank_and_step(run):
    (masks, replay), _ = run(2, _compiled_masks)
    assert not torch.equal(masks[0][:2], masks[0][2:])  # rank 0's rows and rank 1's
    assert not torch.equal(masks[0], masks[1]) and torch.equal(replay, masks[1])
