"""The pieces of a gradient's reduction, each on its own: buckets, the reducer, the choice.

``transport.assign`` decides which gradients share a bucket, for the eager reducer,
ZeRO's reduce-scatter and the compiled step alike (DDP's rule: reverse order, one
dtype and device per bucket, a small first bucket so communication starts early).
``Reducer`` averages in those buckets over real process groups, on both transports.
``gradients._reduction.choose`` picks who reduces a call's gradients.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

import pardist
from pardist.gradients import _reduction
from pardist.transport import Reducer, assign, signature

F32, F64 = torch.float32, torch.float64


def slots(like, bucket_bytes, first_bytes, width=torch.Tensor.numel, rows=1, comm=None):
    buckets, places = assign(like, width, rows, comm, bucket_bytes, first_bytes)
    return [b.slots for b in buckets], places, buckets


def test_buckets_fill_in_reverse_and_close_at_their_size():
    like = [torch.empty(10) for _ in range(4)]  # 40 bytes each
    # The first bucket closes at 40 bytes (one tensor), the next at 80 (two).
    got, places, _ = slots(like, bucket_bytes=80, first_bytes=40)
    assert got == [[3], [2, 1], [0]]
    # Each tensor's (bucket, column offset) in its bucket's row.
    assert places == [(2, 0), (1, 10), (1, 0), (0, 0)]
    assert slots(like, 1 << 30, 1 << 30)[0] == [[3, 2, 1, 0]]  # all in one


def test_dtypes_and_devices_never_share_a_bucket():
    like = [torch.empty(4, dtype=F32), torch.empty(4, dtype=F64), torch.empty(4, dtype=F32)]
    got, _, buckets = slots(like, 1 << 30, 1 << 30)
    assert got == [[2, 0], [1]]
    assert [b.dtype for b in buckets] == [F32, F64]
    meta = [torch.empty(4), torch.empty(4, device="meta"), torch.empty(4)]
    assert slots(meta, 1 << 30, 1 << 30)[0] == [[2, 0], [1]]


def test_compression_applies_to_floating_buckets_only():
    like = [torch.empty(4, dtype=torch.int64), torch.empty(4, dtype=F32)]
    _, _, buckets = slots(like, 1 << 30, 1 << 30, comm=torch.bfloat16)
    assert [(b.dtype, b.comm_dtype) for b in buckets] == [
        (F32, torch.bfloat16),
        (torch.int64, None),
    ]
    _, _, same = slots(
        [torch.empty(4, dtype=torch.bfloat16)], 1 << 30, 1 << 30, comm=torch.bfloat16
    )
    assert same[0].comm_dtype is None  # already in the communication dtype


def test_a_reduce_scatter_bucket_is_rows_of_chunks():
    # ZeRO: each tensor takes a chunk of ceil(numel / size) per row, one row per rank.
    like = [torch.empty(5), torch.empty(8)]
    chunk = lambda t: -(-t.numel() // 4)  # noqa: E731
    got, places, buckets = slots(like, 1 << 30, 1 << 30, width=chunk, rows=4)
    assert got == [[1, 0]] and places == [(0, 2), (0, 0)]
    assert buckets[0].row == 2 + 2 and buckets[0].numel == 4 * 4


SHAPES = ((7,), (10, 13), (3,), (2, 4, 2, 4))


def _reduce(dtypes, how="one by one", channels_last=False):
    """Every rank's own gradients, averaged by a Reducer in small buckets: added one by
    one as the backward produces them, or all at once after it (``add_many``)."""
    rank, world = pardist.rank(), pardist.world_size()
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(n, generator=g, dtype=d) for n, d in zip(SHAPES, dtypes)]
    like = [torch.empty_like(t) for t in grads]
    if channels_last:  # a slot laid out as the parameter's strides, not row-major
        like[3] = like[3].contiguous(memory_format=torch.channels_last)
    groups = pardist.Mesh({"gpu": world}).groups("gpu")
    reducer = Reducer(like, groups, world, bucket_bytes=256)
    means = []
    for _ in range(2):  # the buckets are reused by the next step
        reducer.begin()
        if how == "all at once":
            reducer.add_many([(i, grads[i]) for i in range(len(grads))])
        else:
            for i in reversed(range(len(grads))):  # as the backward produces them
                reducer.add(i, grads[i])
        means.append([m.clone() for m in reducer.finish()])
    return grads, means


@pytest.mark.parametrize("how", ["one by one", "all at once"])
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_the_reducer_averages_over_real_ranks(run, transport, how):
    dtypes = (F32, F64, F32, F64)
    env = {"PARDIST_SHM": "0"} if transport == "gloo" else None
    results = run(2, _reduce, dtypes, how, how == "all at once", env=env)
    (a, _), (b, _) = results
    # At two ranks each contribution is halved exactly, then one rounding: (a + b) / 2.
    want = [(x + y) / 2 for x, y in zip(a, b)]
    for _, means in results:
        for step in means:
            assert all(torch.equal(m, w) for m, w in zip(step, want))


def test_added_all_at_once_a_bucket_is_one_concatenation_of_its_gradients():
    # One rank (no group): add_many writes each whole bucket of small row-major slots by
    # one concatenation and one division, the numbers of add's division per gradient; a
    # bucket holding a channels_last slot, or large ones, is written gradient by gradient.
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) for n in SHAPES]
    for last in (False, True):
        like = [torch.empty_like(t) for t in grads]
        if last:
            like[3] = like[3].contiguous(memory_format=torch.channels_last)
        one, many = (Reducer(like, [], 3, bucket_bytes=1 << 20) for _ in range(2))
        assert [b.concatenated for b in many.buckets] == [not last]
        one.begin()
        for i, t in enumerate(grads):
            one.add(i, t)
        many.begin()
        many.add_many(list(enumerate(grads)))
        for a, b in zip(one.finish(), many.finish()):
            assert torch.equal(a, b) and a.stride() == b.stride()
        assert torch.equal(many.finish()[1], grads[1] / 3)
    large = [torch.empty(100_000), torch.empty(3)]  # 200 KB a slot: not concatenated
    assert not Reducer(large, [], 2).buckets[0].concatenated


def test_the_averaged_gradients_are_views_of_the_buckets_with_their_parameters_strides():
    # Row-major buckets hand out their slots' views in one call (views_of); a bucket with a
    # channels_last slot, or an empty one, view by view: the same views either way.
    g = torch.Generator().manual_seed(2)
    for odd in (None, "channels_last", "empty"):
        like = [torch.empty(s) for s in SHAPES] + [torch.empty(0, 3)]
        if odd == "channels_last":
            like[3] = like[3].contiguous(memory_format=torch.channels_last)
        if odd != "empty":
            like.pop()
        reducer = Reducer(like, [], 2, bucket_bytes=1 << 20)
        assert [bool(b.metas) for b in reducer.buckets] == [odd is None]
        reducer.begin()
        reducer.add_many([(i, torch.randn(t.shape, generator=g)) for i, t in enumerate(like)])
        got = reducer.finish()
        for i, (view, t) in enumerate(zip(got, like)):
            want = reducer._view(i)  # the slot's own as_strided view
            assert view.shape == t.shape and view.stride() == t.stride() == want.stride()
            assert view.data_ptr() == want.data_ptr() and view._base is not None


def test_all_at_once_slots_with_divisors_of_their_own_divide_as_add_does():
    # pardist.grad's first slots: the per-rank table (divided by 1: exact) and batch-norm
    # statistics (by the ranks, not ranks x micro-batches), added with the gradients after
    # the backward. The bucket is still one concatenation; those slots are divided again.
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=g) for n in SHAPES]
    like = [torch.empty_like(t) for t in tensors]
    one, many = (Reducer(like, [], 3, bucket_bytes=1 << 20) for _ in range(2))
    assert [b.concatenated for b in many.buckets] == [True]
    divided = [(0, tensors[0], 1), (2, tensors[2], 7)]
    one.begin()
    for i, t, by in divided:
        one.add(i, t, divisor=by)
    for i in (1, 3):
        one.add(i, tensors[i])
    many.begin()
    many.add = lambda *args, **kwargs: pytest.fail("written slot by slot")
    many.add_many([(1, tensors[1]), (3, tensors[3])], divided)
    for a, b in zip(one.finish(), many.finish()):
        assert torch.equal(a, b)
    got = many.finish()
    assert torch.equal(got[0], tensors[0]) and torch.equal(got[2], tensors[2] / 7)
    assert torch.equal(got[1], tensors[1] / 3)


def _bn_steps(how: str):
    """Two data-parallel steps of a batch-norm model with per-rank statistics (their mean
    rides in the gradient bucket with the per-rank table): the step's reduction added all
    at once (``add_many``) or, with ``add_many`` replaced, slot by slot. Returns the
    parameters, buffers and losses, and how many slots the second step added one by one."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    apply, params, buffers = pardist.functional(net, sync_bn=False)
    opt = pardist.optim.adamw(1e-2)
    state = opt.init(params)

    def loss_fn(p, b, x):
        out, b = apply(p, b, x)
        return out.square().mean(), b

    @pardist.data_parallel
    def step(p, b, s, x):
        (loss, b), grads = pardist.value_and_grad(loss_fn, has_aux=True)(p, b, x)
        p, s = opt.update(grads, s, p)
        return p, b, s, loss

    one_by_one = []
    real_add, real_many = Reducer.add, Reducer.add_many

    def add(self, i, t, divisor=None):
        one_by_one.append(i)
        return real_add(self, i, t, divisor)

    def slot_by_slot(self, pairs, divided=()):
        for i, t, by in divided:
            self.add(i, t, by)
        for i, t in pairs:
            self.add(i, t)

    g = torch.Generator().manual_seed(pardist.rank())
    Reducer.add = add
    if how == "slot by slot":
        Reducer.add_many = slot_by_slot
    try:
        losses = []
        for _ in range(2):
            one_by_one.clear()
            params, buffers, state, loss = step(
                params, buffers, state, torch.randn(6, 5, generator=g)
            )
            losses.append(loss)
    finally:
        Reducer.add, Reducer.add_many = real_add, real_many
    return params, buffers, losses, len(one_by_one)


def test_a_steps_reduction_all_at_once_is_the_same_bits_as_slot_by_slot(run):
    # Between CPU ranks of one host the buckets are summed after the backward, so the
    # table, the statistics and the gradients go to the reducer in one call, which writes
    # this model's one bucket by one concatenation (no slot added one by one).
    at_once, by_slot = run(2, _bn_steps, "all at once"), run(2, _bn_steps, "slot by slot")
    for (p, b, losses, singles), (p1, b1, losses1, singles1) in zip(at_once, by_slot):
        assert singles == 0 and singles1 == 1 + 2 + 6  # table, 2 statistics, 6 gradients
        for mine, theirs in ((p, p1), (b, b1)):
            assert mine.keys() == theirs.keys()
            assert all(torch.equal(mine[k], theirs[k]) for k in mine)
        assert all(torch.equal(x, y) for x, y in zip(losses, losses1))
    (_, b, _, _), (_, b_other, _, _) = at_once
    assert all(torch.equal(b[k], b_other[k]) for k in b)  # the statistics' mean: every rank's


def test_the_choice_of_reduction():
    rep = [torch.empty(3), torch.empty(2, 2)]
    ctx = lambda size, scatter=frozenset(): types.SimpleNamespace(size=size, scatter=scatter)  # noqa: E731
    choose = _reduction.choose
    assert isinstance(choose(ctx(2), [], 1), _reduction.Local)  # nothing replicated
    assert isinstance(choose(ctx(1), rep, 1), _reduction.Local)  # one rank
    assert isinstance(choose(ctx(1), rep, 4), _reduction.Accumulate)  # micro-batches
    assert isinstance(choose(ctx(2, frozenset({signature(rep)})), rep, 1), _reduction.Scatter)
    other = frozenset({signature(rep[:1])})  # a sharded state of other parameters
    chosen = choose(ctx(2, other), rep, 1)
    assert isinstance(chosen, _reduction.AllReduce) and chosen.late  # one pass: after forward
    assert not choose(ctx(2), rep, 2).late  # micro-batches: during the first backward


def _bucket_sums(numels, room: bool):
    """The compiled step's bucket operators, called eagerly on two buckets (both started,
    then both waited for): this rank's tensors and sums. Without ``room`` in /dev/shm
    for the buckets' regions, they are summed through the smaller shared transport."""
    import torch.distributed as dist

    from pardist.compile import _beside, _ops
    from pardist.transport import _segments, _shmgroups

    rank, world = pardist.rank(), pardist.world_size()
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(n, generator=g, dtype=F32) for n in numels]
    xs[1] = xs[1][:1].expand(numels[1])  # a broadcast gradient ((p * z).sum()'s): stride 0
    divisors = [float(world), 1.0, 7.0][: len(xs)]
    group = dist.group.WORLD.group_name
    given = [x.clone() for x in xs]
    given[1] = given[1][:1].expand(numels[1])  # (clone made it dense)
    mapped, key = _segments.map_shared, f"{group} beside"
    _ops._arenas.pop(key, None)
    caches = (_ops._arenas, _shmgroups._collective_groups)
    saved = [dict(cache) for cache in caches]
    if not room:
        _segments.map_shared = lambda *args: None
    try:
        sums = _beside.sum_buckets(given, [[0, 1], [2]], divisors, group)
        arena = _ops._arenas.get(key)
    finally:  # what no room left behind is not the next test's
        _segments.map_shared = mapped
        for cache, before in zip(caches, saved):
            cache.clear()
            cache.update(before)
    helper = any(t.name == "pardist-shm-sum" for t in threading.enumerate())
    # New tensors: nothing given is written (in a graph, inductor may reuse a given
    # tensor's memory, and write over the sums, once it thinks that tensor was last read)
    assert all(torch.equal(g, x) for g, x in zip(given, xs))
    assert not any(
        s.untyped_storage().data_ptr() == g.untyped_storage().data_ptr()
        for s, g in zip(sums, given)
    )
    return xs, divisors, sums, arena is not None, helper


@pytest.mark.parametrize("helper", ["1", "0"], ids=["helper", "own_thread"])
@pytest.mark.parametrize("room", [True, False], ids=["arena", "no_room"])
@pytest.mark.parametrize("numels", [(5, 300, 17), (700_000, 600_000, 3)], ids=["small", "large"])
def test_the_compiled_bucket_sum_divides_then_sums(run, numels, room, helper):
    # Each quotient is written straight into the rank's region of the arena, and summed
    # there by the rank's helper thread (or its own); with no room, by shared memory's
    # smaller region (small) or gloo (large), on the rank's own thread.
    import pardist.compile  # noqa: F401  (registers torch.ops.pardist)

    env = {"PARDIST_SHM_HELPER": helper}
    results = run(2, _bucket_sums, numels, room, env=env)
    (a, divisors, sums_a, arena, helped), (b, _, sums_b, _, _) = results
    assert arena == room
    assert helped == (helper == "1") or not room  # (no room: summed by the rank's thread)
    # Each quotient rounds (divisor 7), then one rounding of the sum: not (a + b) / 7.
    want = [x / d + y / d if d != 1 else x + y for x, y, d in zip(a, b, divisors)]
    for sums in (sums_a, sums_b):
        assert all(torch.equal(s, w) for s, w in zip(sums, want))
