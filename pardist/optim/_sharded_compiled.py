"""``sharded(opt).update`` inside a compiled step: the same shards, gathered in the graph.

The eager update keeps each rank's rows of parameters in shared-memory buckets
and gathers them there; a graph can hold neither. Here this rank's shard of
each parameter is a slice, the wrapped optimizer updates the shards, and the
new rows are all-gathered in flat buckets of the graph (``_traced``), with the
layout of ``_zero`` (chunks of ``ceil(n / size)``, the last one shorter).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pardist.compile import _traced
from pardist.optim import _shard
from pardist.optim._base import Optimizer
from pardist.runtime import _tree, donating, is_donated, sharded_over
from pardist.transport import shard_range

__all__ = ["update"]


def update(opt: Optimizer, grads: Any, state: Any, params: Any, plan: Any, where: str):
    """(new params, new inner state) of one sharded update inside a compiled step."""
    key = state.axis[0] if len(state.axis) == 1 else state.axis
    info = _traced.axis_info(plan, key, where)
    size, index = info.size, info.index
    leaves, treedef = _tree.tree_flatten(params)
    g_shards, p_shards = [], []
    for (path, g), p in zip(_tree.leaves_with_paths(grads, "grads"), leaves):
        start, stop = shard_range(p.numel(), size, index)
        g_shards.append(_shard.grad_shard(g, p, path, size, index, where))
        p_shards.append(p.detach().reshape(-1)[start:stop].clone())
    inner_leaves, inner_def = _tree.tree_flatten(state.inner)
    locals_ = [x.to_local() if isinstance(x, DTensor) else x for x in inner_leaves]
    sharded_leaves = [x for x in inner_leaves if isinstance(x, DTensor)]
    mine = p_shards + (
        [t for t in locals_ if isinstance(t, torch.Tensor)] if is_donated(sharded_leaves) else []
    )
    with donating(mine), sharded_over(state.axis):  # our rows; the state if given up
        new_p, new_inner = opt.update(
            _tree.tree_unflatten(g_shards, treedef),
            _tree.tree_unflatten(locals_, inner_def),
            _tree.tree_unflatten(p_shards, treedef),
        )
    rows = _traced.gather_rows(_tree.tree_leaves(new_p), [p.numel() for p in leaves], plan)
    in_place = is_donated(leaves)
    new_params = []
    for p, flat in zip(leaves, rows):
        if in_place and p.is_contiguous():
            p.copy_(flat.view(p.shape))
            new_params.append(p)
        else:
            new_params.append(flat.view(p.shape))
    rewrapped = []
    for old, passed, new in zip(inner_leaves, locals_, _tree.tree_leaves(new_inner)):
        if isinstance(old, DTensor) and new is not passed:
            new = DTensor.from_local(
                new, old.device_mesh, old.placements, shape=old.shape, stride=(1,), run_check=False
            )
        elif isinstance(old, DTensor):
            new = old
        rewrapped.append(new)
    return _tree.tree_unflatten(new_params, treedef), _tree.tree_unflatten(rewrapped, inner_def)
