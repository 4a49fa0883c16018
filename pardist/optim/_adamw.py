"""AdamW (and Adam): ``torch.optim.AdamW``, purely, on torch's fused kernels."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from operator import attrgetter
from typing import Any, NamedTuple

import torch
from torch.optim.adam import adam as torch_adam
from torch.optim.adamw import adamw as torch_adamw

from pardist.optim import _base
from pardist.runtime import _tree, fused_adam_, fused_adamw_, tracing

__all__ = ["AdamWState", "adam", "adamw"]

_dtype = attrgetter("dtype")


class AdamWState(NamedTuple):
    count: torch.Tensor  # steps taken (int64, CPU)
    exp_avg: Any  # like params
    exp_avg_sq: Any  # like params
    max_exp_avg_sq: Any  # like params with amsgrad, else None


# A state is data: torch.load(weights_only=True) reads a torch.save of it (issue 48).
torch.serialization.add_safe_globals([AdamWState])


def adamw(
    lr: float | Callable[[int], float] = 1e-3,
    betas: tuple[float, float] | Callable[[int], tuple[float, float]] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    fused: bool | None = None,
    foreach: bool | None = None,
    decoupled: bool = True,
) -> _base.Optimizer:
    """AdamW, step for step equal to ``torch.optim.AdamW`` (same defaults).

    Runs torch's fused AdamW kernel where the device has one (CPU and CUDA), with
    one shared step-count tensor per device, else torch's foreach/for-loop code.

    Args:
        lr: learning rate, or a schedule ``count -> lr``.
        betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW``; ``betas``
            may be a function ``count -> betas`` (eager steps only).
        fused, foreach: pick torch's implementation; default: fused where available.
        decoupled: True for AdamW; False gives Adam's L2 weight decay.

    Example:
        >>> import pardist, torch
        >>> opt = pardist.optim.adamw(lr=0.1, weight_decay=0.0)
        >>> params = {'w': torch.zeros(2)}
        >>> state = opt.init(params)
        >>> params, state = opt.update({'w': torch.tensor([1., -1.])}, state, params)
        >>> params['w']
        tensor([-0.1000,  0.1000])
    """
    cycled = callable(betas)  # read at each update (a scheduler cycling them): eager only
    beta1, beta2 = (0.0, 0.0) if cycled else betas
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1) or eps < 0 or weight_decay < 0:
        raise ValueError(
            f"pardist.optim.adamw: betas={betas} must lie in [0, 1); eps={eps} "
            f"and weight_decay={weight_decay} must be >= 0."
        )
    name = "pardist.optim.adamw" if decoupled else "pardist.optim.adam"
    _base.schedule(lr)  # a compiled step evaluates it at run time

    def init_fn(params):
        _tree.check_tensor_leaves(params, where=f"{name}.init", name="params")
        zeros = lambda: _tree.tree_map(torch.zeros_like, params)  # noqa: E731
        return AdamWState(
            torch.zeros((), dtype=torch.int64), zeros(), zeros(), zeros() if amsgrad else None
        )

    hyper = dict(beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps)
    hyper.update(amsgrad=amsgrad, maximize=maximize)  # torch's kernels' keywords
    checked = _base.Checked()  # the checks' answers, kept for one signature of the tensors

    def update_fn(grads, state, params):
        trees = (state.exp_avg, state.exp_avg_sq) + ((state.max_exp_avg_sq,) if amsgrad else ())
        flat = [_tree.tree_flatten(t) for t in trees]
        leaves = [f[0] for f in flat] + ([] if amsgrad else [None])
        g, p, treedef, answers = checked.aligned(grads, params, leaves, f"{name}.update")
        in_place, p, (m, v, vmax) = _base.owned(p, *leaves)
        traced = tracing()  # then the count is no Python int
        options = dict(lr=_base.schedule_value(lr, state.count), **hyper)
        if cycled:
            if traced:
                raise NotImplementedError(
                    f"{name}: betas that change at every update (a scheduler cycling the "
                    "momentum) have no form in a compiled step's kernels; the step runs eagerly"
                )
            options["beta1"], options["beta2"] = map(float, betas(int(state.count)))
        plan = lambda: _groups(p) if _base.fused_ok(p, fused, g, m, v, vmax) else None  # noqa: E731
        groups = checked.decided(answers, in_place, plan) if foreach is None else None
        if groups is not None:
            _fused(p, g, m, v, vmax or [], int(state.count) + 1, decoupled, options, groups)
        elif traced:  # foreach kernels over step tensors, as torch's compiled AdamW
            # torch adds the 1; its bias correction in the step's dtype: float64 for
            # float64 parameters (float32 there would be 1e-6 off, not 1e-16)
            steps = [state.count.to(_step_dtype(t), copy=True) for t in p]
            kernel = torch_adamw if decoupled else torch_adam
            each = True if foreach is None else foreach
            kernel(p, g, m, v, vmax or [], steps, foreach=each, capturable=each, **options)
        else:
            steps = [torch.tensor(float(int(state.count))) for _ in p]  # torch adds the 1
            kernel = torch_adamw if decoupled else torch_adam
            kernel(p, g, m, v, vmax or [], steps, foreach=foreach, **options)
        count = _base.next_count(state.count, in_place)
        if in_place and all(spec is treedef or spec == treedef for _, spec in flat):
            # Written in place: the given trees hold the new values (no rebuilt containers)
            more = state.max_exp_avg_sq if amsgrad else None
            return params, AdamWState(count, state.exp_avg, state.exp_avg_sq, more)
        unflat = lambda ts: _tree.tree_unflatten(ts, treedef)  # noqa: E731
        return unflat(p), AdamWState(count, unflat(m), unflat(v), unflat(vmax) if amsgrad else None)

    return _base.Optimizer(init_fn, _base.on_shards(update_fn, f"{name}.update"), lr)


def _step_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _groups(p: list) -> list[tuple[torch.device, list[int] | None]]:
    """The fused kernel's calls: a device and the indices it updates (None: all of them)."""
    cpu = all(map(_base._is_cpu, p))  # (CPU: no objects)
    one_device = cpu or len(set(map(_base._device, p))) == 1
    if p and one_device and len(set(map(_dtype, p))) == 1:  # the common case: one call
        return [(p[0].device, None)]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, t in enumerate(p):
        groups[(t.device, t.dtype)].append(i)
    return [(device, index) for (device, _), index in groups.items()]


def _fused(p, g, m, v, vmax, step: int, decoupled: bool, options: dict, groups: list) -> None:
    """torch's fused kernel per (device, dtype) group, reading one step tensor per group."""
    kernel = fused_adamw_ if decoupled else fused_adam_
    for device, index in groups:
        pick = lambda ts, index=index: ts if index is None or not ts else [ts[i] for i in index]  # noqa: E731
        steps = [torch.full((), float(step), dtype=torch.float32, device=device)]
        kernel(pick(p), pick(g), pick(m), pick(v), pick(vmax), steps * len(pick(p)), **options)


def adam(
    lr: float | Callable[[int], float] = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    **kwargs,
) -> _base.Optimizer:
    """Adam with L2 weight decay, equal to ``torch.optim.Adam``; see :func:`adamw`."""
    return adamw(lr, betas, eps, weight_decay, amsgrad, decoupled=False, **kwargs)
