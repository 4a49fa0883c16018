"""A compiled step's plan: the constants its graph reads, made once per step signature.

Everything the traced code reads from outside the graph (the axis sizes and
indices, which groups go through shared memory, which leaves are sharded or
donated, the bucket sizes) is a frozen :class:`Plan`, the same object on every
call of one signature, so a second call does not recompile.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from pardist.runtime import _mesh
from pardist.transport import _shmgroups

__all__ = ["AxisInfo", "Plan", "make_plan"]


@dataclasses.dataclass(frozen=True)
class AxisInfo:
    """One axis (or tuple of axes) of the mesh, as constants a graph can hold."""

    size: int
    index: int
    groups: tuple[str, ...]  # group names to reduce over, innermost axis first
    shm: tuple[bool, ...]  # per group: through shared memory (else a functional collective)
    group: str | None  # one group spanning the axis (all-gather, reduce-scatter)
    gather_shm: bool


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """What a compiled step knows about itself: the same object on every call."""

    name: str
    axis: tuple[str, ...]
    axis_key: Any  # the key of the step's axis in ``axes``
    size: int
    sharded: tuple[int, ...]  # flat positions of the arguments' leaves sharded over the axis
    donated: tuple[int, ...]
    scatter: frozenset
    compression: torch.dtype | None
    bucket_bytes: int
    first_bucket_bytes: int
    axes: dict  # axis name, or tuple of names -> AxisInfo
    submesh: Any  # torch DeviceMesh over the step's axis (for DTensor gradient shards)
    fsdp: Any = None  # the key in ``axes`` of the axes pardist.fsdp shards are split over
    replicas: tuple[str, ...] = ()  # the step's other axes, over which they are replicated
    chunks: dict = dataclasses.field(default_factory=dict)  # their numel -> padded chunk
    numels: dict = dataclasses.field(default_factory=dict)  # a padded shard's length -> numel


def _shared(group: dist.ProcessGroup) -> bool:
    return group.size() > 1 and _shmgroups.for_collectives(group) is not None


def _axis_info(mesh: _mesh.Mesh, names: tuple[str, ...]) -> AxisInfo:
    groups = mesh.groups(names)
    group = mesh.group(names) if mesh.size(names) > 1 else None
    return AxisInfo(
        size=mesh.size(names),
        index=mesh.index(names),
        groups=tuple(g.group_name for g in groups),
        shm=tuple(_shared(g) for g in groups),
        group=None if group is None else group.group_name,
        gather_shm=group is not None and _shared(group),
    )


def make_plan(
    step: Any,
    mesh: _mesh.Mesh,
    axes: tuple,
    sharded,
    donated,
    scatter,
    fsdp: tuple | None = None,
    chunks: dict | None = None,
) -> Plan:
    """The plan of one step signature; collective on first use (shared memory is set up).

    ``sharded`` lists every leaf that varies over the axis: those whose spec shards
    them, and DTensors (a sharded optimizer's state, pardist.fsdp's shards, which are
    split over the axes ``fsdp``).
    """
    infos: dict = {}
    for name in mesh.axis_names:
        infos[name] = _axis_info(mesh, (name,))
    for names in {axes, mesh.axis_names} | ({fsdp} if fsdp else set()):
        if len(names) > 1:
            infos[names] = _axis_info(mesh, names)
    key = axes[0] if len(axes) == 1 else axes
    return Plan(
        name=step.where,
        axis=axes,
        axis_key=key,
        size=mesh.size(axes),
        sharded=tuple(sharded),
        donated=tuple(donated),
        scatter=scatter,
        compression=step.compression,
        bucket_bytes=int(step.bucket_mb * 2**20),
        first_bucket_bytes=2**20,
        axes=infos,
        submesh=mesh.submesh(axes),
        fsdp=None if not fsdp else fsdp[0] if len(fsdp) == 1 else fsdp,
        replicas=tuple(a for a in axes if a not in fsdp) if fsdp else (),
        chunks=chunks or {},
        numels={mesh.size(fsdp) * c: n for n, c in (chunks or {}).items()},
    )
