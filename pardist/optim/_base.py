"""Optimizers as pairs of pure functions, the optax way.

A :class:`GradientTransformation` maps gradients to gradients (clipping, ...);
an :class:`Optimizer` maps gradients to new parameters. Both are NamedTuples of
``init`` and ``update``; their states are NamedTuples of tensors, so they
checkpoint, shard and travel through ``data_parallel`` like any other tree.
``chain`` composes them.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from pardist.compile import _ops
from pardist.optim import _aligned
from pardist.runtime import (
    Signature,
    _tree,
    current_mode,
    donating,
    dtensor_like,
    dtensor_local,
    fused_kernel_devices,
    is_dense,
    is_donated,
    laid_out_like,
    same_layout,
    tracing,
)

__all__ = [
    "Checked",
    "GradientTransformation",
    "Optimizer",
    "chain",
    "on_shards",
    "schedule",
    "schedule_value",
]


class GradientTransformation(NamedTuple):
    """``init(params) -> state``; ``update(grads, state, params) -> (grads, state)``."""

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]


class Optimizer(NamedTuple):
    """``init(params) -> state``; ``update(grads, state, params) -> (params, state)``.

    Pure unless the running data-parallel step was given ``params`` and ``state``
    through ``donate_argnums``: then the update happens in place, in torch's fused
    (or foreach) kernels, and the same tensors come back.
    """

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]
    lr: Any = None  # its learning rate or schedule, for current_lr (None: not known)


def chain(*parts: GradientTransformation | Optimizer) -> GradientTransformation | Optimizer:
    """Apply gradient transformations in order, optionally ending with an optimizer.

    Example:
        >>> import pardist, torch
        >>> opt = pardist.optim.chain(pardist.optim.clip_by_global_norm(1.0),
        ...                           pardist.optim.sgd(lr=0.1))
        >>> params = {'w': torch.zeros(2)}
        >>> state = opt.init(params)
        >>> params, state = opt.update({'w': torch.tensor([3., 4.])}, state, params)
        >>> params['w']
        tensor([-0.0600, -0.0800])
    """
    if not parts:
        raise ValueError("pardist.optim.chain: give at least one transformation.")
    *transforms, last = parts
    for i, part in enumerate(transforms):
        if not isinstance(part, GradientTransformation):
            raise TypeError(
                f"pardist.optim.chain: part {i} is a {type(part).__name__}; only the last "
                "part may be an optimizer, the others must be gradient transformations."
            )

    def init_fn(params):
        return tuple(part.init(params) for part in parts)

    def update_fn(grads, state, params=None):
        states = []
        for part, s in zip(transforms, state[:-1]):
            grads, s = part.update(grads, s, params)
            states.append(s)
        out, s = last.update(grads, state[-1], params)
        return out, tuple(states + [s])

    if isinstance(last, Optimizer):
        return Optimizer(init_fn, update_fn, last.lr)
    return GradientTransformation(init_fn, update_fn)


def schedule_value(value: float | Callable[[int], float], count: torch.Tensor) -> float:
    """A hyper-parameter that may be a schedule: a function of the step count.

    While being compiled, a schedule becomes a graph node that evaluates it at run
    time (a float64 scalar tensor): the count is a tensor, not a Python int.
    """
    if not callable(value):
        return value
    if tracing():  # registered by the optimizer's factory
        return torch.ops.pardist.schedule(count, id(value))
    return float(value(int(count)))


def schedule(value: float | Callable[[int], float]) -> float | Callable[[int], float]:
    """Register a schedule for compiled steps (see ``schedule_value``); returns it."""
    if callable(value):
        _ops.schedule_key(value)
    return value


_shape = operator.attrgetter("shape")
_device = operator.attrgetter("device")
_device_type = operator.attrgetter("type")
_is_cpu = operator.attrgetter("is_cpu")
_contiguous = torch.Tensor.is_contiguous
_given = functools.partial(operator.is_not, None)


def aligned(grads: Any, params: Any, where: str) -> tuple[list, list, Any]:
    """Flat (grads, params, treedef), checking that the two trees have one structure.

    Each gradient comes back laid out like its parameter (copied where the strides
    differ): torch's fused kernels walk both memories in step.
    """
    p_leaves, treedef = _tree.tree_flatten(params)
    g_leaves, g_def = _tree.tree_flatten(grads)
    if g_def != treedef:
        raise ValueError(
            f"{where}: grads and params have different structures ({len(g_leaves)} vs "
            f"{len(p_leaves)} leaves). Pass the gradients of exactly these params."
        )
    if not all(map(isinstance, p_leaves, itertools.repeat(torch.Tensor))):
        _tree.check_tensor_leaves(params, where=where, name="params")  # names the leaf
    if tracing():  # (dynamo does not trace map over attrgetter)
        same = all(
            isinstance(g, torch.Tensor) and g.shape == p.shape for g, p in zip(g_leaves, p_leaves)
        )
    else:  # map: no Python per tensor (torch.is_tensor is a Python function: isinstance)
        same = all(map(isinstance, g_leaves, itertools.repeat(torch.Tensor))) and list(
            map(_shape, g_leaves)
        ) == list(map(_shape, p_leaves))
    if same:  # the common case, without building key paths
        if not tracing() and all(map(_contiguous, g_leaves + p_leaves)):
            return g_leaves, p_leaves, treedef
        g_leaves = [laid_out_like(g, p) for g, p in zip(g_leaves, p_leaves)]
        return g_leaves, p_leaves, treedef
    for (path, g), p in zip(_tree.leaves_with_paths(grads, "grads"), p_leaves):
        if not isinstance(g, torch.Tensor) or g.shape != p.shape:
            shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            raise ValueError(
                f"{where}: {path} has shape {shape} but its parameter has shape {tuple(p.shape)}."
            )
    return g_leaves, p_leaves, treedef


class Checked:
    """What an optimizer's checks found, remembered for a few signatures of its tensors.

    ``aligned`` and ``fused_ok`` read only what a :class:`Signature` compares (type,
    shape, strides, dtype, device of each tensor). A later call whose parameters,
    gradients and state match checked ones, position by position, in trees of one
    structure, skips them: one pass in C instead of one per property. Any other call
    runs every check and remembers its tensors (issue 19). The last ``KEEP``
    signatures are kept (one optimizer may serve several parameter groups in turn);
    making one costs about ten checked calls, so after ``MAKE`` of them an optimizer
    whose signatures keep changing stops making more and checks every call, as before.
    """

    KEEP, MAKE = 4, 64

    def __init__(self):
        self._known: list[tuple[Signature, dict]] = []  # newest first; dict: in_place -> answer
        self._made = 0

    def aligned(self, grads: Any, params: Any, states: list, where: str) -> tuple:
        """``aligned``'s (grads, params, treedef), and the answers kept for these tensors'
        signature (None: not remembered)."""
        if tracing():  # a graph's guards are dynamo's
            return (*aligned(grads, params, where), None)
        p, treedef = _tree.tree_flatten(params)
        g, g_def = _tree.tree_flatten(grads)
        every = p + g + [t for s in states if s is not None for t in s]
        if g_def is treedef or g_def == treedef:
            for i, entry in enumerate(self._known):
                if entry[0].matches(every):
                    if i:  # the newest first
                        self._known.insert(0, self._known.pop(i))
                    return g, p, treedef, entry[1]
        g_out, p, treedef = aligned(grads, params, where)
        # Remembered only where the gradients are used as given (none re-laid out).
        same = len(g_out) == len(g) and all(map(operator.is_, g_out, g))
        if not same or self._made >= self.MAKE:
            return g_out, p, treedef, None
        self._made += 1
        signature, answers = Signature(every), {}
        if not signature.usable:  # subclasses, or no guard in this torch
            return g_out, p, treedef, None
        self._known = [(signature, answers)] + self._known[: self.KEEP - 1]
        return g_out, p, treedef, answers

    @staticmethod
    def decided(answers: dict | None, in_place: bool, decide: Callable[[], Any]) -> Any:
        """``decide()``, or what it returned before for these tensors' signature."""
        if answers is not None and in_place in answers:
            return answers[in_place]
        answer = decide()
        if answers is not None:
            answers[in_place] = answer
        return answer


def owned(params: list, *states: list) -> tuple[bool, list, list[list]]:
    """Tensors the update may write: the donated ones, else fresh copies (purity)."""
    flat_states = [s for s in states if s is not None]
    if is_donated(list(itertools.chain(params, *flat_states))):
        return True, params, list(states)
    copy = lambda ts: None if ts is None else [t.clone() for t in ts]  # noqa: E731
    return False, copy(params), [copy(s) for s in states]


def next_count(count: torch.Tensor, in_place: bool) -> torch.Tensor:
    return count.add_(1) if in_place else count + 1


def fused_ok(tensors: list[torch.Tensor], fused: bool | None, *alongside: list | None) -> bool:
    """Use torch's fused kernels where the caller allows it and the device has them.

    Those kernels walk each parameter's memory and that of its gradient and state
    (``alongside``: lists like ``tensors``, or None) in step, ignoring strides: a
    dense parameter and the same strides everywhere are needed, or the update is
    silently wrong. Otherwise torch's foreach / for-loop code runs, which indexes.
    Compiled graphs use the foreach kernels: the fused ones have no fake implementation.
    """
    if fused is False or tracing():
        return False
    if not all(map(torch.Tensor.is_floating_point, tensors)):  # (2x torch.is_floating_point)
        return False
    supported = set(fused_kernel_devices())  # (per call: a backend may be renamed)
    on_cpu = "cpu" in supported and all(map(_is_cpu, tensors))  # no device objects made
    if not on_cpu and not supported.issuperset(map(_device_type, set(map(_device, tensors)))):
        return False
    given = itertools.chain.from_iterable(filter(None, alongside))
    if all(map(_contiguous, tensors)) and all(map(_contiguous, filter(_given, given))):
        return True  # the common case, cheaply
    return all(is_dense(t) for t in tensors) and all(
        t is None or same_layout(t, p) for ts in alongside if ts for t, p in zip(ts, tensors)
    )


def on_shards(update_fn: Callable, where: str) -> Callable:
    """``update_fn`` made to take DTensor shards (``pardist.fsdp`` params, their grads, state).

    torch's fused optimizer kernels have no DTensor rule, and DTensor dispatch
    costs more than updating a shard. The update is elementwise, so each rank
    updates its local shards and the results keep their layout; donated shards are
    updated in place and come back as the same DTensors.
    """

    def update(grads, state, params):
        p_leaves = _tree.tree_leaves(params)
        if not _tree.any_instance(p_leaves, DTensor):
            return update_fn(grads, state, params)
        aligned(grads, params, where)  # same structure, same (global) shapes
        for (path, g), p in zip(_tree.leaves_with_paths(grads, "grads"), p_leaves):
            if isinstance(g, DTensor) != isinstance(p, DTensor):
                raise ValueError(
                    f"{where}: {path} is a {type(g).__name__} but its parameter is a "
                    f"{type(p).__name__}. pardist.fsdp parameters take the shards that "
                    "pardist.grad returns inside the data-parallel step."
                )
        s_leaves, s_def = _tree.tree_flatten(state)
        for path, s in _tree.leaves_with_paths(state, "opt_state"):
            if isinstance(s, torch.Tensor) and not isinstance(s, DTensor) and s.ndim:
                raise ValueError(
                    f"{where}: {path} has shape {tuple(s.shape)}, a full tensor, but the "
                    "params are pardist.fsdp shards. Make the state from the sharded params: "
                    "opt_state = opt.init(params) after params = pardist.fsdp(params)."
                )
        local = lambda x: dtensor_local(x) if isinstance(x, DTensor) else x  # noqa: E731
        g_leaves = _tree.tree_leaves(grads)
        lp, lg, ls = (list(map(local, ts)) for ts in (p_leaves, g_leaves, s_leaves))
        shards = [x for x in p_leaves + s_leaves if isinstance(x, DTensor)]
        donated = is_donated(shards)
        # The deterministic mode: each shard updated at its place in the whole tensor
        # (optim._aligned), so that it has one process's bits on every CPU.
        aligned_ = current_mode().name == "deterministic"
        bp, pw = _aligned.widened(p_leaves, lp) if aligned_ else (lp, None)
        bg = _aligned.widened(g_leaves, lg)[0] if aligned_ else lg
        bs, sw = _aligned.widened(s_leaves, ls) if aligned_ else (ls, None)
        mine = [t for t in bp + bs if isinstance(t, torch.Tensor)] if donated else []
        p_def = _tree.tree_flatten(params)[1]
        with donating(mine):
            new_p, new_s = update_fn(
                _tree.tree_unflatten(bg, p_def),
                _tree.tree_unflatten(bs, s_def),
                _tree.tree_unflatten(bp, p_def),
            )
        if aligned_:
            new_p, new_s = (
                _tree.tree_unflatten(_aligned.narrowed(leaves, w, was, donated), treedef)
                for (leaves, treedef), w, was in (
                    (_tree.tree_flatten(new_p), pw, lp),
                    (_tree.tree_flatten(new_s), sw, ls),
                )
            )
        return _rewrap(new_p, p_leaves, lp), _rewrap(new_s, s_leaves, ls)

    return update


def _rewrap(tree: Any, old: list, old_local: list) -> Any:
    leaves, treedef = _tree.tree_flatten(tree)
    if len(leaves) != len(old):
        return tree
    out = []
    for new, was, was_local in zip(leaves, old, old_local):
        if isinstance(was, DTensor):
            new = was if new is was_local else dtensor_like(new, was)
        out.append(new)
    return _tree.tree_unflatten(out, treedef)
