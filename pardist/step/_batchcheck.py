"""Mistakes about the batch: every rank fed the very same one, or the batch in another place.

A plain DataLoader on every rank, seeded alike (as replicated parameters
require), yields the same batches everywhere: N processes then do one
process's work N times over, and nothing fails. On a step's first call (and on
every call under ``PARDIST_DEBUG=1``) ``data_parallel`` compares one small
fingerprint of the sharded inputs across the axis (a single all-gather of four
integers) and, when every rank's is the same, warns once naming the argument
and the fix; under ``PARDIST_DEBUG=1`` it raises.

Equal batches are not always a mistake, so the check stays quiet where
equality proves little: at an axis size of 1; when no rank holds more than one
row of data (one sample per rank may repeat by chance); and when every sharded
tensor is constant (``torch.ones``, zeros: synthetic test data).

When no ``in_specs`` are given, the last positional argument is the batch; an
error that follows from that assumption (``step(params, batch, opt_state)``)
says so and shows the ``in_specs`` for the layout the user meant.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pardist.data import _gather
from pardist.runtime import _warnings
from pardist.step._specs import P

__all__ = ["check_distinct", "default_misfit", "default_specs", "param_names"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK = (1 << 62) - 1
_GOLDEN = 0x5851F42D4C957F2D  # an odd 64-bit multiplier (Knuth's MMIX LCG), as an int64


def _fingerprint(t: torch.Tensor) -> tuple[int, int, bool]:
    """A sum of ``t``'s bits, a hash of them by position (so that which element holds
    which value counts: one-hot rows, permutations, rows in another order), and
    whether all its elements are equal."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    bits = flat.contiguous().view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
    if not len(bits):
        return 0, 0, True
    # A multiplicative hash of each position (int64 products wrap): a different
    # weight per element, the same on every rank.
    weight = torch.arange(1, len(bits) + 1, device=bits.device).mul_(_GOLDEN)
    weight.bitwise_xor_(weight >> 29)
    sums = torch.stack([bits.sum(), (bits * weight).sum(), bits.max() - bits.min()])
    total, hashed, spread = sums.tolist()
    return total, hashed, spread == 0


def _telling(t: torch.Tensor, rows: int, constant: bool) -> bool:
    """Whether ``t`` alike on every rank says the ranks were given the same batch: two or
    more rows, not all equal, and, for integers (labels), at least 64 bits of them, so that
    chance cannot make them equal (10 classes: 20 rows; two: 64)."""
    if rows <= 1 or constant:
        return False
    if t.is_floating_point() or t.is_complex():
        return True
    distinct = torch.unique(t).numel()
    return t.numel() * math.log2(distinct) >= 64


def _rows(t: torch.Tensor, spec: P, axes: tuple[str, ...]) -> int:
    """How many slices of ``t`` this rank holds along the dims sharded over ``axes``."""
    rows = 1
    for dim, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        if entry is not None and set(names) & set(axes):
            rows *= t.shape[dim]
    return rows


def param_names(fn: Callable) -> list[str]:
    """The names of ``fn``'s positional parameters, as far as they can be known."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def check_distinct(
    where: str,
    fn: Callable,
    named: list[tuple[str, object]],
    specs: list[P],
    sharded: list[int],
    axes: tuple[str, ...],
    group: dist.ProcessGroup,
    debug: bool,
) -> None:
    """Warn (raise if ``debug``) when the sharded inputs are the same on every rank."""
    size = dist.get_world_size(group)
    leaves = [
        (named[i][0], named[i][1], specs[i])
        for i in sharded
        if isinstance(named[i][1], torch.Tensor) and not isinstance(named[i][1], DTensor)
    ]
    if size == 1 or not leaves:
        return
    counts = _gather.all_gather_ints([len(leaves)], group)  # (lists of micro-batches vary)
    if any(c != [len(leaves)] for c in counts):
        return  # other leaves on another rank: not the same batch
    mine = [len(leaves)]
    for _, t, spec in leaves:
        s1, s2, constant = _fingerprint(t)
        mine += [s1 & _MASK, s2 & _MASK, int(_telling(t, _rows(t, spec, axes), constant))]
    everyone = _gather.all_gather_ints(mine, group)
    if not all(len(theirs) == len(mine) for theirs in everyone):
        return
    # Each leaf on its own: labels alike on every rank are a repeated batch even when
    # per-rank augmentation made the inputs differ (if they say enough: see _telling).
    same = [
        k
        for k in range(len(leaves))
        if everyone[0][3 + 3 * k]
        and all(
            theirs[1 + 3 * k : 4 + 3 * k] == everyone[0][1 + 3 * k : 4 + 3 * k]
            for theirs in everyone
        )
    ]
    if not same:
        return
    names = param_names(fn)
    args = sorted({int(leaves[k][0][5:].split("]")[0]) for k in same})
    shown = " and ".join(
        f"args[{i}]" + (f" ({names[i]!r})" if i < len(names) else "") for i in args
    )
    if len(same) < len(leaves):  # e.g. the labels, the inputs augmented on each rank
        shown += f" (its {', '.join(leaves[k][0] for k in same)}; the rest differ)"
    axis = axes[0] if len(axes) == 1 else axes
    replicated = ", ".join("P()" for _ in range(max(len(names), args[-1] + 1)))
    message = (
        f"{where}: every rank received the same batch: {shown}, sharded over axis {axis!r}, "
        f"is identical on all {size} ranks, so they do the same work {size} times over "
        "(a DataLoader on every rank, seeded alike, yields the same batches everywhere). "
        "Give each rank its own piece of the data: loader = pardist.data.shard(loader). "
        "If every rank is meant to see the same values, mark them replicated: "
        f"in_specs=({replicated}). "
        + (
            "(Raised under PARDIST_DEBUG=1.)"
            if debug
            else "(Checked on the first call; PARDIST_DEBUG=1 checks every call and raises.)"
        )
    )
    if debug:
        raise ValueError(message)
    _warnings.warn(message, _warnings.DuplicateBatchWarning)


def default_specs(fn: Callable, nargs: int, axes: tuple[str, ...]) -> tuple[str, str]:
    """What the default in_specs assume, and how to say otherwise."""
    names = param_names(fn)
    named = lambda i: f"args[{i}]" + (f" ({names[i]!r})" if i < len(names) else "")  # noqa: E731
    likely = [i for i, n in enumerate(names[:nargs]) if "batch" in n or n in ("x", "data")]
    guess = likely[0] if likely else max(nargs - 2, 0)
    axis = repr(axes[0] if len(axes) == 1 else axes)
    specs = ", ".join(f"P({axis})" if i == guess else "P()" for i in range(nargs))
    return (
        f"No in_specs were given, so the last positional argument, {named(nargs - 1)}, is "
        f"taken to be the batch (split along dim 0 over {axis}) and every other argument "
        "to be replicated: the step(params, opt_state, batch) convention.",
        "If the batch is another argument, pass it last or say where it is, e.g. "
        f"in_specs=({specs}) for {named(guess)}.",
    )


def default_misfit(
    where: str, fn: Callable, error: Exception, path: str, leaf: object, nargs: int, axes
) -> Exception:
    """The default in_specs' error: what they assumed, what did not fit, the fix."""
    if not isinstance(leaf, torch.Tensor):
        why = f"{path} is a {type(leaf).__name__} ({leaf!r:.40}), not a tensor."
    elif leaf.ndim == 0:
        why = f"{path} has shape (), with no dim 0 to split."
    else:
        why = str(error).removeprefix(f"{where}: ")
    assumed, fix = default_specs(fn, nargs, axes)
    return type(error)(f"{where}: {assumed} But {why} {fix}")
