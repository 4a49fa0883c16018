"""Partition specs: how each tensor dim of a value is laid out over mesh axes.

``P('gpu')`` says dim 0 is split over axis 'gpu' (each rank holds its own slice);
``P()`` says the value is replicated; ``P(None, 'gpu')`` splits dim 1;
``P(('node', 'gpu'))`` splits dim 0 over both axes. A spec tree may be a prefix
of the value tree, as in JAX's ``shard_map``.
"""

from __future__ import annotations

from typing import Any

import torch

from pardist import _tree
from pardist._mesh import Mesh

__all__ = ["P", "check_fits", "flat_specs", "spec_axes", "specs"]


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

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"


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
