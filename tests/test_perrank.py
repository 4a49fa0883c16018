"""Every rank's loss and rows, carried in the buckets: full-precision loss, NaN report, row mean.

References are plain torch in one process: the whole global batch (for the
row-weighted mean), or the mean of each rank's own mean loss (DDP's convention,
for the default).
"""

from __future__ import annotations

import warnings

import helpers
import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64

import pardist

F64 = torch.float64  # both sides compute in float64, compared up to its rounding (numerics.py)
TRANSPORTS = [pytest.param({}, id="shm"), pytest.param({"PARDIST_SHM": "0"}, id="gloo")]


def _loss_fn(apply):
    return lambda p, x, y: F.cross_entropy(apply(p, {}, x)[0], y)


def _compressed_loss(compression):
    apply, params, _ = pardist.functional(helpers.mlp().double())
    x, y = helpers.global_batch(0, "mlp", dtype=F64)
    r = pardist.rank()
    step = pardist.data_parallel(
        lambda p, b: pardist.value_and_grad(_loss_fn(apply))(p, *b)[0], compression=compression
    )
    return step(params, (x.chunk(2)[r], y.chunk(2)[r]))


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_the_loss_keeps_full_precision_under_compression(run, compression):
    model = helpers.mlp().double()
    x, y = helpers.global_batch(0, "mlp", dtype=F64)
    # the mean of the two ranks' losses, as one process computes them
    halves = [F.cross_entropy(model(xs), ys) for xs, ys in zip(x.chunk(2), y.chunk(2))]
    expected = (halves[0] + halves[1]) / 2
    full = run(2, _compressed_loss, None)
    for loss, uncompressed in zip(run(2, _compressed_loss, compression), full):
        assert loss.dtype == F64
        assert torch.equal(loss, uncompressed)  # not rounded to the wire's 8 or 11 bits
        assert_close64(loss, expected, "loss")  # nor to float32's 24


def _nonfinite(scaled: bool):
    apply, params, _ = pardist.functional(helpers.mlp())
    scaler = pardist.amp.dynamic_loss_scale()
    x, y = helpers.global_batch(0, "mlp")
    r = pardist.rank()
    x, y = x.chunk(2)[r].clone(), y.chunk(2)[r]
    if r == 1:
        x[0, 0] = float("nan")  # one bad row on rank 1 only

    @pardist.data_parallel()
    def step(params, ls, batch):
        f = _loss_fn(apply)
        loss_fn = (lambda p, x, y: scaler.scale(f(p, x, y), ls)) if scaled else f
        loss, grads = pardist.value_and_grad(loss_fn)(params, *batch)
        return loss, scaler.unscale(grads, ls)[1]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loss, finite = step(params, scaler.init(), (x, y))
            outcome = f"loss {float(loss)}, finite {finite}"
        except FloatingPointError as e:
            outcome = str(e)
    return outcome, [
        (str(w.message), w.filename)
        for w in caught
        if issubclass(w.category, pardist.NonFiniteLossWarning)
    ]


def test_a_nan_loss_on_one_rank_is_reported_naming_it(run):
    for outcome, warned in run(2, _nonfinite, False):
        assert outcome == "loss nan, finite False"  # the step itself goes on, as DDP's
        assert len(warned) == 1, warned
        message, filename = warned[0]
        assert "the loss is not finite on 1 of 2 rank(s) of axis 'gpu': rank 1: nan" in message
        assert "rank 0" not in message
        assert "PARDIST_DEBUG=1 raises" in message
        assert filename.endswith("test_perrank.py")  # the user's line, not pardist's
    for outcome, warned in run(2, _nonfinite, False, env={"PARDIST_DEBUG": "1"}):
        assert outcome.startswith("pardist.value_and_grad(<lambda>): the loss is not finite")
        assert "rank 1: nan" in outcome and not warned  # raised on every rank, no hang


def test_a_dynamic_loss_scale_skips_nonfinite_steps_unreported(run):
    for outcome, warned in run(2, _nonfinite, True, env={"PARDIST_DEBUG": "1"}):
        assert outcome == "loss nan, finite False"  # skipped by the scale, not raised
        assert not warned


# Rows on each rank, step by step: totals that change (12, 9, 12, 7) and an empty shard.
COUNTS = [(8, 4), (5, 4), (6, 6), (3, 9), (0, 7)]


def _weighted_loss(apply):
    """Cross-entropy with a learned weight (Kendall et al.'s uncertainty weighting): its
    gradient in ``s`` is nan on an empty shard, whose mean loss is nan."""

    def loss(p, x, y):
        ce = F.cross_entropy(apply({k: v for k, v in p.items() if k != "s"}, {}, x)[0], y)
        return ce * torch.exp(-p["s"]) + p["s"]

    return loss


def _uneven(mean: str, counts: list, sharded: bool = False):
    apply, params, _ = pardist.functional(helpers.mlp().double())
    params["s"] = torch.tensor(0.1, dtype=F64)
    opt = pardist.optim.sgd(0.1)
    opt = pardist.optim.sharded(opt) if sharded else opt

    @pardist.data_parallel()
    def step(params, opt_state, batch):
        loss, grads = pardist.value_and_grad(_weighted_loss(apply), mean=mean)(params, *batch)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, opt_state, loss

    state, r, losses = opt.init(params), pardist.rank(), []
    for s, c in enumerate(counts):
        x, y = helpers.global_batch(s, "mlp", sum(c), dtype=F64)
        start = sum(c[:r])
        batch = (x[start : start + c[r]], y[start : start + c[r]])
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, losses


def _torch_training(counts: list, mean: str):
    model = helpers.mlp().double()
    s = torch.nn.Parameter(torch.tensor(0.1, dtype=F64))
    opt = torch.optim.SGD([*model.parameters(), s], lr=0.1)
    losses = []

    def loss_fn(x, y):
        return F.cross_entropy(model(x), y) * torch.exp(-s) + s

    for step, c in enumerate(counts):
        x, y = helpers.global_batch(step, "mlp", sum(c), dtype=F64)
        opt.zero_grad()
        if mean == "rows":  # one process on the whole global batch
            loss = loss_fn(x, y)
        else:  # each rank's mean loss, averaged over ranks (DDP)
            loss = sum(loss_fn(xs, ys) for xs, ys in zip(x.split(c), y.split(c))) / len(c)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {**{k: v.detach() for k, v in model.named_parameters()}, "s": s.detach()}, losses


@pytest.mark.parametrize("env", TRANSPORTS)
def test_row_weighted_mean_of_uneven_shards_equals_one_process_on_the_whole_batch(run, env):
    params1, losses1 = _torch_training(COUNTS, "rows")
    results = run(2, _uneven, "rows", COUNTS, env=env)
    for params, losses in results:
        assert_close64(params, params1, "parameters")
        assert_close64(losses, losses1, "losses")
    assert all(torch.equal(results[0][0][k], results[1][0][k]) for k in params1)


def test_row_weighted_mean_with_a_sharded_optimizer(run):
    params1, losses1 = _torch_training(COUNTS[:4], "rows")
    for params, losses in run(2, _uneven, "rows", COUNTS[:4], True):
        assert_close64(params, params1, "parameters")  # sharded ones as full tensors
        assert_close64(losses, losses1, "losses")


def test_default_mean_over_ranks_is_ddps(run):
    counts = COUNTS[:4]  # no empty shard: its nan mean would spoil DDP's convention
    params1, losses1 = _torch_training(counts, "ranks")
    for params, losses in run(2, _uneven, "ranks", counts):
        assert_close64(params, params1, "parameters")
        assert_close64(losses, losses1, "losses")


def _empty_under_ranks():
    try:
        _uneven("ranks", COUNTS)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("env", TRANSPORTS)
def test_an_empty_shard_under_mean_ranks_stops_every_rank_naming_mean_rows(run, env):
    # Its mean is 0/0: the loss would be nan and the gradient half the other rank's,
    # under a warning that every rank's gradients were non-finite (they were not).
    for message in run(2, _empty_under_ranks, env=env):
        assert "rank(s) [0] of axis 'gpu'" in message and "[0, 7] rows" in message, message
        assert "mean='rows'" in message, message


def test_equal_shards_give_the_same_bits_either_way(run):
    equal = [(4, 4, 4)] * 3  # three ranks: a third is not exact in binary
    by_rows = run(3, _uneven, "rows", equal)
    by_ranks = run(3, _uneven, "ranks", equal)
    for (p_rows, l_rows), (p_ranks, l_ranks) in zip(by_rows, by_ranks):
        assert l_rows == l_ranks
        assert all(torch.equal(p_rows[k], p_ranks[k]) for k in p_rows)


def test_mean_option_errors(world1):
    with pytest.raises(ValueError, match=r"mean='token'; use 'ranks' .*, 'rows' .* or 'tokens'"):
        pardist.grad(lambda w: w.sum(), mean="token")


def _cubic(w, x):
    return (x @ w).pow(3).mean()


def _nested_rows():
    counts, r = (3, 1), pardist.rank()
    x = torch.arange(8.0, dtype=F64).reshape(4, 2) / 8
    mine = x[sum(counts[:r]) : sum(counts[: r + 1])]
    inner = lambda w, x: pardist.grad(_cubic, mean="rows")(w, x).sum()  # noqa: E731
    step = pardist.data_parallel(lambda w, x: pardist.value_and_grad(inner)(w, x))
    return step(torch.tensor([0.5, -1.0], dtype=F64), mine)


def test_row_weighted_mean_nested_in_another_gradient(run):
    # The inner mean is differentiated once more: rows must be weighed once, not twice.
    w, x = torch.tensor([0.5, -1.0], dtype=F64), torch.arange(8.0, dtype=F64).reshape(4, 2) / 8
    outer = lambda w: torch.func.grad(_cubic)(w, x).sum()  # noqa: E731
    for value, g in run(2, _nested_rows):
        assert_close64(value, outer(w), "value")
        assert_close64(g, torch.func.grad(outer)(w), "gradient")
