"""Parameter groups, masks, warm-up + cosine and the current learning rate, against torch.optim."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64
from torch import nn

import pardist
from pardist import optim


# float64 models and batches: compared with torch up to float64 rounding (numerics.py)
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3)).double()


def _batches(n: int = 5):
    g = torch.Generator().manual_seed(3)
    return [
        tuple(torch.randn(8, k, generator=g, dtype=torch.float64) for k in (4, 3)) for _ in range(n)
    ]


def _labels(params: dict) -> dict:
    """No weight decay on biases and norm weights; the head ('3.') at a higher rate."""
    return {
        k: "head" if k.startswith("3.") else ("decay" if v.ndim > 1 else "no_decay")
        for k, v in params.items()
    }


def _torch_groups(model: nn.Module, lr):
    named = dict(model.named_parameters())
    labels = _labels(named)
    groups = [
        {"params": [p for k, p in named.items() if labels[k] == "decay"], "weight_decay": 0.1},
        {"params": [p for k, p in named.items() if labels[k] == "no_decay"], "weight_decay": 0.0},
        {"params": [p for k, p in named.items() if labels[k] == "head"], "lr": 10 * lr},
    ]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.05)


def _pardist_groups(params: dict, lr):
    return optim.multi_transform(
        {
            "decay": optim.adamw(lr, weight_decay=0.1),
            "no_decay": optim.adamw(lr, weight_decay=0.0),
            "head": optim.adamw(10 * lr, weight_decay=0.05),
        },
        _labels(params),
    )


def _train(sharded: bool = False):
    apply, params, buffers = pardist.functional(_net())
    opt = _pardist_groups(params, 1e-2)
    opt = optim.sharded(opt) if sharded else opt

    @pardist.data_parallel(donate_argnums=(0, 1))
    def step(p, s, batch):
        grads = pardist.grad(lambda p, x, y: F.mse_loss(apply(p, buffers, x)[0], y))(p, *batch)
        return opt.update(grads, s, p)

    state = opt.init(params)
    r, n = pardist.rank(), 8 // pardist.world_size()
    for x, y in _batches():
        params, state = step(params, state, (x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]))
    return params


def _reference():
    model = _net()
    opt = _torch_groups(model, 1e-2)
    for x, y in _batches():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return dict(model.named_parameters())


@pytest.mark.parametrize("nprocs, sharded", [(1, False), (2, False), (2, True)])
def test_parameter_groups_equal_torch_adamw_groups(run, nprocs, sharded):
    want = _reference()
    for got in run(nprocs, _train, sharded):
        assert_close64(got, {k: v.detach() for k, v in want.items()}, "parameters")


def test_masked_parameters_are_not_updated():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    tx = optim.masked(optim.adamw(0.1), lambda path, p: p.ndim > 1)
    state = tx.init(params)
    for _ in range(3):
        params, state = tx.update({"w": torch.ones(2, 2), "b": torch.ones(2)}, state, params)
    assert torch.equal(params["b"], torch.ones(2)) and not torch.equal(
        params["w"], torch.ones(2, 2)
    )


def test_labels_that_name_no_transformation_are_an_error():
    tx = optim.multi_transform({"a": optim.sgd(0.1)}, {"w": "b"})
    with pytest.raises(ValueError, match="labels 'b' have no transformation"):
        tx.init({"w": torch.ones(1)})


def test_warmup_cosine_equals_lambda_lr_and_current_lr_follows_it():
    peak, warmup, total = 0.1, 3, 10
    sched = optim.warmup_cosine(peak, warmup, total)
    model = _net()
    ref = torch.optim.SGD(model.parameters(), lr=peak, momentum=0.9)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(ref, lambda t: sched(t) / peak)
    apply, params, buffers = pardist.functional(_net())
    opt = optim.sgd(sched, momentum=0.9)
    state = opt.init(params)
    for x, y in _batches(total):
        assert optim.current_lr(opt, state) == pytest.approx(lambda_lr.get_last_lr()[0])
        ref.zero_grad()
        F.mse_loss(model(x), y).backward()
        ref.step()
        lambda_lr.step()
        grads = pardist.grad(lambda p, x, y: F.mse_loss(apply(p, buffers, x)[0], y))(params, x, y)
        params, state = opt.update(grads, state, params)
    assert optim.step_count(state) == total
    assert_close64(params, {k: v.detach() for k, v in model.named_parameters()}, "parameters")
    # a warm-up from 0 at step 0, the peak after it, the end at total
    assert sched(0) == 0.0 and sched(warmup) == pytest.approx(peak) and sched(total) == 0.0


def test_current_lr_per_group():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    tx = optim.multi_transform(
        {"a": optim.adamw(optim.linear_warmup(1.0, 4)), "b": optim.sgd(0.5)},
        {"w": "a", "b": "b"},
    )
    state = tx.init(params)
    _, state = tx.update({"w": torch.ones(2, 2), "b": torch.ones(2)}, state, params)
    assert optim.current_lr(tx, state) == {"a": 0.25, "b": 0.5}
