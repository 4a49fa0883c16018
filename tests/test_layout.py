"""Gradients laid out like their parameters, and fused optimizers that respect layouts.

torch's fused AdamW / SGD kernels walk parameter, gradient and state memory in
step: a channels_last parameter with a contiguous gradient (or a gradient made
non-contiguous by its backward, such as that of a transposed weight) used to get
a silently wrong update. Checked against plain torch (``.backward()`` and
``torch.optim``) in one process, at 1 and 2 ranks, on both transports, in float64
on both sides (compared up to float64 rounding: numerics.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64
from torch import nn

import pardist

TRANSPORTS = {"shm": None, "gloo": {"PARDIST_SHM": "0"}}
F64 = torch.float64


class Transposed(nn.Module):
    """Uses its weight transposed: the weight's gradient comes back non-contiguous."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)

    def forward(self, x):
        # The backward of .t() transposes the contiguous gradient of the copy.
        return x @ self.weight.t().contiguous()


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),  # (a bias before a batch norm has no
        nn.BatchNorm2d(8),  # gradient but rounding noise, which AdamW would amplify)
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        Transposed(32, 16),
        nn.Tanh(),
        nn.Linear(16, 5),
    )
    return net.double().to(memory_format=torch.channels_last)


def batch(step: int, n: int = 8):
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randn(n, 3, 8, 8, generator=g, dtype=F64)
    x = x.contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 5, (n,), generator=g)


OPTIMIZERS = {
    "sgd": (
        lambda: pardist.optim.sgd(0.1, momentum=0.9, weight_decay=1e-3),
        lambda p: torch.optim.SGD(p, 0.1, momentum=0.9, weight_decay=1e-3),
    ),
    "adamw": (lambda: pardist.optim.adamw(1e-2), lambda p: torch.optim.AdamW(p, 1e-2)),
}


def one_process(opt_name: str, steps: int = 3):
    net = model()
    opt = OPTIMIZERS[opt_name][1](net.parameters())
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in net.named_parameters()}


def dense(g, p) -> bool:
    """The gradient walks memory like its parameter (strides of size-1 dims aside)."""
    return all(n == 1 or a == b for n, a, b in zip(p.shape, g.stride(), p.stride()))


def on_ranks(opt_name: str, steps: int = 3, shard: bool = False, accumulate: int = 1):
    apply, params, buffers = pardist.functional(model())
    assert any(not p.is_contiguous() for p in params.values())  # channels_last weights
    opt = OPTIMIZERS[opt_name][0]()
    if shard:
        opt = pardist.optim.sharded(opt)
    state = opt.init(params)
    layouts = []

    def loss_fn(p, b, batch):
        out, nb = apply(p, b, batch[0])
        return F.cross_entropy(out, batch[1]), nb

    @pardist.data_parallel
    def step(p, b, state, batch):
        carry = 1 if accumulate > 1 else None  # the buffers after the last micro-batch
        (_, nb), g = pardist.value_and_grad(
            loss_fn, has_aux=True, accumulate=accumulate, carry=carry
        )(p, b, batch)
        if not shard:
            layouts.append(all(dense(g[k], p[k]) for k in g))
        p, state = opt.update(g, state, p)
        return p, nb, state

    r, w = pardist.rank(), pardist.world_size()
    for s in range(steps):
        x, y = batch(s)
        params, buffers, state = step(params, buffers, state, (x.chunk(w)[r], y.chunk(w)[r]))
    same = all(params[k].stride() == v.stride() for k, v in model().named_parameters())
    return params, layouts, same


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_world_size_one(world1, opt_name):
    want = one_process(opt_name)
    got, layouts, same = on_ranks(opt_name)  # autograd.grad's own gradients
    assert all(layouts) and same  # gradients and new parameters keep the layout
    assert_close64(got, want, "parameters")
    # Accumulated in the reducer's buckets (micro-batches change batch norm's
    # statistics, so only the layout is compared here).
    _, layouts, same = on_ranks(opt_name, accumulate=2)
    assert all(layouts) and same


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_two_ranks(run, opt_name, transport):
    want = one_process(opt_name)
    for got, layouts, same in run(2, on_ranks, opt_name, env=TRANSPORTS[transport]):
        assert all(layouts) and same
        assert_close64(got, want, "parameters")


def test_sharded_optimizer_keeps_layouts(run):
    want = one_process("adamw")
    for got, _, same in run(2, on_ranks, "adamw", 3, True):
        assert same  # the all-gathered parameters are channels_last again
        assert_close64(got, want, "parameters")


def test_grad_outside_a_step_has_the_parameters_layout():
    w, m = torch.randn(4, 6), torch.randn(6, 4)
    f = lambda p: (p["w"].t() * m).sum()  # noqa: E731
    assert torch.func.grad(f)({"w": w})["w"].stride() == (1, 4)  # what torch.func gives
    for g in (pardist.grad(f)({"w": w}), pardist.value_and_grad(f)({"w": w})[1]):
        assert g["w"].stride() == (6, 1) and torch.equal(g["w"], m.t())
    cl = w.view(1, 4, 2, 3).contiguous(memory_format=torch.channels_last)
    g = pardist.grad(lambda c: c.permute(0, 2, 3, 1).sin().sum())(cl)
    assert g.stride() == cl.stride()


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_optimizers_with_mismatched_layouts(opt_name):
    # Gradients and state in any layout: the update is torch's, element for element.
    # The state starts contiguous and non-zero (as one loaded from a checkpoint).
    torch.manual_seed(0)
    p = torch.randn(4, 3, 2, 5, dtype=F64)
    grads = [
        torch.randn(4, 3, 2, 5, dtype=F64),
        torch.randn(5, 2, 3, 4, dtype=F64).permute(3, 2, 1, 0),
    ] * 2
    reference = p.clone().requires_grad_()
    torch_opt = OPTIMIZERS[opt_name][1]([reference])
    opt = OPTIMIZERS[opt_name][0]()
    params = {"w": p}
    state = opt.init(params)
    for i, g in enumerate(grads):
        reference.grad = g
        torch_opt.step()
        params, state = opt.update({"w": g}, state, params)
        if i == 0:  # from now on the parameter is channels_last, its state is not
            params = {"w": params["w"].contiguous(memory_format=torch.channels_last)}
        assert_close64(params["w"], reference.detach(), f"step {i}")


def test_the_models_gradients_are_not_laid_out_like_their_parameters_by_themselves():
    # What the tests above would miss if autograd happened to give matching layouts.
    net = model()
    x, y = batch(0)
    params = [p for p in net.parameters()]
    grads = torch.autograd.grad(F.cross_entropy(net(x), y), params)
    assert not all(dense(g, p) for g, p in zip(grads, params))
