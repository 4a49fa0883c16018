"""An ordered sum over row groups: the same bits whichever rank holds which group.

The deterministic mode cuts the global batch into G row groups; rank r holds
groups ``r * n .. r * n + n - 1`` (``n = G / world size``). A sum over the rows
(a gradient, a loss, batch-norm statistics) is then each group's own sum, and
those G partial sums are added left to right, group 0 first:
``((s0 + s1) + s2) + ...``. Every rank gathers all G partial sums (one
``all_gather`` over the step's axis, on whichever transport carries it) and
folds them itself, so the result depends on G and on the groups' values, never
on the world size. The price is the gather: each rank receives G partial sums
instead of the one an all-reduce would give it.
"""

from __future__ import annotations

import torch

from pardist.runtime import StepContext
from pardist.transport import _primitives

__all__ = ["gather_groups", "ordered_sum"]


def gather_groups(local: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """Every group's row of ``local`` (this rank's ``n`` groups along dim 0), in group order."""
    if ctx.size == 1:
        return local
    group = ctx.mesh.group(ctx.axis)
    return torch.cat(_primitives.gather_parts(local.contiguous(), group), dim=0)


def ordered_sum(local: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """The sum of every group's row (``local``: this rank's groups along dim 0), left to right."""
    if ctx.size > 1 and local[0].numel() >= _SPLIT_NUMEL:
        return _split_sum(local, ctx)
    return _fold(gather_groups(local, ctx))


_SPLIT_NUMEL = 2**16  # smaller sums (batch-norm statistics, losses) are gathered whole


def _fold(rows: torch.Tensor) -> torch.Tensor:
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total


def _split_sum(local: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """The same sum, each rank folding one slice of the columns (as a reduce-scatter):
    an all-to-all sends each rank every group's values of its slice, and an all-gather
    joins the folded slices. Each element is still added over groups 0..G-1 in order."""
    size, group = ctx.size, ctx.mesh.group(ctx.axis)
    n, shape = local.shape[0], local.shape[1:]
    flat = local.reshape(n, -1)
    width = flat.shape[1]
    pad = -width % size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(n, size, -1).transpose(0, 1).contiguous()  # [rank, group, slice]
    mine = _primitives.AllToAll.apply(blocks, group, 0, 0)  # every rank's groups, my slice
    folded = _fold(mine.reshape(size * n, -1))
    whole = torch.cat(_primitives.gather_parts(folded, group))
    return whole[:width].view(shape)
