"""pardist.fsdp inside a compiled step: each unit's gather one node of the step's graph.

In ``data_parallel(step, compile=True)``, ``pardist.grad`` differentiates an FSDP
parameter through this rank's chunk of it, which the loss receives as a :class:`Local`
(the chunk, and the shape of the flat shard it stands for). ``apply`` gathers each
unit's chunks with one all-gather of the graph (``compile._traced.fsdp_gather``), whose
transpose reduce-scatters the gradients into each rank's shard of their mean, and runs
the module on the full parameters. The eager path's hooks, freeing and regathering
(``_apply``) are the compiler's business here: inductor frees a gathered unit after
its last use, and AOTAutograd chooses what the backward saves. Outside ``pardist.grad``
(an evaluation step) the DTensor shards are gathered the same way.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pardist.compile import _step, _traced
from pardist.runtime import (
    Compiled,
    ShardsGradients,
    _tree,
    current_step,
    dtensor_like,
    dtensor_local,
)
from pardist.sharding import _fsdp, _units
from pardist.transport import shard_range

__all__ = ["Local", "call", "padded", "register", "trimmed", "usable"]

_RUNNERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class Local:
    """An FSDP shard as a compiled step's ``pardist.grad`` gives it to the loss: this rank's
    chunk (``local``, what is differentiated) and the flat shard's metadata. Only
    ``apply`` computes with it (as with the eager step's guarded shards)."""

    def __init__(self, local: torch.Tensor, numel: int):
        self.local, self.shape = local, torch.Size((numel,))
        self.dtype, self.device, self.ndim = local.dtype, local.device, 1

    def numel(self) -> int:
        return self.shape[0]

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return 1


def register(runner: Any) -> int:
    """The key by which a compiled step's graph names ``runner`` (a constant)."""
    key = next(_KEYS)
    _RUNNERS[key] = runner
    return key


def usable() -> bool:
    """Whether ``apply`` gathers shards in the graph: in a compiled step that knows the axes
    its FSDP shards are split over."""
    ctx = current_step()
    plan = ctx.mode.plan if ctx is not None else None
    return plan is not None and plan.fsdp is not None


@_step.constant_result
def _unit_names(key: int, names: tuple[str, ...]) -> tuple:
    """((parameter names, their shapes) per unit with parameters): ``_units.choose``, run
    once as the graph is traced and held in it as a constant."""
    runner = _RUNNERS[key]
    metas = dict(runner.skeleton.named_parameters())
    wanted = [n for n in metas if n in names]
    units, _ = _units.choose(runner.skeleton, wanted, runner.policy, runner.where)
    return tuple(
        (tuple(u.params), tuple(tuple(metas[n].shape) for n in u.params)) for u in units if u.params
    )


def call(runner: Any, params: dict, buffers: dict, inputs: tuple, kwargs: dict, enter) -> Any:
    """The module run on ``params`` with every unit's shards gathered in the graph."""
    plan = current_step().mode.plan
    shards = {k: v for k, v in params.items() if isinstance(v, (Local, DTensor))}
    given = dict(params)
    for names, shapes in _unit_names(runner.key, tuple(shards)):
        chunks = []
        for name, shape in zip(names, shapes):
            v, numel = shards[name], torch.Size(shape).numel()
            held = v.numel() if isinstance(v, Local) else plan.numels.get(v.shape[0])
            if held != numel:  # (the eager step names the parameter and the fix)
                raise ValueError(
                    f"{runner.where}: params[{name!r}] holds {held} elements, but "
                    f"the module's parameter has shape {shape}; pass pardist.fsdp(params) "
                    "of the params that pardist.functional returned."
                )
            chunks.append(v.local if isinstance(v, Local) else v.to_local())
        numels = [torch.Size(s).numel() for s in shapes]
        fulls = _traced.fsdp_gather(chunks, numels, plan)
        given.update((n, t.view(s)) for n, t, s in zip(names, fulls, shapes))
    return runner.slots.call(given, buffers, inputs, kwargs, enter)


def _is_state(x: Any) -> bool:
    return isinstance(x, ShardsGradients)


def _flat_shards(args: Any) -> tuple[list, Any]:
    return _tree.tree_flatten(args, is_leaf=_is_state)


@Compiled.register("fsdp_layout")
def _layout(mode, args: tuple, mesh, axes: tuple) -> tuple:
    """(the axes the pardist.fsdp shards in ``args`` are split over, their chunks' padded
    lengths): (None, None) without shards (DTensors outside a sharded optimizer's state),
    (why the step is not compiled, None) where it cannot be (the eager step raises the
    error that says what to do, if any)."""
    nodes = _flat_shards(args)[0]
    found = {_fsdp.axes_of(x, mesh) for x in nodes if isinstance(x, DTensor)}
    if not found:
        return None, None
    if len(found) > 1 or None in found or not set(next(iter(found))) <= set(axes):
        return "its pardist.fsdp shards are not all split over the step's axes", None
    if any(isinstance(x, ShardsGradients) for x in nodes):
        return (
            "optim.sharded's state over pardist.fsdp parameters is not compiled; the plain "
            "optimizer keeps its state sharded like the parameters: use it",
            None,
        )
    fsdp = next(iter(found))
    return fsdp, chunk_lengths(args, mesh.size(fsdp))


def chunk_lengths(args: tuple, size: int) -> dict[int, int]:
    """{numel: the length every rank's chunk of a flat shard of numel is padded to}.

    At least ``ceil(numel / size)``, and one length per numel (the shortest increasing
    ones): a padded shard's global length then names the numel it stands for.
    """
    numels = sorted({x.shape[0] for x in _flat_shards(args)[0] if _is_shard(x)})
    out: dict[int, int] = {}
    last = 0
    for n in numels:
        last = out[n] = max(-(-n // size), last + 1)
    return out


def _is_shard(x: Any) -> bool:
    return isinstance(x, DTensor) and x.ndim == 1


@Compiled.register("fsdp_pad")
def _pad(mode, args: tuple) -> tuple[tuple, dict]:
    return padded(args, mode.plan)


@Compiled.register("fsdp_trim")
def _trim(mode, out: Any, args: tuple, stands: dict) -> Any:
    return trimmed(out, args, stands, mode.plan)


def padded(args: tuple, plan: Any) -> tuple[tuple, dict]:
    """``args`` with every flat shard's chunk zero-padded to ``plan.chunks[numel]``
    elements on every rank (a shard of ``size x`` that many), and {id of a padded shard:
    the caller's shard}.

    Chunks of one length on every rank make every rank's graph the same, so inductor
    orders the collectives alike everywhere (with chunks of different lengths it ordered
    the gathers differently on each rank). The padding takes no part in any value: the
    gather drops it, and :func:`trimmed` cuts it off what the step returns."""
    leaves, spec = _flat_shards(args)
    stands: dict = {}
    size = plan.axes[plan.fsdp].size
    for i, x in enumerate(leaves):
        if _is_shard(x):
            chunk, local = plan.chunks[x.shape[0]], dtensor_local(x)
            if local.numel() != chunk:
                local = torch.nn.functional.pad(local, (0, chunk - local.numel()))
            leaves[i] = DTensor.from_local(
                local, x.device_mesh, x.placements, shape=(size * chunk,), stride=(1,),
                run_check=False,
            )  # fmt: skip
            stands[id(leaves[i])] = x
    return _tree.tree_unflatten(leaves, spec), stands


def trimmed(out: Any, args: tuple, stands: dict, plan: Any) -> Any:
    """What the step returned with each flat shard's padding cut off; a padded input it
    returns (donated: updated in place) comes back as the caller's shard, updated."""
    leaves, spec = _flat_shards(out)
    numel = plan.numels
    like = {(x.shape[0], x.dtype): x for x in _flat_shards(args)[0] if _is_shard(x)}
    for i, x in enumerate(leaves):
        if not _is_shard(x) or x.shape[0] not in numel:
            continue
        n = numel[x.shape[0]]
        mesh = x.device_mesh
        start, stop = shard_range(n, mesh.size(), mesh.get_local_rank())
        local = dtensor_local(x)[: stop - start]
        own = stands.get(id(x))
        if own is not None:
            if dtensor_local(own).data_ptr() != local.data_ptr():
                dtensor_local(own).copy_(local)
            leaves[i] = own
        elif (n, x.dtype) in like:
            leaves[i] = dtensor_like(local, like[(n, x.dtype)])
        else:
            leaves[i] = DTensor.from_local(
                local, mesh, x.placements, shape=(n,), stride=(1,), run_check=False
            )
    return _tree.tree_unflatten(leaves, spec)
