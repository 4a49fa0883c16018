"""FSDP inside ``functional``'s apply: each unit gathered just before its module runs.

``apply`` is given ``pardist.fsdp`` shards. The root unit (parameters no other
unit holds, tied weights among them) is gathered first and kept for the whole
forward; every other unit is gathered by a forward pre-hook on its module (in
pardist's private skeleton, never the user's module), put into the module's
parameter slots, and taken out again (freed) when the next unit starts. While a
unit is not gathered its slots hold placeholders (``_fsdp_plan.Absent``) that
gather it on the spot if a module computes with them.

Each gather is an autograd Function (``_fsdp_gather``), so the backward
reduce-scatters the gradients and ``pardist.grad`` gets shards; saved views of
gathered parameters are stored as where they lie (``saved_tensors_hooks``) and
gathered again by the backward. The last unit of the forward is kept for the
backward, which starts with it. Over the backend (not shared memory) the next
unit's gather is started while the current one computes, forward and backward.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pardist.collectives import _vma
from pardist.runtime import _tree, current_step, functorch, pytree, tracing
from pardist.sharding import _fsdp, _traced
from pardist.sharding._gather import Gather, Gathered, Packed, unpack
from pardist.sharding._plan import Plan, Unit

__all__ = ["Runner", "has_shards"]


def _unwrapped(x):
    """``x`` without torch.func's wrappers (a DTensor given to torch.func.grad is wrapped)."""
    while functorch.is_functorch_wrapped_tensor(x):
        x = functorch.get_unwrapped(x)
    return x


def has_shards(params: dict) -> bool:
    if _tree.any_instance(params.values(), DTensor):
        return True
    if tracing():  # a compiled step's pardist.grad gives its shards as Locals
        return _tree.any_instance(params.values(), _traced.Local)
    if functorch.peek_interpreter_stack() is None:
        return False
    return any(isinstance(_unwrapped(v), DTensor) for v in params.values())


def _lifted(full: tuple) -> tuple:
    """A unit's gathered parameters, typed as the step's replicated inputs are inside
    ``pardist.grad``: the same value on every rank, lifted over the data axes (their
    gather's transpose, a reduce-scatter of the mean, is the ``psum`` of that lift)."""
    state = _vma.current()
    if state is not None:
        for t in full:
            state.set(t, state.data_lifted)
    return full


class _Run:
    """One call of apply: what is gathered, and what the next unit will be."""

    def __init__(self, plan: Plan, shards: dict):
        self.plan, self.shards = plan, shards
        self.ranges: list[tuple] = []  # (first byte, end, gathered, bucket) of gathered buffers
        self.active: dict[int, list] = {}  # unit index -> [gathered, depth]
        self.pending: Gathered | None = None  # the unit that just returned
        self.prefetched: dict[int, Gathered] = {}
        self.root: Gathered | None = None
        self.kept: list[Gathered] = []  # units whose output is a view of their parameters
        self.borrowed: dict[int, tuple] = {}  # unit -> (gathered, outputs, unit that used it)
        self.stack: list[int] = []  # the units whose modules are running, innermost last
        self.last: Gathered | None = None
        self.count = 0

    def gather(self, unit: Unit) -> tuple[Gathered, tuple]:
        shards = [self.shards[n] for n in unit.params]
        g = self.prefetched.pop(unit.index, None) or Gathered(self.plan, unit, shards)
        g.prev, self.last = self.last, g
        outs = _lifted(Gather.apply(g, *shards))
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
                ahead = Gathered(plan, later, [self.shards[n] for n in later.params])
                ahead.start()
                self.prefetched[nxt] = ahead
        self.count += 1
        return g, outs

    def release(self, g: Gathered | None) -> None:
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

    def _take(self, unit: Unit) -> tuple[Gathered, tuple]:
        """The unit's full parameters: still there if it just returned, else gathered."""
        if self.pending is not None and self.pending.unit is unit:
            g, self.pending = self.pending, None
            return g, _lifted(Gather.apply(g, *(self.shards[n] for n in unit.params)))
        self.release(self.pending)
        self.pending = None
        return self.gather(unit)

    def enter(self, unit: Unit) -> None:
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

    def exit(self, unit: Unit, output) -> None:
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
        return Packed(hit[2], hit[3], t, (t.data_ptr() - hit[0]) // t.itemsize)

    def detach_views(self, out):
        """Outputs that are views of gathered parameters, copied: the buffers get reused."""
        if not self.ranges:
            return out
        return pytree.tree_map(lambda x: x.clone() if self.owner(x) is not None else x, out)


class _Regather:
    """A recomputation's gathers (activation checkpointing, ``nn._remat``).

    Each unit is gathered again as its module runs (or on the spot), into tensors of
    its own: the recomputed activations keep them until the backward is done with
    them, so the collective's buffers are released at once. The recomputation's own
    graph is thrown away; the gradients go through the forward's gathers.
    """

    def __init__(self, plan: Plan, shards: dict):
        self.plan, self.shards = plan, shards
        self.held: dict[int, list] = {}
        self.depth: dict[int, int] = {}

    def full(self, unit: Unit) -> list:
        if unit.index not in self.held:
            shards = [self.shards[n] for n in unit.params]
            g = Gathered(self.plan, unit, shards)
            # As the forward's gathers gave them (differentiable where the shards are), so
            # that the recomputation saves the same tensors as the forward did.
            self.held[unit.index] = [
                t.clone().requires_grad_(s.requires_grad) for t, s in zip(g.ensure(), shards)
            ]
            g.release()
        return self.held[unit.index]

    def install(self, unit: Unit, tensors) -> None:
        for name, t in zip(unit.params, tensors):
            for table, attr in self.plan.places[name]:
                table[attr] = t

    def enter(self, unit: Unit) -> None:
        self.depth[unit.index] = self.depth.get(unit.index, 0) + 1
        self.install(unit, self.full(unit))

    def exit(self, unit: Unit, output) -> None:
        depth = self.depth.pop(unit.index, 0) - 1
        if depth > 0:
            self.depth[unit.index] = depth
            return
        self.install(unit, [self.plan.absent[n] for n in unit.params])
        self.held.pop(unit.index, None)

    def borrow(self, index: int) -> list:
        return self.full(self.plan.units[index])


class Runner:
    """FSDP for one functional model: plans per kind of call, hooks on its skeleton."""

    def __init__(self, skeleton: nn.Module, slots, policy, where: str):
        self.skeleton, self.slots, self.policy, self.where = skeleton, slots, policy, where
        self.plans: dict = {}
        self.run: _Run | _Regather | None = None
        self._hooked: set[int] = set()
        self.key = _traced.register(self)  # how a compiled step's graph names this runner

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

    @contextlib.contextmanager
    def _rerun(self, plan: Plan, shards: dict, enter):
        """The contexts a recomputation of this call runs in: its units gathered again."""
        outer, self.run = self.run, _Regather(plan, shards)
        try:
            root = plan.units[0]
            if root.params:
                self.run.install(root, self.run.full(root))
            with enter():
                yield
        finally:
            self.run = outer

    def call(self, params: dict, buffers: dict, inputs: tuple, kwargs: dict, enter):
        if tracing() and _traced.usable():  # in a compiled step's graph
            return _traced.call(self, params, buffers, inputs, kwargs, enter)
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
        if functorch.peek_interpreter_stack() is not None:
            raise RuntimeError(
                f"{self.where}: pardist.fsdp parameters cannot be used under torch.func "
                "transforms (vmap, grad, jacrev): their gather and reduce-scatter are "
                "collectives. Differentiate with pardist.grad, outside other transforms."
            )
        tracked = _vma.current()
        if tracked is not None and tracked.live - tracked.data:  # model axes: untyped gathers
            model = sorted(tracked.live - tracked.data)
            raise RuntimeError(
                f"{self.where}: pardist.fsdp parameters in a step whose mesh also has the "
                f"model axes {model} are not supported yet (tensor parallelism with FSDP). "
                f"Name every axis of size > 1 in the step's axis (HSDP: axis=('node', 'gpu')), "
                "or keep these parameters unsharded."
            )
        key = (
            tuple((k, id(v.device_mesh), v.shape, v.dtype) for k, v in shards.items()),
            ctx.axis,
            id(ctx.mesh),
        )
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = Plan(self, shards, ctx)
        run, given = _Run(plan, shards), dict(params)
        outer, self.run = self.run, run
        ok = False
        try:
            with torch.autograd.graph.saved_tensors_hooks(run.pack, unpack):
                root = plan.units[0]
                if root.params:
                    run.root, outs = run.gather(root)
                    given.update(zip(root.params, outs))
                for unit in plan.units[1:]:
                    given.update((n, plan.absent[n]) for n in unit.params)
                rerun = functools.partial(self._rerun, plan, shards, enter)
                out = self.slots.call(given, buffers, inputs, kwargs, rerun)
            out = run.detach_views(out)
            ok = True
        finally:
            self.run = outer
            run.finish(ok)
        plan.recording = False
        return out
