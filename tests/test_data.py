"""pardist.data: fastai's DistributedDL semantics, shuffling, split_batches, workers, uneven inputs.

Tests with explicit ``rank``/``world_size`` build every rank's shard in this one
process (as fastai's doc test does); the others run on real gloo groups.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    TensorDataset,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

import pardist
from pardist import data as pdata


def test_fastai_doc_test():
    dl = DataLoader(list(range(50)), batch_size=12, num_workers=2)
    for i in range(4):
        dl1 = pdata.shard(dl, i, 4)
        got = list(dl1)
        expected = (torch.arange(i * 13, i * 13 + 12) % 50, torch.tensor([i * 13 + 12]) % 50)
        assert len(dl1) == len(got) == len(expected)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "n, world, bs",
    [(3, 4, 2), (1, 3, 5), (8, 4, 2), (12, 4, 5), (9, 4, 2), (13, 3, 2), (10, 1, 3)],
    ids=["n<world", "n=1", "divisible", "divisible-bs-5", "k*world+1", "k*3+1", "world1"],
)
@pytest.mark.parametrize("drop_last", [False, True])
def test_padding_and_lengths(n, world, bs, drop_last):
    loader = DataLoader(list(range(n)), batch_size=bs, drop_last=drop_last)
    per_rank = math.ceil(n / world)
    everything = []
    for r in range(world):
        sharded = pdata.shard(loader, r, world)
        batches = list(sharded)
        assert len(sharded) == len(batches)  # len() is exact
        assert len(batches) == (per_rank // bs if drop_last else math.ceil(per_rank / bs))
        assert all(len(b) == bs for b in batches[:-1])
        piece = (torch.arange(r * per_rank, (r + 1) * per_rank) % n).tolist()
        got = torch.cat(batches).tolist() if batches else []
        assert got == (piece[: per_rank // bs * bs] if drop_last else piece)
        everything += got
    if not drop_last:  # the dataset in order, then fewer than `world` wrapped-around samples
        assert everything[:n] == list(range(n))
        assert everything[n:] == [i % n for i in range(len(everything) - n)]
        assert len(everything) - n < world


def _epochs(n: int, bs: int, epochs: int, set_epoch: bool):
    loader = pdata.shard(DataLoader(list(range(n)), batch_size=bs, shuffle=True))
    out = []
    for e in range(epochs):
        if set_epoch:
            loader.set_epoch(e)
        out.append(torch.cat(list(loader)).tolist())
    return out, len(loader)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_shuffle_covers_every_sample_once_per_epoch(run, nprocs):
    n, bs, epochs = 23, 4, 3
    results = run(nprocs, _epochs, n, bs, epochs, True)
    per_rank = math.ceil(n / nprocs)
    assert len({length for _, length in results}) == 1
    orders = []
    for e in range(epochs):
        whole = sum((pieces[e] for pieces, _ in results), [])
        assert len(whole) == per_rank * nprocs
        assert sorted(whole[:n]) == list(range(n))  # every sample exactly once
        assert whole[n:] == whole[: len(whole) - n]  # plus the padding, from the start
        orders.append(whole[:n])
    assert orders[0] != orders[1] and orders[1] != orders[2]  # a new permutation each epoch
    # One permutation per epoch shared by all ranks: one process gets the same order.
    alone = pdata.shard(DataLoader(list(range(n)), batch_size=bs, shuffle=True), 0, 1)
    alone.set_epoch(1)
    assert torch.cat(list(alone)).tolist() == orders[1]
    # Without set_epoch, each pass takes the next epoch.
    assert run(nprocs, _epochs, n, bs, epochs, False) == results


def test_an_iterator_takes_its_epoch_at_the_first_batch():
    loader = pdata.shard(DataLoader(list(range(10)), batch_size=10, shuffle=True), 0, 1)
    iter(loader), iter(loader)  # made and dropped, as some wrappers do
    assert loader.epoch == 0
    first = next(iter(loader))
    assert loader.epoch == 1 and torch.equal(first, loader.indices(0))
    loader.set_epoch(0)
    assert torch.equal(next(iter(pardist.progress(loader, disable=True))), first)


def test_split_batches_slices_each_global_batch():
    for shuffle in (False, True):
        loader = DataLoader(list(range(20)), batch_size=8, shuffle=shuffle)
        alone = list(pdata.shard(loader, 0, 1, split_batches=True))
        halves = [pdata.shard(loader, r, 2, split_batches=True) for r in range(2)]
        assert [len(h) for h in halves] == [3, 3] and halves[0].batch_size == 4
        batches = [list(h) for h in halves]
        for k in range(3):  # two ranks see exactly the global batches of one process
            assert torch.equal(torch.cat([batches[0][k], batches[1][k]]), alone[k])
        if not shuffle:
            assert alone[2].tolist() == [16, 17, 18, 19, 0, 1, 2, 3]  # wrapped to a full batch
    dropped = [list(pdata.shard(loader, r, 2, split_batches=True, drop_last=True)) for r in (0, 1)]
    assert [len(d) for d in dropped] == [2, 2]
    with pytest.raises(ValueError, match=r"10 is not a multiple of 4\. .*\(e\.g\. 12\)"):
        pdata.shard(DataLoader(range(20), batch_size=10), 0, 4, split_batches=True)


def test_sized_sequences_datasets_and_overrides():
    assert [b.tolist() for b in pdata.shard(range(10), 1, 2, batch_size=3)] == [[5, 6, 7], [8, 9]]
    ds = TensorDataset(torch.arange(6.0), torch.arange(6) * 10)
    ((x, y),) = list(pdata.shard(ds, 1, 2, batch_size=4))
    assert x.tolist() == [3.0, 4.0, 5.0] and y.tolist() == [30, 40, 50]
    loader = DataLoader(range(10), batch_size=2)
    assert len(pdata.shard(loader, 0, 2, batch_size=5)) == 1
    assert len(pdata.shard(loader, 0, 2, drop_last=True, batch_size=3)) == 1
    order = pdata.shard(loader, 0, 1, shuffle=True).indices(0).tolist()
    assert sorted(order) == list(range(10)) and order != list(range(10))


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_clear_errors():
    with pytest.raises(
        TypeError,
        match=r"shard: the dataset is an IterableDataset \(_Stream\).*"
        r"pardist\.data\.even\(loader\)",
    ):
        pdata.shard(DataLoader(_Stream(), batch_size=2), 0, 2)
    ds = list(range(8))
    with pytest.raises(ValueError, match="already has a DistributedSampler"):
        pdata.shard(DataLoader(ds, sampler=DistributedSampler(ds, 2, 0)), 0, 2)
    with pytest.raises(ValueError, match=r"no batch_size.*Pass batch_size="):
        pdata.shard(DataLoader(ds, batch_sampler=[[0, 1], [2, 3]]), 0, 2)
    with pytest.raises(ValueError, match="no batch size"):
        pdata.shard(ds, 0, 2)
    with pytest.raises(TypeError, match="has no len"):
        pdata.shard(iter(ds), 0, 2, batch_size=2)
    with pytest.raises(ValueError, match=r"rank=2, world_size=2; need ints with 0 <= rank"):
        pdata.shard(ds, 2, 2, batch_size=2)
    with pytest.raises(ValueError, match="dataset is empty"):
        pdata.shard([], 0, 2, batch_size=2)


class _Augmented(Dataset):
    """Returns (index, a random draw, the value set by the worker_init_fn)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.tensor([i, int(torch.randint(0, 2**30, ())), _MARK])


_MARK = -1


def _mark(worker_id):
    global _MARK
    _MARK = 100 + worker_id


def _worker_batches(num_workers: int):
    pardist.seed_everything(0)  # the main processes' generators are alike on every rank
    options = dict(num_workers=num_workers, worker_init_fn=_mark)
    if num_workers:  # kept by shard; fork starts a worker in milliseconds, not seconds
        options["multiprocessing_context"] = "fork"
    loader = DataLoader(_Augmented(), batch_size=4, **options)
    return torch.cat(list(pdata.shard(loader)))


def test_workers_in_one_process_differ_per_rank():
    torch.manual_seed(0)
    loader = DataLoader(_Augmented(), batch_size=4, num_workers=1, worker_init_fn=_mark)
    ranks = [torch.cat(list(pdata.shard(loader, r, 2))) for r in (0, 1)]
    assert [b[:, 0].tolist() for b in ranks] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert ranks[0][:, 2].tolist() == [100] * 6
    assert not torch.equal(ranks[0][:, 1], ranks[1][:, 1])


def test_workers_keep_dataset_and_init_fn_and_differ_per_rank(run):
    first, again = run(2, _worker_batches, 2), run(2, _worker_batches, 2)
    inline = run(2, _worker_batches, 0)
    for r in (0, 1):
        assert first[r][:, 0].tolist() == list(range(r * 6, r * 6 + 6))
        assert torch.equal(first[r][:, 0], inline[r][:, 0])  # same samples as without workers
        assert set(first[r][:, 2].tolist()) == {100, 101}  # the user's worker_init_fn ran
        assert torch.equal(first[r], again[r])  # reproducible
    assert not torch.equal(first[0][:, 1], first[1][:, 1])  # augmentation differs per rank


def _weighted():
    g = torch.Generator().manual_seed(pardist.rank())  # every rank would draw differently
    sampler = WeightedRandomSampler([1.0] * 10, num_samples=10, generator=g)
    mine = torch.cat(list(pdata.shard(DataLoader(list(range(10)), batch_size=4, sampler=sampler))))
    rank0 = WeightedRandomSampler([1.0] * 10, num_samples=10, generator=torch.Generator())
    rank0.generator.manual_seed(0)
    return mine.tolist(), list(rank0)


def test_custom_sampler_takes_rank0_order(run):
    (a, expected), (b, _) = run(2, _weighted)
    assert a + b == expected


def _by_axis():
    with pardist.Mesh({"node": 2, "gpu": 2}):
        loader = pdata.shard(DataLoader(list(range(8)), batch_size=2), axis="gpu")
    return loader.rank, loader.world_size, torch.cat(list(loader)).tolist()


def test_axis_takes_rank_from_the_mesh(run):
    results = run(4, _by_axis)
    assert [r[:2] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert results[0][2] == results[2][2] == [0, 1, 2, 3]
    assert results[1][2] == results[3][2] == [4, 5, 6, 7]


# Uneven inputs: every rank must raise, naming ranks and counts, within seconds.


def _uneven(counts: list[int], sized: bool, every_step: bool | None):
    batches = [torch.tensor([i]) for i in range(counts[pardist.rank()])]
    start = time.monotonic()
    seen = 0
    try:
        for _ in pdata.even(batches if sized else iter(batches), every_step=every_step):
            seen += 1
    except ValueError as exc:
        return str(exc), seen, time.monotonic() - start
    return None, seen, time.monotonic() - start


def test_even_lengths_are_compared_before_the_epoch(run):
    results = run(3, _uneven, [5, 4, 5], True, None)
    for message, seen, seconds in results:
        assert "different lengths (ranks 0, 2: 5; rank 1: 4)" in message
        assert "itertools.islice(loader, 4)" in message
        assert seen == 0 and seconds < 20  # not PARDIST_TIMEOUT's 30 s


def test_unsized_loaders_are_checked_every_step(run):
    results = run(2, _uneven, [3, 2], False, None)
    for message, seen, seconds in results:
        assert "rank 1 yielded 2 batches and stopped, while rank 0 had at least 3" in message
        assert seen == 2 and seconds < 20  # not PARDIST_TIMEOUT's 30 s
    assert [r[:2] for r in run(2, _uneven, [3, 3], False, None)] == [(None, 3)] * 2


class _Lying:
    """Says it has 3 batches; rank 1 yields 2."""

    def __len__(self):
        return 3

    def __iter__(self):
        return iter(range(3 - pardist.rank()))


def _lying_then_shard():
    try:
        list(pdata.even(_Lying()))
        lying = None
    except ValueError as exc:
        lying = str(exc)
    loader = pdata.shard(DataLoader(list(range(10)), batch_size=3))
    return lying, [b.tolist() for b in loader]  # the sharded loader under the per-step check


def test_debug_mode_checks_every_step(run):
    results = run(2, _lying_then_shard, env={"PARDIST_DEBUG": "1"})
    for lying, _ in results:
        assert "rank 1 yielded 2 batches and stopped, while rank 0 had at least 3" in lying
    assert [r[1] for r in results] == [[[0, 1, 2], [3, 4]], [[5, 6, 7], [8, 9]]]


def _uneven_training(counts: list[int]):
    @pardist.data_parallel(axis="gpu")
    def step(w, x):
        return w - 0.1 * pardist.grad(lambda w, x: (x * w).sum())(w, x)

    w = torch.zeros(2)
    batches = (torch.ones(1, 2) for _ in range(counts[pardist.rank()]))
    start = time.monotonic()
    try:
        for x in pdata.even(batches):
            w = step(w, x)
    except ValueError as exc:
        return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


def test_uneven_training_loop_raises_instead_of_hanging(run):
    for message, seconds in run(2, _uneven_training, [2, 3]):
        assert "rank 0 yielded 2 batches and stopped, while rank 1 had at least 3" in message
        assert seconds < 20  # not PARDIST_TIMEOUT's 30 s


def _shard_of_different_datasets():
    n = 10 - pardist.rank()  # e.g. each rank listed a directory that was still being written
    try:
        list(pdata.shard(DataLoader(list(range(n)), batch_size=4)))
    except ValueError as exc:
        return str(exc)


def test_shard_checks_ranks_agree_before_each_epoch(run):
    for message in run(2, _shard_of_different_datasets):
        assert (
            "rank 0: 10 samples, 2 batches, epoch 0; rank 1: 9 samples, 2 batches, epoch 0"
            in message
        )


def test_check_even(world1):
    assert pdata.check_even(7) == 7 and pdata.check_even([1, 2]) == 2


def _check_even_counts():
    try:
        pdata.check_even(4 + pardist.rank() % 2, what="steps")
    except ValueError as exc:
        return str(exc)


def test_check_even_names_ranks_and_counts(run):
    for message in run(3, _check_even_counts):
        assert "different numbers of steps (ranks 0, 2: 4; rank 1: 5)" in message


# rank0_first: the download-once idiom.


def _prepare(path: str):
    def download():
        with open(path, "a") as f:
            f.write(f"{pardist.rank()} start\n")
        time.sleep(0.3)
        with open(path, "a") as f:
            f.write(f"{pardist.rank()} end\n")
        return "data/"

    return pardist.rank0_first(download)


def test_rank0_first_runs_rank0_before_the_others(run, tmp_path):
    path = tmp_path / "log"
    assert run(3, _prepare, str(path)) == ["data/"] * 3
    lines = path.read_text().splitlines()
    assert lines[:2] == ["0 start", "0 end"]
    assert sorted(lines[2:]) == ["1 end", "1 start", "2 end", "2 start"]


def _prepare_fails():
    def download():
        if pardist.rank() == 0:
            raise OSError("disk full")
        return "data/"

    try:
        return pardist.rank0_first(download)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def test_rank0_first_failure_reaches_every_rank(run):
    first, second = run(2, _prepare_fails)
    assert first == "OSError: disk full"
    assert second.startswith("RuntimeError: pardist.rank0_first: rank 0 failed running download")


def _prepare_in_a_block(path: str, fail: bool):
    import time

    try:
        with pardist.rank0_first():
            with open(path, "a") as f:
                f.write(f"{pardist.rank()} start\n")
            if fail and pardist.rank() == 0:
                raise OSError("disk full")
            time.sleep(0.2 if pardist.rank() == 0 else 0)  # a slow rank 0: the others wait
            with open(path, "a") as f:
                f.write(f"{pardist.rank()} end\n")
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "done"


def test_rank0_first_as_a_context_manager(run, tmp_path):
    path = tmp_path / "log"
    assert run(3, _prepare_in_a_block, str(path), False) == ["done"] * 3
    lines = path.read_text().splitlines()
    assert lines[:2] == ["0 start", "0 end"]
    assert sorted(lines[2:]) == ["1 end", "1 start", "2 end", "2 start"]
    first, second = run(2, _prepare_in_a_block, str(tmp_path / "fails"), True)
    assert first == "OSError: disk full"
    assert second.startswith("RuntimeError: pardist.rank0_first: rank 0 failed running the block")
    assert (tmp_path / "fails").read_text().splitlines() == ["0 start"]  # rank 1 never began
