"""``accumulate='list'``: gradient accumulation over a list of micro-batches of their own shapes.

Padded text is padded per micro-batch: each one to its own longest row, the last one
shorter, and a rank whose loader ran out may have fewer. ``accumulate=k`` cuts one
rectangular batch into k equal parts, which pads every part to the update's longest
row (twice the tokens on real text). With ``accumulate='list'`` the batch argument is a
list of micro-batches, each a tree as the loader made it, and ``f`` runs on each in
turn; the backward passes add into the same buckets and the update reduces once, as
with ``accumulate=k``.

Each micro-batch j of a rank's k weighs as one process running the same micro-batches
would weigh it (``w_j``): ``mean='ranks'`` 1/k (the mean of the micro-batches' losses,
then of the ranks', DDP's and Accelerate's loop), ``'rows'`` rows_j over this rank's
rows (then ranks by their rows), ``'tokens'`` 1 (sums; the count over every
micro-batch of every rank divides once). The reducers divide what they add by the k
micro-batches, so each backward is seeded with ``k * w_j``.

The ranks agree on nothing but their counts: one small all-reduce says whether k
differs between them. Where it does, a collective inside ``f`` (sync batch norm, FSDP's
gathers, tensor parallelism) would pair one rank's micro-batch with another's gradient
reduction, so the first such collective raises on every rank, naming the counts.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from pardist.collectives import _collectives
from pardist.runtime import StepContext, _tree, device

__all__ = ["LIST", "Listed", "agree", "holds_some", "listed"]

LIST = "list"


class Listed:
    """The micro-batches of one call: which arguments hold them, how many, their weights."""

    def __init__(self, positions: list[int], k: int, rows: list[int], mean: str):
        self.positions, self.k, self.rows, self.mean = positions, k, rows, mean
        total = sum(rows)
        if mean == "rows" and total > 0:
            self.within = [r / total for r in rows]
            self.seeds = [k * r / total for r in rows]
        elif mean == "tokens":  # f returns sums: each counts whole
            self.within, self.seeds = [1.0] * k, [float(k)] * k
        else:
            self.within, self.seeds = [1.0 / max(k, 1)] * k, [1.0] * k

    def args(self, args: tuple, j: int) -> tuple:
        """The arguments of micro-batch ``j``: each list argument's j-th entry."""
        out = list(args)
        for i in self.positions:
            out[i] = args[i][j]
        return tuple(out)

    def value(self, values: list[torch.Tensor]) -> torch.Tensor:
        """This rank's loss from its micro-batches' (the mean, the row-weighted mean, the sum)."""
        if len(values) == 1 and self.mean != "tokens":
            return values[0]
        if self.mean == "ranks":
            return torch.stack(values).mean()
        return sum(v * w for v, w in zip(values, self.within))


def holds_some(args: tuple, nums: tuple) -> bool:
    """Whether a list argument of this call holds a micro-batch (a list may be empty)."""
    return any(type(a) in (list, tuple) and len(a) for i, a in enumerate(args) if i not in nums)


def listed(args: tuple, flat: list, masks: list, nums: tuple, mean: str, where: str) -> Listed:
    """The list arguments of a call (those holding the batch), checked."""
    positions = [i for i, m in enumerate(masks) if m]
    if not positions:  # an empty list holds no tensor to find it by: this rank has none
        positions = [
            i for i, a in enumerate(args) if i not in nums and type(a) in (list, tuple) and not a
        ]
    if not positions:
        raise ValueError(
            f"{where}: accumulate='list' found no argument holding the batch; pass the list "
            "of micro-batches as the step received it, or name it with batch_argnums=..."
        )
    bad = [
        i for i in positions if type(args[i]) not in (list, tuple) or hasattr(args[i], "_fields")
    ]
    if bad:
        raise ValueError(
            f"{where}: accumulate='list' takes the batch as a list of micro-batches, but "
            f"args[{bad[0]}], which holds the batch, is a {type(args[bad[0]]).__name__}. Pass "
            "a list with one entry per micro-batch (each a tensor or a tree, e.g. a "
            "Hugging Face batch), or use accumulate=k to split one batch k ways."
        )
    differentiated = [i for i in positions if i in nums]
    if differentiated:
        raise ValueError(
            f"{where}: args[{differentiated[0]}] is differentiated (argnums) and holds the list "
            "of micro-batches; accumulate='list' differentiates the parameters, not the batch."
        )
    lengths = {i: len(args[i]) for i in positions}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"args[{i}] has {n}" for i, n in lengths.items())
        raise ValueError(
            f"{where}: the arguments holding micro-batches list different numbers of them "
            f"({shown}); give each micro-batch's part in every one (the same length)."
        )
    k = next(iter(lengths.values()))
    return Listed(positions, k, _rows(args, positions, k, mean, where), mean)


def _rows(args: tuple, positions: list[int], k: int, mean: str, where: str) -> list[int]:
    """Each micro-batch's rows (dim 0 of its tensors; -1 where they disagree)."""
    out = []
    for j in range(k):
        named = [
            (path, x)
            for i in positions
            for path, x in _tree.leaves_with_paths(args[i][j], f"args[{i}][{j}]")
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.ndim > 0
        ]
        sizes = {x.shape[0] for _, x in named}
        if len(sizes) > 1 and mean == "rows":
            shown = ", ".join(f"{p} has {x.shape[0]}" for p, x in named[:4])
            raise ValueError(
                f"{where}: mean='rows' weighs micro-batch {j} by its rows, but its tensors "
                f"disagree on how many it has ({shown}); use mean='ranks' or 'tokens'."
            )
        out.append(sizes.pop() if len(sizes) == 1 else -1 if sizes else 0)
    return out


def agree(listed: Listed, ctx: StepContext | None, where: str) -> str | None:
    """Whether the ranks have as many micro-batches (one all-reduce of two numbers): None
    where they do, else the message a collective inside the micro-batches raises. An
    empty list on any rank is an error on every rank."""
    high = low = -listed.k
    if ctx is not None and ctx.size > 1:
        both = torch.tensor([listed.k, -listed.k], dtype=torch.float64, device=device())
        high, low = _collectives.reduce_groups(both, ctx.mesh.groups(ctx.axis), "max").tolist()
    if low == 0:  # (every rank raises: every rank knows)
        raise ValueError(
            f"{where}: accumulate='list' was given an empty list of micro-batches "
            + ("on this rank " if listed.k == 0 else "on another rank ")
            + "(every rank must bring at least one micro-batch to the update's reduction); "
            "skip the update on every rank together, or give that rank a micro-batch."
        )
    if high == -low:
        return None
    return (
        f"{where}: the ranks run different numbers of micro-batches in this update (from "
        f"{int(-low)} to {int(high)}; this rank {listed.k}), which only works where each "
        "micro-batch is the rank's own business; the loss runs {name}, which pairs every "
        "rank's micro-batches. Give every rank the same number of micro-batches (drop or "
        "pad the last ones: pardist.data.shard gives every rank the same), or keep the "
        "ranks out of the loss (no batch norm: LayerNorm or GroupNorm; no pardist.fsdp; "
        "no collective)."
    )
