"""Collectives over named mesh axes that autograd and torch.func differentiate correctly.

Every rank runs the same program on its own data. Which transpose is right depends
on whether a value *varies* over an axis or is *invariant* over it (the same on every
rank of it), exactly as in JAX's ``shard_map`` with ``check_vma=True``: every step on
more than one process types its values (``_vma``), each collective's result is typed
by its Function's rule, and an invariant input is lifted with ``pvary`` first (so
``psum`` of an invariant ``x`` is ``axis_size * x``). The table of forwards,
transposes and type rules is ``pardist/transport/_primitives.py``; docs/semantics.md
sets it beside JAX's.

Outside any step nothing is typed: every value counts as varying and each result is
lifted back at once (``psum``'s transpose is then ``psum``, the gradient of the sum
of every rank's objective). Python numbers are constants, the same on every rank:
``psum(1.0, axis)`` is the axis size, as in JAX.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pardist.collectives import _groups, _vma
from pardist.compile import _traced
from pardist.runtime import (
    Compiled,
    Eager,
    _lockstep,
    _mesh,
    _tree,
    current_mode,
    current_step,
    functorch,
)
from pardist.transport import _primitives

__all__ = [
    "AxisIndex",
    "varying_axes",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "pmin",
    "psum",
    "pvary",
]

_functorch = functorch
reduce_groups = (
    _primitives.reduce
)  # how reductions travel: shared memory on one host, else the backend
_NUMBER = (int, float, bool)


def psum_groups(x: torch.Tensor, groups: list) -> torch.Tensor:
    """The untyped psum over process groups (backward: psum), as pardist.grad's mean calls it."""
    return _primitives.family().Psum.apply(x, groups, reduce_groups)


def needs_grad(x: torch.Tensor) -> bool:
    """Whether a gradient may flow through ``x`` (so its lift must be a real ``pvary``)."""
    return torch.is_grad_enabled() and (
        x.requires_grad or _functorch.peek_interpreter_stack() is not None
    )


def lift(state: _vma.Tracking, x: torch.Tensor, axes: frozenset[str]) -> torch.Tensor:
    """``x`` made varying over ``axes`` (JAX inserts the same ``pvary`` before a collective)."""
    missing = axes - _vma.grad_axes(state.get(x))
    if not missing or not needs_grad(x):
        return x
    state.outside_grads = state.outside_grads or not state.grads
    return _primitives.family().Pvary.apply(x, state.groups(missing), reduce_groups)


def retype(state: _vma.Tracking, out: torch.Tensor, v: frozenset, fn, axes) -> torch.Tensor:
    """Type ``out``, ``fn``'s result from a value of type ``v``, by ``fn``'s type rule."""
    kind = fn.typing
    return state.set(out, _vma.drop(v, axes) if kind == "invariant" else _vma.vary(v, axes))


def guard(state: _vma.Tracking | None, names: tuple, where: str) -> None:
    """A collective over ``names`` may run here: a manual axis of the step, and not over
    the data axes inside the deterministic mode's row groups (whose pairing of rows across
    ranks changes with the world size: the mode's bits would not be the same)."""
    if state is not None:
        state.check(names, where)
    if _lockstep.current() is not None:
        ctx = current_step()
        if ctx is not None and set(names) & set(ctx.axis):
            raise ValueError(
                f"{where} over {names} inside the function pardist.grad differentiates in the "
                f"deterministic mode: its row groups would pair up differently at another "
                "world size, so the mode's bits could not be the same. Call it outside "
                "pardist.grad (on its results), or train without deterministic=."
            )


def split_leaves(tree: Any, where: str) -> tuple[list, Any]:
    """``tree``'s leaves (tensors, or Python numbers) and its structure."""
    leaves, spec = _tree.tree_flatten(tree)
    if not all(isinstance(x, torch.Tensor) or type(x) in _NUMBER for x in leaves):
        _tree.check_tensor_leaves(tree, where=where, name="tree")  # names the leaf
    return leaves, spec


def _map(tree: Any, where: str, fn) -> Any:
    leaves, spec = split_leaves(tree, where)
    return _tree.tree_unflatten([fn(x) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def _coalesced(tree: Any, where: str, fn, typed: Callable | None, number) -> Any:
    """Apply an elementwise collective ``fn`` once per (dtype, device, type), not per leaf.

    A tree of many small tensors (batch-norm buffers, metrics) then costs one
    collective. The flattening is differentiable (cat / split), so autograd and
    torch.func see through it. ``typed(out, v)`` types a result from its input's
    type; ``number(x)`` is the result for a Python number.
    """
    leaves, spec = split_leaves(tree, where)
    state = _vma.current() if typed is not None else None
    out: list = [number(x) if type(x) in _NUMBER else None for x in leaves]
    groups: dict[tuple, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if out[i] is None:
            kind = state.get(leaf) if state is not None else None
            groups.setdefault((leaf.dtype, leaf.device, kind), []).append(i)
    with _vma.paused():
        for (_, _, kind), index in groups.items():
            if len(index) == 1:
                out[index[0]] = fn(leaves[index[0]])
            else:
                joined = torch.cat([leaves[i].reshape(-1) for i in index])
                if state is not None:  # (made while paused: typed as its leaves, by hand)
                    state.set(joined, kind)
                flat = fn(joined)
                pieces = flat.split([leaves[i].numel() for i in index])
                for i, piece in zip(index, pieces):
                    out[i] = piece.view(leaves[i].shape)
            if state is not None:
                for i in index:
                    typed(out[i], kind)
    return _tree.tree_unflatten(out, spec)


def _reduction(tree: Any, axis, name: str, op, number, groups=None, scale: float = 1.0) -> Any:
    """psum / pmean / pmax over ``axis`` (within ``groups`` of its indices, if given).

    ``op(x, process_groups, typed)`` is the per-tensor reduction, ``number(x, size)``
    the result for a Python number, ``scale`` a factor of the result (pmean's 1/size).
    """
    mesh = _mesh.current_mesh(name)
    names, where = mesh.axes(axis, name), f"pardist.{name}"
    size, pgroups = mesh.size(axis, name), mesh.groups(axis, name)
    if groups is not None:
        group, size, _ = _groups.subgroup(mesh.group(axis, name), mesh.index(axis), groups, where)
        pgroups = [group] if size > 1 else []
    if not pgroups:
        return _coalesced(tree, where, lambda x: x, None, lambda x: number(x, 1))
    factor = scale if scale != 1.0 else None
    state = _vma.current()
    guard(state, names, where)
    axes = frozenset(names) & state.live if state is not None else frozenset()

    def one(x: torch.Tensor) -> torch.Tensor:
        y = op(lift(state, x, axes) if state is not None else x, pgroups, state)
        return y * factor if factor is not None else y

    def typed(out: torch.Tensor, v: frozenset):
        # Over groups of indices the result still differs between groups: varying.
        kind = _vma.drop(v, axes) if groups is None else _vma.vary(v, axes)
        state.set(out, kind)

    return _coalesced(tree, where, one, typed, lambda x: number(x, size))


def _summed(groups_option):
    def op(x, pgroups, state):
        fam = _primitives.family()
        kind = fam.PsumInvariant if state is not None and groups_option is None else fam.Psum
        return kind.apply(x, pgroups, reduce_groups)

    return op


def _integral(x):
    return int(x) if type(x) is bool else x


def psum(tree: Any, axis: str | tuple[str, ...], *, axis_index_groups=None) -> Any:
    """Sum every leaf of ``tree`` over the ranks of ``axis``.

    The result is invariant over ``axis``; its transpose is the identity (a ``pvary``
    of the cotangent), and an invariant input is lifted first, so ``psum`` of a value
    that is the same on every rank is ``axis_size`` times it (JAX's rule; see
    docs/semantics.md). With a tuple of axes it reduces the innermost axis first.
    ``axis_index_groups=[[0, 1], [2, 3]]`` sums within each group of indices (the
    result then still varies over the axis, and transposes to the same grouped sum).
    A Python number is a constant: ``psum(1, 'gpu')`` is the axis size.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.psum({'n': torch.tensor(3.), 'ranks': 1}, 'gpu')
        {'n': tensor(3.), 'ranks': 1}
        >>> pardist.shutdown()
    """
    return current_mode().run("psum", tree, axis, axis_index_groups)


@Eager.register("psum")
def _psum(mode, tree: Any, axis, groups) -> Any:
    number = lambda x, size: _integral(x) * size  # noqa: E731
    return _reduction(tree, axis, "psum", _summed(groups), number, groups)


def pmean(tree: Any, axis: str | tuple[str, ...], *, axis_index_groups=None) -> Any:
    """Average every leaf of ``tree`` over the ranks of ``axis`` (differentiable).

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.pmean([torch.tensor([1., 3.]), 2.0], 'gpu')
        [tensor([1., 3.]), 2.0]
        >>> pardist.shutdown()
    """
    return current_mode().run("pmean", tree, axis, axis_index_groups)


@Eager.register("pmean")
def _pmean(mode, tree: Any, axis, groups) -> Any:
    mesh = _mesh.current_mesh("pmean")
    size = mesh.size(axis, "pmean")
    if groups is not None:  # the size of this rank's group of indices
        index = mesh.index(axis)
        size = next(
            len(g) for g in _groups.check(groups, size, "pardist.pmean", False) if index in g
        )
    number = lambda x, n: float(x)  # noqa: E731  (the mean of a constant is itself)
    return _reduction(tree, axis, "pmean", _summed(groups), number, groups, 1.0 / size)


def _maximum(groups_option):
    def op(x, pgroups, state):
        typed = state is not None and groups_option is None
        return _primitives.family().Pmax.apply(x, pgroups, reduce_groups, typed)

    return op


def pmax(tree: Any, axis: str | tuple[str, ...], *, axis_index_groups=None) -> Any:
    """Elementwise maximum of every leaf over the ranks of ``axis``.

    The gradient flows to the ranks holding the maximum (split evenly on ties); JAX
    defines none. ``axis_index_groups`` as for :func:`psum`.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.pmax(torch.tensor([1., -2.]), 'gpu')
        tensor([ 1., -2.])
        >>> pardist.shutdown()
    """
    return current_mode().run("pmax", tree, axis, axis_index_groups)


@Eager.register("pmax")
def _pmax(mode, tree: Any, axis, groups) -> Any:
    return _reduction(tree, axis, "pmax", _maximum(groups), lambda x, n: x, groups)


def pmin(tree: Any, axis: str | tuple[str, ...], *, axis_index_groups=None) -> Any:
    """Elementwise minimum of every leaf over the ranks of ``axis``: ``-pmax(-x)``, exactly
    (negation is exact), with pmax's gradient.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.pmin(torch.tensor([1., -2.]), 'gpu')
        tensor([ 1., -2.])
        >>> pardist.shutdown()
    """
    negated = _map(tree, "pardist.pmin", torch.neg)
    return _map(pmax(negated, axis, axis_index_groups=axis_index_groups), "pardist.pmin", torch.neg)


def pvary(tree: Any, axis: str | tuple[str, ...]) -> Any:
    """Mark every leaf as varying over ``axis``: the identity, whose transpose is ``psum``.

    pardist inserts it by itself wherever an invariant value meets a varying one
    inside a step, and before every collective that needs a varying input. Call it
    yourself where the sum of the cotangents is what you mean without any operation
    showing it. Outside a step every value already counts as varying, and this
    returns its input.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.pvary(torch.ones(2), 'gpu')
        tensor([1., 1.])
        >>> pardist.shutdown()
    """
    return current_mode().run("pvary", tree, axis)


@Compiled.register("pvary")
def _pvary_traced(mode, tree: Any, axis) -> Any:
    _traced.axis_size(axis, mode.plan)  # names an unknown axis; nothing is tracked in a graph
    return _map(tree, "pardist.pvary", lambda x: x)


@Eager.register("pvary")
def _pvary(mode, tree: Any, axis) -> Any:
    mesh = _mesh.current_mesh("pvary")
    names = mesh.axes(axis, "pvary")
    state = _vma.current()
    if state is None:
        return _map(tree, "pardist.pvary", lambda x: x)
    axes = frozenset(names) & state.live

    def one(x: torch.Tensor) -> torch.Tensor:
        v = state.get(x)
        if axes <= _vma.grad_axes(v):
            return state.set(x.view_as(x), _vma.vary(v, axes))
        with _vma.paused():
            y = lift(state, x, axes)
            return state.set(y if y is not x else x.view_as(x), _vma.vary(v, axes))

    return _map(tree, "pardist.pvary", one)


def varying_axes(x: Any) -> tuple[str, ...]:
    """The mesh axes ``x`` varies over inside the running step, in mesh order (JAX's
    ``jax.typeof(x).vma``): ``()`` for a value that is the same on every rank, and
    outside any step (where nothing is typed). Useful to see where a ``pmean`` is missing.

    Example:
        >>> import pardist, torch
        >>> pardist.varying_axes(torch.ones(2))
        ()
    """
    state = _vma.current()
    if state is None:
        return ()
    if isinstance(x, AxisIndex):
        return state.ordered(x.vma)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"pardist.varying_axes: x is a {type(x).__name__}; give a tensor.")
    return state.ordered(_vma.value_axes(state.get(x)))


class AxisIndex(int):
    """This rank's index along an axis: an ``int`` that *varies* over the axis, as JAX's
    ``axis_index`` (a varying int32) does. Integer arithmetic keeps the mark, and a
    tensor operation that takes it (``w * (i + 1)``, ``x[i]``, ``w[:, i * k:(i + 1) * k]``,
    ``torch.tensor(i)``) gives a value that varies over the axis, so its gradient has
    JAX's ``psum``. ``vma``: the axes it varies over."""

    vma: frozenset = frozenset()

    def __new__(cls, value: int, vma: frozenset = frozenset()):
        out = super().__new__(cls, value)
        out.vma = vma
        return out

    def __reduce__(self):
        return int, (int(self),)  # a plain int to whatever pickles it


def _keeps_mark(name: str):
    base = getattr(int, name)

    def op(self, other):
        out = base(self, other)
        if type(out) is not int:
            return out
        vma = self.vma | other.vma if isinstance(other, AxisIndex) else self.vma
        return AxisIndex(out, vma)

    op.__name__ = name
    return op


for _name in ("add", "sub", "mul", "floordiv", "mod", "pow", "lshift", "rshift", "and", "or"):
    for _side in ("__", "__r"):
        setattr(AxisIndex, f"{_side}{_name}__", _keeps_mark(f"{_side}{_name}__"))
AxisIndex.__neg__ = lambda self: AxisIndex(-int(self), self.vma)
AxisIndex.__abs__ = lambda self: AxisIndex(abs(int(self)), self.vma)


def axis_index(axis: str | tuple[str, ...]) -> int:
    """This rank's position along ``axis`` (row-major over a tuple of axes).

    An :class:`AxisIndex`: an int that varies over ``axis``, so values computed from
    it are typed as varying (JAX's ``axis_index``).

    Example:
        >>> import pardist
        >>> _ = pardist.init()
        >>> pardist.axis_index('gpu'), pardist.axis_size('gpu')
        (0, 1)
        >>> pardist.shutdown()
    """
    return current_mode().run("axis_index", axis)


def axis_size(axis: str | tuple[str, ...]) -> int:
    """The number of ranks along ``axis`` (the product over a tuple of axes)."""
    return current_mode().run("axis_size", axis)


@Eager.register("axis_index")
def _axis_index(mode, axis) -> int:
    mesh = _mesh.current_mesh("axis_index")
    names = mesh.axes(axis, "axis_index")
    return AxisIndex(mesh.index(axis), frozenset(n for n in names if mesh.shape[n] > 1))


Eager.register("axis_size")(lambda mode, axis: _mesh.current_mesh("axis_size").size(axis))


# A compiled step's rules: its graph's collectives, with the plan's static axes; every
# value counts as varying there (see pardist/compile).
def _no_groups(name: str, groups) -> None:
    if groups is not None:
        raise NotImplementedError(
            f"pardist.{name}(axis_index_groups=...) has no traceable form inside a compiled "
            "step; pass compile=False (the step runs eagerly)"
        )


@Compiled.register("psum")
def _psum_traced(mode, tree, axis, groups):
    _no_groups("psum", groups)
    return _traced.psum(tree, axis, mode.plan)


@Compiled.register("pmean")
def _pmean_traced(mode, tree, axis, groups):
    _no_groups("pmean", groups)
    return _traced.pmean(tree, axis, mode.plan)


@Compiled.register("pmax")
def _pmax_traced(mode, tree, axis, groups):
    _no_groups("pmax", groups)
    return _traced.pmax(tree, axis, mode.plan)


Compiled.register("axis_index")(lambda mode, axis: _traced.axis_index(axis, mode.plan))
Compiled.register("axis_size")(lambda mode, axis: _traced.axis_size(axis, mode.plan))
