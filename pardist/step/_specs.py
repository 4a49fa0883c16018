"""Partition specs: how each tensor dim of a value is laid out over mesh axes.

``P('gpu')`` says dim 0 is split over axis 'gpu' (each rank holds its own slice);
``P()`` says the value is replicated; ``P(None, 'gpu')`` splits dim 1;
``P(('node', 'gpu'))`` splits dim 0 over both axes. A spec tree may be a prefix
of the value tree, as in JAX's ``shard_map``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from pardist.runtime import Mesh, _tree

__all__ = [
    "P",
    "check_fits",
    "flat_specs",
    "local_block",
    "spec_axes",
    "specs",
    "state_specs",
]


class P(tuple):
    """A partition spec: one entry per tensor dim, each ``None``, an axis, or a tuple of axes.

    Example:
        >>> from pardist import P
        >>> P('gpu'), P(), P(None, ('node', 'gpu'))
        (P('gpu'), P(), P(None, ('node', 'gpu')))
        >>> P('gpu').axes
        ('gpu',)
        >>> import pickle; pickle.loads(pickle.dumps(P('gpu', None)))
        P('gpu', None)
    """

    def __new__(cls, *entries: str | tuple[str, ...] | None) -> P:
        for entry in entries:
            names = entry if isinstance(entry, tuple) else (entry,)
            if entry is not None and not all(isinstance(n, str) and n for n in names):
                raise TypeError(
                    f"pardist.P: each entry is None, an axis name or a tuple of axis "
                    f"names, got {entry!r} in P{entries!r}."
                )
        return super().__new__(cls, entries)

    def __getnewargs__(self) -> tuple:
        return tuple(self)  # pickle passes the entries back one by one

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis this spec splits over, in order of appearance."""
        out: list[str] = []
        for entry in self:
            if entry is not None:
                out.extend(entry if isinstance(entry, tuple) else (entry,))
        return tuple(out)

    @property
    def vma(self) -> frozenset[str]:
        """The axes as a set: those a value with this spec varies over (made once)."""
        return _vma_of(self)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"


@functools.cache
def _vma_of(spec: P) -> frozenset[str]:
    return frozenset(spec.axes)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P) or x is None


def flat_specs(specs: Any, tree: Any, *, where: str, specs_name: str, tree_name: str) -> list[P]:
    """One spec per leaf of ``tree`` (None in a spec tree means ``P()``)."""
    flat = _tree.broadcast_prefix(
        specs,
        tree,
        is_prefix_leaf=_is_spec,
        where=where,
        prefix_name=specs_name,
        full_name=tree_name,
    )
    return [P() if s is None else s for s in flat]


def spec_axes(spec: P) -> tuple[str, ...]:
    return spec.axes


def check_fits(spec: P, leaf: Any, path: str, mesh: Mesh, *, where: str, spec_path: str) -> None:
    """Raise a JAX-style error if ``spec`` cannot describe ``leaf`` on ``mesh``."""
    seen: set[str] = set()
    for name in spec.axes:
        mesh.axes(name, where)  # names the axis and the mesh if it is missing
        if name in seen:
            raise ValueError(
                f"{where}: {spec_path} is {spec!r}, which uses axis {name!r} twice; "
                "an axis can split only one dim."
            )
        seen.add(name)
    if not spec:
        return
    if not isinstance(leaf, torch.Tensor):
        raise TypeError(
            f"{where}: {spec_path} is {spec!r}, which splits {path}, but {path} is a "
            f"{type(leaf).__name__} ({leaf!r:.40}), not a tensor. Only tensors can be "
            "sharded: give it P() (replicated) or pass a tensor."
        )
    if len(spec) > leaf.ndim:
        raise ValueError(
            f"{where}: {spec_path} is {spec!r}, with {len(spec)} entries, but {path} has "
            f"shape {tuple(leaf.shape)}, only {leaf.ndim} dims. Give at most one entry "
            "per dim (P() replicates; P('gpu') splits dim 0)."
        )


def specs(tree: Any) -> Any:
    """The layout of each leaf of ``tree`` as a spec: ``P()`` unless it is a sharded DTensor.

    A DTensor placed ``Shard(d)`` on mesh dim ``'gpu'`` gets ``'gpu'`` at entry
    ``d`` (the layout of a sharded optimizer's state, for instance).

    Example:
        >>> import pardist, torch
        >>> pardist.specs({'w': torch.ones(2), 'n': 3})
        {'w': P(), 'n': P()}
    """
    from torch.distributed.tensor import DTensor, Shard

    def spec(leaf: Any) -> P:
        if not isinstance(leaf, DTensor):
            return P()
        names = leaf.device_mesh.mesh_dim_names or tuple(
            f"dim{i}" for i in range(leaf.device_mesh.ndim)
        )
        entries: list = [None] * leaf.ndim
        for name, placement in zip(names, leaf.placements):
            if isinstance(placement, Shard):
                entries[placement.dim] = (
                    name
                    if entries[placement.dim] is None
                    else (
                        *(
                            entries[placement.dim]
                            if isinstance(entries[placement.dim], tuple)
                            else (entries[placement.dim],)
                        ),
                        name,
                    )
                )
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    return _tree.tree_map(spec, tree)


def local_block(tree: Any, specs: Any, *, mesh: Mesh | None = None) -> Any:
    """This rank's block of every leaf of a global ``tree``, as ``specs`` split it.

    The inputs :func:`pardist.shard_map` expects, cut from values every rank
    holds whole (a model built from the same seed): ``P(None, 'model')`` keeps
    this rank's columns, in axis order. Blocks are exact: a dim split over axes
    of total size n must be a multiple of n. No communication. Each block is
    copied into memory of its own (contiguous), so the full tensors can be
    freed; replicated leaves come back as they are.

    Args:
        tree: the global values (any pytree; non-tensor leaves need ``P()``).
        specs: a spec tree, a prefix of ``tree``.
        mesh: default: the innermost ``with mesh:``, else ``init``'s.

    Example:
        >>> import pardist, torch
        >>> from pardist import P
        >>> _ = pardist.init()
        >>> pardist.local_block({'w': torch.arange(6.).reshape(2, 3)}, {'w': P(None, 'gpu')})
        {'w': tensor([[0., 1., 2.],
                [3., 4., 5.]])}
        >>> pardist.shutdown()
    """
    from pardist.runtime import current_mesh

    where = "pardist.local_block"
    mesh = mesh or current_mesh("local_block")
    flat = flat_specs(specs, tree, where=where, specs_name="specs", tree_name="tree")
    named = _tree.leaves_with_paths(tree, "tree")
    out = []
    for (path, leaf), spec in zip(named, flat):
        check_fits(spec, leaf, path, mesh, where=where, spec_path=f"the spec of {path}")
        for dim, entry in enumerate(spec):
            if entry is None:
                continue
            size, index = mesh.size(entry, "local_block"), mesh.index(entry, "local_block")
            if leaf.shape[dim] % size:
                raise ValueError(
                    f"{where}: {path} has shape {tuple(leaf.shape)}, and its spec {spec!r} "
                    f"splits dim {dim} (size {leaf.shape[dim]}) over {entry!r} of size {size}, "
                    f"which does not divide {leaf.shape[dim]}: blocks must be exact. Pad dim "
                    f"{dim} to a multiple of {size}, or split another dim."
                )
            block = leaf.shape[dim] // size
            leaf = leaf.narrow(dim, index * block, block)
        out.append(leaf.clone(memory_format=torch.contiguous_format) if spec.axes else leaf)
    return _tree.tree_unflatten(out, _tree.tree_flatten(tree)[1])


def state_specs(state: Any, params: Any, param_specs: Any) -> Any:
    """The spec tree of an optimizer ``state``: ``param_specs`` where it is shaped like ``params``.

    Optimizer states hold trees like the parameters (momentum, Adam's moments)
    beside scalars (the step count); the former split as the parameters do, the
    latter are replicated (``P()``). optax's ``tree_map_params``, for specs.

    Example:
        >>> import pardist, torch
        >>> from pardist import P
        >>> params = {'w': torch.zeros(4, 2), 'b': torch.zeros(2)}
        >>> state = pardist.optim.sgd(0.1, momentum=0.9).init(params)
        >>> pardist.state_specs(state, params, {'w': P(None, 'model'), 'b': P()})
        SGDState(count=P(), momentum_buffer={'w': P(None, 'model'), 'b': P()})
    """
    target = _tree.tree_flatten(params)[1]
    if target.is_leaf():
        shape = params.shape  # a single tensor: its moments have its shape

        def like(x: Any) -> bool:
            return isinstance(x, torch.Tensor) and x.shape == shape
    else:

        def like(x: Any) -> bool:
            return not isinstance(x, torch.Tensor) and _tree.tree_flatten(x)[1] == target

    return _tree.tree_map(lambda x: param_specs if like(x) else P(), state, is_leaf=like)
