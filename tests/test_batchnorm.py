"""Cross-replica batch norm for every module that normalises with batch statistics.

N ranks against plain torch in one process on the concatenated batch, on both
transports: nn.BatchNorm, a subclass with its own forward (timm's BatchNormAct2d
pattern), modules calling F.batch_norm / torch.batch_norm, nn.SyncBatchNorm, empty
shards, large means, bf16. What cannot be made cross-replica raises, naming the
module. Outside a step and in eval mode, ``apply`` is the module itself. The
models run in float64 on both sides, compared up to float64 rounding (numerics.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64
from torch import nn

import pardist

TRANSPORTS = {"shm": None, "gloo": {"PARDIST_SHM": "0"}}


class NormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d pattern: batch norm, then an activation, in its own forward."""

    def forward(self, x):
        return F.silu(super().forward(x))


class Direct(nn.Module):
    """Normalises with F.batch_norm and torch.batch_norm itself, with its own buffers."""

    def __init__(self, c: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(c))
        self.register_buffer("var", torch.ones(c))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, c))

    def forward(self, x):
        x = F.batch_norm(x, self.mean, self.var, self.scale, None, self.training, 0.3, 1e-3)
        return torch.batch_norm(x, None, None, None, None, True, 0.0, 1e-5, False)


def net(norm=NormAct, channels_last: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        norm(6),
        nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=2),
        Direct(6),
        nn.BatchNorm2d(6, momentum=None),  # cumulative average
        nn.BatchNorm2d(6, affine=False, track_running_stats=False),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 5),
        nn.BatchNorm1d(5),
    )
    model = model.double()
    return model.to(memory_format=torch.channels_last) if channels_last else model


def data(n: int = 12):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64) * 2 + 0.5
    return x, torch.randint(0, 5, (n,), generator=g)


def one_process(model: nn.Module, x, y, steps: int = 2):
    """Plain torch: loss, parameter gradients and input gradients of the first step;
    buffers after ``steps`` forward passes."""
    x = x.clone().requires_grad_()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    for _ in range(steps - 1):
        model(x)
    return float(loss), grads, x.grad, {k: b.clone() for k, b in model.named_buffers()}


def on_ranks(sizes, norm=NormAct, channels_last=False, steps: int = 2, mean="ranks"):
    """pardist, rank r holding ``sizes[r]`` rows of the same batch; ``mean='rows'``: the
    loss is each rank's own mean and pardist weighs the ranks by their rows."""
    apply, params, buffers = pardist.functional(net(norm, channels_last))
    x, y = data(sum(sizes))
    r = pardist.rank()
    x, y = x.split(sizes)[r], y.split(sizes)[r]

    def loss_fn(p, b, x, y):
        out, nb = apply(p, b, x)
        if mean == "rows":
            return F.cross_entropy(out, y), nb
        # the global mean: this rank's sum over the global count, summed over ranks
        return F.cross_entropy(out, y, reduction="sum") * len(sizes) / sum(sizes), nb

    P = pardist.P
    specs = dict(in_specs=(P(), P(), P("gpu"), P("gpu")), out_specs=(P(), P(), P("gpu"), P()))

    @pardist.data_parallel(**specs)
    def step(p, b, x, y):
        vg = pardist.value_and_grad(loss_fn, (0, 2), has_aux=True, mean=mean)
        (loss, nb), (g, gx) = vg(p, b, x, y)
        return loss, g, gx, nb

    loss, grads, gx, new = step(params, buffers, x, y)
    for _ in range(steps - 1):
        _, _, _, new = step(params, new, x, y)
    return float(loss), {k: v.clone() for k, v in grads.items()}, gx.clone(), new


def check(results, sizes, norm=NormAct, channels_last=False, inputs=True):
    x, y = data(sum(sizes))
    loss1, grads1, gx1, buffers1 = one_process(net(norm, channels_last), x, y)
    for r, (loss, grads, gx, buffers) in enumerate(results):
        assert_close64(loss, loss1, "loss")
        assert_close64(grads, grads1, "parameter gradients")
        # an input's gradient is its rows of one process's (the loss averaged over ranks)
        if inputs:
            assert_close64(gx, gx1.split(sizes)[r], f"rank {r}'s input gradient")
        assert_close64(buffers, buffers1, "buffers")
    for other in results[1:]:  # replicas bit-identical
        assert all(torch.equal(other[1][k], results[0][1][k]) for k in grads1)
        assert all(torch.equal(other[3][k], results[0][3][k]) for k in buffers1)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_every_kind_of_batch_norm_equals_one_process(run, transport):
    sizes = [6, 6]
    check(run(2, on_ranks, sizes, env=TRANSPORTS[transport]), sizes)


@pytest.mark.parametrize("sizes", [[5, 4, 3], [7, 0, 5], [0, 12]])
def test_uneven_and_empty_shards(run, sizes):
    # An empty shard contributes nothing (it used to make every rank NaN).
    check(run(len(sizes), on_ranks, sizes), sizes)


@pytest.mark.parametrize("sizes", [[8, 4], [2, 4, 6]])
def test_row_weighted_mean_with_uneven_shards(run, sizes):
    # mean='rows' weighs each rank's backward by its rows, so that batch norm's
    # cross-rank backward sums gradients of one objective (it was 7.8% off).
    check(run(len(sizes), on_ranks, sizes, mean="rows"), sizes)


def test_channels_last_and_sync_batchnorm(run):
    # nn.SyncBatchNorm (models converted for DDP) synchronises over the step's axis.
    sizes = [6, 6]
    got = run(2, on_ranks, sizes, nn.SyncBatchNorm, True)
    check(got, sizes, nn.SyncBatchNorm, True)


def _every_rank_empty(rows: int):
    apply, params, buffers = pardist.functional(nn.BatchNorm1d(3))
    step = pardist.data_parallel(lambda p, b, x: apply(p, b, x)[0])
    try:
        step(params, buffers, torch.ones(rows if pardist.rank() == 0 else 0, 3))
    except ValueError as e:
        return str(e)


def test_too_few_rows_in_all_is_an_error(run):
    for rows in (0, 1):
        for msg in run(2, _every_rank_empty, rows):
            assert f"the step's ranks hold {rows} in all" in msg
            assert "more than 1 value per channel" in msg and "pardist.functional" in msg


def test_a_single_row_per_rank_is_enough(run):
    # torch refuses 1 row when training; 2 ranks of 1 row are a batch of 2. With 2 rows
    # every normalised value is about +-1 and many gradients are rounding noise (a bias's
    # is exactly 0 in exact arithmetic): in float32 that noise is the CPU's kernels', ~1e-7
    # of the largest gradient, and no tolerance on it holds everywhere. In float64 it is
    # ~1e-16 of it, far below the tolerance (numerics.py).
    sizes = [1, 1]
    check(run(2, on_ranks, sizes), sizes)


def _large_mean(dtype):
    bn = nn.BatchNorm1d(3).to(dtype)
    apply, params, buffers = pardist.functional(bn)
    g = torch.Generator().manual_seed(1)
    # 1e4 plus multiples of 1/16 up to 1/2: every partial sum of up to 64 of them is a
    # multiple of 1/16 below 2^20, exact in float32 (see the test)
    x = 1e4 + torch.randint(-8, 9, (64, 3), generator=g).double() / 16
    step = pardist.data_parallel(
        lambda p, b, x: apply(p, b, x.to(dtype)), out_specs=(pardist.P("gpu"), None)
    )
    out, new = step(params, buffers, x.chunk(2)[pardist.rank()])
    return out.dtype, new["running_var"], x.var(0)


def test_statistics_keep_their_precision_when_the_mean_is_large(run):
    # Per rank mean 1e4, variance ~0.1: a sum of squares in float32 would lose it all
    # (its terms are ~1e8, spaced 8 apart). This is about float32 inputs, so it runs in
    # float32, with a bound from the sizes. The values are chosen so that torch's float32
    # statistics of each shard are exact in any summation order (its sums are multiples of
    # 1/16 below 2^20, the mean a multiple of 2^-9, the squared deviations multiples of
    # 2^-18 below 1, their sum below 2^5), or within (32 + 3) 2^-24 var of it for a
    # Welford kernel. Combined as sums of squares in float64 (~1e8 a value, a handful of
    # steps each off by 2^-53 of it): under 16 * 2^-53 * 1e8 more. The running variance
    # (~0.91) takes a tenth of the unbiased variance (64/63 of the biased one) and is
    # rounded twice in float32 (2^-25 each, 2^-23 with room).
    for dtype, running_var, var in run(2, _large_mean, torch.float32):
        assert dtype == running_var.dtype == torch.float32
        bound = 0.1 * 64 / 63 * (35 * 2**-24 * var + 16 * 2**-53 * 1e8) + 2**-23
        err = (running_var.double() - (0.9 + 0.1 * var)).abs()
        assert (err <= bound).all(), (err, bound)


class _Raw(nn.BatchNorm1d):
    def forward(self, x):
        return torch.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)[0]


class _ByHand(nn.BatchNorm1d):
    def forward(self, x):
        return (x - x.mean(0)) / (x.var(0, unbiased=False) + self.eps).sqrt()


class _OwnSync(nn.SyncBatchNorm):
    def forward(self, x):
        return super().forward(x).relu()


def _refused(kind: str):
    layer = {"raw": _Raw, "hand": _ByHand, "sync": _OwnSync}[kind](3)
    apply, params, buffers = pardist.functional(nn.Sequential(nn.Linear(3, 3), layer))
    step = pardist.data_parallel(lambda p, b, x: apply(p, b, x)[0].sum())
    try:
        step(params, buffers, torch.randn(4, 3))
    except RuntimeError as e:
        return str(e)


@pytest.mark.parametrize(
    "kind, says",
    [
        ("raw", "module '1' (_Raw) calls native_batch_norm directly"),
        ("hand", "module '1' (_ByHand) is a batch norm whose forward did not call F.batch_norm"),
        ("sync", "module '1' is a _OwnSync, a subclass of nn.SyncBatchNorm with its own forward"),
    ],
)
def test_what_cannot_be_synchronised_exactly_raises(run, kind, says):
    for msg in run(2, _refused, kind):
        assert msg.startswith("pardist.functional(Sequential): ")
        assert says in msg and "sync_bn=False" in msg


def test_apply_is_the_module_outside_a_step_and_in_eval(world1):
    x, _ = data()
    for norm in (NormAct, nn.BatchNorm2d):
        module, copy = net(norm), net(norm)
        apply, params, buffers = pardist.functional(copy)
        for train in (True, False):
            module.train(train)
            out, new = apply(params, buffers, x, train=train)
            assert torch.equal(out, module(x))
            assert all(torch.equal(new[k], v) for k, v in module.named_buffers())
            buffers = new

        @pardist.data_parallel  # a step at world size 1: no interception either
        def step(p, b, x, apply=apply):
            return apply(p, b, x)

        module.train()
        assert torch.equal(step(params, buffers, x)[0], module(x))


def test_convert_batchnorm_refuses_to_drop_a_forward():
    with pytest.raises(TypeError, match=r"module '1' is a NormAct with its own forward"):
        pardist.convert_batchnorm(net())
    converted = pardist.convert_batchnorm(nn.Sequential(nn.BatchNorm2d(3), nn.SyncBatchNorm(3)))
    assert all(isinstance(m, pardist.CrossReplicaBatchNorm) for m in converted)


def _cross_replica_module():
    # CrossReplicaBatchNorm in a model run without pardist.functional.
    torch.manual_seed(0)
    model = pardist.convert_batchnorm(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double())
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    @pardist.data_parallel
    def step(p, x):
        return pardist.grad(lambda p, x: torch.func.functional_call(model, p, x).square().mean())(
            p, x
        )

    return step(params, x.chunk(2)[pardist.rank()])


def test_cross_replica_batchnorm_module(run):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    model(x).square().mean().backward()
    for grads in run(2, _cross_replica_module):
        assert_close64(grads, {k: p.grad for k, p in model.named_parameters()}, "gradients")


class _Helper(nn.Module):
    """Batch statistics from a function, no batch-norm module anywhere."""

    def forward(self, x):
        return torch.relu(F.batch_norm(x, None, None, training=True))


def _helper_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), _Helper(), nn.Linear(6, 2)).double()


def _helper_steps(steps: int = 3):
    apply, params, _ = pardist.functional(_helper_net())
    g = torch.Generator().manual_seed(5)
    x, y = (torch.randn(8, n, generator=g, dtype=torch.float64) for n in (4, 2))
    r = pardist.rank()

    @pardist.data_parallel
    def step(p, batch):
        loss = lambda p, x, y: F.mse_loss(apply(p, {}, x)[0], y)  # noqa: E731
        g = pardist.grad(loss)(p, *batch)
        return {k: v - 0.1 * g[k] for k, v in p.items()}

    for _ in range(steps):  # the first call decides whether batch norm is intercepted
        params = step(params, (x[4 * r : 4 * r + 4], y[4 * r : 4 * r + 4]))
    return params


def test_batch_norm_called_from_a_function_stays_cross_replica_after_the_first_call(run):
    model = _helper_net()
    g = torch.Generator().manual_seed(5)
    x, y = (torch.randn(8, n, generator=g, dtype=torch.float64) for n in (4, 2))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    for params in run(2, _helper_steps):
        assert_close64(params, {k: v.detach() for k, v in model.named_parameters()}, "params")
