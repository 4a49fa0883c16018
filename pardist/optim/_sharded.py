"""``sharded(opt)``: optimizer state split over a mesh axis (ZeRO-1/2), without wrapping a model.

Data parallelism keeps a full copy of the optimizer state on every rank (AdamW:
twice the parameters). ``sharded`` keeps 1/N of every state tensor per rank:
each is a flat shard of the flattened tensor, a ``DTensor`` placed ``Shard(0)``
on the axis, so the state describes its own layout (``pardist.specs(state)``
gives ``P('gpu')``), ``data_parallel`` treats it as sharded, and
``pardist.checkpoint`` saves it shard by shard and reshards it on load at
another world size.

Inside a data-parallel step that is given the sharded state, ``pardist.grad``
reduce-scatters the gradients of the matching parameters (ZeRO-2): each rank
receives only its shard of each mean gradient, as a ``DTensor``. ``update``
applies the wrapped optimizer to this rank's shards, then all-gathers the new
parameters. Reduce-scatter plus all-gather move what one all-reduce moves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from pardist.optim import _aligned, _shard, _sharded_compiled
from pardist.optim._base import Optimizer
from pardist.runtime import (
    ShardsGradients,
    _mesh,
    _survive,
    _tree,
    compiled_plan,
    current_mode,
    donating,
    is_donated,
    pytree,
    sharded_over,
)
from pardist.sharding import _fsdp
from pardist.transport import ParamGather, shard_range, signature

__all__ = ["ShardedState", "sharded"]


class ShardedState(ShardsGradients):
    """A sharded optimizer's state: the wrapped optimizer's state over flat shards.

    ``inner`` is that state (DTensor leaves for per-parameter tensors, plain
    tensors for replicated ones such as the step count). ``signature`` (the
    parameters' shapes and dtypes) and ``axis`` are static: they live in the
    tree structure, not in its leaves.
    """

    __slots__ = ("inner", "signature", "axis")

    def __init__(self, inner: Any, signature: tuple, axis: tuple[str, ...]):
        self.inner, self.signature, self.axis = inner, signature, axis

    def __repr__(self) -> str:
        return f"ShardedState(axis={self.axis}, inner={self.inner!r})"


pytree.register_pytree_node(
    ShardedState,
    lambda s: ([s.inner], (s.signature, s.axis)),
    lambda children, context: ShardedState(children[0], *context),
    serialized_type_name="pardist.optim.ShardedState",
    flatten_with_keys_fn=lambda s: ([(pytree.GetAttrKey("inner"), s.inner)], (s.signature, s.axis)),
)


def _local(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


def sharded(
    opt: Optimizer,
    axis: str | tuple[str, ...] = "gpu",
    *,
    mesh: _mesh.Mesh | None = None,
    bucket_mb: float = 25.0,
) -> Optimizer:
    """Shard ``opt``'s state over ``axis``: each rank keeps about 1/N of every state tensor.

    The one-line change from plain data parallelism:
    ``opt = pardist.optim.sharded(pardist.optim.adamw(1e-3))``. The step is
    unchanged; donating the params and state (``donate_argnums``) lets the
    update run in place.

    Args:
        opt: any pardist optimizer (sgd, adamw, a chain ending in one).
        axis: the mesh axis (or axes) to shard over: the step's data-parallel axis.
        mesh: default: the current mesh (``with mesh:``, else ``pardist.init``'s).
        bucket_mb: size of the parameter all-gather buckets, in MiB.

    Returns:
        An :class:`Optimizer` whose state is a :class:`ShardedState`.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> opt = pardist.optim.sharded(pardist.optim.adamw(0.1, weight_decay=0.0))
        >>> params = {'w': torch.zeros(3)}
        >>> state = opt.init(params)
        >>> pardist.specs(state.inner.exp_avg)
        {'w': P('gpu')}
        >>> params, state = opt.update({'w': torch.ones(3)}, state, params)
        >>> params['w']
        tensor([-0.1000, -0.1000, -0.1000])
        >>> pardist.shutdown()
    """
    _survive.refuse_sharded("pardist.optim.sharded", "the optimizer state")
    plans: dict[tuple, ParamGather] = {}

    def where(fn: str) -> str:
        return f"pardist.optim.sharded.{fn}"

    def setup(params: Any, fn: str):
        m = mesh or _mesh.current_mesh(f"optim.sharded.{fn}")
        axes = m.axes(axis, f"optim.sharded.{fn}")
        leaves = _tree.check_tensor_leaves(params, where=where(fn), name="params")
        for path, leaf in _tree.leaves_with_paths(params, "params"):
            if not leaf.is_floating_point():
                raise TypeError(
                    f"{where(fn)}: {path} has dtype {leaf.dtype}; only floating-point tensors "
                    "can be optimized, so only they can have sharded optimizer state. Keep "
                    "integer values (step counters, masks) out of the params tree."
                )
        return m, axes, leaves

    def fsdp_shards(params: Any, m, axes, fn: str) -> bool:
        """Whether params are pardist.fsdp shards over ``axes`` (the state then follows them)."""
        named = _tree.leaves_with_paths(params, "params")
        if not any(isinstance(x, DTensor) for _, x in named):
            return False
        for path, x in named:
            found = _fsdp.axes_of(x, m) if _fsdp.is_shard(x) else None
            if found != axes:
                what = (
                    f"{_fsdp.describe('params', path[len('params') :], x)}"
                    if found
                    else f"{path} is {type(x).__name__} (not a pardist.fsdp shard over {axes})"
                )
                raise ValueError(
                    f"{where(fn)} over {axes}: {what}. A sharded optimizer over pardist.fsdp "
                    "shards keeps its state like them: shard the params and the optimizer "
                    "over the same axis (or use the plain optimizer: its state follows the "
                    "params' shards), and pass every parameter sharded."
                )
        return True

    def init_fn(params):
        m, axes, leaves = setup(params, "init")
        if fsdp_shards(params, m, axes, "init"):  # FSDP: the inner state is sharded already
            return ShardedState(opt.init(params), signature(leaves), axes)
        size, index, sub = m.size(axes), m.index(axes), m.submesh(axes)
        shards = []
        for leaf in leaves:
            start, stop = shard_range(leaf.numel(), size, index)
            local = leaf.detach().reshape(-1)[start:stop].clone()
            shards.append(
                DTensor.from_local(
                    local, sub, [Shard(0)], shape=(leaf.numel(),), stride=(1,), run_check=False
                )
            )
        inner = opt.init(_tree.tree_unflatten(shards, _tree.tree_flatten(params)[1]))
        return ShardedState(inner, signature(leaves), axes)

    def update_fn(grads, state: ShardedState, params):
        if (plan := compiled_plan()) is not None:  # inside data_parallel(compile=True)
            new_params, inner = _sharded_compiled.update(
                opt, grads, state, params, plan, where("update")
            )
            return new_params, ShardedState(inner, state.signature, state.axis)
        m, axes, leaves = setup(params, "update")
        fsdp = fsdp_shards(params, m, axes, "update")
        if state.signature != signature(leaves) or state.axis != axes:
            raise ValueError(
                f"{where('update')}: the state was made for parameters {state.signature} "
                f"over {state.axis}, not for these {signature(leaves)} over {axes}. Use the "
                "state that init returned for these parameters (pardist.fsdp shards and "
                "full parameters each need their own: opt.init(params) after pardist.fsdp)."
            )
        if fsdp:
            new_params, inner = opt.update(grads, state.inner, params)
            return new_params, ShardedState(inner, state.signature, axes)
        size, index, group = m.size(axes), m.index(axes), m.group(axes)
        key = (state.signature, axes, id(m))
        if key not in plans:
            cap = int(bucket_mb * 2**20)
            plans[key] = ParamGather(
                leaves, group, size, index, bucket_bytes=cap, first_bucket_bytes=min(cap, 2**20)
            )
        plan = plans[key]
        treedef = _tree.tree_flatten(params)[1]
        g_shards = []
        for (path, g), p in zip(_tree.leaves_with_paths(grads, "grads"), leaves):
            g_shards.append(_shard.grad_shard(g, p, path, size, index, where("update")))
        p_shards = plan.shards(leaves)
        inner_leaves, inner_def = _tree.tree_flatten(state.inner)
        locals_ = [_local(x) for x in inner_leaves]
        sharded_leaves = [x for x in inner_leaves if isinstance(x, DTensor)]
        donated = is_donated(sharded_leaves)
        # The deterministic mode: each slice updated at its place in the whole tensor
        # (optim._aligned), so that it has one process's bits on every CPU.
        bp, bg, bs, pw, sw = p_shards, g_shards, locals_, None, None
        if current_mode().name == "deterministic":
            pw = [_aligned.Window(*shard_range(p.numel(), size, index), p.numel()) for p in leaves]
            bp, bg = ([w.widen(t) for w, t in zip(pw, ts)] for ts in (p_shards, g_shards))
            bs, sw = _aligned.widened(inner_leaves, locals_)
        mine = bp + ([t for t in bs if isinstance(t, torch.Tensor)] if donated else [])
        with donating(mine), sharded_over(group):  # our rows; the state if given up
            new_p, new_inner = opt.update(
                _tree.tree_unflatten(bg, treedef),
                _tree.tree_unflatten(bs, inner_def),
                _tree.tree_unflatten(bp, treedef),
            )
        if pw is not None:
            new_p = [w.narrow(t) for w, t in zip(pw, _tree.tree_leaves(new_p))]
            new_inner = _aligned.narrowed(_tree.tree_leaves(new_inner), sw, locals_, donated)
        for row, new in zip(p_shards, _tree.tree_leaves(new_p)):
            if new is not row:
                row.copy_(new)
        new_params = plan.gather(leaves, in_place=is_donated(leaves))
        rewrapped = []
        for old, passed, new in zip(inner_leaves, locals_, _tree.tree_leaves(new_inner)):
            if isinstance(old, DTensor):
                new = (
                    old
                    if new is passed
                    else DTensor.from_local(
                        new,
                        old.device_mesh,
                        old.placements,
                        shape=old.shape,
                        stride=old.stride(),
                        run_check=False,
                    )
                )
            rewrapped.append(new)
        new_state = ShardedState(_tree.tree_unflatten(rewrapped, inner_def), state.signature, axes)
        return _tree.tree_unflatten(new_params, treedef), new_state

    return Optimizer(init_fn, update_fn, opt.lr)
