"""One gather of an FSDP unit, as autograd sees it: shards in, full parameters out.

:class:`_Gather` is an autograd Function whose inputs are a unit's shards and
whose outputs are its full parameters; its backward reduce-scatters their
gradients (a mean over the data-parallel axes) into gradients of the shards.
Autograd would keep every full parameter alive until the backward through the
tensors it saves; ``apply`` stores a saved view of a gathered unit as a
:class:`Packed` (where it lies) instead, and :func:`unpack` gathers the unit again
the first time the backward needs it (:meth:`Gathered.ensure`), to be freed once
the unit's gradients are reduce-scattered.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from pardist.runtime import dtensor_local, dtensor_spec

__all__ = ["Gather", "Gathered", "Packed", "unpack"]


class Gathered:
    """One gather of a unit: its full parameters while needed, gathered again on demand."""

    def __init__(self, plan, unit, shards: list[DTensor]):
        self.plan, self.unit = plan, unit
        self.locals = [dtensor_local(s) for s in shards]
        self.specs = [dtensor_spec(s) for s in shards]
        self.buffers = self.tensors = self.handle = self.prev = None

    def start(self) -> None:
        if self.tensors is None and self.handle is None and self.plan.size > 1:
            self.handle = self.plan.transport.start_gather(
                self.unit.layout, self.unit.index + 1, self.locals
            )

    def ensure(self, backward: bool = False) -> list:
        if self.tensors is None:
            layout, shapes = self.unit.layout, self.unit.shapes
            if self.plan.size == 1:  # the shard is the parameter
                self.tensors = [t.reshape(s) for t, s in zip(self.locals, shapes)]
                return self.tensors
            self.start()
            self.buffers = self.plan.transport.finish(self.handle)
            self.tensors = []
            for i, shape in enumerate(shapes):
                b, start = layout.columns[i].bucket, layout.starts[i]
                self.tensors.append(self.buffers[b][start : start + shape.numel()].view(shape))
            if backward and self.prev is not None and self.plan.prefetch:
                self.prev.start()  # the backward needs the unit before this one next
        return self.tensors

    def release(self) -> None:
        if self.handle is not None:
            if self.buffers is None:
                self.plan.transport.finish(self.handle)  # every rank completes the collective
            self.plan.transport.release(self.handle)
            self.handle = None
        self.buffers = self.tensors = None


class Gather(torch.autograd.Function):
    """Shards in, full parameters out; the backward reduce-scatters their gradients."""

    @staticmethod
    def forward(ctx, gathered: Gathered, *shards):
        ctx.gathered = gathered
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in gathered.ensure())

    @staticmethod
    def backward(ctx, *grads):
        g = ctx.gathered
        plan = g.plan
        if plan.transport is None:  # one rank, no replicas: the gradient is the shard
            local = [
                torch.zeros_like(t) if d is None else d.reshape(-1) for t, d in zip(g.locals, grads)
            ]
        else:
            local = plan.transport.reduce_scatter(g.unit.layout, g.unit.index + 1, list(grads))
        g.release()
        return (None, *(DTensor(t, spec, requires_grad=False) for t, spec in zip(local, g.specs)))


class Packed:
    """A saved view of a gathered unit, kept as where it lies instead of the memory itself."""

    __slots__ = ("gathered", "bucket", "size", "stride", "offset")

    def __init__(self, gathered, bucket, t, offset):
        self.gathered, self.bucket, self.offset = gathered, bucket, offset
        self.size, self.stride = t.shape, t.stride()


def unpack(x):
    if type(x) is Packed:
        x.gathered.ensure(backward=True)
        buffer = x.gathered.buffers[x.bucket]
        return buffer.as_strided(x.size, x.stride, buffer.storage_offset() + x.offset)
    return x
