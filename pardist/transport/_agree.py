"""Every rank at the same collective of the same call: the header of a collective over gloo.

gloo pairs the ranks' operations by their order alone. A rank that raised inside a
call of a step and went on (the user caught it, to skip a bad batch) sends its next
operation to whatever the others wait in: the start of its next call pairs with their
batch-norm statistics, a ``gather_object`` after the step with their gradient
reduction. Wrong numbers, an abort on a size check, or a wait to the timeout.

So every collective pardist runs over gloo (CPU ranks) begins with a *header*: one
all-reduce of two integers, a checksum of the collective (its name, dtype and shape)
and of the call of the step this rank is in (its step mark: which step, how many
calls entered; 0 outside steps). Headers always pair with headers: a rank that skips
a collective skips its header too. Where they differ, every rank learns so from the
same reduction, gathers what each was doing, and raises: :class:`StepMismatch`
(the ranks are at different calls; for good, as on shared memory) or
:class:`CollectiveMismatch` (same call, different collectives), naming each rank's
collective and call. Shared memory needs no header (its barriers carry the same
signature); GPU backends get one under ``PARDIST_DEBUG=1`` only, as torch's own check.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from pardist.runtime import _faults, _process, debug_enabled
from pardist.transport import _stepmark

__all__ = ["agree", "header", "name_step"]

_names: dict[int, str] = {}  # step key -> what the user calls it


def name_step(step_key: int, where: str) -> None:
    """Remember the name of the step keyed ``step_key``, for the messages."""
    _names[step_key] = where


def _call(mark: int) -> str:
    if mark == 0:
        return "outside any step"
    if mark == _stepmark.LOST:
        return "after the ranks were found out of step"
    return f"in call {_stepmark.call_of(mark)} of {_names.get(mark >> 41, 'a step')}"


def agree(name: str, group, x: torch.Tensor | None = None) -> None:
    """The header of collective ``name`` over ``group`` (of ``x``'s shape), where needed.

    Needed over gloo: CPU ranks (where shared memory does not carry it), and every
    backend under ``PARDIST_DEBUG=1``.
    """
    device = x.device if x is not None else _process.device()
    if device.type == "cpu" or debug_enabled():
        header(name, group, x)


def header(name: str, group, x: torch.Tensor | None = None) -> None:
    """Check that every rank of ``group`` is at collective ``name`` of the same call."""
    _stepmark.check_lost()  # (found together: no collective pairs any more)
    what = (
        name if x is None else f"{name} of {str(x.dtype).removeprefix('torch.')} {tuple(x.shape)}"
    )
    mark = _stepmark.now()
    mine = zlib.crc32(f"{what}|{mark}".encode())
    device = x.device if x is not None else _process.device()
    both = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    ranks = dist.get_process_group_ranks(group)
    with _faults.collective_errors(name, group), _stepmark.over_gloo(what, ranks):
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if int(both[0]) == -int(both[1]):
        return
    doing: list = [None] * dist.get_world_size(group)
    with _faults.collective_errors(name, group):
        dist.all_gather_object(doing, (what, mark), group=group)
    listing = "; ".join(f"rank {r}: {w}, {_call(m)}" for r, (w, m) in zip(ranks, doing))
    where = _faults.describe_group(group.group_name, ranks)
    if len({m for _, m in doing}) > 1:
        _stepmark.out_of_step(
            f"pardist: the ranks of {where} are at different calls ({listing}): a rank "
            "raised inside a call and went on, or called a step that the others did not. "
            "To skip a bad batch, decide on every rank together, before the step "
            "(docs/faults.md).",
            together=True,
        )
    raise _faults.CollectiveMismatch(
        f"pardist: the ranks of {where} are not in the same collective, or gave it "
        f"different shapes or dtypes ({listing}); every rank stops here. Every rank must "
        "call the same collectives, in the same order, with the same shapes and dtypes "
        "(for per-rank lengths, gather with pardist.gather)."
    )
