"""Torch's optimizers and schedulers, as pardist's: a model's ``configure_optimizers()`` goes in.

A torch script builds ``torch.optim.AdamW(groups, ...)`` over the model's parameters
(decay and no-decay groups, a learning rate per group) and often a scheduler over it
(transformers' ``get_linear_schedule_with_warmup``, a ``LambdaLR``). :func:`from_torch`
reads both and returns a pure pardist optimizer that updates the params of
``pardist.functional(model)`` as torch would, group by group: each group becomes a
``pardist.optim`` optimizer with the group's options, chosen per parameter by name
(``multi_transform``), on the same torch kernels (fused where the group asked for
fused, else torch's own choice, so the numbers are torch's).

A scheduler becomes each group's learning rate as a function of the optimizer's step
count: a copy of it, bound to a stand-in optimizer, is stepped once per update (torch's
own code, so any scheduler works, ``SequentialLR`` and ``OneCycleLR`` included). The
script's scheduler itself is then not stepped any more; a loop that still calls its
``step()`` gets an error at the next update.

:func:`state_from_torch` and :func:`state_to_torch` convert an optimizer's state between
torch's ``state_dict()`` (a DDP-era checkpoint) and pardist's.
"""

from __future__ import annotations

import collections
import copy
import warnings
from typing import Any

import torch

from pardist.optim._adamw import AdamWState, adamw
from pardist.optim._base import Optimizer
from pardist.optim._groups import _keep, multi_transform
from pardist.optim._sgd import SGDState, sgd

__all__ = ["from_torch", "state_from_torch", "state_to_torch"]

_WHERE = "pardist.optim.from_torch"
_UNTOUCHED = "untouched"  # the label of parameters no group holds: never updated, as in torch
_SUPPORTED = "torch.optim.SGD, torch.optim.Adam and torch.optim.AdamW"


def _kind(optimizer: torch.optim.Optimizer) -> str:
    for name in ("AdamW", "Adam", "SGD"):  # AdamW before Adam: it may subclass it
        if type(optimizer) is getattr(torch.optim, name):
            return name
    raise TypeError(
        f"{_WHERE}: {type(optimizer).__module__}.{type(optimizer).__qualname__} cannot be "
        f"converted; pardist converts {_SUPPORTED} (every param-group option they have). "
        "Build one of those, or write the optimizer with pardist.optim (optax's shape)."
    )


def _implementation(group: dict) -> dict:
    """The group's kernel: fused where it asked for fused, else torch's own default."""
    if group.get("fused"):
        return {"fused": True}
    return {"fused": False, "foreach": group.get("foreach")}


def _number(x: Any) -> Any:
    return float(x) if isinstance(x, torch.Tensor) else x


def _group_optimizer(kind: str, group: dict, lr: Any, index: int) -> Optimizer:
    if group.get("differentiable"):
        raise ValueError(
            f"{_WHERE}: param group {index} has differentiable=True, which pardist does not "
            "convert (its updates are not differentiated); build the optimizer without it."
        )
    common = dict(weight_decay=_number(group["weight_decay"]), maximize=group["maximize"])
    if kind == "SGD":
        return sgd(
            lr,
            momentum=_number(group["momentum"]),
            dampening=_number(group["dampening"]),
            nesterov=group["nesterov"],
            **common,
            **_implementation(group),
        )
    decoupled = kind == "AdamW" or group.get("decoupled_weight_decay", False)
    return adamw(
        lr,
        betas=tuple(_number(b) for b in group["betas"]),
        eps=_number(group["eps"]),
        amsgrad=group["amsgrad"],
        decoupled=decoupled,
        **common,
        **_implementation(group),
    )


class _Replay:
    """Each group's learning rate after ``t`` updates, by stepping a copy of the scheduler."""

    def __init__(self, scheduler: Any, optimizer: torch.optim.Optimizer, steps_per_update: int):
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                f"{_WHERE}: ReduceLROnPlateau follows a metric, not the step count, so it is "
                "no function of the update; give its rate as the lr of a pardist.optim "
                "optimizer made each time it changes, or use a step-based scheduler."
            )
        for part in [scheduler, *getattr(scheduler, "_schedulers", [])]:
            if getattr(part, "cycle_momentum", False):
                raise ValueError(
                    f"{_WHERE}: {type(part).__name__} has cycle_momentum=True, which changes the "
                    "momentum (Adam's beta1) at every step; pardist's optimizers take it fixed. "
                    f"Build it with cycle_momentum=False."
                )
        if getattr(scheduler, "optimizer", None) is not optimizer:
            raise ValueError(
                f"{_WHERE}: the scheduler steps another optimizer than the one given; pass the "
                "optimizer the scheduler was made for."
            )
        self.scheduler, self.every = scheduler, steps_per_update
        self.start = scheduler.last_epoch  # the scheduler's steps so far (0: as made)
        stand_in = torch.optim.SGD([torch.zeros(0)], lr=0.0)
        stand_in.param_groups = [
            {k: copy.deepcopy(v) for k, v in g.items() if k != "params"} | {"params": []}
            for g in optimizer.param_groups
        ]
        self.copy = copy.deepcopy(scheduler, {id(optimizer): stand_in})
        self.rates = [[_number(g["lr"]) for g in stand_in.param_groups]]  # at self.start
        self.fixed = self._others()

    def lr(self, group: int, count: int) -> float:
        if self.scheduler.last_epoch != self.start:
            raise ValueError(
                f"{_WHERE}: the torch scheduler was stepped after pardist.optim.from_torch took "
                f"it (from step {self.start} to {self.scheduler.last_epoch}). pardist's "
                "optimizer follows the schedule by its own step count, one step per update on "
                "every process: remove lr_scheduler.step() from the loop."
            )
        t = count * self.every - self.start
        if t < 0:
            raise ValueError(
                f"{_WHERE}: the optimizer is at update {count}, but the scheduler had been "
                f"stepped {self.start} times when it was converted; convert the scheduler as "
                "made (before any step), or load the optimizer's state with "
                "pardist.optim.state_from_torch (its step count is the scheduler's)."
            )
        while len(self.rates) <= t:
            with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()"
                warnings.simplefilter("ignore")
                self.copy.step()
            self.rates.append([_number(g["lr"]) for g in self.copy.optimizer.param_groups])
            if self._others() != self.fixed:
                raise ValueError(
                    f"{_WHERE}: the scheduler changes more than the learning rate at step "
                    f"{len(self.rates) - 1} (the groups' other options were {self.fixed}, now "
                    f"{self._others()}); pardist converts learning-rate schedules only."
                )
        return self.rates[t][group]

    def _others(self) -> list:
        return [
            {k: v for k, v in g.items() if k not in ("lr", "params", "initial_lr")}
            for g in self.copy.optimizer.param_groups
        ]


class _Converted:
    """The update of :func:`from_torch`'s optimizer, with what converting states needs."""

    def __init__(self, update: Any, kind: str, names: list[list[str]], optimizer, model):
        self.update, self.kind, self.names = update, kind, names
        self.groups = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]
        self.shapes = dict((n, p) for n, p in model.named_parameters())

    def __call__(self, grads, state, params=None):
        return self.update(grads, state, params)


def from_torch(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    scheduler: Any = None,
    *,
    steps_per_update: int = 1,
) -> Optimizer:
    """A pardist optimizer that updates ``pardist.functional(model)``'s params as ``optimizer``.

    Every param group keeps its options (lr, weight_decay, betas, eps, momentum,
    dampening, nesterov, maximize, amsgrad, Adam's decoupled_weight_decay) and its
    kernel (fused where it asked for one); parameters are matched to groups by
    identity, so the model's ``configure_optimizers()`` stays as it is. Parameters of
    the model that no group holds are not updated, as in torch. Numbers equal torch's
    step for step.

    Args:
        optimizer: a ``torch.optim.SGD``, ``Adam`` or ``AdamW`` over ``model``'s
            parameters (the model before ``pardist.functional``, or after: it copies).
        model: the module whose parameters the optimizer holds; the params it updates
            are ``pardist.functional(model)``'s (a dict by parameter name).
        scheduler: a torch learning-rate scheduler of ``optimizer`` (``LambdaLR``,
            transformers' ``get_*_schedule_with_warmup``, any other), stepped once per
            update by the optimizer's own count: the loop no longer calls its ``step()``.
            Or a function ``update -> lr`` for every group, as a loop that sets each
            ``param_group["lr"]`` by hand (nanoGPT's ``get_lr``) has it.
        steps_per_update: scheduler steps per update. Accelerate steps a prepared
            scheduler once per process each update (without ``split_batches``); pass
            ``pardist.world_size()`` to follow an Accelerate run's rates.

    Returns:
        An :class:`Optimizer` (``multi_transform`` of one optimizer per group).

    Example:
        >>> import pardist, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> groups = [{'params': [model.weight]}, {'params': [model.bias], 'weight_decay': 0}]
        >>> torch_opt = torch.optim.AdamW(groups, lr=0.1, weight_decay=0.5)
        >>> sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda t: 1 / (t + 1))
        >>> opt = pardist.optim.from_torch(torch_opt, model, sched)
        >>> apply, params, _ = pardist.functional(model)
        >>> state = opt.init(params)
        >>> pardist.optim.current_lr(opt, state)
        {0: 0.1, 1: 0.1}
    """
    kind = _kind(optimizer)
    if isinstance(steps_per_update, bool) or not isinstance(steps_per_update, int):
        raise TypeError(f"{_WHERE}: steps_per_update={steps_per_update!r}; give an int >= 1.")
    if steps_per_update < 1:
        raise ValueError(f"{_WHERE}: steps_per_update={steps_per_update}; give an int >= 1.")
    by_id = {id(p): name for name, p in model.named_parameters()}
    names: list[list[str]] = []
    for i, group in enumerate(optimizer.param_groups):
        unknown = [k for k, p in enumerate(group["params"]) if id(p) not in by_id]
        if unknown:
            raise ValueError(
                f"{_WHERE}: param group {i}'s parameter {unknown[0]} (shape "
                f"{tuple(group['params'][unknown[0]].shape)}) is not a parameter of the model "
                "given; pass the module whose parameters the optimizer was built over."
            )
        names.append([by_id[id(p)] for p in group["params"]])
    if scheduler is None and any("initial_lr" in g for g in optimizer.param_groups):
        warnings.warn(
            f"{_WHERE}: the optimizer has a learning-rate scheduler (its groups have "
            "'initial_lr'), which was not given: the rates stay as they are now. Pass it: "
            "from_torch(optimizer, model, scheduler).",
            stacklevel=2,
        )
    by_hand = callable(scheduler) and not hasattr(scheduler, "optimizer")  # count -> lr
    replay = None
    if scheduler is not None and not by_hand:
        replay = _Replay(scheduler, optimizer, steps_per_update)
    transforms: dict[Any, Optimizer] = {}
    for i, group in enumerate(optimizer.param_groups):
        if by_hand:  # one rate for every group, as a loop setting param_group["lr"] has it
            lr = _every(scheduler, steps_per_update)
        else:
            lr = _number(group["lr"]) if replay is None else _rate(replay, i)
        transforms[i] = _group_optimizer(kind, group, lr, i)
    transforms[_UNTOUCHED] = _keep()
    label = {f"[{name!r}]": i for i, group in enumerate(names) for name in group}

    def labels(path: str, leaf: torch.Tensor) -> Any:
        return label.get(path, _UNTOUCHED)

    inner = multi_transform(transforms, labels)
    return Optimizer(inner.init, _Converted(inner.update, kind, names, optimizer, model), inner.lr)


def _every(schedule: Any, steps: int):
    if steps == 1:
        return schedule

    def lr(count: int) -> float:
        return schedule(count * steps)

    return lr


def _rate(replay: _Replay, group: int):
    def lr(count: int) -> float:
        return replay.lr(group, count)

    return lr


def _converted(opt: Any, where: str) -> _Converted:
    update = getattr(opt, "update", None)
    if not isinstance(update, _Converted):
        raise TypeError(
            f"{where}: pass the optimizer pardist.optim.from_torch returned (not a chain of "
            "it: convert that part's state, the chain's last)."
        )
    return update


def state_from_torch(opt: Optimizer, state_dict: dict, *, step: int | None = None) -> Any:
    """pardist's state of ``opt`` (:func:`from_torch`'s) from a torch ``state_dict()``.

    ``state_dict`` is what the torch optimizer's ``state_dict()`` returned, as a DDP
    script saved it: its groups must hold as many parameters as the optimizer given to
    :func:`from_torch`, in the same order. Adam's and AdamW's step count comes from the
    state; SGD keeps none, so give ``step`` (the updates taken, e.g. the scheduler's
    ``last_epoch``) where the learning rate is a schedule.

    Example:
        >>> import pardist, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> torch_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model(torch.ones(1, 2)).sum().backward(); torch_opt.step()
        >>> opt = pardist.optim.from_torch(torch_opt, model)
        >>> state = pardist.optim.state_from_torch(opt, torch_opt.state_dict())
        >>> state[0].momentum_buffer["['bias']"]
        tensor([1.])
    """
    where = "pardist.optim.state_from_torch"
    conv = _converted(opt, where)
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    sizes = [len(g["params"]) for g in saved_groups]
    if sizes != [len(n) for n in conv.names]:
        raise ValueError(
            f"{where}: the state's param groups hold {sizes} parameters, the optimizer's "
            f"{[len(n) for n in conv.names]}; convert the state of an optimizer built the "
            "same way (the same groups, in the same order)."
        )
    out: dict[Any, Any] = {_UNTOUCHED: ()}
    for i, (group, names) in enumerate(zip(saved_groups, conv.names)):
        per = [saved_state.get(index, {}) for index in group["params"]]
        like = [conv.shapes[name].detach() for name in names]
        key = [f"[{name!r}]" for name in names]

        def tree(field: str, per=per, like=like, key=key) -> dict:
            return {
                k: (s[field].detach().clone() if s.get(field) is not None else torch.zeros_like(p))
                for k, s, p in zip(key, per, like)
            }

        steps = [int(_number(s["step"])) for s in per if "step" in s]
        if conv.kind == "SGD":
            started = any(s.get("momentum_buffer") is not None for s in per)
            count = step if step is not None else int(started)
            momentum = conv.groups[i]["momentum"]
            out[i] = SGDState(_count(count), tree("momentum_buffer") if momentum else None)
        else:
            count = step if step is not None else (max(steps) if steps else 0)
            vmax = tree("max_exp_avg_sq") if conv.groups[i]["amsgrad"] else None
            out[i] = AdamWState(_count(count), tree("exp_avg"), tree("exp_avg_sq"), vmax)
    return {k: out[k] for k in [*range(len(conv.names)), _UNTOUCHED]}


def _count(n: int) -> torch.Tensor:
    return torch.tensor(int(n), dtype=torch.int64)


def state_to_torch(opt: Optimizer, state: Any) -> dict:
    """A torch ``state_dict()`` of ``opt``'s state (:func:`from_torch`'s optimizer), for the
    torch optimizer's ``load_state_dict``: its groups' options as when converted, each
    group's learning rate at the state's step count.

    Example:
        >>> import pardist, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> torch_opt = torch.optim.Adam(model.parameters(), lr=0.1)
        >>> opt = pardist.optim.from_torch(torch_opt, model)
        >>> _, params, _ = pardist.functional(model)
        >>> torch_opt.load_state_dict(pardist.optim.state_to_torch(opt, opt.init(params)))
    """
    conv = _converted(opt, "pardist.optim.state_to_torch")
    groups, entries, index = [], {}, 0
    for i, names in enumerate(conv.names):
        s = state[i]
        count = int(s.count)
        group = dict(conv.groups[i])
        lr = opt.lr[i]
        group["lr"] = lr(count) if callable(lr) else lr
        group["params"] = list(range(index, index + len(names)))
        groups.append(group)
        for name in names:
            key = f"[{name!r}]"
            if conv.kind == "SGD" and count:  # torch keeps nothing for a parameter before a step
                buffers = s.momentum_buffer
                entries[index] = {"momentum_buffer": buffers[key].clone() if buffers else None}
            elif conv.kind != "SGD" and count:
                entry = {
                    "step": torch.tensor(float(count)),
                    "exp_avg": s.exp_avg[key].clone(),
                    "exp_avg_sq": s.exp_avg_sq[key].clone(),
                }
                if s.max_exp_avg_sq is not None:
                    entry["max_exp_avg_sq"] = s.max_exp_avg_sq[key].clone()
                entries[index] = entry
            index += 1
    return {"state": collections.OrderedDict(sorted(entries.items())), "param_groups": groups}
