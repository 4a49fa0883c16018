"""Mixed precision: autocast for the step's device, and a functional dynamic loss scale.

bf16 needs no loss scaling: wrap the forward in ``pardist.amp.autocast('bf16')``.
fp16 does: scale the loss, unscale the gradients, and skip the update when they
are not finite. The skip decision must be the same on every rank, or the
replicas diverge; inside a data-parallel step :func:`DynamicLossScale.unscale`
agrees on it over the step's axis. The state is a NamedTuple of tensors, so it
travels through ``data_parallel`` and checkpoints like the optimizer state.

Example (inside a step):

    (loss, grads) = pardist.value_and_grad(lambda p, b: scaler.scale(loss_fn(p, b), ls))(p, b)
    params, opt_state, ls = scaler.step(opt, grads, opt_state, params, ls)

``step`` is GradScaler's ``step`` and ``update``: unscale, update unless a gradient is not
finite on some rank, adjust the scale. It holds in a compiled step too, where the skip is a
``torch.where`` in the graph instead of a Python branch. The same by hand, eagerly:

    grads, finite = scaler.unscale(grads, ls)
    if finite:
        params, opt_state = opt.update(grads, opt_state, params)
    ls = scaler.adjust(ls, finite)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from pardist.collectives import _collectives
from pardist.runtime import (
    _process,
    _tree,
    current_step,
    dtensor_local,
    foreach_mul,
    foreach_norm,
    tracing,
)

__all__ = ["DynamicLossScale", "LossScaleState", "autocast", "dynamic_loss_scale"]

# Accelerate's --mixed_precision words too: "no" is full precision.
_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "no": torch.float32,
}


def autocast(
    dtype: str | torch.dtype | None = "bf16", *, enabled: bool = True
) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on pardist's device: the same line works on CPU and GPU.

    ``dtype``: ``'bf16'``, ``'fp16'``, ``'fp32'`` or ``'no'`` (Accelerate's
    ``--mixed_precision`` values, so a script's flag goes in as it is; ``'no'``, ``'fp32'``
    and None: no autocast), or a torch dtype.

    Example:
        >>> import pardist, torch
        >>> with pardist.amp.autocast('bf16'):
        ...     y = torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3))
        >>> y.dtype
        torch.bfloat16
    """
    if dtype is None:
        dtype = torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(
                f"pardist.amp.autocast: dtype={dtype!r}; give one of {sorted(_DTYPES)} "
                "(Accelerate's --mixed_precision values) or a torch dtype."
            )
        dtype = _DTYPES[dtype]
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=_process.device().type, dtype=dtype, enabled=enabled)


class LossScaleState(NamedTuple):
    scale: torch.Tensor  # float32 scalar
    good_steps: torch.Tensor  # int64 scalar: finite steps since the last change


# A state is data: torch.load(weights_only=True) reads a torch.save of it (issue 48).
torch.serialization.add_safe_globals([LossScaleState])


class DynamicLossScale(NamedTuple):
    """``init``, ``scale``, ``unscale``, ``adjust`` and ``step``: pure functions of the state.

    ``step(opt, grads, opt_state, params, state) -> (params, opt_state, state)`` unscales,
    updates with ``opt`` unless a gradient is not finite on some rank, and adjusts."""

    init: Callable[[], LossScaleState]
    scale: Callable[[Any, LossScaleState], Any]
    unscale: Callable[[Any, LossScaleState], tuple[Any, bool]]
    adjust: Callable[[LossScaleState, bool], LossScaleState]
    step: Callable[..., tuple[Any, Any, LossScaleState]]


def dynamic_loss_scale(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    *,
    enabled: bool = True,
) -> DynamicLossScale:
    """The dynamic loss scale of ``torch.amp.GradScaler``, as pure functions.

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval: as GradScaler.
        enabled: False makes every function a no-op (a scale of 1 that never changes,
            every step finite, no collective), as ``GradScaler(enabled=False)``: one
            script for float16 and for the dtypes that need no scaling.

    Returns:
        A :class:`DynamicLossScale`. ``unscale(grads, state)`` returns the
        gradients divided by the scale and whether all of them are finite on
        every rank of the running step's axis (a one-element ``pmax``): a bool,
        or a 0-dim bool tensor in a compiled step (a graph branches on no value).
        ``step`` does unscale, the update and adjust in one call, in every mode.

    Example:
        >>> import pardist, torch
        >>> scaler = pardist.amp.dynamic_loss_scale(init_scale=8.0)
        >>> state = scaler.init()
        >>> grads, finite = scaler.unscale({'w': torch.tensor([8., float('inf')])}, state)
        >>> finite, float(scaler.adjust(state, finite).scale)
        (False, 4.0)
    """

    def init_fn() -> LossScaleState:
        first = float(init_scale) if enabled else 1.0
        return LossScaleState(torch.tensor(first), torch.zeros((), dtype=torch.int64))

    if not enabled:
        return DynamicLossScale(
            init_fn,
            lambda loss, state: loss,
            lambda grads, state: (grads, True),
            lambda state, finite: state,
            lambda opt, grads, opt_state, params, state: (
                *opt.update(grads, opt_state, params),
                state,
            ),
        )

    def scale_fn(loss, state: LossScaleState):
        ctx = current_step()
        if ctx is not None:
            ctx.call.loss_scaled = True  # non-finite steps are expected and skipped, not reported
        return _tree.tree_map(lambda x: x * state.scale.to(x.device), loss)

    def unscale_fn(grads, state: LossScaleState) -> tuple[Any, bool]:
        leaves, treedef = _tree.tree_flatten(grads)
        if not leaves:
            return grads, True
        inverse = (1.0 / state.scale).to(leaves[0].device)
        unscaled = foreach_mul(leaves, inverse)
        # inf or nan wherever an element is: of this rank's chunks of pardist.fsdp shards (the
        # verdict of every rank is the pmax below)
        norms = foreach_norm([dtensor_local(t) if isinstance(t, DTensor) else t for t in unscaled])
        bad = (~torch.stack([n.to(leaves[0].device) for n in norms]).isfinite()).any().float()
        ctx = current_step()
        if ctx is not None and ctx.mesh is None and ctx.size > 1:  # a compiled step
            bad = _collectives.pmax(bad, ctx.axis)  # (its mesh has no other axis of size > 1)
        elif ctx is not None and ctx.mesh is not None and ctx.mesh.size(ctx.mesh.axis_names) > 1:
            # The same verdict on every rank: model axes too, whose gradients differ.
            bad = _collectives.pmax(bad, ctx.mesh.axis_names)
        finite = bad == 0 if tracing() else not bool(bad)
        return _tree.tree_unflatten(unscaled, treedef), finite

    def adjust_fn(state: LossScaleState, finite: bool) -> LossScaleState:
        if isinstance(finite, torch.Tensor):  # a compiled step: the rule as torch.where
            good = torch.where(finite, state.good_steps + 1, torch.zeros_like(state.good_steps))
            grow = good >= growth_interval
            kept = torch.where(grow, state.scale * growth_factor, state.scale)
            scale = torch.where(finite, kept, state.scale * backoff_factor)
            return LossScaleState(scale, torch.where(grow, torch.zeros_like(good), good))
        if not finite:
            return LossScaleState(state.scale * backoff_factor, torch.zeros_like(state.good_steps))
        good = state.good_steps + 1
        if int(good) >= growth_interval:
            return LossScaleState(state.scale * growth_factor, torch.zeros_like(good))
        return LossScaleState(state.scale, good)

    def step_fn(opt, grads, opt_state, params, state: LossScaleState):
        grads, finite = unscale_fn(grads, state)
        if not isinstance(finite, torch.Tensor):  # eagerly: a skipped update costs nothing
            if finite:
                params, opt_state = opt.update(grads, opt_state, params)
            return params, opt_state, adjust_fn(state, finite)
        # In a graph: the update out of place (new tensors, never the donated inputs), then
        # kept or not by torch.where, which the graph holds where a branch it cannot.
        fresh = lambda tree: _tree.tree_map(  # noqa: E731
            lambda t: t.view_as(t) if isinstance(t, torch.Tensor) else t, tree
        )
        new_params, new_state = opt.update(grads, fresh(opt_state), fresh(params))
        keep = lambda new, old: (  # noqa: E731
            torch.where(finite, new, old) if isinstance(new, torch.Tensor) else new
        )
        params = _tree.tree_map(keep, new_params, params)
        return params, _tree.tree_map(keep, new_state, opt_state), adjust_fn(state, finite)

    return DynamicLossScale(init_fn, scale_fn, unscale_fn, adjust_fn, step_fn)
