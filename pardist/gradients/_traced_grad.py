"""``pardist.grad`` inside a compiled step: torch.func's gradients, then a bucketed mean.

The eager ``pardist.grad`` hands each gradient to the reducer from a hook while
the backward runs. A compiled step has no hooks and no persistent buckets: the
gradients come from ``torch.func.grad_and_value`` (which dynamo traces into the
graph), and the mean over the axis is a flat all-reduce per bucket that the
graph holds (``_traced.mean``), or a reduce-scatter for a sharded optimizer's
parameters (ZeRO-2). The arithmetic is the eager reducer's: every contribution
is divided by (ranks x micro-batches) before the sum, and every rank's loss rides
in the first gradient bucket (one slot per rank, the others zero, so the sum
delivers each exactly), so ``value_and_grad``'s global loss costs nothing extra
and is the eager step's: the mean of the ranks' losses in float64.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from pardist.compile import _traced
from pardist.gradients import _bucketed
from pardist.runtime import StepContext, _tree, dtensor_like
from pardist.sharding import Local
from pardist.transport import signature

__all__ = ["compute"]


def _loss_table(mine: torch.Tensor, ctx: StepContext, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's slot zero but this rank's, which holds its loss."""
    info = ctx.mode.plan.axes[ctx.mode.plan.axis_key]
    table = torch.zeros(ctx.size, dtype=dtype, device=mine.device)
    table[info.index] = mine.detach().to(dtype)
    return table


def _global(table: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of the losses the summed table holds, as the eager step's."""
    return table.detach().double().mean().to(mine.dtype)


def compute(mode, call: Any, ctx: StepContext, leaves: list) -> tuple[torch.Tensor, Any, list]:
    """(value, aux, flat grads in ``leaves``' order); the value is global for value_and_grad."""
    if call.listed is not None:
        raise NotImplementedError(
            f"{call.where}: accumulate='list' runs micro-batches of other shapes at every "
            "update, which one graph cannot hold without recompiling; the step runs eagerly"
        )
    plan, k, replicated = mode.plan, call.accumulate, call.replicated
    # pardist.fsdp shards: differentiated through this rank's chunk (see sharding._traced)
    # (indices by range, not enumerate: dynamo runs half the bytecodes; see compute's loop)
    fsdp = [i for i in range(len(leaves)) if isinstance(leaves[i], DTensor)]
    places = _shard_places(call, fsdp, plan)
    reduce = ctx.size > 1

    counting = call.counts is not None  # mean='tokens': f's aux ends with its token count
    has_aux = call.has_aux or counting

    def checked(*args):
        if places:
            args = _swap(args, places, Local)
        out = call.f(*args, **call.kwargs)
        _bucketed.split_value(out, has_aux, call.where)  # pardist's error for a non-scalar
        return out

    nums = call.nums if len(call.nums) > 1 else call.nums[0]
    transform = torch.func.grad_and_value(checked, argnums=nums, has_aux=has_aux)
    # Replicated gradients are divided before they are summed, as the eager buckets do:
    # here, or (one micro-batch, all-reduced) by the mean as it writes its buckets.
    scale = (ctx.size if reduce else 1) * k
    rep = [i for i in range(len(replicated)) if replicated[i]]
    scatter = reduce and bool(ctx.scatter) and signature([leaves[i] for i in rep]) in ctx.scatter
    late = reduce and k == 1 and not scatter
    values, auxes = [], []
    local: list[Any] = [None] * len(leaves)  # summed as they come, divided by combine
    summed: list[Any] = [None] * len(leaves)  # replicated: divided first
    parts: list = [[None] * k for _ in leaves]
    for j, margs, _ in call.micro_batches():
        g, out = transform(*(_swap(margs, places, _chunk) if places else margs))  # (chunks)
        value, aux = out if has_aux else (out, None)
        if counting:
            aux, count = aux if call.has_aux else (None, aux)
            call.counts.append(count)
        call.took(j, aux)
        values.append(value)
        auxes.append(aux)
        flat = _tree.tree_flatten(g)[0]
        for i, gi in zip(range(len(flat)), flat):
            if replicated[i] and scale > 1:
                gi = gi if late else gi / scale
                summed[i] = gi if summed[i] is None else summed[i] + gi
            elif call.split[i] and k > 1:
                parts[i][j] = gi
            else:
                local[i] = gi if local[i] is None else local[i] + gi
    chunks = [t.to_local() if i in fsdp else t for i, t in zip(range(len(leaves)), leaves)]
    grads = call.combine(local, parts, chunks, [s is not None for s in summed])
    for i in fsdp:  # each rank's shard of the mean gradient, as the parameter is held
        grads[i] = dtensor_like(grads[i], leaves[i])
    for i in rep:
        if summed[i] is not None:
            grads[i] = summed[i]
    # The batch's gradients, weighed as the ranks' objectives (a row-weighted mean: below).
    sharded = [i for i in range(len(leaves)) if not replicated[i] and i not in fsdp]
    if reduce and call.mean != "rows":
        for i in sharded:
            grads[i] = grads[i] / ctx.size
    aux = call.aux(auxes)
    mine = torch.stack(values).mean() if k > 1 else values[0]
    if not reduce:
        return mine, aux, grads
    need = call.need_value
    rows_value = None
    if call.mean == "rows":  # each rank weighs by its rows: one small all-reduce of two
        rows_value = _weigh_rows(grads, rep, sharded, mine, call.rows, ctx, plan)
        need = False  # the value is the row-weighted mean, not the ranks' table
    # The loss table rides in the first bucket unless it would be compressed there.
    alone = need and (scatter or plan.compression is not None or not rep)
    value = mine
    if alone:
        table = _loss_table(mine, ctx, torch.float64)
        value = _global(_traced.psum(table, plan.axis_key, plan), mine)  # not compressed
    if scatter:
        shards = _traced.mean_scatter([grads[i] for i in rep], plan)
        for i, shard in zip(rep, shards):
            grads[i] = DTensor.from_local(
                shard,
                plan.submesh,
                [Shard(0)],
                shape=(leaves[i].numel(),),
                stride=(1,),
                run_check=False,
            )
        return value, aux, grads
    if not rep:  # (every differentiated input a pardist.fsdp shard)
        return value, aux, grads
    carried = [_loss_table(mine, ctx, grads[rep[0]].dtype)] if need and not alone else []
    divisors = [1.0] * len(carried) + [float(scale) if late else 1.0] * len(rep)
    means = _traced.mean(carried + [grads[i] for i in rep], plan, divisors)
    for i, m in zip(rep, means[len(carried) :]):
        grads[i] = m
    if carried:
        value = _global(means[0], mine)
    return (rows_value if rows_value is not None else value), aux, grads


def _shard_places(call: Any, fsdp: list[int], plan) -> dict:
    """{argument: {leaf position: numel}} of the differentiated pardist.fsdp shards (each
    padded to a length that names its numel: ``sharding._traced.padded``)."""
    if not fsdp:
        return {}
    places: dict = {}
    leaf = 0
    for n in call.nums:
        for j, t in enumerate(call.flat[n][0]):
            if leaf in fsdp:
                places.setdefault(n, {})[j] = plan.numels[t.shape[0]]
            leaf += 1
    return places


def _chunk(t: DTensor, numel: int) -> torch.Tensor:
    """This rank's (padded) chunk of the shard ``t``, as ``_swap`` gives it."""
    return t.to_local()


def _swap(args: tuple, places: dict, fn) -> tuple:
    """``args`` with ``fn(leaf, numel)`` at each place of a shard."""
    out = list(args)
    for n, where in places.items():
        leaves, spec = _tree.tree_flatten(out[n])
        for j, numel in where.items():
            leaves[j] = fn(leaves[j], numel)
        out[n] = _tree.tree_unflatten(leaves, spec)
    return tuple(out)


def _weigh_rows(grads: list, rep: list, sharded: list, mine, rows, ctx, plan) -> torch.Tensor:
    """``mean='rows'``: each replicated gradient weighed by the rank's rows over the mean
    rows per rank (the mean over ranks then weighs every row of the global batch alike),
    as the eager step weighs its seed, and each of the batch's by the rank's rows over all;
    the row-weighted global loss. A rank without rows adds nothing (its mean over no rows
    is not a number)."""
    r = torch.zeros((), dtype=torch.float64, device=mine.device) + rows
    used = mine.double() * r if rows else torch.zeros_like(r)
    total, summed = _traced.psum(torch.stack([r, used]), plan.axis_key, plan).unbind()
    for i in rep:
        g = grads[i]
        grads[i] = g * (ctx.size * r / total).to(g.dtype) if rows else torch.zeros_like(g)
    for i in sharded:
        g = grads[i]
        grads[i] = g * (r / total).to(g.dtype) if rows else torch.zeros_like(g)
    return (summed / total).to(mine.dtype)
