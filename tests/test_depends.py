"""A loss that does not depend on the params it differentiates is an error (model(x) in a step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64
from torch import nn

import pardist


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(12, 8, generator=g), torch.randint(0, 4, (12,), generator=g)


def _module_called_directly():
    net = _net()
    apply, params, buffers = pardist.functional(net)

    def my_loss(p, x, y):
        return F.cross_entropy(net(x), y)  # the mistake: the module, not apply(p, ...)

    @pardist.data_parallel
    def step(p, xy):
        return pardist.grad(my_loss)(p, *xy)

    x, y = _batch()
    rank, world = pardist.rank(), pardist.world_size()
    try:
        step(params, (x.chunk(world)[rank], y.chunk(world)[rank]))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("nprocs", [1, 2])
def test_model_called_instead_of_apply_raises_on_the_first_call(run, nprocs):
    for message in run(nprocs, _module_called_directly):
        assert message is not None, "no error: the step silently trained nothing"
        assert "pardist.grad(my_loss)" in message
        assert "does not depend on the params it differentiates" in message
        assert "apply" in message and "pardist.functional" in message


def _zero_for_one_leaf():
    net = _net().double()  # compared with torch.func in float64, up to its rounding
    apply, params, buffers = pardist.functional(net)
    params = {**params, "unused": torch.ones(3), "times_zero": torch.ones(4)}
    model = {k: v for k, v in params.items() if k not in ("unused", "times_zero")}

    def loss(p, x, y):
        q = {k: v for k, v in p.items() if k not in ("unused", "times_zero")}
        out = apply(q, buffers, x)[0] + 0.0 * p["times_zero"]
        return F.cross_entropy(out, y)

    @pardist.data_parallel
    def step(p, xy):
        return pardist.grad(loss)(p, *xy)

    x, y = _batch()
    x = x.double()
    rank, world = pardist.rank(), pardist.world_size()
    g = step(params, (x.chunk(world)[rank], y.chunk(world)[rank]))
    reference = torch.func.grad(
        lambda m: F.cross_entropy(torch.func.functional_call(net, m, x), y)
    )(model)
    return g, reference


@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_zero_gradient_for_some_leaves_does_not_raise(run, nprocs):
    for g, reference in run(nprocs, _zero_for_one_leaf):
        assert torch.equal(g["unused"], torch.zeros(3))
        assert torch.equal(g["times_zero"], torch.zeros(4))
        assert_close64({k: g[k] for k in reference}, reference, "gradients")
