"""Collectives that move blocks between ranks: all_gather, psum_scatter, all_to_all, ppermute.

Each cuts or joins a dim in ``axis_size`` exact blocks (``tiled=True``, pardist's
default), or adds or removes a dim of that size (``tiled=False``, JAX's default).
``all_gather`` and ``psum_scatter`` transpose into each other, ``all_to_all`` into
itself with its dims swapped, ``ppermute`` into the inverse permutation (the table
is ``pardist/transport/_primitives.py``). Results vary over the axis, except
``all_gather(..., invariant=True)``'s (JAX's ``all_gather_invariant``).
"""

from __future__ import annotations

from typing import Any

import torch

from pardist.collectives import _groups, _vma
from pardist.collectives._collectives import guard, lift, retype
from pardist.compile import _traced
from pardist.runtime import Compiled, Eager, _mesh, _tree, current_mode
from pardist.transport import AllToAll, Ppermute, PsumScatter, _primitives

__all__ = ["all_gather", "all_to_all", "checked_dim", "ppermute", "psum_scatter"]


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


def _blocks(x: torch.Tensor, dim: int, size: int, tree: Any, where: str, axis, what: str) -> int:
    """``dim`` made non-negative, checked to split into ``size`` equal blocks."""
    dim = checked_dim(x, dim, where, what)
    if x.shape[dim] % size:
        path = next(p for p, leaf in _tree.leaves_with_paths(tree, "tree") if leaf is x)
        raise ValueError(
            f"{where}: {path} has shape {tuple(x.shape)}; its dim {dim} (size {x.shape[dim]}) "
            f"does not split into {size} equal blocks over axis {axis!r} of size {size}. "
            f"Pad dim {dim} to a multiple of {size}, or {what} along another dim."
        )
    return dim


def _blockwise(tree: Any, axis, name: str, prepare, apply, fn, groups=None) -> Any:
    """A collective over one (flattened) group, or over ``groups`` of its indices.

    ``prepare(x, size, where)`` checks a leaf and returns its dims, ``apply(x, group,
    dims)`` runs the collective, ``fn`` is its Function (whose type rule types it).
    """
    return current_mode().run("blockwise", tree, axis, name, prepare, apply, fn, groups)


@Compiled.register("blockwise")
def _blockwise_traced(mode, tree, axis, name: str, *_) -> Any:
    # data_parallel(compile=True) then runs the step eagerly
    raise NotImplementedError(
        f"pardist.{name} has no traceable form inside a compiled step; pass "
        "compile=False (the step runs eagerly)"
    )


@Eager.register("blockwise")
def _blockwise_eager(mode, tree: Any, axis, name: str, prepare, apply, fn, groups) -> Any:
    mesh = _mesh.current_mesh(name)
    where = f"pardist.{name}"
    names, size = mesh.axes(axis, name), mesh.size(axis, name)
    group = mesh.group(axis, name) if size > 1 else None
    if groups is not None and size > 1:
        group, size, _ = _groups.subgroup(group, mesh.index(axis), groups, where, equal=True)
    elif groups is not None:
        _groups.check(groups, size, where, equal=True)
    leaves = _tree.check_tensor_leaves(tree, where=where, name="tree")
    spec = _tree.tree_flatten(tree)[1]
    dims = [prepare(x, size, where) for x in leaves]
    if size == 1:
        return _tree.tree_unflatten(leaves, spec)
    state = _vma.current()
    guard(state, names, where)
    if state is None:
        return _tree.tree_unflatten([apply(x, group, d) for x, d in zip(leaves, dims)], spec)
    axes = frozenset(names) & state.live

    def one(x: torch.Tensor, d) -> torch.Tensor:
        v = state.get(x)
        with _vma.paused():
            out = apply(lift(state, x, axes), group, d)
        if groups is not None:  # the same within a group of indices, not over the axis
            return state.set(out, _vma.vary(v, axes))
        return retype(state, out, v, fn, axes)

    return _tree.tree_unflatten([one(x, d) for x, d in zip(leaves, dims)], spec)


def _unsqueezed(tree: Any, dim: int, where: str) -> Any:
    leaves = _tree.check_tensor_leaves(tree, where=where, name="tree")
    out = [x.unsqueeze(dim if dim >= 0 else dim + x.ndim + 1) for x in leaves]
    return _tree.tree_unflatten(out, _tree.tree_flatten(tree)[1])


def all_gather(
    tree: Any,
    axis: str | tuple[str, ...],
    dim: int = 0,
    *,
    invariant: bool = False,
    tiled: bool = True,
    axis_index_groups=None,
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
    ``tiled=False`` stacks the blocks along a new dim ``dim`` of size ``axis_size``
    instead (JAX's default). ``axis_index_groups`` gathers within groups of indices.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.all_gather(torch.tensor([[1., 2.]]), 'gpu', dim=1)
        tensor([[1., 2.]])
        >>> pardist.all_gather(torch.tensor([1., 2.]), 'gpu', tiled=False).shape
        torch.Size([1, 2])
        >>> pardist.shutdown()
    """
    if not tiled:
        tree = _unsqueezed(tree, dim, "pardist.all_gather")
    return current_mode().run("all_gather", tree, axis, dim, invariant, axis_index_groups)


@Eager.register("all_gather")
def _all_gather(mode, tree: Any, axis, dim: int, invariant: bool, groups) -> Any:
    # Untyped (outside steps) an invariant gather is lifted back at once: all_gather's rules.
    fam = _primitives.family()
    fn = fam.AllGatherInvariant if invariant and _vma.current() is not None else fam.AllGather

    def prepare(x: torch.Tensor, size: int, where: str) -> int:
        return checked_dim(x, dim, where, "concatenate along")

    return _blockwise(
        tree, axis, "all_gather", prepare, lambda x, group, d: fn.apply(x, group, d), fn, groups
    )


@Compiled.register("all_gather")
def _all_gather_traced(mode, tree, axis, dim, invariant, groups):
    if groups is not None:
        return _blockwise_traced(mode, tree, axis, "all_gather")
    return _traced.all_gather(tree, axis, dim, mode.plan)


def psum_scatter(
    tree: Any, axis: str | tuple[str, ...], dim: int = 0, *, tiled: bool = True,
    axis_index_groups=None,
) -> Any:  # fmt: skip
    """Sum every leaf over ``axis`` and keep this rank's block of ``dim`` (reduce-scatter).

    ``dim`` is cut into ``axis_size`` equal blocks, in axis order; rank ``i``
    gets block ``i`` of the sum. The inverse layout of :func:`all_gather`, and
    its transpose: the backward all-gathers the cotangent. The result varies
    over ``axis``. With ``tiled=False`` (JAX's default) ``dim`` must have size
    ``axis_size`` and is removed: rank ``i`` gets ``psum(x)[i]``.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.psum_scatter(torch.tensor([1., 2.]), 'gpu')
        tensor([1., 2.])
        >>> pardist.shutdown()
    """
    where = "pardist.psum_scatter"
    if not tiled:
        size = _group_size(axis, axis_index_groups, "psum_scatter")
        for path, x in _tree.leaves_with_paths(tree, "tree"):
            d = checked_dim(x, dim, where, "scatter") if isinstance(x, torch.Tensor) else None
            if d is not None and x.shape[d] != size:
                raise ValueError(
                    f"{where}: with tiled=False, dim {dim} of each leaf must have the size of "
                    f"axis {axis!r} ({size}), but {path} has shape {tuple(x.shape)}. Use "
                    "tiled=True to cut it into blocks instead."
                )
    out = _blockwise(
        tree,
        axis,
        "psum_scatter",
        lambda x, size, where: _blocks(x, dim, size, tree, where, axis, "scatter"),
        lambda x, group, d: PsumScatter.apply(x, group, d),
        PsumScatter,
        axis_index_groups,
    )
    return out if tiled else _tree.tree_map(lambda y: y.squeeze(dim), out)


def _group_size(axis, groups, name: str) -> int:
    mesh = _mesh.current_mesh(name)
    size = mesh.size(axis, name)
    if groups is None:
        return size
    return len(_groups.check(groups, size, f"pardist.{name}", equal=True)[0])


def all_to_all(
    tree: Any, axis: str | tuple[str, ...], split_dim: int, concat_dim: int, *,
    tiled: bool = True, axis_index_groups=None,
) -> Any:  # fmt: skip
    """Cut ``split_dim`` into ``axis_size`` blocks, send block ``j`` to rank ``j``, and
    concatenate what arrives along ``concat_dim`` in axis order.

    The usual use: switch which dim is sharded (heads to sequence and back).
    Its transpose is the same exchange with the two dims swapped. The result
    varies over ``axis``. With ``tiled=False`` (JAX's default) ``split_dim`` must
    have size ``axis_size``; it is removed, and a new dim of that size, indexed by
    the sending rank, is inserted at ``concat_dim``.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.all_to_all(torch.ones(2, 3), 'gpu', split_dim=0, concat_dim=1).shape
        torch.Size([2, 3])
        >>> pardist.shutdown()
    """
    if not tiled:  # JAX's wrapper: a new dim to concatenate along, the split one dropped
        size = _group_size(axis, axis_index_groups, "all_to_all")
        leaves = _tree.check_tensor_leaves(tree, where="pardist.all_to_all", name="tree")
        out = []
        for x in leaves:
            split = checked_dim(x, split_dim, "pardist.all_to_all", "split")
            if x.shape[split] != size:
                raise ValueError(
                    f"pardist.all_to_all: with tiled=False, split_dim {split_dim} must have the "
                    f"size of axis {axis!r} ({size}); a leaf has shape {tuple(x.shape)}."
                )
            concat = concat_dim % x.ndim if -x.ndim <= concat_dim < x.ndim else concat_dim
            if split < concat:
                concat += 1
                x = x.unsqueeze(concat)
            elif concat < split:
                x = x.unsqueeze(concat)
                split += 1
            y = all_to_all(x, axis, split, concat, axis_index_groups=axis_index_groups)
            out.append(y.squeeze(split) if split != concat else y)
        return _tree.tree_unflatten(out, _tree.tree_flatten(tree)[1])

    def prepare(x: torch.Tensor, size: int, where: str) -> tuple[int, int]:
        split = _blocks(x, split_dim, size, tree, where, axis, "split")
        if not -x.ndim <= concat_dim < x.ndim:
            raise ValueError(
                f"{where}: concat_dim {concat_dim} is out of range for a leaf of shape "
                f"{tuple(x.shape)}."
            )
        return split, concat_dim % x.ndim

    return _blockwise(
        tree,
        axis,
        "all_to_all",
        prepare,
        lambda x, group, d: AllToAll.apply(x, group, *d),
        AllToAll,
        axis_index_groups,
    )


def _checked_perm(perm, size: int, axis) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        pairs = None
    bad = pairs is None or any(not (0 <= i < size) for p in pairs for i in p)
    if not bad:
        srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
        bad = len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts)
    if bad:
        ring = [(i, (i + 1) % size) for i in range(size)]
        raise ValueError(
            f"pardist.ppermute: perm={perm!r} must be (source, destination) pairs of indices "
            f"of axis {axis!r} (0..{size - 1}), no source or destination twice; e.g. the "
            f"ring {ring}."
        )
    return pairs


def ppermute(tree: Any, axis: str | tuple[str, ...], perm) -> Any:
    """Send every leaf from index ``source`` to index ``destination`` of ``axis``, for each
    ``(source, destination)`` pair of ``perm`` (JAX's ``ppermute``); an index that no pair
    sends to receives zeros.

    The result varies over ``axis``; the transpose sends the cotangents back along the
    inverse permutation. Ring attention and pipelines pass blocks this way.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.ppermute(torch.tensor([1., 2.]), 'gpu', perm=[(0, 0)])
        tensor([1., 2.])
        >>> pardist.shutdown()
    """
    mesh = _mesh.current_mesh("ppermute")
    pairs = _checked_perm(perm, mesh.size(axis, "ppermute"), axis)
    if mesh.size(axis) == 1:
        src = dict((d, s) for s, d in pairs)
        return _tree.tree_map(lambda x: x if 0 in src else torch.zeros_like(x), tree)
    return _blockwise(
        tree,
        axis,
        "ppermute",
        lambda x, size, where: None,
        lambda x, group, _: Ppermute.apply(x, group, pairs),
        Ppermute,
    )
