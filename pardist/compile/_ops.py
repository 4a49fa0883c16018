"""Operators that compiled steps call as single graph nodes: shared memory and schedules.

A compiled step cannot trace pardist's shared-memory transport (it synchronises
through memory words and futexes), but a graph can *call* it: each collective
here is a ``torch.library.custom_op`` with a fake implementation for tracing,
which inductor runs as one opaque kernel. They are functional (a new tensor
comes back; nothing passed in is written), synchronous and identical on every rank,
like the eager transport (the gradients' sums, which run beside the backward, are
``_beside``'s). Shared memory is about 0.6x gloo's time for a CPU all-reduce between
ranks of one host, inside graphs as outside.

``pardist::schedule`` evaluates a learning-rate schedule (a Python function of
the step count) into a float64 scalar at run time, so that a compiled optimizer
reads its learning rate from the count tensor instead of baking in one value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from pardist import transport
from pardist.runtime import _process
from pardist.transport import _shm, _shmgroups

__all__ = ["schedule_key"]

# Per group name: a region pair sized for the largest bucket seen (None: no room).
_arenas: dict[str, _shm.SharedMemoryGroup | None] = {}
_process.on_shutdown(_arenas.clear)


def _group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


def _arena(name: str, nbytes: int, key: str | None = None) -> _shm.SharedMemoryGroup | None:
    """A region per rank plus a common area of ``nbytes`` each, made collectively on first use.

    Every rank runs the same graph, so every rank reaches the same call first. ``key``
    (default: the group's name) keeps apart arenas that different threads synchronise.
    """
    key = name if key is None else key
    arena = _arenas.get(key, False)
    if arena is False or (arena is not None and arena.region_bytes < nbytes):
        arena = _shm.SharedMemoryGroup.create(_group(name), nbytes, nbytes)
        _arenas[key] = arena
    return arena


@torch.library.custom_op("pardist::shm_all_reduce", mutates_args=())
def shm_all_reduce(x: torch.Tensor, group: str, op: str) -> torch.Tensor:
    """Sum (or max) of ``x`` over ``group`` through shared memory; a new tensor."""
    nbytes = x.numel() * x.element_size()
    arena = _arena(group, nbytes) if op == "sum" and nbytes > _shmgroups.COLLECTIVE_BYTES else None
    if arena is not None:
        # Written once into this rank's region, summed chunk by chunk into the common area.
        arena.view(arena.index, 0, x.numel(), x.dtype).copy_(x.reshape(-1))
        return arena.reduce_into(0, x.numel(), x.dtype, 0).clone().view(x.shape)
    y = x.clone(memory_format=torch.contiguous_format)
    shm = _shmgroups.for_collectives(_group(group))
    if shm is None:
        transport.agree("pardist.psum (compiled)", _group(group), y)
        dist.all_reduce(
            y, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=_group(group)
        )
    else:
        shm.all_reduce(y, op)
    return y


@shm_all_reduce.register_fake
def _(x, group, op):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("pardist::shm_all_gather", mutates_args=())
def shm_all_gather(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0, in group order, through shared memory."""
    shm = _shmgroups.for_collectives(_group(group))
    parts = shm.all_gather(x) if shm is not None else None
    if parts is None:
        nbytes = x.numel() * x.element_size()
        arena = _arena(group, nbytes)
        if arena is None:
            parts = [
                torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(size)
            ]
            transport.agree("pardist.all_gather (compiled)", _group(group), x)
            dist.all_gather(parts, x.contiguous(), group=_group(group))
        else:
            arena.view(arena.index, 0, x.numel(), x.dtype).copy_(x.reshape(-1))
            arena.barrier()
            parts = [arena.view(k, 0, x.numel(), x.dtype).view(x.shape) for k in range(size)]
            out = torch.cat(parts)
            arena.barrier()  # nobody rewrites a region another rank still reads
            return out
    return torch.cat(parts)


@shm_all_gather.register_fake
def _(x, group, size):
    return x.new_empty((size * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("pardist::shm_reduce_scatter", mutates_args=())
def shm_reduce_scatter(x: torch.Tensor, group: str, size: int, index: int) -> torch.Tensor:
    """Row ``index`` of the sum over ``group`` of ``x`` viewed as (size, row); a new tensor."""
    nbytes = x.numel() * x.element_size()
    arena = _arena(group, nbytes)
    if arena is None:
        out = x.new_empty(x.numel() // size)
        transport.agree("pardist.psum_scatter (compiled)", _group(group), x)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=_group(group))
        return out
    mine = arena.view(arena.index, 0, x.numel(), x.dtype)
    mine.copy_(x.reshape(-1))
    arena.reduce_in_place(0, x.numel(), x.dtype, gather=False)
    row = mine.view(size, -1)[index].clone()
    arena.barrier()  # every rank has summed its chunk before regions are rewritten
    return row


@shm_reduce_scatter.register_fake
def _(x, group, size, index):
    return x.new_empty(x.numel() // size)


_schedules: dict[int, Callable[[int], float]] = {}


def schedule_key(fn: Callable[[int], float]) -> int:
    """Register ``fn`` for ``pardist::schedule`` (kept alive); returns its key.

    Call it eagerly (when the optimizer is made): a graph only reads the key.
    """
    _schedules[id(fn)] = fn
    return id(fn)


@torch.library.custom_op("pardist::schedule", mutates_args=())
def schedule(count: torch.Tensor, key: int) -> torch.Tensor:
    """``fn(int(count))`` as a float64 scalar tensor, ``fn`` the schedule registered as ``key``."""
    fn = _schedules.get(key)
    if fn is None:
        raise RuntimeError(
            "pardist::schedule: this learning-rate schedule was not registered; pass it to a "
            "pardist optimizer (pardist.optim.sgd(lr=schedule)), which registers it."
        )
    return torch.tensor(float(fn(int(count))), dtype=torch.float64)


@schedule.register_fake
def _(count, key):
    return torch.empty((), dtype=torch.float64)
