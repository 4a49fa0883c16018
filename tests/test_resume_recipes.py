"""Every resume recipe of the docs reads the uninterrupted run's samples, in its order.

A shuffled sharded loader, a run stopped part-way through epoch 1 and resumed in a fresh
process's objects, three ways: the loader in pardist.checkpoint's tree, its own
``state_dict()`` / ``load_state_dict()``, and Accelerate's recipe (a fresh loader,
``set_epoch`` of the epoch the step count gives, ``skip_first_batches``). Each must give
the uninterrupted run's batches from the stop on, on every rank; Accelerate's recipe
without ``set_epoch`` would read epoch 0's order, and says so at its first batch.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import pardist

N, BATCH, EPOCHS = 40, 4, 3
STOP = 7  # batches into the run: part-way through epoch 1 (5 batches an epoch per rank at 2)


def loader():
    data = torch.arange(N)
    return pardist.data.shard(DataLoader(data, batch_size=BATCH, shuffle=True), seed=3)


def uninterrupted():
    out, train = [], loader()
    for epoch in range(EPOCHS):
        train.set_epoch(epoch)
        out += [b.tolist() for b in train]
    return out


def resumed(recipe: str, tmp: str):
    train = loader()
    seen, done = [], 0
    for epoch in range(EPOCHS):  # the first run, stopped at STOP
        train.set_epoch(epoch)
        for batch in train:
            seen.append(batch.tolist())
            done += 1
            if done == STOP:
                break
        if done == STOP:
            break
    if recipe == "checkpoint":
        pardist.checkpoint.save(tmp, {"loader": train}, step=done)
    saved = train.state_dict()
    train = loader()  # a fresh process's
    if recipe == "checkpoint":
        train = pardist.checkpoint.load(pardist.checkpoint.latest(tmp), {"loader": train})["loader"]
    elif recipe == "state_dict":
        train.load_state_dict(saved)
    starting_epoch, resume_step = divmod(done, len(train))
    for epoch in range(starting_epoch, EPOCHS):
        if recipe in ("accelerate", "accelerate_no_epoch"):
            if recipe == "accelerate":
                train.set_epoch(epoch)
            active = train
            if epoch == starting_epoch:
                active = pardist.data.skip_first_batches(train, resume_step)
        else:
            if epoch > starting_epoch:
                train.set_epoch(epoch)
            active = train
        seen += [b.tolist() for b in active]
    return seen


def _both(recipe: str, tmp: str):
    try:
        return uninterrupted(), resumed(recipe, tmp), None
    except ValueError as e:
        return None, None, str(e)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("recipe", ["checkpoint", "state_dict", "accelerate"])
def test_a_resumed_shuffled_loader_reads_the_uninterrupted_runs_batches(
    run, tmp_path, ranks, recipe
):
    for want, got, error in run(ranks, _both, recipe, str(tmp_path)):
        assert error is None, error
        assert got == want  # every batch, in order, from the stop on (and before it)


def test_accelerates_recipe_without_set_epoch_says_what_it_lacks(run, tmp_path):
    for _, _, error in run(2, _both, "accelerate_no_epoch", str(tmp_path)):
        assert error is not None and "loader.set_epoch(epoch)" in error
        assert "epoch 0's order" in error
