"""``pardist.optim.from_torch``: a torch optimizer and scheduler, converted, train as torch does.

Both sides run in float64 on the same kernels (the group's fused/foreach choice is kept),
so the only differences allowed are float64 rounding (``assert_close64``); a wrong
option (a weight decay on the wrong group, Adam's L2 decay for AdamW's decoupled one, a
missing bias correction) is off by 1e-3 or more. Learning rates come from torch's own
scheduler code, stepped by the loop where torch's loop steps it, so they must be equal
exactly.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64
from torch import nn

import pardist
from pardist import optim

STEPS = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3)).double()


def _groups(model: nn.Module, **second) -> list[dict]:
    """configure_optimizers' usual split: weights decay, biases and norms do not."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, **second}]


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 5, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (16,), generator=g
    )


def _linear_warmup(t: int, warmup: int, total: int) -> float:  # transformers' lambda, as written
    if t < warmup:
        return float(t) / float(max(1, warmup))
    return max(0.0, float(total - t) / float(max(1, total - warmup)))


OPTIMIZERS = {
    "sgd": lambda g: torch.optim.SGD(g, lr=0.1),
    "sgd_momentum_wd": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd_nesterov_maximize": lambda g: torch.optim.SGD(
        g, lr=0.05, momentum=0.8, nesterov=True, maximize=True
    ),
    "sgd_dampening": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, dampening=0.3),
    "adam": lambda g: torch.optim.Adam(g, lr=0.01, weight_decay=0.1),
    "adam_amsgrad": lambda g: torch.optim.Adam(g, lr=0.01, betas=(0.8, 0.95), amsgrad=True),
    "adam_decoupled": lambda g: torch.optim.Adam(
        g, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True
    ),
    "adamw": lambda g: torch.optim.AdamW(g, lr=0.01, weight_decay=0.1, eps=1e-6),
    "adamw_amsgrad_maximize": lambda g: torch.optim.AdamW(g, lr=0.01, amsgrad=True, maximize=True),
    "adamw_fused": lambda g: torch.optim.AdamW(g, lr=0.01, weight_decay=0.1, fused=True),
    "adamw_foreach": lambda g: torch.optim.AdamW(g, lr=0.01, foreach=True),
}

SCHEDULERS = {
    None: None,
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, functools.partial(_linear_warmup, warmup=2, total=STEPS)
    ),
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "one_cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.05, total_steps=STEPS, cycle_momentum=False
    ),
    "sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [
            torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=2),
            torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS),
        ],
        milestones=[2],
    ),
}


def _loss(model):
    def loss(params, x, y):
        return F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)

    return loss


def _both(name: str, sched: str | None, second: dict, steps: int = STEPS):
    """(torch's params and rates per step, pardist's) for one optimizer and scheduler."""
    model = _model()
    twin = _model()
    torch_opt = OPTIMIZERS[name](_groups(model, **second))
    torch_sched = SCHEDULERS[sched](torch_opt) if sched else None
    torch_rates, torch_params = [], []
    for t in range(steps):
        torch_rates.append([g["lr"] for g in torch_opt.param_groups])
        x, y = _batch(t)
        F.cross_entropy(model(x), y).backward()
        torch_opt.step()
        torch_opt.zero_grad()
        if torch_sched:
            torch_sched.step()
        torch_params.append({k: v.detach().clone() for k, v in model.named_parameters()})

    twin_opt = OPTIMIZERS[name](_groups(twin, **second))  # the script's own, unchanged
    twin_sched = SCHEDULERS[sched](twin_opt) if sched else None
    opt = optim.from_torch(twin_opt, twin, twin_sched)
    _, params, _ = pardist.functional(twin)
    state = opt.init(params)
    rates, ours = [], []
    for t in range(steps):
        lr = optim.current_lr(opt, state)
        rates.append([lr[0], lr[1]])
        grads = pardist.grad(_loss(twin))(params, *_batch(t))
        params, state = opt.update(grads, state, params)
        if twin_sched:  # the script's own step() stays where it was
            twin_sched.step()
        ours.append(params)
    return (torch_params, torch_rates), (ours, rates)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_steps_as_torch(name):
    second = {"lr": 0.003} if "maximize" not in name else {}  # a group with a rate of its own
    (want, want_lr), (got, got_lr) = _both(name, None, second)
    assert got_lr == want_lr
    for t, (a, b) in enumerate(zip(got, want)):
        assert_close64(a, b, f"{name}, step {t}")


@pytest.mark.parametrize("sched", [s for s in SCHEDULERS if s])
@pytest.mark.parametrize("name", ["sgd_momentum_wd", "adamw"])
def test_schedulers_give_torchs_rates_at_every_update(name, sched):
    (want, want_lr), (got, got_lr) = _both(name, sched, {"lr": 0.003})
    assert got_lr == want_lr  # torch's own code stepped: the same floats
    for t, (a, b) in enumerate(zip(got, want)):
        assert_close64(a, b, f"{name} with {sched}, step {t}")


def test_steps_per_update_scales_a_function_of_the_count():
    """A rate given as a function of the update count, scaled by steps_per_update."""
    model = _model()
    lam = functools.partial(_linear_warmup, warmup=4, total=12)
    opt = optim.from_torch(
        torch.optim.AdamW(model.parameters(), lr=0.01), model, lam, steps_per_update=3
    )
    state = opt.init(pardist.functional(model)[1])
    for u in range(4):
        assert optim.current_lr(opt, state) == {0: lam(3 * u)}
        state = {0: state[0]._replace(count=state[0].count + 1), "untouched": ()}


def test_a_rate_set_by_hand_every_update():
    """nanoGPT's loop sets every group's lr to get_lr(it) before each step."""
    model, twin = _model(), _model()
    torch_opt = OPTIMIZERS["adamw"](_groups(model, lr=0.003))

    def get_lr(it: int) -> float:
        return 0.01 * (it + 1) / 3 if it < 2 else 0.01 / (it + 1)

    for t in range(STEPS):
        for group in torch_opt.param_groups:
            group["lr"] = get_lr(t)
        x, y = _batch(t)
        F.cross_entropy(model(x), y).backward()
        torch_opt.step()
        torch_opt.zero_grad()
    opt = optim.from_torch(OPTIMIZERS["adamw"](_groups(twin, lr=0.003)), twin, get_lr)
    _, params, _ = pardist.functional(twin)
    state = opt.init(params)
    for t in range(STEPS):
        assert optim.current_lr(opt, state) == {0: get_lr(t), 1: get_lr(t)}
        params, state = opt.update(pardist.grad(_loss(twin))(params, *_batch(t)), state, params)
    assert_close64(params, dict(model.named_parameters()), "lr by hand")


def test_parameters_no_group_holds_stay_as_they_are():
    model = _model()
    torch_opt = torch.optim.AdamW(model[3].parameters(), lr=0.1)  # only the head
    opt = optim.from_torch(torch_opt, model)
    _, params, _ = pardist.functional(model)
    grads = pardist.grad(_loss(model))(params, *_batch(0))
    new, _ = opt.update(grads, opt.init(params), params)
    for k in params:
        assert torch.equal(new[k], params[k]) != k.startswith("3."), k


def _torch_steps(model, torch_opt, torch_sched, steps) -> None:
    for t in steps:
        F.cross_entropy(model(_batch(t)[0]), _batch(t)[1]).backward()
        torch_opt.step()
        torch_opt.zero_grad()
        torch_sched.step()


def test_a_torch_state_converts_and_back_mid_run():
    """A DDP-era checkpoint's optimizer state continues in pardist, and pardist's in torch."""
    for name, sched in [("adamw_amsgrad_maximize", "lambda"), ("sgd_momentum_wd", "step")]:
        model, twin = _model(), _model()
        torch_opt = OPTIMIZERS[name](_groups(model))
        torch_sched = SCHEDULERS[sched](torch_opt)
        _torch_steps(model, torch_opt, torch_sched, range(3))  # then the checkpoint
        saved = torch_opt.state_dict()
        twin.load_state_dict(model.state_dict())
        fresh = OPTIMIZERS[name](_groups(twin))
        fresh_sched = SCHEDULERS[sched](fresh)
        opt = optim.from_torch(fresh, twin, fresh_sched)
        _, params, _ = pardist.functional(twin)
        state = optim.state_from_torch(opt, saved, step=3)  # (the rates back in fresh)
        fresh_sched.load_state_dict(torch_sched.state_dict())  # as the DDP script resumes
        assert optim.step_count(state) == {0: 3, 1: 3}
        back = optim.state_to_torch(opt, state)
        assert [g["lr"] for g in back["param_groups"]] == [g["lr"] for g in saved["param_groups"]]
        steps = lambda sd: [float(e.get("step", -1)) for e in sd["state"].values()]  # noqa: E731
        tensors = lambda sd: {
            i: {k: v for k, v in e.items() if k != "step"} for i, e in sd["state"].items()
        }  # noqa: E731, E501
        assert steps(back) == steps(saved)
        assert_close64(tensors(back), tensors(saved), f"{name}: round trip")
        for t in range(3, 6):  # both go on
            _torch_steps(model, torch_opt, torch_sched, [t])
            params, state = opt.update(pardist.grad(_loss(twin))(params, *_batch(t)), state, params)
            fresh_sched.step()
        assert_close64(params, dict(model.named_parameters()), f"{name}: after resuming")
        # and back: pardist's state continues in the torch optimizer of the DDP script
        torch_opt.load_state_dict(optim.state_to_torch(opt, state))
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(params[k])
        for t in range(6, 8):
            _torch_steps(model, torch_opt, torch_sched, [t])
            params, state = opt.update(pardist.grad(_loss(twin))(params, *_batch(t)), state, params)
            fresh_sched.step()
        assert_close64(params, dict(model.named_parameters()), f"{name}: back in torch")


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_clear_errors():
    model = _model()
    with pytest.raises(TypeError, match=r"torch.optim.rmsprop.RMSprop cannot be converted.*SGD"):
        optim.from_torch(torch.optim.RMSprop(model.parameters()), model)
    with pytest.raises(ValueError, match=r"param group 0's parameter 0 \(shape \(3,\)\) is not"):
        optim.from_torch(torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.1), model)
    with pytest.raises(ValueError, match="differentiable=True"):
        optim.from_torch(torch.optim.SGD(model.parameters(), lr=0.1, differentiable=True), model)
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(other, 2)
    with pytest.raises(ValueError, match="steps another optimizer"):
        optim.from_torch(torch_opt, model, sched)
    with pytest.raises(ValueError, match=r"steps_per_update=3 with a torch scheduler"):
        optim.from_torch(other, model, sched, steps_per_update=3)
    # an option the kernels hold fixed, changed by something else than a given scheduler
    opt = optim.from_torch(torch_opt, model)
    _, params, _ = pardist.functional(model)
    state = opt.init(params)
    torch_opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(ValueError, match=r"param group 0's 'weight_decay' changed from 0 to 0.5"):
        opt.update(pardist.grad(_loss(model))(params, *_batch(0)), state, params)
    torch_opt.param_groups[0]["weight_decay"] = 0
    with pytest.raises(TypeError, match="pass the optimizer pardist.optim.from_torch returned"):
        optim.state_from_torch(optim.adamw(0.1), torch_opt.state_dict())
    with pytest.raises(
        ValueError, match=r"param groups hold \[2\] parameters, the optimizer's \[6\]"
    ):
        two = torch.optim.SGD(model[0].parameters(), lr=0.1)
        optim.state_from_torch(opt, two.state_dict())


def _in_a_step(name: str):
    """A converted optimizer and scheduler in a data-parallel step at N ranks: the loop steps
    the scheduler once per update, as torch's on the whole batch in one process."""
    model = _model()
    torch_opt = OPTIMIZERS[name](_groups(model, lr=0.003))
    sched = SCHEDULERS["one_cycle"](torch_opt)
    opt = optim.from_torch(torch_opt, model, sched)
    _, params, _ = pardist.functional(model)

    @pardist.data_parallel(donate_argnums=(0, 1))
    def step(params, state, batch):
        grads = pardist.grad(_loss(model))(params, *batch)
        return opt.update(grads, state, params)

    state = opt.init(params)
    n, r = pardist.world_size(), pardist.rank()
    for t in range(STEPS):
        x, y = _batch(t)
        rows = slice(r * 16 // n, (r + 1) * 16 // n)
        params, state = step(params, state, (x[rows], y[rows]))
        sched.step()
    return params


def test_a_converted_optimizer_in_a_step_at_two_ranks(run):
    (want, _), _ = _both("adamw", "one_cycle", {"lr": 0.003})
    for got in run(2, _in_a_step, "adamw"):
        assert_close64(got, want[-1], "2 ranks")
