"""pardist.optim: step for step equal to torch.optim, pure unless donated."""

from __future__ import annotations

import math

import pytest
import torch
from numerics import assert_close64

import pardist
from pardist import optim

STEPS = 6
SHAPES = {"w": (5, 3), "b": (3,)}


def problem():
    """float64 parameters and gradients: both optimizers' results are compared up to
    float64 rounding (numerics.py)."""
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    params = {k: torch.randn(shape, generator=g, dtype=f64) for k, shape in SHAPES.items()}
    grads = [
        {k: torch.randn(v.shape, generator=g, dtype=f64) for k, v in params.items()}
        for _ in range(STEPS)
    ]
    return params, grads


def run_torch(make, params, grads, schedule=None):
    tensors = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = make(list(tensors.values()))
    sched = schedule(opt) if schedule else None
    for g in grads:
        for k, p in tensors.items():
            p.grad = g[k].clone()
        opt.step()
        if sched:
            sched.step()
    return {k: v.detach() for k, v in tensors.items()}


def run_ours(opt, params, grads):
    state = opt.init(params)
    for g in grads:
        params, state = opt.update(g, state, params)
    return params, state


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.1, momentum=0.9, nesterov=True),
    dict(lr=0.1, momentum=0.8, dampening=0.3, weight_decay=0.01),
    dict(lr=0.05, momentum=0.9, weight_decay=0.1, maximize=True),
]
IMPLS = [dict(), dict(fused=False), dict(foreach=True)]


@pytest.mark.parametrize("kw", SGD_CASES)
@pytest.mark.parametrize("impl", IMPLS)
def test_sgd_equals_torch(kw, impl):
    params, grads = problem()
    ours, state = run_ours(optim.sgd(**kw, **impl), params, grads)
    theirs = run_torch(lambda p: torch.optim.SGD(p, **kw), params, grads)
    assert_close64(ours, theirs, "parameters")
    assert int(state.count) == STEPS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_steps_half_precision_parameters(dtype, momentum):
    """bfloat16 and float16 parameters of every size move as SGD says, to their rounding.

    torch 2.11-2.13's fused CPU SGD kernel leaves them unchanged wherever it vectorizes
    (every full 16 elements on AVX2): pardist must not use it there. Parameters start at
    0, so every step's update is most of their value. Bound: each step rounds at most 4
    times (the momentum's product and sum, the update's), each by at most u = half an
    ulp relative to a magnitude that SGD on |g| in float64 bounds, over 3 steps: 12 u.
    """
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (40, 10), "b": (33,)}  # full vectors and a tail
    grads = [{k: torch.randn(s, generator=g).to(dtype) for k, s in shapes.items()} for _ in "abc"]
    params = {k: torch.zeros(s, dtype=dtype) for k, s in shapes.items()}
    ours, _ = run_ours(optim.sgd(0.1, momentum=momentum), params, grads)

    def sgd64(grads):  # SGD in float64, torch's formula (the first buffer is the gradient)
        p, buf = {k: torch.zeros(s, dtype=torch.float64) for k, s in shapes.items()}, {}
        for step in grads:
            for k, gk in step.items():
                buf[k] = gk if k not in buf or not momentum else momentum * buf[k] + gk
                p[k] = p[k] - 0.1 * buf[k]
        return p

    want = sgd64([{k: v.double() for k, v in step.items()} for step in grads])
    scale = sgd64([{k: v.double().abs() for k, v in step.items()} for step in grads])
    u = torch.finfo(dtype).eps / 2
    for k in shapes:
        error = (ours[k].double() - want[k]).abs()
        assert (error <= 12 * u * scale[k].abs()).all(), (k, error.max().item())
        assert (ours[k] != 0).float().mean() > 0.9  # (the bound is no vacuous one)


ADAM_CASES = [
    dict(),
    dict(lr=0.01, weight_decay=0.1),
    dict(lr=0.01, amsgrad=True),
    dict(lr=0.02, betas=(0.8, 0.9), eps=1e-6, maximize=True),
]


@pytest.mark.parametrize("kw", ADAM_CASES)
@pytest.mark.parametrize("impl", IMPLS)
def test_adamw_and_adam_equal_torch(kw, impl):
    params, grads = problem()
    ours, _ = run_ours(optim.adamw(**kw, **impl), params, grads)
    theirs = run_torch(lambda p: torch.optim.AdamW(p, **kw), params, grads)
    assert_close64(ours, theirs, "parameters")
    ours, _ = run_ours(optim.adam(**kw, **impl), params, grads)
    theirs = run_torch(lambda p: torch.optim.Adam(p, **kw), params, grads)
    assert_close64(ours, theirs, "parameters")


def test_one_cycle_and_cosine_schedules_equal_torch_schedulers():
    params, grads = problem()
    total = STEPS
    ours, _ = run_ours(optim.adamw(optim.one_cycle(total, 0.05)), params, grads)
    theirs = run_torch(
        lambda p: torch.optim.AdamW(p, lr=0.05),
        params,
        grads,
        lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, 0.05, total_steps=total, cycle_momentum=False
        ),
    )
    assert_close64(ours, theirs, "parameters")
    sched = optim.cosine_decay(0.1, 4, alpha=0.1)
    ours, _ = run_ours(optim.sgd(sched, momentum=0.9), params, grads)
    theirs = run_torch(
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        params,
        grads,
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 4, eta_min=0.01),
    )
    # torch's closed form differs past T_max (it cycles back up): compare the first 4 steps
    ours4, _ = run_ours(optim.sgd(sched, momentum=0.9), params, grads[:4])
    theirs4 = run_torch(
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        params,
        grads[:4],
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 4, eta_min=0.01),
    )
    assert_close64(ours4, theirs4, "parameters")


def test_schedule_shapes():
    warm = optim.linear_warmup(optim.cosine_decay(1.0, 10), 5)
    assert [warm(i) for i in (0, 5)] == [0.0, 1.0] and warm(15) == pytest.approx(0.0)
    flat = optim.flat_cos(100, 0.1)
    assert flat(0) == flat(74) == 0.1 and flat(99) < 0.002
    steps = optim.piecewise_constant([3, 6], [1.0, 0.1, 0.01])
    assert [steps(i) for i in (0, 3, 6, 9)] == [1.0, 0.1, 0.01, 0.01]
    assert math.isclose(optim.one_cycle(100, 1.0, pct_start=0.25)(0), 0.04)


def test_chain_clips_like_clip_grad_norm():
    params, grads = problem()
    ours, _ = run_ours(
        optim.chain(optim.clip_by_global_norm(0.5), optim.sgd(0.1, momentum=0.9)), params, grads
    )
    tensors = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.SGD(list(tensors.values()), lr=0.1, momentum=0.9)
    for g in grads:
        for k, p in tensors.items():
            p.grad = g[k].clone()
        torch.nn.utils.clip_grad_norm_(list(tensors.values()), 0.5)
        opt.step()
    assert_close64(ours, {k: v.detach() for k, v in tensors.items()}, "parameters")
    clipped, _ = optim.clip_by_value(0.1).update({"a": torch.tensor([-1.0, 0.05])}, None)
    assert torch.equal(clipped["a"], torch.tensor([-0.1, 0.05]))


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.sgd(0.1, momentum=0.9),
        lambda: optim.adamw(0.1),
        lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, foreach=True),
        lambda: optim.adam(0.1, weight_decay=0.1, foreach=True, maximize=True),
        lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(0.1, amsgrad=True)),
    ],
)
def test_update_is_pure(make):
    opt = make()
    params, grads = problem()
    state = opt.init(params)
    state = opt.update(grads[0], state, params)[1]  # past the first step's special case
    leaves = lambda t: [
        x for x in pardist.runtime._tree.tree_leaves(t) if isinstance(x, torch.Tensor)
    ]  # noqa: E731
    before = [x.clone() for x in leaves((grads[1], state, params))]
    new_params, new_state = opt.update(grads[1], state, params)
    assert all(torch.equal(a, b) for a, b in zip(before, leaves((grads[1], state, params))))
    assert not any(a is b for a, b in zip(leaves(new_params), leaves(params)))


def test_errors():
    opt = optim.sgd(0.1)
    params = {"w": torch.ones(2)}
    state = opt.init(params)
    with pytest.raises(ValueError, match="grads and params have different structures"):
        opt.update({"w": torch.ones(2), "b": torch.ones(1)}, state, params)
    with pytest.raises(
        ValueError, match=r"grads\['w'\] has shape \(3,\) but its parameter has shape \(2,\)"
    ):
        opt.update({"w": torch.ones(3)}, state, params)
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        optim.sgd(0.1, nesterov=True)
    with pytest.raises(TypeError, match="only the last part may be an optimizer"):
        optim.chain(optim.sgd(0.1), optim.sgd(0.1))
    with pytest.raises(TypeError, match=r"params\['n'\] is a int"):
        opt.init({"n": 3})
