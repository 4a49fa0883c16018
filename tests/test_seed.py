"""Seeding: identical initialization on every rank, different augmentation per rank."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import pardist


def _draws(per_rank: bool):
    seed = pardist.seed_everything(0, per_rank=per_rank)
    return seed, random.random(), float(np.random.rand()), torch.rand(3)


def test_seed_everything_is_the_same_on_every_rank(run):
    results = run(2, _draws, False)
    here = _draws(False)  # and the same as in any other process
    for seed, py, npy, t in results:
        assert (seed, py, npy) == here[:3] and torch.equal(t, here[3])


def test_per_rank_seeds_differ_between_ranks_and_repeat(run):
    first, again = run(2, _draws, True), run(2, _draws, True)
    assert [r[0] for r in first] == [pardist.rank_seed(0, rank=r) for r in (0, 1)]
    assert first[0][1] != first[1][1] and first[0][2] != first[1][2]
    assert not torch.equal(first[0][3], first[1][3])
    for a, b in zip(first, again):
        assert a[:3] == b[:3] and torch.equal(a[3], b[3])


def _first_step(seed_alike: bool):
    if seed_alike:
        pardist.seed_everything(0)
    else:
        torch.manual_seed(pardist.rank())  # the mistake the replication check catches
    apply, params, _ = pardist.functional(torch.nn.Linear(3, 2))
    step = pardist.data_parallel(lambda p, x: pardist.grad(lambda p: apply(p, {}, x)[0].sum())(p))
    try:
        step(params, torch.ones(2, 3))
    except ValueError as exc:
        return str(exc)
    return {k: v.tolist() for k, v in params.items()}


def test_seed_everything_gives_identical_replicas(run):
    alike = run(2, _first_step, True)
    assert alike[0] == alike[1]
    for message in run(2, _first_step, False):
        assert "pardist.seed_everything(0)" in message


def test_rank_seed():
    seeds = {pardist.rank_seed(s, rank=r) for s in range(4) for r in range(64)}
    assert len(seeds) == 4 * 64 and all(0 <= s < 2**63 for s in seeds)
    assert pardist.rank_seed(0, rank=1) != pardist.rank_seed(1, rank=0)
    assert pardist.rank_seed(7, rank=3) == pardist.rank_seed(7, rank=3)
    assert pardist.rank_seed(7) == pardist.rank_seed(7, rank=0)  # this process is rank 0
    with pytest.raises(TypeError, match=r"pardist.seed_everything: seed=1.5; a seed is"):
        pardist.seed_everything(1.5)
    with pytest.raises(TypeError, match=r"pardist.rank_seed: seed=-1"):
        pardist.rank_seed(-1)


class _Random(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([float(torch.rand(())), np.random.rand(), random.random()])


def _worker_draws(init_fn):
    pardist.seed_everything(0)  # every rank's main process alike: so are its workers' seeds
    loader = DataLoader(
        _Random(),
        batch_size=2,
        num_workers=1,
        worker_init_fn=init_fn,
        multiprocessing_context="fork",
    )
    return torch.cat(list(loader))


def test_seed_worker_differs_per_rank_and_repeats(run):
    plain = run(2, _worker_draws, None)
    assert torch.equal(plain[0], plain[1])  # the problem: every rank augments alike
    first, again = (
        run(2, _worker_draws, pardist.seed_worker),
        run(2, _worker_draws, pardist.seed_worker),
    )
    assert (first[0] != first[1]).all()  # torch, numpy and random all differ per rank
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
