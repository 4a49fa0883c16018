"""The plan of one FSDP call: which units, their layouts, the transport, the placeholders.

Made on the first call of ``apply`` with a given set of shards in a given kind of
step: it checks that the shards are ``pardist.fsdp``'s, over (part of) the step's
axes, the same on every rank, and builds what gathering needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pardist.runtime import (
    DisableTorchFunctionSubclass,
    StepContext,
    dtensor_local,
    make_wrapper_subclass,
    pytree,
)
from pardist.sharding import _fsdp, _units
from pardist.sharding._comm import Layout, Transport

__all__ = ["Absent", "Plan", "Unit"]


_PROPERTIES = "shape dtype device ndim requires_grad layout is_leaf is_cuda itemsize nbytes"
_METHODS = "size dim numel nelement stride is_floating_point is_complex element_size __len__"
_METADATA = {getattr(torch.Tensor, n).__get__ for n in _PROPERTIES.split()} | {
    getattr(torch.Tensor, n) for n in _METHODS.split()
}


class Absent(torch.Tensor):
    """A unit's parameter slot while the unit is not gathered.

    It answers metadata (shape, dtype, device). Anything that computes with it is
    a module using a parameter outside the forward of the module that holds it
    (``nn.MultiheadAttention`` uses ``out_proj.weight`` without calling
    ``out_proj``): the unit is then gathered on the spot, above autograd, so the
    gradient still reaches the shards, and kept until the running unit returns.
    """

    @staticmethod
    def __new__(cls, shape, dtype, device, runner, unit: int, index: int):
        t = make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        t._runner, t._unit, t._index = runner, unit, index
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)

        def real(x):
            return x._runner.borrow(x._unit)[x._index] if isinstance(x, Absent) else x

        args, kwargs = pytree.tree_map(real, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(  # only reachable around torch_function (e.g. under a mode)
            f"pardist.fsdp: {func} used a parameter of an FSDP unit that is not gathered."
        )


class Unit(_units.Unit):
    index: int
    layout: Layout | None
    shapes: list


class Plan:
    """How one set of shards is gathered in one kind of step: units, layouts, transport."""

    def __init__(self, runner, shards: dict, ctx: StepContext):
        where, skeleton = runner.where, runner.skeleton
        metas = dict(skeleton.named_parameters())
        axes, first = None, None
        for k, v in shards.items():
            meta = metas.get(k)
            if meta is None:
                continue  # not a parameter of the module: slots.call names it
            path = f"params[{k!r}]"
            if not _fsdp.is_shard(v) or v.shape[0] != meta.numel():
                raise ValueError(
                    f"{where}: {path} is a DTensor of shape {tuple(v.shape)} placed "
                    f"{v.placements}, but apply takes the flat shard that pardist.fsdp makes "
                    f"of the module's parameter {k!r} (shape {tuple(meta.shape)}): global "
                    f"shape ({meta.numel()},), placed Shard(0). Pass pardist.fsdp(params) of "
                    "the params that pardist.functional returned."
                )
            found = _fsdp.axes_of(v, ctx.mesh)
            if found is None:
                raise ValueError(
                    f"{where}: {_fsdp.describe('params', f'[{k!r}]', v)}, a mesh that is "
                    f"not part of the step's mesh {ctx.mesh}. Shard with "
                    "pardist.fsdp(params, axis=..., mesh=<the step's mesh>)."
                )
            if axes is None:
                axes, first = found, k
            elif found != axes:
                raise ValueError(
                    f"{where}: {path} is sharded over {found} but params[{first!r}] over "
                    f"{axes}. Shard every parameter over one axis: pardist.fsdp(params, axis)."
                )
        if axes is not None and not set(axes) <= set(ctx.axis):
            raise ValueError(
                f"{where}: the params are pardist.fsdp shards over {axes}, but {ctx.name} "
                f"is data parallel over {ctx.axis}. FSDP shards over (part of) the "
                f"data-parallel axes: shard over one of {ctx.axis}, or make the step data "
                f"parallel over {tuple(dict.fromkeys(ctx.axis + axes))}."
            )
        axes = axes or ctx.axis
        names = [k for k in metas if k in shards]
        units, _ = _units.choose(skeleton, names, runner.policy, where)
        self._agree(ctx, axes, names, shards, units)
        self.size, index = ctx.mesh.size(axes), ctx.mesh.index(axes)
        replicas = tuple(a for a in ctx.axis if a not in axes)  # HSDP: reduced after
        outer = ctx.mesh.groups(replicas) if replicas else []
        self.units: list[Unit] = []
        for i, u in enumerate(units):
            unit = Unit(u.name, u.module, u.params)
            unit.index, unit.shapes = i, [metas[n].shape for n in u.params]
            device = dtensor_local(shards[u.params[0]]).device if u.params else None
            unit.layout = Layout(
                unit.shapes, [shards[n].dtype for n in u.params], device, self.size, index
            )
            self.units.append(unit)
        self.transport = None
        if self.size > 1 or outer:
            group = ctx.mesh.group(axes)
            labels = [u.name or "<root>" for u in self.units]
            layouts = [u.layout for u in self.units if u.params]
            self.transport = Transport(group, self.size, index, outer, ctx.size, layouts, labels)
        self.prefetch = self.transport is not None and self.transport.arena is None
        self.unit_of = {id(u.module): u for u in self.units[1:]}
        self.places: dict[str, list] = {n: [] for n in names}
        for table, attr, kind, name, _ in runner.slots.places:
            if kind == "_parameters" and name in self.places:
                self.places[name].append((table, attr))
        self.absent = {}
        for unit in self.units[1:]:
            for k, name in enumerate(unit.params):
                device = dtensor_local(shards[name]).device
                self.absent[name] = Absent(
                    metas[name].shape, shards[name].dtype, device, runner, unit.index, k
                )
        self.order: list[int] = []
        self.recording = True
        for unit in self.units[1:]:
            runner.hook(unit.module)

    def _agree(self, ctx: StepContext, axes, names, shards, units) -> None:
        """Every rank must shard alike: compare once, before any collective of the plan."""
        group = ctx.mesh.group(ctx.axis)
        if dist.get_world_size(group) == 1:
            return
        mine = {
            "axis": axes,
            "params": [(k, tuple(shards[k].shape), str(shards[k].dtype)) for k in names],
            "units": [(u.name, u.params) for u in units],
        }
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        for r, theirs in enumerate(everyone):
            for what in ("axis", "params", "units"):
                if theirs[what] != everyone[0][what]:
                    a, b = everyone[0][what], theirs[what]
                    diff = next(
                        (f"{x} against {y}" for x, y in zip(a, b) if x != y),
                        f"{len(a)} entries against {len(b)}",
                    )
                    raise ValueError(
                        f"{ctx.name}: the FSDP {what} differ between group rank 0 and group "
                        f"rank {r}: {diff}. Every rank must call pardist.fsdp on the same "
                        "parameters, over the same axis, with the same fsdp_units."
                    )
