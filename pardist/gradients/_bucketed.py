"""The fast path of ``pardist.grad`` inside a step: gradients handed to buckets during the backward.

Each replicated input's gradient goes to the reduction ``_reduction.choose`` picks
for the call (buckets all-reduced like DDP's, a reduce-scatter for a sharded
optimizer, nothing on one rank) the moment autograd produces it. With
``accumulate=k`` the k micro-batches add into the same buckets, and only the last
one's backward launches the reduction: one reduction per step. The buckets also
carry, at no extra collective, the table of every rank's loss and row count
(``_perrank``): the global loss in full precision, the row-weighted mean, and the
report of a non-finite loss.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pardist.collectives import _vma
from pardist.gradients import _lists, _perrank, _reduction
from pardist.gradients._call import Call, split_value
from pardist.gradients._reduction import Reduction
from pardist.runtime import StepContext, _tree
from pardist.sharding import _fsdp
from pardist.transport import Reducer, signature

__all__ = ["Call", "compute", "compute_local", "split_value"]


_requires_grad = operator.attrgetter("requires_grad")
_requires_grad_ = torch.Tensor.requires_grad_


class _HandOver:
    """What gradient hooks call: the reducer (which may be made after the forward)."""

    reducer: Reducer | None = None
    carry = 0  # slot 0 carries the per-rank table, slots 1.. the statistics to average
    base = 0  # the first gradient's slot
    pending: list = []  # the statistics the forward left to average (one pass, late)
    rep_index: dict = {}  # a replicated leaf's index -> its gradient's index among them

    def __init__(self, ctx: StepContext, rep: list, divisor: float | None, empty: bool):
        self.ctx, self.rep, self.divisor, self.empty = ctx, rep, divisor, empty
        self.table = _perrank.table(ctx.size, ctx.mesh.index(ctx.axis) if ctx.size > 1 else 0)

    def use(self, reduction: Reduction, pending: list, accumulate: int) -> None:
        rep = self.rep
        # Slot 0 carries the per-rank table, except to a reduce-scatter (ZeRO-2).
        self.carry = 0 if reduction.scatter else 1
        table = (
            []
            if reduction.scatter
            else [torch.empty(self.table.numel, dtype=rep[0].dtype, device=rep[0].device)]
        )
        self.reducer, self.base = reduction.reducer(self.ctx, rep, pending, table)
        # A row-weighted mean weighs the backward's seed instead (see compute): every
        # rank's contributions are then summed over the ranks' mean like any others.
        self.reducer.begin(accumulate, None)

    def __call__(self, index: int, grad: torch.Tensor) -> None:
        if self.empty and self.divisor is not None:
            grad = torch.zeros_like(grad)  # no rows, no weight (and not its nan gradient)
        self.reducer.add(self.base + index, grad)

    def many(self, pairs: list[tuple[int, torch.Tensor]], first: list = ()) -> None:
        """Every ``(index, grad)`` at once, after the backward (where no hook took them),
        with the slots before the gradients (``first``: slot, tensor, its divisor)."""
        if self.empty and self.divisor is not None:  # zeros in their place, one by one
            for slot, t, by in first:
                self.reducer.add(slot, t, divisor=by)
            for index, grad in pairs:
                self(index, grad)
        else:
            self.reducer.add_many([(self.base + index, grad) for index, grad in pairs], first)


def _rows_divisor(ctx: StepContext, rep: list, rows: int, exact: bool) -> float:
    """This rank's divisor for a row-weighted mean: the global rows over its own.

    The total is agreed by a collective on the first call (or every call where no
    bucket carries the counts: ``exact``), then taken from the previous step's
    carried counts; :func:`_correction` fixes the rare step where it changed.
    """
    key = ("rows total", signature(rep), ctx.axis)
    if exact or key not in ctx.reducers:
        ctx.reducers[key] = _perrank.total_rows(rows, ctx)
    total = ctx.reducers[key]
    return total / rows if rows > 0 else math.inf


def _correction(ctx: StepContext, hand: _HandOver, counts: list[int] | None) -> float:
    """The factor for gradients pre-scaled by a total that turned out to be wrong."""
    if hand.divisor is None or not hand.carry or counts is None:
        return 1.0
    key = ("rows total", signature(hand.rep), ctx.axis)
    assumed, actual = ctx.reducers[key], sum(c for c in counts if c > 0)
    ctx.reducers[key] = actual
    return assumed / actual if actual and actual != assumed else 1.0


def compute(call: Call, ctx: StepContext, leaves: list) -> tuple[torch.Tensor, Any, list]:
    """(global value, aux, flat gradients) of one call inside a step."""
    k, replicated = call.accumulate, call.replicated
    rep = list(itertools.compress(leaves, replicated))
    reduction = _reduction.choose(ctx, rep, k, call.listed is not None)
    # Buckets take the replicated leaves' gradients: their slots, by leaf index.
    positions = itertools.compress(itertools.count(), replicated)
    rep_index = dict(zip(positions, itertools.count())) if reduction.buckets else {}
    divisor = None
    if call.mean == "rows" and ctx.size > 1:  # (no buckets to carry the counts: agreed now)
        divisor = _rows_divisor(ctx, rep, call.rows, exact=reduction.scatter or not rep)
    # One pass with an all-reduce: the reducer is made after the forward, so that the
    # statistics the forward left to average (batch norm with sync_bn=False) ride in
    # the gradient buckets instead of costing a collective of their own.
    hand = _HandOver(ctx, rep, divisor, call.rows == 0)
    hand.rep_index = rep_index
    if reduction.buckets and not reduction.late:
        hand.use(reduction, [], k)
    local: list = [None] * len(leaves)
    parts: list = [[None] * k for _ in leaves] if k > 1 else []  # split gradients, per micro-batch
    values, auxes = [], []
    if call.listed is not None:  # ranks with more micro-batches than others: no collective
        ctx.call.uneven = _lists.agree(call.listed, ctx, call.where)
    try:
        with _vma.in_grad():
            _micro_batches(call, ctx, hand, reduction, leaves, local, parts, values, auxes)
    finally:
        ctx.call.uneven = None
    reduced = hand.reducer.finish() if hand.reducer is not None else []
    with _vma.paused():
        for m, t in enumerate(hand.pending):
            t.copy_(reduced[1 + m])  # the averaged statistics, into the tensors apply returned
    _vma.invariant(hand.pending)
    value, counts = _value(call, ctx, hand, reduced, values)
    if value is not values[0]:
        _vma.mean_over_data(value, values[0])  # the loss averaged over the data axes
    factor = _correction(ctx, hand, counts)
    grads = call.combine(local, parts, leaves, replicated if hand.reducer is not None else None)
    if ctx.size > 1:  # the batch's gradients: those of the loss averaged over the data axes
        grads = sharded_mean(grads, leaves, replicated, ctx.size / factor)
    for i, t in enumerate(leaves) if hand.reducer is not None else ():
        if replicated[i]:
            g = reduced[hand.base + hand.rep_index[i]]
            if factor != 1.0:
                g = g * factor  # out of place: shared-memory buckets are every rank's
            grads[i] = _reduction.Scatter.as_shard(g, t, ctx) if reduction.scatter else g
    return value, call.aux(auxes), _vma.typed_like(grads, leaves)


def _micro_batches(call, ctx, hand, reduction, leaves, local, parts, values, auxes) -> None:
    """Forward and backward of each micro-batch, their gradients to the reducer or kept."""
    k, replicated, rep_index, divisor = (
        call.accumulate,
        call.replicated,
        hand.rep_index,
        hand.divisor,
    )
    weight = ctx.size / divisor if divisor is not None else 1.0  # 0.0 for a rank without rows
    rep = list(itertools.compress(leaves, replicated))
    for j, margs, mleaves in call.micro_batches():
        if hand.reducer is not None and j == k - 1:
            hand.reducer.last_micro_batch()
        diff = [t for n in call.nums for t in mleaves[n]]
        if _tree.any_instance(diff, DTensor):  # FSDP shards: only apply
            inputs = _fsdp.grad_inputs(diff, margs, call.nums, call.where)
        else:
            inputs = list(map(_requires_grad_, map(torch.Tensor.detach, diff)))  # (in C)
        _vma.enter_grad(inputs, leaves, replicated)
        mark = len(ctx.call.pending_means)
        with torch.enable_grad(), _vma.user():
            out = call.f(*call.with_inputs(margs, inputs), **call.kwargs)
        value, aux = split_value(out, call.has_aux, call.where)
        if reduction.late:
            hand.pending = ctx.call.pending_means[mark:]
            del ctx.call.pending_means[mark:]
            hand.use(reduction, hand.pending, 1)
        values.append(value.detach())
        # Where buckets reduce during the backward, the reducer takes each gradient the
        # moment autograd produces it; else all of them after it (no hooks).
        hooked = hand.reducer is not None and hand.reducer.overlaps()
        first, after = [], []  # (slot, tensor, divisor) before the gradients; (slot, gradient)
        if hand.carry and j == k - 1:
            mine = call.rank_value(values)
            first = [(0, hand.table.encode(mine, call.rows, rep[0].dtype), 1)]
            first += [(1 + m, t, ctx.size) for m, t in enumerate(hand.pending)]
            if hooked:  # before the last backward, which launches buckets
                for slot, t, by in first:
                    hand.reducer.add(slot, t, divisor=by)
                first = []
        if value.requires_grad:
            for i, x in enumerate(inputs) if hooked else ():
                if replicated[i]:
                    x.register_hook(functools.partial(hand, rep_index[i]))
            seed = _vma.seed(value)
            if divisor is not None:
                # mean='rows': this rank's loss weighs rows / total (times the ranks,
                # whose mean the reducer takes). In the seed, not on the gradients, so
                # that cross-rank backwards (sync batch norm) see one weighted objective.
                seed = (torch.ones_like(value) if seed is None else seed) * weight
            seed = call.seed(j, value, seed)  # a list's micro-batch: its own weight
            got = torch.autograd.grad(value, inputs, seed, allow_unused=True)
            if hand.reducer is None and k == 1:
                local[:] = got  # one pass, nothing to bucket: as autograd gave (seed weighed)
                got = ()
            for i, g in enumerate(got):
                if g is None:
                    continue
                if hand.reducer is not None and replicated[i]:
                    if not hooked:
                        after.append((rep_index[i], g))
                    continue
                if call.split[i] and k > 1:
                    parts[i][j] = g
                else:
                    local[i] = g if local[i] is None else local[i] + g
        if after or first:  # where no hook took them: all at once, after the backward
            hand.many(after, first)
        aux = _detached(aux)
        call.took(j, aux)
        if call.carry is not None and j < k - 1:
            # Superseded by the next micro-batch's: nothing to average at the end.
            gone = {id(x) for x in _tree.tree_leaves(aux)}
            ctx.call.pending_means[:] = [t for t in ctx.call.pending_means if id(t) not in gone]
        auxes.append(aux)


def sharded_mean(grads: list, leaves: list, replicated: list, size: int) -> list:
    """The gradients of the leaves that vary over the data axes (the batch, activations),
    divided by the ranks: with the replicated ones' mean, the gradient of the loss averaged
    over the data axes, so that every argument's is one process's on the global batch.
    (A row-weighted mean's weights are in the backward's seed; ``pardist.fsdp`` shards are
    reduce-scattered as means already.)"""
    return [
        g / size if g is not None and not rep and not isinstance(t, DTensor) else g
        for g, t, rep in zip(grads, leaves, replicated)
    ]


def compute_local(call: Call, leaves: list) -> tuple[torch.Tensor, Any, list]:
    """(value, aux, flat gradients) outside a step and outside any torch.func transform.

    torch.func.grad's numbers by autograd's own backward, which, unlike torch.func,
    runs saved-tensor hooks: activation checkpointing recomputes here.
    """
    k = call.accumulate
    local: list = [None] * len(leaves)
    parts: list = [[None] * k for _ in leaves] if k > 1 else []  # split gradients, per micro-batch
    values, auxes = [], []
    if call.listed is not None:
        _lists.agree(call.listed, None, call.where)  # (raises where the list is empty)
    for j, margs, mleaves in call.micro_batches():
        inputs = [t.detach().requires_grad_() for n in call.nums for t in mleaves[n]]
        with torch.enable_grad():
            out = call.f(*call.with_inputs(margs, inputs), **call.kwargs)
        value, aux = split_value(out, call.has_aux, call.where)
        values.append(value.detach())
        got = [None] * len(inputs)
        if value.requires_grad:
            seed = call.seed(j, value, None)
            got = torch.autograd.grad(value, inputs, seed, allow_unused=True)
        for i, g in enumerate(got):
            if g is not None and call.split[i] and k > 1:
                parts[i][j] = g
            elif g is not None:
                local[i] = g if local[i] is None else local[i] + g
        aux = _detached(aux)
        call.took(j, aux)
        auxes.append(aux)
    return call.rank_value(values), call.aux(auxes), call.combine(local, parts, leaves)


def _detached(aux: Any) -> Any:
    """``aux`` cut from the graph (as is where nothing in it requires grad: buffers)."""
    leaves = _tree.tree_leaves(aux)
    tensors = all(map(isinstance, leaves, itertools.repeat(torch.Tensor)))
    if tensors and not any(map(_requires_grad, leaves)):
        return aux
    return _tree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux)


def _value(call: Call, ctx: StepContext, hand: _HandOver, reduced: list, values: list):
    """The global loss (reported if not finite) and every rank's row count (or None)."""
    mine = call.rank_value(values)
    if hand.carry:
        everyone, counts = hand.table.decode(reduced[0])
    elif ctx.size > 1 and call.need_value:
        everyone, counts = _perrank.exchange(mine, call.rows, ctx)  # what a pmean costs
    elif ctx.size > 1:
        return mine, None  # pardist.grad with nothing carried: no value to give
    else:  # one rank: its own loss
        if _perrank.checked(mine, ctx) and not math.isfinite(mine.item()):
            _perrank.report(mine.double().reshape(1), [call.rows], call.mean, ctx, call.where)
        return mine, [call.rows]
    check = _perrank.checked(everyone, ctx)
    need = check or call.mean == "rows"
    counts = counts.tolist() if need else None
    if check and call.mean == "ranks":
        _perrank.refuse_empty(everyone, counts, ctx, call.where)
    if check:
        _perrank.report(everyone, counts, call.mean, ctx, call.where)
    return _perrank.global_value(everyone, counts, call.mean, mine.dtype), counts
