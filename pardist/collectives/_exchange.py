"""Collectives that move blocks between ranks: ``psum_scatter`` and ``all_to_all``.

Both cut a dim into ``axis_size`` exact blocks, and both results vary over the
axis. ``psum_scatter`` (reduce-scatter) is the transpose of ``all_gather``, and
``all_to_all`` is its own transpose with its two dims swapped; see
``pardist._collectives`` for the rules and the tracking of varying axes.
"""

from __future__ import annotations

from typing import Any

import torch

from pardist.collectives._collectives import _blockwise, checked_dim
from pardist.runtime import _tree
from pardist.transport import AllToAll, PsumScatter

__all__ = ["all_to_all", "psum_scatter"]


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


def psum_scatter(tree: Any, axis: str | tuple[str, ...], dim: int = 0) -> Any:
    """Sum every leaf over ``axis`` and keep this rank's block of ``dim`` (reduce-scatter).

    ``dim`` is cut into ``axis_size`` equal blocks, in axis order; rank ``i``
    gets block ``i`` of the sum. The inverse layout of :func:`all_gather`, and
    its transpose: the backward all-gathers the cotangent. The result varies
    over ``axis``.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.psum_scatter(torch.tensor([1., 2.]), 'gpu')
        tensor([1., 2.])
        >>> pardist.shutdown()
    """
    return _blockwise(
        tree,
        axis,
        "psum_scatter",
        lambda x, size, where: _blocks(x, dim, size, tree, where, axis, "scatter"),
        lambda x, group, d: PsumScatter.apply(x, group, d),
        lambda v, axes: v | axes,
    )


def all_to_all(tree: Any, axis: str | tuple[str, ...], split_dim: int, concat_dim: int) -> Any:
    """Cut ``split_dim`` into ``axis_size`` blocks, send block ``j`` to rank ``j``, and
    concatenate what arrives along ``concat_dim`` in axis order.

    The usual use: switch which dim is sharded (heads to sequence and back).
    Its transpose is the same exchange with the two dims swapped. The result
    varies over ``axis``.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.all_to_all(torch.ones(2, 3), 'gpu', split_dim=0, concat_dim=1).shape
        torch.Size([2, 3])
        >>> pardist.shutdown()
    """

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
        lambda v, axes: v | axes,
    )
