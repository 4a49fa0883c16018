"""Which shared-memory group collectives over a process group use, made on first use.

Two per process group: one for collectives (psum, pmax, all_gather, all_to_all,
compiled steps' custom ops), with a region of ``COLLECTIVE_BYTES`` per rank, and one
of its own for small sums (batch-norm statistics, losses), which nothing else writes.
None where shared memory cannot serve (another host, no room): gloo then. Forgotten
at shutdown, since the next ``init`` reuses the group names.
"""

from __future__ import annotations

import torch.distributed as dist

from pardist.runtime import _process
from pardist.transport._shm import SharedMemoryGroup

__all__ = ["COLLECTIVE_BYTES", "SMALL_BYTES", "for_collectives", "for_small_sums"]

COLLECTIVE_BYTES = 4 * 2**20  # region per rank for psum / pmax / all_gather
_collective_groups: dict[str, SharedMemoryGroup | None] = {}  # by group name


def for_collectives(group: dist.ProcessGroup) -> SharedMemoryGroup | None:
    """The shared-memory group that collectives over ``group`` use (None: use gloo).

    Made on first use, which every rank of the group reaches at the same point.
    """
    name = group.group_name
    if name not in _collective_groups:
        _collective_groups[name] = SharedMemoryGroup.create(group, COLLECTIVE_BYTES)
    return _collective_groups[name]


_process.on_shutdown(_collective_groups.clear)  # names are reused by the next init

SMALL_BYTES = 64 * 2**10  # largest tensor for small_all_reduce (batch-norm statistics)
_small_groups: dict[str, SharedMemoryGroup | None] = {}  # by group name


def for_small_sums(group: dist.ProcessGroup) -> SharedMemoryGroup | None:
    """The shared-memory group for :meth:`SharedMemoryGroup.small_all_reduce` over ``group``.

    A group of its own: its regions are written by nothing else, which is what
    lets a small all-reduce return without waiting for the others to read.
    """
    name = group.group_name
    if name not in _small_groups:
        _small_groups[name] = SharedMemoryGroup.create(group, 2 * SMALL_BYTES)
    return _small_groups[name]


_process.on_shutdown(_small_groups.clear)
