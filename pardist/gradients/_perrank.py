"""Every rank's loss and row count, known to every rank at no extra collective.

``pardist.grad`` carries a small table in the gradient buckets, with an entry for
every rank of the axis: each rank writes its own loss and number of batch rows
and leaves the other entries zero, so the sum over ranks that reduces the
gradients fills in the whole table on every rank. The values travel as their bytes
(integers 0-255, exact in every float dtype, bf16 and fp16 compression
included, since each sum adds one non-zero to zeros), so every rank reads every
rank's exact loss and computes the global loss itself, identically.

From that table come the global loss (the mean over ranks, DDP's convention, or
over the rows of the global batch with ``mean='rows'``), the global row count,
and the report of a non-finite loss naming the rank(s) it came from.
"""

from __future__ import annotations

import functools
import math

import torch

from pardist.collectives import _collectives
from pardist.runtime import StepContext, _warnings, debug_enabled

__all__ = ["Table", "checked", "exchange", "global_value", "report", "table", "total_rows"]

_COUNT = torch.int32  # a rank's row count; -1 when unknown


class Table:
    """The flat table: every rank's loss as 8 bytes (float64), then every rank's row count
    as 4 (int32), each byte one element of the bucket's dtype."""

    def __init__(self, size: int, index: int):
        self.size, self.index = size, index
        self.numel = (8 + _COUNT.itemsize) * size
        self._counts: dict[int, torch.Tensor] = {}

    def encode(self, value: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's entries filled in, the others zero, in the bucket's ``dtype``."""
        if rows not in self._counts:
            self._counts[rows] = torch.tensor([rows], dtype=_COUNT).view(torch.uint8)
        out = torch.zeros(self.numel, dtype=dtype, device=value.device)
        i, n, c = self.index, self.size, _COUNT.itemsize
        out[8 * i : 8 * i + 8] = value.detach().reshape(1).double().view(torch.uint8)
        out[8 * n + c * i : 8 * n + c * (i + 1)] = self._counts[rows]
        return out

    def decode(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's loss (float64, exact) and row count (int32), in axis order.

        The entries are whole numbers 0-255 that arrived exactly, so a cast recovers
        the bytes."""
        raw = table.detach().to(torch.uint8)
        return raw[: 8 * self.size].view(torch.float64), raw[8 * self.size :].view(_COUNT)


@functools.lru_cache(maxsize=64)
def table(size: int, index: int) -> Table:
    """The table of rank ``index`` of ``size`` (kept: it caches its encoded counts)."""
    return Table(size, index)


def global_value(values: torch.Tensor, counts: list[int] | None, mean: str, dtype) -> torch.Tensor:
    """The global loss from every rank's, in ``dtype``, identical on every rank."""
    if mean == "rows" and counts and any(c > 0 for c in counts):
        weights = torch.tensor([max(c, 0) for c in counts], dtype=torch.float64)
        used = (weights > 0).to(values.device)  # a rank with no rows has no weight (nor a mean)
        weights = weights.to(values.device)
        return ((values[used] * weights[used]).sum() / weights.sum()).to(dtype)
    return values.mean().to(dtype)


def checked(values: torch.Tensor, ctx: StepContext) -> bool:
    """Whether :func:`report` looks at these values (reading them costs a host sync)."""
    if ctx.call.loss_scaled:  # pardist.amp.dynamic_loss_scale skips such steps on purpose
        return False
    return values.is_cpu or debug_enabled()


def refuse_empty(values: torch.Tensor, counts: list[int], ctx: StepContext, where: str):
    """Under mean='ranks', a rank with no rows whose loss is a mean (nan): an error on
    every rank. Its gradient is zero, so the average would be NaN and the gradient a
    fraction of the others' mean, neither of them a number anyone asked for. (A loss
    that is a sum, 0 on no rows, is fine.)"""
    shown = values.tolist()
    empty = [r for r, c in enumerate(counts) if c == 0 and not math.isfinite(shown[r])]
    if not empty or len(empty) == len(counts):
        return
    axis = ctx.axis[0] if len(ctx.axis) == 1 else ctx.axis
    raise ValueError(
        f"{where}: rank(s) {empty} of axis {axis!r} (numbered along the axis) have an empty "
        f"batch ({counts} rows) and a loss of nan: with mean='ranks' every rank's mean "
        "counts equally, and an empty batch has none (0/0). Pass mean='rows' to weigh each rank "
        "by its rows (an empty shard then has no weight: the gradient of the global "
        "batch's mean), or give every rank rows (pardist.data.shard gives each rank "
        "ceil(n / world size) samples, wrapping around). Every rank stops here."
    )


def report(values: torch.Tensor, counts: list[int], mean: str, ctx: StepContext, where: str):
    """Warn (raise under PARDIST_DEBUG=1) when some rank's loss is not finite."""
    debug = debug_enabled()
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
            "The gradient mean includes theirs: where those are non-finite too, so are "
            "every rank's. "
            if ctx.size > 1
            else ""
        )
        + (
            f"Rank(s) {empty} had an empty batch, whose mean is nan: give every rank rows, "
            "or pass mean='rows' to pardist.grad so that an empty shard has no weight. "
            if empty
            else (
                "Every rank's is: one rank's batch can be the cause, since what the ranks "
                "share in the forward (cross-replica batch-norm statistics) carries a "
                "non-finite value to all of them. Look at every rank's batch and at the "
                "learning rate; "
                if len(bad) == ctx.size > 1
                else "Look at that rank's batch and at the learning rate; "
            )
            + "pardist.amp.dynamic_loss_scale skips such steps on every rank. "
        )
        + ("(PARDIST_DEBUG=1 raises.)" if not debug else "(Raised under PARDIST_DEBUG=1.)")
    )
    if debug:
        raise FloatingPointError(message)
    _warnings.warn(message, _warnings.NonFiniteLossWarning)


def exchange(value: torch.Tensor, rows: int, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The table by a small all-reduce of its own (where no gradient bucket carries it)."""
    mine = table(ctx.size, ctx.mesh.index(ctx.axis))
    summed = mine.encode(value, rows, torch.float32)
    groups = ctx.mesh.groups(ctx.axis)
    if groups:
        summed = _collectives.reduce_groups(summed, groups, "sum")
    return mine.decode(summed)


def total_rows(rows: int, ctx: StepContext) -> int:
    """The global row count by a small all-reduce (where it cannot ride in a bucket)."""
    mine = torch.tensor([float(rows)], dtype=torch.float64)
    groups = ctx.mesh.groups(ctx.axis)
    if groups:
        mine = _collectives.reduce_groups(mine, groups, "sum")
    return int(mine.item())
