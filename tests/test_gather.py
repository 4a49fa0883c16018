"""pardist.gather and gather_object: uneven lengths, total=, and exact distributed evaluation."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pardist
from pardist import data as pdata


def _uneven():
    r = pardist.rank()
    tree = {"x": torch.full((r + 1, 2), float(r)), "i": (torch.arange(r + 1),)}
    return pardist.gather(tree)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_gather_uneven_lengths_in_rank_order(run, nprocs):
    expected_x = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(nprocs)])
    expected_i = torch.cat([torch.arange(r + 1) for r in range(nprocs)])
    for out in run(nprocs, _uneven):
        assert torch.equal(out["x"], expected_x)
        assert torch.equal(out["i"][0], expected_i) and out["i"][0].dtype == torch.int64


def _epoch_of_indices(n: int):
    loader = pdata.shard(DataLoader(list(range(n)), batch_size=4))
    mine = torch.cat(list(loader))
    return pardist.gather(mine, total=n), pardist.gather(mine)


@pytest.mark.parametrize("nprocs, n", [(3, 10), (4, 10), (3, 9), (4, 3)])
def test_total_drops_the_padding_and_restores_dataset_order(run, nprocs, n):
    padded = math.ceil(n / nprocs) * nprocs
    for exact, everything in run(nprocs, _epoch_of_indices, n):
        assert exact.tolist() == list(range(n))
        assert everything.tolist() == [i % n for i in range(padded)]


def _errors():
    r, messages = pardist.rank(), []
    attempts = [
        lambda: pardist.gather(torch.ones(2), total=5),  # 4 rows between 2 ranks
        lambda: pardist.gather(torch.ones(2), total=2),  # 2 rows too many
        lambda: pardist.gather({"p": torch.ones(2, 3 + r)}),  # trailing shapes differ
        lambda: pardist.gather(torch.tensor(1.0)),
        lambda: pardist.gather({"a": torch.ones(2), ("b" if r else "c"): torch.ones(2)}),
    ]
    for attempt in attempts:
        try:
            attempt()
            messages.append(None)
        except (ValueError, TypeError) as exc:
            messages.append(str(exc))
    return messages


def test_gather_errors_name_sizes_paths_and_ranks(run):
    for too_few, too_many, shapes, scalar, keys in run(2, _errors):
        assert "total=5, but the ranks of axis 'gpu' hold only 4 rows of tree" in too_few
        assert "(per rank: [2, 2])" in too_few
        assert "hold 4 rows of tree (per rank: [2, 2]), 2 more" in too_many
        assert "fewer than 2 rows" in too_many
        assert "tree['p'] has different dtypes or trailing shapes" in shapes
        assert "rank 0: float32 (2, 3), rank 1: float32 (2, 4)" in shapes
        assert "tree is a scalar (shape ()); gather concatenates along dim 0" in scalar
        assert "rank 0 has 2 (tree['c'] not on rank 1), rank 1 has 2 (tree['b'] not" in keys


def _objects():
    r = pardist.rank()
    return pardist.gather_object({"rank": r, "files": [f"part-{r}"] * r})


def test_gather_object_in_rank_order(run):
    expected = [{"rank": r, "files": [f"part-{r}"] * r} for r in range(3)]
    assert run(3, _objects) == [expected] * 3


def _gather_over_gpu_axis():
    with pardist.Mesh({"node": 2, "gpu": 2}):
        return pardist.gather(torch.tensor([pardist.rank()]), "gpu").tolist()


def test_gather_over_one_mesh_axis(run):
    assert run(4, _gather_over_gpu_axis) == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_world_size_one(world1):
    x = torch.arange(6).reshape(3, 2)
    out = pardist.gather({"x": x}, total=3)
    assert torch.equal(out["x"], x)
    assert pardist.gather_object("a") == ["a"]
    with pytest.raises(ValueError, match="1 more"):  # one process has no padding to drop
        pardist.gather(x, total=2)
    with pytest.raises(TypeError, match=r"total=2\.0; give the dataset size"):
        pardist.gather(x, total=2.0)
    with pytest.raises(TypeError, match=r"tree\[0\] is a str"):
        pardist.gather(["no"])


# Exact evaluation: the idiom from the README, at 1 to 4 ranks.


def _dataset(n: int) -> TensorDataset:
    # Small integers: every sum is exact in float32, so predictions cannot depend on
    # how samples are batched, and any difference would come from the gathering.
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-3, 4, (n, 5), generator=g).float()
    return TensorDataset(x, torch.randint(0, 3, (n,), generator=g))


def _classifier() -> torch.nn.Module:
    pardist.seed_everything(0)
    model = torch.nn.Linear(5, 3)
    with torch.no_grad():
        model.weight.copy_(torch.randint(-2, 3, (3, 5)).float())
        model.bias.zero_()
    return model


def _evaluate(n: int, bs: int):
    model, valid = _classifier(), pdata.shard(DataLoader(_dataset(n), batch_size=bs))
    preds, targets = [], []
    with torch.no_grad():
        for x, y in pardist.progress(valid, disable=True):
            preds.append(model(x).argmax(1))
            targets.append(y)
    preds, targets = pardist.gather((torch.cat(preds), torch.cat(targets)), total=n)
    return (preds == targets).float().mean().item(), preds, targets


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_gathered_accuracy_equals_one_process_exactly(run, nprocs):
    n = 50
    x, y = _dataset(n).tensors
    with torch.no_grad():
        preds = _classifier()(x).argmax(1)
    accuracy = (preds == y).float().mean().item()
    assert 0.1 < accuracy < 0.9  # neither trivial nor perfect: padding would change it
    for acc, got_preds, got_targets in run(nprocs, _evaluate, n, 8):
        assert acc == accuracy
        assert torch.equal(got_preds, preds) and torch.equal(got_targets, y)


# loader.gather: Accelerate's gather_for_metrics, per batch.


def _per_batch(n: int, bs: int, split: bool, drop_last: bool):
    loader = DataLoader(list(range(n)), batch_size=bs, drop_last=drop_last)
    valid = pdata.shard(loader, split_batches=split)
    batches = [valid.gather(batch).tolist() for batch in valid]
    keys = [valid.gather({"i": b, "x": {"sq": b.double() ** 2}}) for b in valid]
    return batches, [k["i"].tolist() for k in keys], [k["x"]["sq"].sum().item() for k in keys]


@pytest.mark.parametrize(
    "nprocs, n, bs, split, drop_last",
    [(3, 10, 3, False, False), (4, 10, 2, False, False), (3, 9, 4, False, False),
     (4, 3, 2, False, False), (2, 11, 4, True, False), (3, 10, 3, True, False),
     (2, 11, 4, True, True), (3, 10, 3, False, True)],
)  # fmt: skip
def test_per_batch_gather_counts_every_sample_once(run, nprocs, n, bs, split, drop_last):
    """Summed over an epoch's batches, the gathered rows are the dataset's, each exactly once
    (what a per-batch metric needs), for every way shard pads: the wrap-around repeats of the
    last rank(s) and a split last global batch. With drop_last, the samples the loader drops."""
    one = [list(b.tolist()) for b in DataLoader(list(range(n)), batch_size=bs, drop_last=drop_last)]
    for batches, again, squares in run(nprocs, _per_batch, n, bs, split, drop_last):
        seen = sorted(i for b in batches for i in b)
        if drop_last and split:  # the global batches one process would have
            assert seen == sorted(i for b in one for i in b)
        elif drop_last:  # every rank's full batches of its share: no sample twice
            assert len(seen) == len(set(seen))
        else:
            assert seen == list(range(n))
        assert again == batches and len(squares) == len(batches)
        assert sum(squares) == sum(i * i for b in batches for i in b)


def _gather_before_a_batch():
    valid = pdata.shard(DataLoader(list(range(8)), batch_size=2))
    try:
        valid.gather(torch.ones(2))
    except ValueError as e:
        first = str(e)
    for _ in valid:
        try:
            valid.gather(torch.ones(3))  # not one row per sample
        except ValueError as e:
            return first, str(e)
    return first, None


def test_per_batch_gather_errors(run):
    for first, rows in run(2, _gather_before_a_batch):
        assert "has handed out no batch yet" in first
        assert "has 6 rows over the ranks, but their batches hold 4 samples" in rows
