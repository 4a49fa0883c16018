"""Who reduces a step's gradients: one object, chosen once per call of ``pardist.grad``.

``pardist.grad`` inside an eager step (``_bucketed``) hands the gradients of the
replicated inputs to the reduction that :func:`choose` picks from the step and
the call, and asks nothing else about it:

    Local       one rank, or nothing replicated: autograd's gradients as they are
    Accumulate  micro-batches (``accumulate=k``) on one rank: added up in buckets
    AllReduce   the mean over the data axes, in buckets during the backward (DDP's
                reducer); with one pass it is made after the forward, so that the
                statistics the forward left to average (``sync_bn=False``) ride in it
    Scatter     a sharded optimizer state (ZeRO-2): reduce-scatter, one shard each

Each reduction keeps its buckets between steps in the step's ``reducers``, found by
the layout of the tensors it reduces (shapes, strides, dtypes, devices: a key made
in C, not a Python loop per tensor). ``pardist.fsdp`` shards are never replicated
inputs: their gathers' backward reduce-scatters them (``sharding/_gather``). The
deterministic mode, compiled steps and calls nested in another transform take
their own paths (``_deterministic``, ``_traced_grad``, torch.func), chosen in ``_grad``.
"""

from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import DTensor, Shard

from pardist.runtime import StepContext
from pardist.transport import Reducer, ScatterReducer, signature

__all__ = ["Accumulate", "AllReduce", "Local", "Reduction", "Scatter", "choose"]

_shape, _dtype, _device = (operator.attrgetter(a) for a in ("shape", "dtype", "device"))


def _layout(like: list[torch.Tensor]) -> tuple:
    """What a reducer's buckets are made for, gathered in C."""
    return (
        tuple(map(_shape, like)),
        tuple(map(torch.Tensor.stride, like)),
        tuple(map(_dtype, like)),
        tuple(map(_device, like)),
    )


class Reduction:
    """How one call's replicated gradients are reduced (see the module docstring)."""

    buckets = True  # the gradients go to a reducer (else autograd's are kept as they are)
    late = False  # the reducer is made after the forward, with the statistics to average
    scatter = False  # each rank gets its shard of the mean (a DTensor), not the whole

    def reducer(self, ctx: StepContext, rep: list, pending: list, table: list):
        """``(reducer, slots before the first gradient)`` for the replicated ``rep``;
        ``table`` (empty, or one tensor: every rank's loss and rows) and the ``pending``
        statistics take the first slots."""
        raise NotImplementedError


class Local(Reduction):
    buckets = False


class Accumulate(Reduction):
    def reducer(self, ctx, rep, pending, table):
        like = table + list(pending) + rep
        key = ("accumulate", _layout(like))
        if key not in ctx.reducers:
            ctx.reducers[key] = Reducer(like, [], 1)
        return ctx.reducers[key], len(like) - len(rep)


class AllReduce(Reduction):
    def __init__(self, late: bool):
        self.late = late

    def reducer(self, ctx, rep, pending, table):
        like = table + list(pending) + rep
        key = (
            _layout(like),
            ctx.axis,
            ctx.compression,
            ctx.overlap,
            ctx.bucket_bytes,
            ctx.first_bucket_bytes,
        )
        if key not in ctx.reducers:
            ctx.reducers[key] = Reducer(
                like,
                ctx.mesh.groups(ctx.axis),
                ctx.size,
                comm_dtype=ctx.compression,
                overlap=ctx.overlap,
                bucket_bytes=ctx.bucket_bytes,
                first_bucket_bytes=ctx.first_bucket_bytes,
            )
        return ctx.reducers[key], len(like) - len(rep)


class Scatter(Reduction):
    scatter = True

    def reducer(self, ctx, rep, pending, table):
        key = ("scatter", _layout(rep), ctx.axis, ctx.bucket_bytes)
        if key not in ctx.reducers:
            ctx.reducers[key] = ScatterReducer(
                rep,
                ctx.mesh.group(ctx.axis),
                ctx.size,
                ctx.mesh.index(ctx.axis),
                bucket_bytes=ctx.bucket_bytes,
                first_bucket_bytes=ctx.first_bucket_bytes,
            )
        return ctx.reducers[key], 0

    @staticmethod
    def as_shard(local: torch.Tensor, like: torch.Tensor, ctx: StepContext) -> DTensor:
        """This rank's flat shard of a mean gradient, as a DTensor that knows its layout."""
        return DTensor.from_local(
            local,
            ctx.mesh.submesh(ctx.axis),
            [Shard(0)],
            shape=(like.numel(),),
            stride=(1,),
            run_check=False,
        )


_LOCAL, _ACCUMULATE, _SCATTER = Local(), Accumulate(), Scatter()
_ALL_REDUCE = {True: AllReduce(late=True), False: AllReduce(late=False)}


def choose(ctx: StepContext, rep: list, accumulate: int, listed: bool = False) -> Reduction:
    """The reduction for the replicated leaves ``rep`` of a call with ``accumulate``
    micro-batches, in step ``ctx``. A list of micro-batches (``listed``) takes the same
    reduction whatever this rank's count (another rank's may differ)."""
    if not rep or (ctx.size == 1 and accumulate == 1):
        return _LOCAL
    if ctx.size == 1:
        return _ACCUMULATE
    if ctx.scatter and signature(rep) in ctx.scatter:  # a sharded optimizer takes these
        return _SCATTER
    return _ALL_REDUCE[accumulate == 1 and not listed]
