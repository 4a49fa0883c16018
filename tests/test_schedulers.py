"""A torch scheduler keeps its own cadence: it moves where the script's loop steps it.

Every scheduler of ``torch.optim.lr_scheduler``, stepped per update, per epoch (every
``EPOCH`` updates) or on a metric (``ReduceLROnPlateau``), over a torch optimizer that
``pardist.optim.from_torch`` converted: the rate of every group at every update, and the
parameters, must be torch's own (the same scheduler code on the same floats: the rates
equal exactly; the parameters to float64 rounding), also through a save and a resume in a
fresh process's objects, and in a compiled step without recompiling.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64
from torch import nn
from torch.optim import lr_scheduler as S

import pardist
from pardist import optim

UPDATES = 12
EPOCH = 3  # updates per epoch, for the schedulers stepped per epoch


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def groups(m: nn.Module) -> list[dict]:
    return [
        {"params": [p for p in m.parameters() if p.ndim > 1]},
        {"params": [p for p in m.parameters() if p.ndim == 1], "lr": 0.02},
    ]


def batch(t: int):
    g = torch.Generator().manual_seed(t)
    return torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(
        0, 2, (8,), generator=g
    )


OPTIMIZERS = {
    "sgd": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adamw": lambda g: torch.optim.AdamW(g, lr=0.01, weight_decay=0.1),
}


def _warmup(warmup: int, t: int) -> float:
    return (t + 1) / warmup if t < warmup else 0.5 ** (t - warmup)


def _warm(o):
    return S.LinearLR(o, start_factor=0.2, total_iters=2)


# Every scheduler torch has, made as a script makes it; "epoch": stepped once per epoch.
SCHEDULERS = {
    "LambdaLR": (lambda o: S.LambdaLR(o, lambda t: 1 / (1 + t)), "update"),
    # transformers' get_*_schedule_with_warmup: a LambdaLR of a functools.partial, whose
    # state_dict() holds the partial's (empty) __dict__
    "LambdaLR(partial)": (lambda o: S.LambdaLR(o, functools.partial(_warmup, 3)), "update"),
    "MultiplicativeLR": (lambda o: S.MultiplicativeLR(o, lambda t: 0.9), "update"),
    "StepLR": (lambda o: S.StepLR(o, step_size=2, gamma=0.5), "epoch"),
    "MultiStepLR": (lambda o: S.MultiStepLR(o, milestones=[1, 3], gamma=0.3), "epoch"),
    "ConstantLR": (lambda o: S.ConstantLR(o, factor=0.5, total_iters=4), "update"),
    "LinearLR": (lambda o: S.LinearLR(o, start_factor=0.1, total_iters=5), "update"),
    "ExponentialLR": (lambda o: S.ExponentialLR(o, gamma=0.8), "epoch"),
    "PolynomialLR": (lambda o: S.PolynomialLR(o, total_iters=8, power=2.0), "update"),
    "CosineAnnealingLR": (lambda o: S.CosineAnnealingLR(o, T_max=3), "epoch"),
    "CosineAnnealingWarmRestarts": (lambda o: S.CosineAnnealingWarmRestarts(o, T_0=4), "update"),
    "SequentialLR": (
        lambda o: S.SequentialLR(o, [_warm(o), S.ExponentialLR(o, 0.9)], milestones=[2]),
        "update",
    ),
    "ChainedScheduler": (
        lambda o: S.ChainedScheduler([S.ConstantLR(o, 0.5, 3), S.ExponentialLR(o, 0.9)]),
        "update",
    ),
    # These cycle the momentum too (SGD's momentum, Adam's beta1), by default.
    "OneCycleLR": (lambda o: S.OneCycleLR(o, max_lr=[0.05, 0.02], total_steps=UPDATES), "update"),
    "CyclicLR": (lambda o: S.CyclicLR(o, base_lr=0.001, max_lr=0.01, step_size_up=3), "update"),
    "ReduceLROnPlateau": (lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=0), "metric"),
}


def _step(sched, when: str, t: int, loss: float) -> None:
    """The script's own step() of the scheduler, after update ``t``."""
    if when == "update":
        sched.step()
    elif when == "epoch" and (t + 1) % EPOCH == 0:
        sched.step()
    elif when == "metric" and (t + 1) % EPOCH == 0:
        sched.step(loss)  # a validation loss, once an epoch


def torch_run(opt_name: str, sched_name: str, updates: int = UPDATES):
    """Plain torch: the rates each update used, and the parameters after each."""
    m = model()
    o = OPTIMIZERS[opt_name](groups(m))
    make, when = SCHEDULERS[sched_name]
    sched = make(o)
    rates, params = [], []
    for t in range(updates):
        rates.append([g["lr"] for g in o.param_groups])
        x, y = batch(t)
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        _step(sched, when, t, float(loss.detach()))
        params.append({k: v.detach().clone() for k, v in m.named_parameters()})
    return rates, params


def _loss(apply):
    def loss(p, x, y):
        return F.cross_entropy(apply(p, {}, x)[0], y)

    return loss


def pardist_run(opt_name: str, sched_name: str, resume_at: int | None = None, step_kw=None):
    """The port: torch's optimizer and scheduler built as before, from_torch, the script's
    own scheduler.step() where it was. ``resume_at``: save there, and go on with every
    object made afresh and loaded, as a restarted process does."""
    make, when = SCHEDULERS[sched_name]

    def build():
        m = model()
        o = OPTIMIZERS[opt_name](groups(m))
        sched = make(o)
        opt = optim.from_torch(o, m, sched)
        apply, params, _ = pardist.functional(m)
        lossf = _loss(apply)

        @pardist.data_parallel(**(step_kw or {}))
        def step(p, s, b):
            loss, g = pardist.value_and_grad(lossf)(p, *b)
            p, s = opt.update(g, s, p)
            return p, s, loss

        return opt, sched, step, params, opt.init(params)

    opt, sched, step, params, state = build()
    rates, out, saved = [], [], None
    t = 0
    while t < UPDATES:
        if t == resume_at and saved is None:
            saved = {
                "params": params,
                "optimizer": optim.state_to_torch(opt, state),
                "scheduler": sched.state_dict(),
            }
            opt, sched, step, _, _ = build()  # a fresh process's objects
            params = saved["params"]
            state = optim.state_from_torch(opt, saved["optimizer"], step=t)
            sched.load_state_dict(saved["scheduler"])
        rates.append([optim.current_lr(opt, state)[i] for i in (0, 1)])
        params, state, loss = step(params, state, batch(t))
        _step(sched, when, t, float(loss))
        out.append(params)
        t += 1
    return rates, out, step


@pytest.mark.parametrize("sched_name", list(SCHEDULERS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_every_torch_scheduler_at_its_own_cadence(world1, opt_name, sched_name):
    want_rates, want = torch_run(opt_name, sched_name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "scheduler.step() before optimizer.step()"
        rates, got, _ = pardist_run(opt_name, sched_name)
    assert rates == want_rates
    for t, (a, b) in enumerate(zip(got, want)):
        assert_close64(a, b, f"{opt_name} with {sched_name}, update {t}")


@pytest.mark.parametrize("sched_name", ["StepLR", "OneCycleLR", "ReduceLROnPlateau"])
def test_a_resume_continues_the_schedule(world1, sched_name):
    want_rates, want = torch_run("sgd", sched_name)
    rates, got, _ = pardist_run("sgd", sched_name, resume_at=5)
    assert rates == want_rates
    assert_close64(got[-1], want[-1], f"{sched_name}, resumed at update 5")


@pytest.mark.parametrize(
    "sched_name", ["MultiStepLR", "OneCycleLR", "ReduceLROnPlateau", "LambdaLR(partial)"]
)
def test_the_torch_objects_resume_from_a_pardist_checkpoint(world1, tmp_path, sched_name):
    """The optimizer and scheduler in the saved tree as they are (their state_dict()), as an
    Accelerate script's save_state keeps them: the rates resume with them."""
    want_rates, want = torch_run("adamw", sched_name)
    make, when = SCHEDULERS[sched_name]

    def build():
        m = model()
        o = OPTIMIZERS["adamw"](groups(m))
        sched = make(o)
        opt = optim.from_torch(o, m, sched)
        apply, params, _ = pardist.functional(m)
        tree = {"params": params, "opt_state": opt.init(params), "optimizer": o, "sched": sched}
        return opt, tree, _loss(apply)

    opt, tree, lossf = build()
    rates = []
    for t in range(UPDATES):
        if t == 7:  # a restarted process: everything afresh, then the checkpoint
            pardist.checkpoint.save(tmp_path, tree, step=t)
            opt, tree, lossf = build()
            tree = pardist.checkpoint.load(pardist.checkpoint.latest(tmp_path), tree)
        rates.append([optim.current_lr(opt, tree["opt_state"])[i] for i in (0, 1)])
        loss, g = pardist.value_and_grad(lossf)(tree["params"], *batch(t))
        tree["params"], tree["opt_state"] = opt.update(g, tree["opt_state"], tree["params"])
        _step(tree["sched"], when, t, float(loss))
    assert rates == want_rates
    assert_close64(tree["params"], want[-1], f"{sched_name}, resumed from a checkpoint")


def test_a_compiled_step_follows_the_rate_without_recompiling(world1):
    want_rates, want = torch_run("adamw", "StepLR")
    rates, got, step = pardist_run("adamw", "StepLR", step_kw={"compile": {"backend": "aot_eager"}})
    assert rates == want_rates
    assert_close64(got[-1], want[-1], "compiled")
    assert step.compiled.backend.graphs == 1  # one graph, whatever the rate
