"""Shared-memory all-reduce for CPU ranks on one host, and the reducer's use of it."""

from __future__ import annotations

import time

import helpers
import pytest
import torch
import torch.distributed as dist
from numerics import assert_close64

import pardist
from pardist.transport._shm import SharedMemoryGroup

F64 = torch.float64


def _sums(numels):
    group = dist.group.WORLD
    shm = SharedMemoryGroup.create(group, 256)  # small regions: big tensors go in passes
    out = []
    for n in numels:
        t = torch.arange(n, dtype=torch.float64) * (dist.get_rank() + 1)
        shm.all_reduce(t)
        out.append(t)
    return shm is not None, out


@pytest.mark.parametrize("nprocs", [2, 3])
def test_all_reduce_in_passes_and_uneven_chunks(run, nprocs):
    numels = [1, 2, 5, 32, 100]  # fewer elements than ranks, not divisible, several passes
    total = sum(range(1, nprocs + 1))
    results = run(nprocs, _sums, numels)
    for used, sums in results:
        assert used
        for n, t in zip(numels, sums):
            assert torch.equal(t, torch.arange(n, dtype=torch.float64) * total)


def _reduce_into(numels):
    shm = SharedMemoryGroup.create(dist.group.WORLD, 1024, 1024)
    out = []
    for n in numels:
        shm.view(shm.index, 0, n, torch.float64).copy_(torch.arange(n) * (shm.index + 1))
        result = shm.reduce_into(0, n, torch.float64, 64)
        out.append(
            (result.clone(), result.data_ptr() == shm.common(64, n, torch.float64).data_ptr())
        )
    return out


@pytest.mark.parametrize("nprocs", [2, 3])
def test_reduce_into_one_common_result(run, nprocs):
    numels = [1, 2, 5, 100]  # fewer elements than ranks, and not divisible
    total = sum(range(1, nprocs + 1))
    for results in run(nprocs, _reduce_into, numels):
        for n, (t, in_common) in zip(numels, results):
            assert in_common
            assert torch.equal(t, torch.arange(n, dtype=torch.float64) * total)


def _exchanges(rounds):
    shm = SharedMemoryGroup.create(dist.group.WORLD, 64)
    if shm.index == 1:  # slow to read what it was sent: the others hurry on to the next call
        barrier = shm.barrier
        shm.barrier = lambda *what: (barrier(*what), time.sleep(0.01))
    return [shm.exchange(10 * i + shm.index) for i in range(rounds)]


def test_back_to_back_exchanges_never_overwrite_an_unread_value(run):
    for got in run(3, _exchanges, 6):
        assert got == [[10 * i + k for k in range(3)] for i in range(6)]


def _grad_step():
    """An MLP's parameters (float64: the transports' results are compared up to float64
    rounding, numerics.py) and a data-parallel step that returns their mean gradients."""
    apply, params, _ = pardist.functional(helpers.mlp().double())
    step = pardist.data_parallel(
        lambda p, b: pardist.grad(
            lambda p, x, y: torch.nn.functional.cross_entropy(apply(p, {}, x)[0], y)
        )(p, *b)
    )
    return params, step


def _train(keep_on: int | None):
    """Two steps; rank ``keep_on`` holds step 1's gradients through step 2."""
    params, step = _grad_step()
    r, kept, grads = pardist.rank(), None, []
    for s in range(2):
        x, y = helpers.global_batch(s, "mlp", dtype=F64)
        g = step(params, (helpers.shard(x, r, 2), helpers.shard(y, r, 2)))
        grads.append({k: v.clone() for k, v in g.items()})
        reducer = next(iter(step.reducers.values()))
        # Step 1's gradients are the one result every rank reads, not a copy of it.
        if s == 0 and reducer.arena is not None:
            arena = reducer.arena
            common = arena._data.data_ptr() + arena.size * arena.region_bytes
            end = arena._data.data_ptr() + arena._data.numel()
            in_common = all(common <= v.data_ptr() < end for v in g.values())
        if r == keep_on:
            kept = g
        del g
    shared = reducer.arena is not None and in_common
    return grads, kept is not None, shared, reducer.staging is not None


def test_reducer_keeps_buckets_in_shared_memory(run):
    shm = run(2, _train, None)
    gloo = run(2, _train, None, env={"PARDIST_SHM": "0"})
    staged = run(2, _train, None, env={"PARDIST_SHM": "staging"})
    assert [r[2:] for r in shm] == [(True, False)] * 2
    assert [r[2:] for r in gloo] == [(False, False)] * 2
    assert [r[2:] for r in staged] == [(False, True)] * 2
    for other in (gloo, staged):
        for a, b in zip(shm[0][0], other[0][0]):
            assert_close64(a, b, "gradients")
    assert all(torch.equal(shm[0][0][1][k], shm[1][0][1][k]) for k in shm[0][0][1])


def test_ranks_that_disagree_about_held_gradients_still_agree(run):
    # Rank 0 keeps its gradients (so its buckets are in use); rank 1 does not.
    # Both must take the same path in step 2, or their collectives would not match.
    mixed = run(2, _train, 0)
    plain = run(2, _train, None)
    for (g_mixed, *_), (g_plain, *_) in zip(mixed, plain):
        for a, b in zip(g_mixed, g_plain):
            assert all(torch.equal(a[k], b[k]) for k in a)


def _skip_on_rank_1():
    step = pardist.data_parallel(lambda w, b: pardist.grad(lambda w, b: (b @ w).sum())(w, b))
    w = torch.ones(3)
    step(w, torch.ones(2, 3))
    if pardist.rank() == 1:
        return "skipped"
    try:
        step(w, torch.ones(2, 3))
    except RuntimeError as e:
        return str(e)


def test_a_rank_that_skips_times_out_with_a_clear_error(run):
    out = run(2, _skip_on_rank_1, env={"PARDIST_TIMEOUT": "3"})
    assert out[1] == "skipped"
    assert "pardist.grad (starting a step) over axis 'gpu' (shared memory) waited 3 s" in out[0]
    assert "Rank(s) [1] never arrived" in out[0] and "PARDIST_TIMEOUT" in out[0]


def _change_in_place_on_rank_1():
    params, step = _grad_step()
    x, y = helpers.global_batch(0, "mlp", dtype=F64)
    batch = (helpers.shard(x, pardist.rank(), 2), helpers.shard(y, pardist.rank(), 2))
    grads = step(params, batch)
    if pardist.rank() == 1:
        torch._foreach_mul_(list(grads.values()), 0.5)  # shared: it reaches rank 0's too
    del grads
    try:
        step(params, batch)
    except RuntimeError as e:
        return str(e)


def test_gradients_changed_in_place_raise_on_every_rank(run):
    for message in run(2, _change_in_place_on_rank_1):
        assert "pardist.grad: the gradients it returned were changed in place" in message
        assert "group rank(s) [1]" in message and "PARDIST_SHM=0" in message
    # Through gloo each rank's gradients are its own, and changing them is allowed.
    assert run(2, _change_in_place_on_rank_1, env={"PARDIST_SHM": "0"}) == [None, None]
