"""Torch's optimizers and schedulers, as pardist's: a model's ``configure_optimizers()`` goes in.

A torch script builds ``torch.optim.AdamW(groups, ...)`` over the model's parameters
(decay and no-decay groups, a learning rate per group) and often a scheduler over it
(transformers' ``get_linear_schedule_with_warmup``, a ``LambdaLR``). :func:`from_torch`
reads both and returns a pure pardist optimizer that updates the params of
``pardist.functional(model)`` as torch would, group by group: each group becomes a
``pardist.optim`` optimizer with the group's options, chosen per parameter by name
(``multi_transform``), on the same torch kernels (fused where the group asked for
fused, else torch's own choice, so the numbers are torch's).

A scheduler keeps its own cadence, as in torch: the script steps it where it did (per
update, per epoch, on a metric: ``ReduceLROnPlateau.step(val_loss)``), it sets the rate on
the torch optimizer's param groups, and pardist's optimizer reads each group's rate there
at every update (a compiled step at run time: no recompile). A scheduler that cycles the
momentum (``OneCycleLR``, ``CyclicLR``) is read for it too. Its ``state_dict()`` saves and
loads as torch's; :func:`state_from_torch` puts a saved optimizer's rates back.

:func:`state_from_torch` and :func:`state_to_torch` convert an optimizer's state between
torch's ``state_dict()`` (a DDP-era checkpoint) and pardist's.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from pardist.optim._adamw import AdamWState, adamw
from pardist.optim._base import Optimizer
from pardist.optim._groups import _keep, multi_transform
from pardist.optim._sgd import SGDState, sgd
from pardist.runtime import mark_optimizer_stepped

__all__ = ["from_torch", "prepared", "state_from_torch", "state_to_torch"]

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


def _group_optimizer(kind: str, group: dict, lr: Any, index: int, live=None) -> Optimizer:
    """One group's pardist optimizer; ``live``: the group's options read at each update
    (a scheduler that cycles the momentum), else fixed as they are now."""
    if group.get("differentiable"):
        raise ValueError(
            f"{_WHERE}: param group {index} has differentiable=True, which pardist does not "
            "convert (its updates are not differentiated); build the optimizer without it."
        )
    common = dict(weight_decay=_number(group["weight_decay"]), maximize=group["maximize"])
    if kind == "SGD":
        momentum = live.option(index, "momentum") if live else _number(group["momentum"])
        return sgd(
            lr,
            momentum=momentum,
            dampening=_number(group["dampening"]),
            nesterov=group["nesterov"],
            **common,
            **_implementation(group),
        )
    decoupled = kind == "AdamW" or group.get("decoupled_weight_decay", False)
    betas = live.option(index, "betas") if live else tuple(_number(b) for b in group["betas"])
    return adamw(
        lr,
        betas=betas,
        eps=_number(group["eps"]),
        amsgrad=group["amsgrad"],
        decoupled=decoupled,
        **common,
        **_implementation(group),
    )


_CYCLED = {"SGD": ("momentum",), "Adam": ("betas",), "AdamW": ("betas",)}


class _Live:
    """A param group's options as the torch optimizer holds them now: the learning rate
    that the script's own scheduler sets there (stepped where the loop steps it, as in
    torch: per update, per epoch, on a metric), read at every update; the options it
    may also cycle (OneCycleLR's and CyclicLR's momentum) read too where it does.

    A compiled step reads them at run time (``schedule_value``'s graph node), so a
    changed rate costs no recompile. Options that are fixed in the kernels (momentum and
    betas where no given scheduler cycles them, weight decay, eps) are checked at every
    update against what was converted: changed, they are an error naming the option.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, cycled: bool):
        self.optimizer, self.kind, self.cycled = optimizer, kind, cycled
        names = set(_CYCLED[kind]) if cycled else set()
        self.fixed = [
            {k: v for k, v in g.items() if k not in ("lr", "params", "initial_lr", *names)}
            | {k: g[k] for k in _CYCLED[kind] if not cycled and k in g}
            for g in optimizer.param_groups
        ]

    def _group(self, i: int) -> dict:
        mark_optimizer_stepped(self.optimizer)  # (this update is its step, to its scheduler)
        group = self.optimizer.param_groups[i]
        for k, v in self.fixed[i].items():
            if not _same(group.get(k), v):
                raise ValueError(
                    f"{_WHERE}: param group {i}'s {k!r} changed from {v!r} to "
                    f"{group.get(k)!r} after the optimizer was converted; pardist follows "
                    "the learning rate (and a given scheduler's cycled momentum), not other "
                    "options. "
                    + (
                        "Pass the scheduler that changes it: from_torch(optimizer, model, "
                        "scheduler)."
                        if k in _CYCLED[self.kind]
                        else "Build the optimizer with the value you train with."
                    )
                )
        return group

    def lr(self, i: int):
        def now(count: Any) -> float:
            return float(_number(self._group(i)["lr"]))

        return now

    def option(self, i: int, name: str):
        def now(count: Any) -> Any:
            value = self._group(i)[name]
            return tuple(map(_number, value)) if isinstance(value, tuple) else _number(value)

        return now


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a == b


class _Converted:
    """The update of :func:`from_torch`'s optimizer, with what converting states needs."""

    def __init__(self, update: Any, kind: str, names: list[list[str]], optimizer, model):
        self.update, self.kind, self.names, self.optimizer = update, kind, names, optimizer
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
        scheduler: optional. A torch scheduler of ``optimizer`` (any in
            ``torch.optim.lr_scheduler``, transformers' schedules): the loop steps it as
            in torch, where it did; given here, its momentum cycling (``OneCycleLR``) is
            followed too. Without it the rate is still each group's ``lr`` at each update,
            whatever sets it. Or a function ``update -> lr`` for every group, as a loop that
            sets each ``param_group["lr"]`` by hand (nanoGPT's ``get_lr``) has it.
        steps_per_update: with such a function, its steps per update (it is called with
            ``update * steps_per_update``).

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
    by_hand = callable(scheduler) and not hasattr(scheduler, "optimizer")  # count -> lr
    cycled = False
    if scheduler is not None and not by_hand:
        cycled = _check_scheduler(scheduler, optimizer, steps_per_update)
    live = _Live(optimizer, kind, cycled)
    transforms: dict[Any, Optimizer] = {}
    for i, group in enumerate(optimizer.param_groups):
        if by_hand:  # one rate for every group, as a loop setting param_group["lr"] has it
            lr = _every(scheduler, steps_per_update)
        else:  # the rate the group holds at each update: where the script's scheduler puts it
            lr = live.lr(i)
        transforms[i] = _group_optimizer(kind, group, lr, i, live if cycled else None)
    transforms[_UNTOUCHED] = _keep()
    label = {f"[{name!r}]": i for i, group in enumerate(names) for name in group}

    def labels(path: str, leaf: torch.Tensor) -> Any:
        return label.get(path, _UNTOUCHED)

    inner = multi_transform(transforms, labels)
    return Optimizer(inner.init, _Converted(inner.update, kind, names, optimizer, model), inner.lr)


class prepared:  # noqa: N801 - used as a function, as accelerator.prepare is
    """``scheduler`` as Accelerate's ``prepare()`` makes it: each ``step()`` steps it once per
    process (``num_processes``, default the world size), as Accelerate does without
    ``split_batches``, so that a port of an Accelerate script keeps its ``step()`` line and
    its rates. Everything else (``state_dict``, ``get_last_lr``, ...) is the scheduler's.

    Example:
        >>> import pardist, torch
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        >>> sched = pardist.optim.prepared(torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), 2)
        >>> sched.step(); opt.param_groups[0]["lr"]
        0.25
    """

    def __init__(self, scheduler: Any, num_processes: int | None = None):
        from pardist.runtime import world_size

        self.scheduler = scheduler
        self.num_processes = world_size() if num_processes is None else num_processes

    def step(self, *args: Any, **kwargs: Any) -> None:
        for _ in range(self.num_processes):
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


def _check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer, steps: int) -> bool:
    """The scheduler steps ``optimizer``; whether it cycles the momentum (read live then)."""
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise ValueError(
            f"{_WHERE}: the scheduler steps another optimizer than the one given; pass the "
            "optimizer the scheduler was made for."
        )
    if steps != 1:
        raise ValueError(
            f"{_WHERE}: steps_per_update={steps} with a torch scheduler: the scheduler moves "
            "where your loop calls its step(), as in torch; call it as often as the "
            "original script did (Accelerate steps a prepared scheduler once per process "
            "each update: pardist.optim.prepared(scheduler) steps it so)."
        )
    parts = [scheduler, *getattr(scheduler, "_schedulers", [])]
    return any(getattr(part, "cycle_momentum", False) for part in parts)


def _every(schedule: Any, steps: int):
    if steps == 1:
        return schedule

    def lr(count: int) -> float:
        return schedule(count * steps)

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
    :func:`from_torch`, in the same order. Its groups' rates go back into that torch
    optimizer's param groups (as torch's ``load_state_dict`` does), where the next update
    reads them. Adam's and AdamW's step count comes from the
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
    for group, saved in zip(conv.optimizer.param_groups, saved_groups):
        # The rates (and cycled options) where the script's scheduler had them, as torch's
        # own load_state_dict leaves them: the next update reads them there.
        group.update({k: v for k, v in saved.items() if k != "params" and k in group})
    return {k: out[k] for k in [*range(len(conv.names)), _UNTOUCHED]}


def _count(n: int) -> torch.Tensor:
    return torch.tensor(int(n), dtype=torch.int64)


def state_to_torch(opt: Optimizer, state: Any) -> dict:
    """A torch ``state_dict()`` of ``opt``'s state (:func:`from_torch`'s optimizer), for the
    torch optimizer's ``load_state_dict``: its groups' options as the torch optimizer holds
    them now (where its scheduler put them).

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
        # The group's options as the torch optimizer holds them now (a scheduler's rate and
        # cycled momentum there), the rate by the state's count where it is a function.
        group = {k: v for k, v in conv.optimizer.param_groups[i].items() if k != "params"}
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
