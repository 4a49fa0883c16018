"""FSDP inside ``functional``'s apply: each unit gathered just before its module runs.

``apply`` is given ``pardist.fsdp`` shards. The root unit (parameters no other
unit holds, tied weights among them) is gathered first and kept for the whole
forward; every other unit is gathered by a forward pre-hook on its module (in
pardist's private skeleton, never the user's module), put into the module's
parameter slots, and taken out again when the module returns. While a unit is
not gathered its slots hold placeholders that raise, naming the parameter, if
anything computes with them.

The gather is an autograd Function (:class:`_Gather`): its inputs are the shards,
its outputs the full parameters, and its backward reduce-scatters their
gradients (a mean over the data-parallel axes), so ``pardist.grad`` gets shards.
Autograd would keep every full parameter alive until the backward through the
tensors it saves; ``saved_tensors_hooks`` store a saved view of a gathered unit as
(unit, shape, stride, offset) instead, and the backward gathers the unit again
when it first unpacks one (:meth:`_Gathered.ensure`), freeing it once the unit's
gradients are reduce-scattered. The last unit of the forward is kept for the
backward, which starts with it. Over the backend (not shared memory) the next
unit's gather is started while the current one computes, forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor

from pardist import _fsdp, _fsdp_units
from pardist._context import StepContext, current_step
from pardist._fsdp_comm import Layout, Transport

__all__ = ["Runner", "has_shards"]


def _unwrapped(x):
    """``x`` without torch.func's wrappers (a DTensor given to torch.func.grad is wrapped)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x


def has_shards(params: dict) -> bool:
    if any(isinstance(v, DTensor) for v in params.values()):
        return True
    if torch._C._functorch.peek_interpreter_stack() is None:
        return False
    return any(isinstance(_unwrapped(v), DTensor) for v in params.values())


_PROPERTIES = "shape dtype device ndim requires_grad layout is_leaf is_cuda itemsize nbytes"
_METHODS = "size dim numel nelement stride is_floating_point is_complex element_size __len__"
_METADATA = {getattr(torch.Tensor, n).__get__ for n in _PROPERTIES.split()} | {
    getattr(torch.Tensor, n) for n in _METHODS.split()
}


class _Absent(torch.Tensor):
    """A unit's parameter slot while the unit is not gathered.

    It answers metadata (shape, dtype, device). Anything that computes with it is
    a module using a parameter outside the forward of the module that holds it
    (``nn.MultiheadAttention`` uses ``out_proj.weight`` without calling
    ``out_proj``): the unit is then gathered on the spot, above autograd, so the
    gradient still reaches the shards, and kept until the running unit returns.
    """

    @staticmethod
    def __new__(cls, shape, dtype, device, runner: Runner, unit: int, index: int):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        t._runner, t._unit, t._index = runner, unit, index
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)

        def real(x):
            return x._runner.borrow(x._unit)[x._index] if isinstance(x, _Absent) else x

        args, kwargs = pytree.tree_map(real, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(  # only reachable around torch_function (e.g. under a mode)
            f"pardist.fsdp: {func} used a parameter of an FSDP unit that is not gathered."
        )


class _Unit(_fsdp_units.Unit):
    index: int
    layout: Layout | None
    shapes: list


class _Gathered:
    """One gather of a unit: its full parameters while needed, gathered again on demand."""

    def __init__(self, plan: _Plan, unit, shards: list[DTensor]):
        self.plan, self.unit = plan, unit
        self.locals = [s._local_tensor for s in shards]
        self.specs = [s._spec for s in shards]
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


class _Gather(torch.autograd.Function):
    """Shards in, full parameters out; the backward reduce-scatters their gradients."""

    @staticmethod
    def forward(ctx, gathered: _Gathered, *shards):
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


class _Packed:
    """A saved view of a gathered unit, kept as where it lies instead of the memory itself."""

    __slots__ = ("gathered", "bucket", "size", "stride", "offset")

    def __init__(self, gathered, bucket, t, offset):
        self.gathered, self.bucket, self.offset = gathered, bucket, offset
        self.size, self.stride = t.shape, t.stride()


def _unpack(x):
    if type(x) is _Packed:
        x.gathered.ensure(backward=True)
        buffer = x.gathered.buffers[x.bucket]
        return buffer.as_strided(x.size, x.stride, buffer.storage_offset() + x.offset)
    return x


class _Plan:
    """How one set of shards is gathered in one kind of step: units, layouts, transport."""

    def __init__(self, runner: Runner, shards: dict, ctx: StepContext):
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
        units, _ = _fsdp_units.choose(skeleton, names, runner.policy, where)
        self._agree(ctx, axes, names, shards, units)
        self.size, index = ctx.mesh.size(axes), ctx.mesh.index(axes)
        replicas = tuple(a for a in ctx.axis if a not in axes)  # HSDP: reduced after
        outer = ctx.mesh.groups(replicas) if replicas else []
        self.units: list[_Unit] = []
        for i, u in enumerate(units):
            unit = _Unit(u.name, u.module, u.params)
            unit.index, unit.shapes = i, [metas[n].shape for n in u.params]
            device = shards[u.params[0]]._local_tensor.device if u.params else None
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
                device = shards[name]._local_tensor.device
                self.absent[name] = _Absent(
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


class _Run:
    """One call of apply: what is gathered, and what the next unit will be."""

    def __init__(self, plan: _Plan, shards: dict):
        self.plan, self.shards = plan, shards
        self.ranges: list[tuple] = []  # (first byte, end, gathered, bucket) of gathered buffers
        self.active: dict[int, list] = {}  # unit index -> [gathered, depth]
        self.pending: _Gathered | None = None  # the unit that just returned
        self.prefetched: dict[int, _Gathered] = {}
        self.root: _Gathered | None = None
        self.kept: list[_Gathered] = []  # units whose output is a view of their parameters
        self.borrowed: dict[int, tuple] = {}  # unit -> (gathered, outputs, unit that used it)
        self.stack: list[int] = []  # the units whose modules are running, innermost last
        self.last: _Gathered | None = None
        self.count = 0

    def gather(self, unit: _Unit) -> tuple[_Gathered, tuple]:
        shards = [self.shards[n] for n in unit.params]
        g = self.prefetched.pop(unit.index, None) or _Gathered(self.plan, unit, shards)
        g.prev, self.last = self.last, g
        outs = _Gather.apply(g, *shards)
        for b, buffer in enumerate(g.buffers or ()):
            start = buffer.data_ptr()
            self.ranges.append((start, start + buffer.numel() * buffer.itemsize, g, b))
        plan = self.plan
        if plan.recording:
            plan.order.append(unit.index)
        elif plan.prefetch and self.count + 1 < len(plan.order):
            nxt = plan.order[self.count + 1]
            held = self.pending is not None and self.pending.unit.index == nxt
            if nxt not in self.active and nxt not in self.prefetched and not held:
                later = plan.units[nxt]
                ahead = _Gathered(plan, later, [self.shards[n] for n in later.params])
                ahead.start()
                self.prefetched[nxt] = ahead
        self.count += 1
        return g, outs

    def release(self, g: _Gathered | None) -> None:
        if g is not None:
            self.ranges = [r for r in self.ranges if r[2] is not g]
            g.release()

    def owner(self, t) -> tuple | None:
        """The gathered buffer that ``t`` is a view of, if any: (first byte, end, gathered, b)."""
        if type(t) is torch.Tensor and self.ranges:
            at = t.data_ptr()
            for r in self.ranges:
                if r[0] <= at < r[1] and t.dtype == r[2].buffers[r[3]].dtype:
                    return r
        return None

    def _take(self, unit: _Unit) -> tuple[_Gathered, tuple]:
        """The unit's full parameters: still there if it just returned, else gathered."""
        if self.pending is not None and self.pending.unit is unit:
            g, self.pending = self.pending, None
            return g, _Gather.apply(g, *(self.shards[n] for n in unit.params))
        self.release(self.pending)
        self.pending = None
        return self.gather(unit)

    def enter(self, unit: _Unit) -> None:
        entry = self.active.get(unit.index)
        if entry is not None:  # the module runs inside itself
            entry[1] += 1
            return
        borrowed = self.borrowed.pop(unit.index, None)
        g, outs = borrowed[:2] if borrowed is not None else self._take(unit)
        self.active[unit.index] = [g, 1, outs]
        self.stack.append(unit.index)
        for name, t in zip(unit.params, outs):
            for table, attr in self.plan.places[name]:
                table[attr] = t

    def borrow(self, index: int) -> tuple:
        """A unit used while its module is not running: gathered until the running unit returns."""
        if index in self.active:
            return self.active[index][2]
        if index not in self.borrowed:
            g, outs = self._take(self.plan.units[index])
            self.borrowed[index] = (g, outs, self.stack[-1] if self.stack else None)
        return self.borrowed[index][1]

    def exit(self, unit: _Unit, output) -> None:
        entry = self.active.get(unit.index)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1]:
            return
        del self.active[unit.index]
        self.stack.remove(unit.index)
        for name in unit.params:
            for table, attr in self.plan.places[name]:
                table[attr] = self.plan.absent[name]
        for k, (g, _, user) in list(self.borrowed.items()):
            if user == unit.index:
                del self.borrowed[k]
                self.release(g)
        self.release(self.pending)
        self.pending = entry[0]
        for t in pytree.tree_leaves(output):
            hit = self.owner(t)
            if hit is not None and hit[2] is entry[0]:  # its output is a view of a parameter
                self.kept.append(entry[0])  # so it stays gathered until apply returns
                self.pending = None
                break

    def finish(self, ok: bool) -> None:
        """Free what the forward gathered; keep the unit the backward starts with."""
        keep = None
        if ok and torch.is_grad_enabled():
            keep = self.root if self.root is not None else self.pending
        done = [self.root, self.pending, *(e[0] for e in self.active.values()), *self.kept]
        done += [b[0] for b in self.borrowed.values()]
        for g in done + list(self.prefetched.values()):
            if g is not None and g is not keep:
                self.release(g)
        self.ranges.clear()
        self.active.clear()
        self.prefetched.clear()
        self.borrowed.clear()

    def pack(self, t: torch.Tensor):
        hit = self.owner(t)
        if hit is None:
            return t
        return _Packed(hit[2], hit[3], t, (t.data_ptr() - hit[0]) // t.itemsize)

    def detach_views(self, out):
        """Outputs that are views of gathered parameters, copied: the buffers get reused."""
        if not self.ranges:
            return out
        return pytree.tree_map(lambda x: x.clone() if self.owner(x) is not None else x, out)


class Runner:
    """FSDP for one functional model: plans per kind of call, hooks on its skeleton."""

    def __init__(self, skeleton: nn.Module, slots, policy, where: str):
        self.skeleton, self.slots, self.policy, self.where = skeleton, slots, policy, where
        self.plans: dict = {}
        self.run: _Run | None = None
        self._hooked: set[int] = set()

    def hook(self, module: nn.Module) -> None:
        if id(module) not in self._hooked:
            self._hooked.add(id(module))
            module.register_forward_pre_hook(self._pre)
            module.register_forward_hook(self._post, always_call=True)

    def borrow(self, index: int) -> tuple:
        return self.run.borrow(index)

    def _pre(self, module, args) -> None:
        unit = None if self.run is None else self.run.plan.unit_of.get(id(module))
        if unit is not None:
            self.run.enter(unit)

    def _post(self, module, args, output) -> None:
        unit = None if self.run is None else self.run.plan.unit_of.get(id(module))
        if unit is not None:
            self.run.exit(unit, output)

    def call(self, params: dict, buffers: dict, inputs: tuple, kwargs: dict):
        ctx = current_step()
        shards = {k: v for k, v in params.items() if isinstance(_unwrapped(v), DTensor)}
        if ctx is None:
            k, v = next(iter(shards.items()))
            v = _unwrapped(v)
            raise RuntimeError(
                f"{self.where}: {_fsdp.describe('params', f'[{k!r}]', v)}; apply gathers "
                "FSDP parameters only inside a data-parallel step. Call apply inside "
                "pardist.data_parallel (evaluation steps too), or pass full parameters "
                "(p.full_tensor().view(shape), on every rank)."
            )
        if torch._C._functorch.peek_interpreter_stack() is not None:
            raise RuntimeError(
                f"{self.where}: pardist.fsdp parameters cannot be used under torch.func "
                "transforms (vmap, grad, jacrev): their gather and reduce-scatter are "
                "collectives. Differentiate with pardist.grad, outside other transforms."
            )
        key = (
            tuple((k, id(v.device_mesh), v.shape, v.dtype) for k, v in shards.items()),
            ctx.axis,
            id(ctx.mesh),
        )
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = _Plan(self, shards, ctx)
        run, given = _Run(plan, shards), dict(params)
        outer, self.run = self.run, run
        ok = False
        try:
            with torch.autograd.graph.saved_tensors_hooks(run.pack, _unpack):
                root = plan.units[0]
                if root.params:
                    run.root, outs = run.gather(root)
                    given.update(zip(root.params, outs))
                for unit in plan.units[1:]:
                    given.update((n, plan.absent[n]) for n in unit.params)
                out = self.slots.call(given, buffers, inputs, kwargs)
            out = run.detach_views(out)
            ok = True
        finally:
            self.run = outer
            run.finish(ok)
        plan.recording = False
        return out
