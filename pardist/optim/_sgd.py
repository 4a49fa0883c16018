"""SGD with momentum, dampening, Nesterov and weight decay: ``torch.optim.SGD``, purely."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.optim.sgd import sgd as torch_sgd

from pardist.optim import _base
from pardist.runtime import _tree, tracing

__all__ = ["SGDState", "sgd"]


@functools.cache
def _fused_kernel_updates(dtype: torch.dtype) -> bool:
    """Whether torch's fused CPU SGD kernel updates ``dtype`` parameters at all.

    torch 2.11-2.13's leaves bfloat16 and float16 parameters unchanged wherever it
    vectorizes (every full 16 elements on AVX2), with or without momentum: a step would
    silently not train them. Asked of the kernel itself, once per dtype: a step of 1 by
    a gradient of 0.5 must give -0.5 everywhere (exact in every float dtype).
    """
    for momentum in (0.0, 0.9):
        p = torch.zeros(64, dtype=dtype, device="cpu")  # (whatever default device is set)
        step = dict(weight_decay=0.0, momentum=momentum, lr=1.0, dampening=0.0, nesterov=False)
        try:
            torch_sgd([p], [torch.full_like(p, 0.5)], [None], fused=True, maximize=False, **step)
            if not bool((p == -0.5).all()):
                return False
        except RuntimeError:  # a kernel without this dtype (the for-loop code has it)
            return False
    return True


def _fused_updates_all(tensors: list[torch.Tensor]) -> bool:
    """``_fused_kernel_updates`` for the dtype of every CPU tensor of ``tensors``."""
    dtypes = {t.dtype for t in tensors if t.device.type == "cpu"}
    return all(map(_fused_kernel_updates, dtypes))


class SGDState(NamedTuple):
    count: torch.Tensor  # steps taken (int64, on the CPU so schedules read it for free)
    momentum_buffer: Any  # like params; None without momentum


# A state is data: torch.load(weights_only=True) reads a torch.save of it (issue 48).
torch.serialization.add_safe_globals([SGDState])


def sgd(
    lr: float | Callable[[int], float],
    momentum: float | Callable[[int], float] = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    fused: bool | None = None,
    foreach: bool | None = None,
) -> _base.Optimizer:
    """Stochastic gradient descent, step for step equal to ``torch.optim.SGD``.

    It runs torch's own SGD kernels (fused where the device has them), so the
    arithmetic is torch's.

    Args:
        lr: learning rate, or a schedule ``count -> lr``.
        momentum, dampening, weight_decay, nesterov, maximize: as ``torch.optim.SGD``;
            ``momentum`` may be a function ``count -> momentum`` (eager steps only).
        fused, foreach: pick torch's implementation; default: fused where available.

    Example:
        >>> import pardist, torch
        >>> opt = pardist.optim.sgd(lr=0.5, momentum=0.9)
        >>> params = {'w': torch.ones(2)}
        >>> state = opt.init(params)
        >>> params, state = opt.update({'w': torch.ones(2)}, state, params)
        >>> params['w'], int(state.count)
        (tensor([0.5000, 0.5000]), 1)
    """
    cycled = callable(momentum)  # read at each update (a scheduler cycling it): eager only
    if nesterov and ((not cycled and momentum <= 0) or dampening != 0):
        raise ValueError("pardist.optim.sgd: nesterov=True needs momentum > 0 and dampening 0.")
    if (not cycled and momentum < 0) or weight_decay < 0 or (not callable(lr) and lr < 0):
        raise ValueError(
            f"pardist.optim.sgd: lr={lr}, momentum={momentum} and "
            f"weight_decay={weight_decay} must be >= 0."
        )

    _base.schedule(lr)  # a compiled step evaluates it at run time

    def init_fn(params):
        _tree.check_tensor_leaves(params, where="pardist.optim.sgd.init", name="params")
        buffers = _tree.tree_map(torch.zeros_like, params) if momentum else None
        return SGDState(torch.zeros((), dtype=torch.int64), buffers)

    hyper = dict(weight_decay=weight_decay, momentum=momentum, dampening=dampening)
    hyper.update(nesterov=nesterov, maximize=maximize)  # torch's kernels' keywords
    checked = _base.Checked()  # the checks' answers, kept for one signature of the tensors

    def update_fn(grads, state, params):
        old, old_def = _tree.tree_flatten(state.momentum_buffer) if momentum else (None, None)
        g, p, treedef, answers = checked.aligned(grads, params, [old], "pardist.optim.sgd.update")
        traced = tracing()
        # Compiled, the count is no Python int; with dampening 0 the general momentum
        # formula on the zero-initialised buffer is exactly torch's first step.
        first = not traced and int(state.count) == 0
        in_place, p, (buffers,) = _base.owned(p, None if first else old)
        if buffers is None:  # torch starts the momentum from the first gradient
            buffers = [None] * len(p)
        each = True if traced and foreach is None else foreach
        if each and nesterov and not weight_decay:
            g = [t.clone() for t in g]  # torch's foreach Nesterov adds into the gradients
        plan = lambda: _base.fused_ok(p, fused, g, buffers) and _fused_updates_all(p)  # noqa: E731
        use_fused = foreach is None and checked.decided(answers, (in_place, first), plan)

        options = hyper
        if cycled:
            if traced:
                raise NotImplementedError(
                    "pardist.optim.sgd: a momentum that changes at every update (a scheduler "
                    "cycling it) has no form in a compiled step's kernels; the step runs eagerly"
                )
            options = {**hyper, "momentum": float(momentum(int(state.count)))}

        def run(p, buffers):
            now = _base.schedule_value(lr, state.count)
            torch_sgd(p, g, buffers, lr=now, fused=use_fused, foreach=each, **options)

        if traced and momentum and dampening:
            # torch's first step differs (no dampening): a graph takes both, then picks.
            p0, b0 = [t.clone() for t in p], [None] * len(p)
            run(p0, b0)
            run(p, buffers)
            start = state.count == 0
            for new, old_ in zip(p + buffers, p0 + b0):
                new.copy_(torch.where(start, old_, new))
        else:
            run(p, buffers)
        count = _base.next_count(state.count, in_place)
        if in_place and (
            not momentum or (not first and (old_def is treedef or old_def == treedef))
        ):
            # Written in place: the given trees hold the new values (no rebuilt containers)
            return params, SGDState(count, state.momentum_buffer)
        new_buffers = _tree.tree_unflatten(buffers, treedef) if momentum else None
        return _tree.tree_unflatten(p, treedef), SGDState(count, new_buffers)

    return _base.Optimizer(init_fn, _base.on_shards(update_fn, "pardist.optim.sgd.update"), lr)
