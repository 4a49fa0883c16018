"""Collectives over named mesh axes that autograd and torch.func differentiate correctly.

Every rank runs the same program on its own data. Which backward rule is right
depends on whether a value *varies* over an axis or is *invariant* over it (the
same on every rank of it), exactly as in JAX's ``shard_map``:

==================  =========================  =================================
collective          result                     transpose (backward)
==================  =========================  =================================
``psum``/``pmean``  invariant over the axis    identity (``pvary``)
``pmax``            invariant over the axis    to the ranks holding the maximum
``all_gather``      varying                    ``psum_scatter``
``all_gather``      invariant                  this rank's block
(``invariant``)
``psum_scatter``    varying                    ``all_gather``
``all_to_all``      varying                    ``all_to_all``, dims swapped
``pvary``           varying                    ``psum``
==================  =========================  =================================

An input that is invariant over the axis is first lifted with ``pvary`` (so
``psum`` of an invariant ``x`` is ``axis_size * x``). Inside a step with axes
beyond its data axes (``pardist.shard_map``, tensor parallelism) pardist tracks
which axes every value varies over (``pardist._vma``) and applies these rules,
lifting invariant values where they meet varying ones. Elsewhere (plain data
parallelism, outside any step) every value counts as varying, and ``psum``'s
transpose is ``psum``: for data parallelism that is exactly the gradient of the
mean loss over the axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pardist.collectives import _vma
from pardist.compile import _traced
from pardist.runtime import Compiled, Eager, _mesh, _tree, current_mode, functorch
from pardist.transport import (
    AllGather,
    AllGatherInvariant,
    Pmax,
    Psum,
    PsumInvariant,
    Pvary,
    _primitives,
)

__all__ = ["all_gather", "axis_index", "axis_size", "pmax", "pmean", "psum", "pvary"]

_functorch = functorch
reduce_groups = (
    _primitives.reduce
)  # how reductions travel: shared memory on one host, else the backend


def psum_groups(x: torch.Tensor, groups: list) -> torch.Tensor:
    """The untracked psum over process groups (backward: psum), as pardist.grad's mean calls it."""
    return Psum.apply(x, groups, reduce_groups)


def needs_grad(x: torch.Tensor) -> bool:
    """Whether a gradient may flow through ``x`` (so its lift must be a real ``pvary``)."""
    return torch.is_grad_enabled() and (
        x.requires_grad or _functorch.peek_interpreter_stack() is not None
    )


def _lift(state: _vma.Tracking, x: torch.Tensor, axes: frozenset[str]) -> torch.Tensor:
    """``x`` made varying over ``axes`` (JAX inserts the same ``pvary`` before a collective)."""
    missing = axes - state.get(x)
    return Pvary.apply(x, state.groups(missing), reduce_groups) if missing and needs_grad(x) else x


def _tensors(tree: Any, where: str) -> tuple[list[torch.Tensor], Any]:
    leaves = _tree.check_tensor_leaves(tree, where=where, name="tree")
    return leaves, _tree.tree_flatten(tree)[1]


def _map(tree: Any, where: str, fn) -> Any:
    leaves, spec = _tensors(tree, where)
    return _tree.tree_unflatten([fn(leaf) for leaf in leaves], spec)


def _coalesced(tree: Any, where: str, fn, vma: Callable | None = None) -> Any:
    """Apply an elementwise collective ``fn`` once per (dtype, device), not once per leaf.

    A tree of many small tensors (batch-norm buffers, metrics) then costs one
    collective. The flattening is differentiable (cat / split), so autograd and
    torch.func see through it. Tracked, leaves are also grouped by the axes
    they vary over, and ``vma(v)`` gives the result's.
    """
    leaves, spec = _tensors(tree, where)
    state = _vma.current() if vma is not None else None
    kinds = [state.get(leaf) for leaf in leaves] if state is not None else [None] * len(leaves)
    out: list[torch.Tensor | None] = [None] * len(leaves)
    groups: dict[tuple, list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault((leaf.dtype, leaf.device, kinds[i]), []).append(i)
    with _vma.paused():
        for index in groups.values():
            if len(index) == 1:
                out[index[0]] = fn(leaves[index[0]])
            else:
                flat = fn(torch.cat([leaves[i].reshape(-1) for i in index]))
                pieces = flat.split([leaves[i].numel() for i in index])
                for i, piece in zip(index, pieces):
                    out[i] = piece.view(leaves[i].shape)
            if state is not None:
                for i in index:
                    state.set(out[i], vma(kinds[i]))
    return _tree.tree_unflatten(out, spec)


def _reduction(tree: Any, axis, name: str, make) -> Any:
    """psum / pmean / pmax: ``make(groups, tracked)`` gives the per-tensor reduction."""
    mesh = _mesh.current_mesh(name)
    names, groups = mesh.axes(axis, name), mesh.groups(axis, name)
    where = f"pardist.{name}"
    if not groups:
        return _map(tree, where, lambda x: x)
    state = _vma.current()
    if state is None:
        return _coalesced(tree, where, make(groups, False))
    axes = frozenset(names) & state.live
    reduce = make(groups, True)
    return _coalesced(tree, where, lambda x: reduce(_lift(state, x, axes)), lambda v: v - axes)


def psum(tree: Any, axis: str | tuple[str, ...]) -> Any:
    """Sum every tensor leaf of ``tree`` over the ranks of ``axis``.

    The result is invariant over ``axis``; its backward is the identity where
    pardist tracks varying axes (a :func:`shard_map` step with model axes) and a
    ``psum`` of the cotangent elsewhere (see the module's table). With a tuple
    of axes it reduces the innermost axis first, then the outer ones.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.psum({'n': torch.tensor(3.)}, 'gpu')
        {'n': tensor(3.)}
        >>> pardist.shutdown()
    """
    return current_mode().run("psum", tree, axis)


@Eager.register("psum")
def _psum(mode, tree: Any, axis) -> Any:
    return _reduction(
        tree,
        axis,
        "psum",
        lambda groups, tracked: (
            lambda x: (PsumInvariant if tracked else Psum).apply(x, groups, reduce_groups)
        ),
    )


def pmean(tree: Any, axis: str | tuple[str, ...]) -> Any:
    """Average every tensor leaf of ``tree`` over the ranks of ``axis`` (differentiable).

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.pmean([torch.tensor([1., 3.])], 'gpu')
        [tensor([1., 3.])]
        >>> pardist.shutdown()
    """
    return current_mode().run("pmean", tree, axis)


@Eager.register("pmean")
def _pmean(mode, tree: Any, axis) -> Any:
    size = _mesh.current_mesh("pmean").size(axis, "pmean")

    def make(groups, tracked):
        kind = PsumInvariant if tracked else Psum
        return lambda x: kind.apply(x, groups, reduce_groups) / size

    return _reduction(tree, axis, "pmean", make)


def pmax(tree: Any, axis: str | tuple[str, ...]) -> Any:
    """Elementwise maximum of every tensor leaf over the ranks of ``axis``.

    The gradient flows to the ranks holding the maximum (split evenly on ties).

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.pmax(torch.tensor([1., -2.]), 'gpu')
        tensor([ 1., -2.])
        >>> pardist.shutdown()
    """
    return current_mode().run("pmax", tree, axis)


@Eager.register("pmax")
def _pmax(mode, tree: Any, axis) -> Any:
    return _reduction(
        tree,
        axis,
        "pmax",
        lambda groups, tracked: lambda x: Pmax.apply(x, groups, reduce_groups, tracked),
    )


def checked_dim(x: torch.Tensor, dim: int, where: str, what: str) -> int:
    """``dim`` of the leaf ``x`` made non-negative; an error where ``x`` has no such dim."""
    if x.ndim == 0:
        raise ValueError(
            f"{where}: a leaf is a scalar (shape ()); there is no dim {dim} to {what}. "
            "Use x[None] to make it a vector."
        )
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(
            f"{where}: dim {dim} is out of range for a leaf of shape {tuple(x.shape)}."
        )
    return dim % x.ndim


def _blockwise(tree: Any, axis, name: str, prepare, apply, vma) -> Any:
    """A collective over one (flattened) group.

    ``prepare(x, size, where)`` checks a leaf and returns its dims,
    ``apply(x, group, dims)`` runs the collective, ``vma(v, axes)`` types it.
    """
    return current_mode().run("blockwise", tree, axis, name, prepare, apply, vma)


@Compiled.register("blockwise")
def _blockwise_traced(mode, tree, axis, name: str, *_) -> Any:
    # data_parallel(compile=True) then runs the step eagerly
    raise NotImplementedError(
        f"pardist.{name} has no traceable form inside a compiled step; pass "
        "compile=False (the step runs eagerly)"
    )


@Eager.register("blockwise")
def _blockwise_eager(mode, tree: Any, axis, name: str, prepare, apply, vma) -> Any:
    mesh = _mesh.current_mesh(name)
    where = f"pardist.{name}"
    names, size = mesh.axes(axis, name), mesh.size(axis, name)
    leaves, spec = _tensors(tree, where)
    dims = [prepare(x, size, where) for x in leaves]
    if size == 1:
        return _tree.tree_unflatten(leaves, spec)
    group = mesh.group(axis, name)
    state = _vma.current()
    if state is None:
        return _tree.tree_unflatten([apply(x, group, d) for x, d in zip(leaves, dims)], spec)
    axes = frozenset(names) & state.live

    def one(x: torch.Tensor, d) -> torch.Tensor:
        v = state.get(x)
        with _vma.paused():
            return state.set(apply(_lift(state, x, axes), group, d), vma(v, axes))

    return _tree.tree_unflatten([one(x, d) for x, d in zip(leaves, dims)], spec)


def all_gather(
    tree: Any, axis: str | tuple[str, ...], dim: int = 0, *, invariant: bool = False
) -> Any:
    """Concatenate every leaf along ``dim`` over the ranks of ``axis``, in axis order.

    Every rank must pass the same shapes; for per-rank lengths that differ (an
    evaluation epoch's outputs) use :func:`pardist.gather`. Differentiable: each
    rank's slice receives the sum of its cotangents over the ranks
    (``psum_scatter``). The result counts as varying over ``axis``, as JAX's
    ``all_gather``; with ``invariant=True`` it is invariant (JAX's
    ``all_gather_invariant``), and the backward keeps this rank's block of the
    cotangent without communicating: use that where every rank then does the
    same work with the whole value (a replicated loss over gathered logits).

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.all_gather(torch.tensor([[1., 2.]]), 'gpu', dim=1)
        tensor([[1., 2.]])
        >>> pardist.shutdown()
    """
    return current_mode().run("all_gather", tree, axis, dim, invariant)


@Eager.register("all_gather")
def _all_gather(mode, tree: Any, axis, dim: int, invariant: bool) -> Any:
    kind = AllGatherInvariant if invariant else AllGather

    def prepare(x: torch.Tensor, size: int, where: str) -> int:
        return checked_dim(x, dim, where, "concatenate along")

    return _blockwise(
        tree,
        axis,
        "all_gather",
        prepare,
        lambda x, group, d: kind.apply(x, group, d),
        (lambda v, axes: v - axes) if invariant else (lambda v, axes: v | axes),
    )


def pvary(tree: Any, axis: str | tuple[str, ...]) -> Any:
    """Mark every leaf as varying over ``axis``: the identity, whose transpose is ``psum``.

    pardist inserts it by itself wherever an invariant value meets a varying one
    inside a tracked step. Call it yourself where a value varies in a way no
    tensor operation shows: one sliced by the Python int :func:`axis_index`
    returns (``w[:, i * k:(i + 1) * k]``) must be ``pvary``'d first. Outside a
    tracked step every value already counts as varying, and this returns its
    input.

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
        if axes <= v:
            return x
        with _vma.paused():
            y = _lift(state, x, axes)
            return state.set(y if y is not x else x.view_as(x), v | axes)

    return _map(tree, "pardist.pvary", one)


def axis_index(axis: str | tuple[str, ...]) -> int:
    """This rank's position along ``axis`` (row-major over a tuple of axes).

    A Python int: values computed from it are not tracked as varying (see :func:`pvary`).

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


Eager.register("axis_index")(lambda mode, axis: _mesh.current_mesh("axis_index").index(axis))
Eager.register("axis_size")(lambda mode, axis: _mesh.current_mesh("axis_size").size(axis))
# A compiled step's rules: its graph's collectives, with the plan's static axes.
Compiled.register("psum")(lambda mode, tree, axis: _traced.psum(tree, axis, mode.plan))
Compiled.register("pmean")(lambda mode, tree, axis: _traced.pmean(tree, axis, mode.plan))
Compiled.register("pmax")(lambda mode, tree, axis: _traced.pmax(tree, axis, mode.plan))
Compiled.register("all_gather")(
    lambda mode, tree, axis, dim, invariant: _traced.all_gather(
        tree, axis, dim, mode.plan, invariant
    )
)
Compiled.register("axis_index")(lambda mode, axis: _traced.axis_index(axis, mode.plan))
Compiled.register("axis_size")(lambda mode, axis: _traced.axis_size(axis, mode.plan))
