"""pardist.grad / value_and_grad: torch.func outside a step, the gradient mean inside."""

from __future__ import annotations

import helpers
import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64

import pardist

F64 = torch.float64  # the gradients compared here are float64 (numerics.py)


def loss(params, x, y):
    h = torch.tanh(x @ params["w1"]) @ params["w2"]
    return F.cross_entropy(h, y), h


W_SHAPES = {"w1": (8, 5), "w2": (5, 4)}


def data(n=24):
    g = torch.Generator().manual_seed(3)
    params = {k: torch.randn(shape, generator=g, dtype=F64) for k, shape in W_SHAPES.items()}
    return params, torch.randn(n, 8, generator=g, dtype=F64), torch.randint(0, 4, (n,), generator=g)


def test_outside_a_step_equals_torch_func():
    params, x, y = data()
    ours = pardist.grad(loss, has_aux=True)(params, x, y)
    theirs = torch.func.grad(loss, has_aux=True)(params, x, y)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    (value, aux), g = pardist.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x, y)
    g2, (value2, aux2) = torch.func.grad_and_value(loss, argnums=(0, 1), has_aux=True)(params, x, y)
    torch.testing.assert_close((value, aux, g), (value2, aux2, g2), rtol=0, atol=0)


def test_accumulation_equals_one_pass_over_the_batch(world1):
    params, x, y = data()
    f = lambda p, x, y: loss(p, x, y)[0]  # noqa: E731
    whole = pardist.value_and_grad(f)(params, x, y)
    batch = (x, y)
    g = lambda p, b: pardist.value_and_grad(  # noqa: E731
        f, accumulate=4, batch_argnums=(1, 2)
    )(p, *b)
    for accumulated in (
        pardist.value_and_grad(f, accumulate=4, batch_argnums=(1, 2))(params, x, y),
        pardist.data_parallel(g)(params, batch),
    ):
        assert_close64(accumulated, whole, "accumulated")
    (_, aux), _ = pardist.value_and_grad(loss, has_aux=True, accumulate=3, batch_argnums=(1, 2))(
        params, x, y
    )
    assert aux.shape == (3, 8, 4)  # aux is stacked per micro-batch
    with pytest.raises(ValueError, match=r"accumulate=5 cannot split args\[1\] of shape \(24, 8\)"):
        pardist.grad(f, accumulate=5, batch_argnums=(1, 2))(params, x, y)


def _accumulate_in_step(k):
    params, x, y = data()
    mine = (x.chunk(2)[pardist.rank()], y.chunk(2)[pardist.rank()])
    f = lambda p, b: loss(p, *b)[0]  # noqa: E731
    return pardist.data_parallel(lambda p, b: pardist.value_and_grad(f, accumulate=k)(p, b))(
        params, mine
    )


def test_accumulation_with_ranks_equals_one_process(run):
    params, x, y = data()
    value, g = pardist.value_and_grad(lambda p: loss(p, x, y)[0])(params)
    for v2, g2 in run(2, _accumulate_in_step, 3):
        assert_close64((v2, g2), (value, g), "value and gradients")


def _local_and_unused():
    r = pardist.rank()
    w, u = torch.ones(2), torch.ones(2)
    x = torch.full((3, 2), float(r + 1))

    def f(w, u, x):
        # u is used on rank 0 only: it must still get the mean (g0 + 0) / 2 on both
        return (x * w).sum() + (u.sum() if r == 0 else 0.0)

    P = pardist.P  # x's gradient is its shard's: it varies over 'gpu'
    step = pardist.data_parallel(
        lambda w, u, x: pardist.grad(f, argnums=(0, 1, 2))(w, u, x),
        out_specs=(P(), P(), P("gpu")),
    )
    return step(w, u, x)


def test_sharded_inputs_get_the_global_gradient_and_unused_get_the_mean(run):
    for gw, gu, gx in run(2, _local_and_unused):
        assert gw.tolist() == [4.5, 4.5]  # mean of 3*1 and 3*2
        assert gu.tolist() == [0.5, 0.5]
        # d/dx of the loss averaged over the ranks (one process's on the global batch)
        assert gx.tolist() == [[0.5, 0.5]] * 3


def _kept_gradients_survive_the_next_step():
    params, x, y = data()
    step = pardist.data_parallel(lambda p, b: pardist.grad(lambda p, b: loss(p, *b)[0])(p, b))
    mine = (x.chunk(2)[pardist.rank()], y.chunk(2)[pardist.rank()])
    first = step(params, mine)
    saved = {k: v.clone() for k, v in first.items()}
    second = step(params, (mine[0] * 2, mine[1]))
    third = step(params, mine)
    return (
        [torch.equal(first[k], saved[k]) for k in first],
        [torch.equal(third[k], saved[k]) for k in first],
        any(not torch.equal(second[k], saved[k]) for k in first),
    )


def test_gradient_buffers_are_never_reused_while_held(run):
    for kept, repeated, differs in run(2, _kept_gradients_survive_the_next_step):
        assert all(kept) and all(repeated) and differs


def _nested():
    w, x = torch.tensor([0.5, -1.0], dtype=F64), torch.arange(8.0, dtype=F64).reshape(4, 2) / 8
    mine = x.chunk(2)[pardist.rank()]
    f = lambda w, x: (x @ w).pow(3).mean()  # noqa: E731
    step = pardist.data_parallel(
        lambda w, x: pardist.grad(lambda w: pardist.grad(f)(w, x).sum())(w)
    )
    return step(w, mine)


def test_nested_transforms_fall_back_to_a_differentiable_mean(run):
    w, x = torch.tensor([0.5, -1.0], dtype=F64), torch.arange(8.0, dtype=F64).reshape(4, 2) / 8
    f = lambda w, x: (x @ w).pow(3).mean()  # noqa: E731
    expected = torch.func.grad(lambda w: torch.func.grad(f)(w, x).sum())(w)
    for got in run(2, _nested):
        assert_close64(got, expected, "second derivative")


def _compressed(compression):
    """The step's (mean) gradients, and this rank's own gradient, in float32."""
    apply, params, _ = pardist.functional(helpers.mlp())
    x, y = helpers.global_batch(0, "mlp")
    r = pardist.rank()
    loss = lambda p, x, y: F.cross_entropy(apply(p, {}, x)[0], y)  # noqa: E731
    step = pardist.data_parallel(lambda p, b: pardist.grad(loss)(p, *b), compression=compression)
    mine = (x.chunk(2)[r], y.chunk(2)[r])
    return step(params, mine), torch.func.grad(loss)(params, *mine)


# Unit roundoff of the wire's dtype: 8 and 11 significant bits.
ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compressed_communication_is_close_to_full_precision(run, compression):
    full = run(2, _compressed, None)
    mean, local = full[0][0], [g for _, g in full]
    u = ROUNDOFF[compression]
    for got, _ in run(2, _compressed, compression):
        for k in mean:
            # The bound, element by element: each rank's half gradient is rounded to the
            # wire's dtype (u of it), their sum is rounded once more (u of it): at most
            # (2u + u^2) (|g0| + |g1|) / 2. 2.1u also covers the float32 rounding of the
            # uncompressed mean (2^-24) and of recomputing g0, g1 here; fp16 adds 2^-25 a
            # rounding below its smallest normal number (2^-14), where its steps are 2^-24.
            terms = (local[0][k].abs() + local[1][k].abs()) / 2
            bound = 2.1 * u * terms + (2.0**-24 if compression == "fp16" else 0.0)
            err = (got[k] - mean[k]).abs()
            assert (err <= bound).all(), (k, float((err - bound).max()))
            assert err.max() > 0, k  # the wire's rounding shows: it was compressed
            assert got[k].dtype == torch.float32


def test_errors():
    params, x, y = data()
    with pytest.raises(
        ValueError, match=r"f must return a floating-point scalar tensor.*shape \(12, 4\)"
    ):
        pardist.value_and_grad(
            lambda p, x, y: loss(p, x, y)[1], accumulate=2, batch_argnums=(1, 2)
        )(params, x, y)
    with pytest.raises(TypeError, match=r"args\[0\] has dtype torch.int64"):
        pardist.grad(lambda n, x: x.sum(), accumulate=2, batch_argnums=1)(
            torch.ones(2, dtype=torch.long), x
        )
    with pytest.raises(ValueError, match="argnums=3 does not name arguments"):
        pardist.grad(lambda a: a.sum(), argnums=3, accumulate=2)(x)
