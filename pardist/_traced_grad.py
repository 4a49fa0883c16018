"""``pardist.grad`` inside a compiled step: torch.func's gradients, then a bucketed mean.

The eager ``pardist.grad`` hands each gradient to the reducer from a hook while
the backward runs. A compiled step has no hooks and no persistent buckets: the
gradients come from ``torch.func.grad_and_value`` (which dynamo traces into the
graph), and the mean over the axis is a flat all-reduce per bucket that the
graph holds (``_traced.mean``), or a reduce-scatter for a sharded optimizer's
parameters (ZeRO-2). The arithmetic is the eager reducer's: every contribution
is divided by (ranks x micro-batches) before the sum, and the loss rides in the
first gradient bucket, so ``value_and_grad``'s global loss costs nothing extra.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from pardist import _microbatch, _traced, _tree
from pardist._context import StepContext
from pardist._zero import signature

__all__ = ["compute"]


def _flat_grads(g: Any, nums: tuple[int, ...]) -> list[torch.Tensor]:
    parts = (g,) if len(nums) == 1 else g
    return [leaf for part in parts for leaf in _tree.tree_leaves(part)]


def compute(
    f: Callable,
    nums: tuple[int, ...],
    has_aux: bool,
    accumulate: int,
    batch_nums: tuple[int, ...],
    args: tuple,
    kwargs: dict,
    ctx: StepContext,
    leaves: list[torch.Tensor],
    replicated: list[bool],
    split: Callable,
    where: str,
) -> tuple[Any, Any, list[torch.Tensor], bool]:
    """(value, aux, flat grads in ``leaves``' order, whether value is the global mean)."""

    def checked(*call):
        out = f(*call, **kwargs)
        split(out, has_aux, where)  # pardist's error for a non-scalar value
        return out

    transform = torch.func.grad_and_value(
        checked, argnums=nums if len(nums) > 1 else nums[0], has_aux=has_aux
    )
    plan = ctx.plan
    reduce = ctx.size > 1 and any(replicated)
    # Replicated gradients are divided before they are summed, as the eager buckets do.
    scale = (ctx.size if reduce else 1) * accumulate
    values, auxes = [], []
    sums: list[Any] = [None] * len(leaves)
    for margs in _microbatch.split(args, batch_nums, accumulate, where):
        g, out = transform(*margs)
        value, aux = out if has_aux else (out, None)
        values.append(value)
        auxes.append(aux)
        for i, gi in enumerate(_flat_grads(g, nums)):
            if replicated[i] and scale > 1:
                gi = gi / scale
            sums[i] = gi if sums[i] is None else sums[i] + gi
    grads = [
        s / accumulate if not replicated[i] and accumulate > 1 else s for i, s in enumerate(sums)
    ]
    aux = _microbatch.stack(auxes)
    rep = [i for i, r in enumerate(replicated) if r]
    scatter = reduce and bool(ctx.scatter) and signature([leaves[i] for i in rep]) in ctx.scatter
    if not reduce:
        value = torch.stack(values).mean() if accumulate > 1 else values[0]
        return value, aux, grads, False
    if scatter:
        shards = _traced.mean_scatter([grads[i] for i in rep], plan)
        for i, local in zip(rep, shards):
            grads[i] = DTensor.from_local(
                local,
                plan.submesh,
                [Shard(0)],
                shape=(leaves[i].numel(),),
                stride=(1,),
                run_check=False,
            )
        value = torch.stack(values).mean() if accumulate > 1 else values[0]
        return value, aux, grads, False
    loss = values[0] / scale
    for v in values[1:]:
        loss = loss + v / scale
    means = _traced.mean([loss.detach().to(grads[rep[0]].dtype)] + [grads[i] for i in rep], plan)
    for i, m in zip(rep, means[1:]):
        grads[i] = m
    return means[0].to(values[0].dtype), aux, grads, True
