"""Every rank's loss and row count, known to every rank at no extra collective.

``pardist.grad`` carries a small table in the gradient buckets: one row per rank
of the axis, in which each rank writes its own loss and number of batch rows and
leaves the other rows zero, so the sum over ranks that reduces the gradients
fills in the whole table on every rank. The values travel as their bytes
(integers 0-255, exact in every float dtype, bf16 and fp16 compression
included, since each sum adds one non-zero to zeros), so every rank reads every
rank's exact loss and computes the global loss itself, identically.

From that table come the global loss (the mean over ranks, DDP's convention, or
over the rows of the global batch with ``mean='rows'``), the global row count,
and the report of a non-finite loss naming the rank(s) it came from.
"""

from __future__ import annotations

import math

import torch

from pardist import _collectives, _warnings
from pardist._context import StepContext, debug_enabled

__all__ = ["Table", "exchange", "global_value", "report", "total_rows"]

_COUNT = torch.int32  # a rank's row count; -1 when unknown


class Table:
    """The (ranks, 12) byte table: each rank's loss as float64, then its row count."""

    width = 8 + _COUNT.itemsize

    def __init__(self, size: int, index: int):
        self.size, self.index = size, index

    def encode(self, value: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's row filled in, the others zero, in the bucket's ``dtype``."""
        raw = torch.cat(
            [
                value.detach().to(torch.float64).reshape(1).view(torch.uint8),
                torch.tensor([rows], dtype=_COUNT).view(torch.uint8).to(value.device),
            ]
        )
        table = torch.zeros(self.size, self.width, dtype=dtype, device=value.device)
        table[self.index] = raw.to(dtype)
        return table

    def decode(self, table: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Every rank's loss (float64, exact) and row count, in axis order."""
        raw = table.detach().reshape(self.size, self.width).round().to(torch.uint8)
        values = raw[:, :8].reshape(-1).clone().view(torch.float64)
        counts = raw[:, 8:].cpu().reshape(-1).clone().view(_COUNT)
        return values, counts.tolist()


def global_value(values: torch.Tensor, counts: list[int], mean: str, dtype) -> torch.Tensor:
    """The global loss from every rank's, in ``dtype``, identical on every rank."""
    if mean == "rows" and any(c > 0 for c in counts):
        weights = torch.tensor([max(c, 0) for c in counts], dtype=torch.float64)
        used = (weights > 0).to(values.device)  # a rank with no rows has no weight (nor a mean)
        weights = weights.to(values.device)
        return ((values[used] * weights[used]).sum() / weights.sum()).to(dtype)
    return values.mean().to(dtype)


def report(values: torch.Tensor, counts: list[int], mean: str, ctx: StepContext, where: str):
    """Warn (raise under PARDIST_DEBUG=1) when some rank's loss is not finite."""
    if ctx.loss_scaled:  # pardist.amp.dynamic_loss_scale skips such steps on purpose
        return
    debug = debug_enabled()
    if values.device.type != "cpu" and not debug:
        return  # reading it would stall the host every step on an accelerator
    shown = values.tolist()
    bad = [
        r
        for r, v in enumerate(shown)
        if not math.isfinite(v) and not (mean == "rows" and counts[r] == 0)
    ]
    if not bad:
        return
    axis = ctx.axis[0] if len(ctx.axis) == 1 else ctx.axis
    empty = [r for r in bad if counts[r] == 0]
    message = (
        f"{where}: the loss is not finite on {len(bad)} of {ctx.size} rank(s) of axis "
        f"{axis!r}: "
        + ", ".join(f"rank {r}: {shown[r]}" for r in bad)
        + " (ranks numbered along the axis). "
        + (
            "The gradient mean includes them, so every rank's gradients are non-finite. "
            if ctx.size > 1
            else ""
        )
        + (
            f"Rank(s) {empty} had an empty batch, whose mean is nan: give every rank rows, "
            "or pass mean='rows' to pardist.grad so that an empty shard has no weight. "
            if empty
            else "Look at that rank's batch and at the learning rate; "
            "pardist.amp.dynamic_loss_scale skips such steps on every rank. "
        )
        + ("(PARDIST_DEBUG=1 raises.)" if not debug else "(Raised under PARDIST_DEBUG=1.)")
    )
    if debug:
        raise FloatingPointError(message)
    _warnings.warn(message, _warnings.NonFiniteLossWarning)


def exchange(value: torch.Tensor, rows: int, ctx: StepContext) -> tuple[torch.Tensor, list[int]]:
    """The table by a small all-reduce of its own (where no gradient bucket carries it)."""
    table = Table(ctx.size, ctx.mesh.index(ctx.axis))
    summed = table.encode(value, rows, torch.float32)
    groups = ctx.mesh.groups(ctx.axis)
    if groups:
        summed = _collectives._reduce(summed, groups, "sum")
    return table.decode(summed)


def total_rows(rows: int, ctx: StepContext) -> int:
    """The global row count by a small all-reduce (where it cannot ride in a bucket)."""
    mine = torch.tensor([float(rows)], dtype=torch.float64)
    groups = ctx.mesh.groups(ctx.axis)
    if groups:
        mine = _collectives._reduce(mine, groups, "sum")
    return int(mine.item())
