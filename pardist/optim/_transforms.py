"""Gradient transformations to ``chain`` before an optimizer."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pardist.collectives import _collectives
from pardist.optim._base import GradientTransformation
from pardist.runtime import (
    Compiled,
    Eager,
    _tree,
    current_mode,
    foreach_mul,
    foreach_norm,
    shard_group,
)
from pardist.transport import agree

__all__ = ["clip_by_global_norm", "clip_by_value", "global_norm"]


class EmptyState(NamedTuple):
    pass


# A state is data: torch.load(weights_only=True) reads a torch.save of it (issue 48).
torch.serialization.add_safe_globals([EmptyState])


def global_norm(tree) -> torch.Tensor:
    """The 2-norm of all leaves together, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    leaves = _tree.check_tensor_leaves(tree, where="pardist.optim.global_norm", name="tree")
    if not leaves:
        return torch.tensor(0.0)
    local = [x.to_local() if isinstance(x, DTensor) else x for x in leaves]
    norms = torch.stack([n.to(local[0].device) for n in foreach_norm(local, 2.0)])
    group = shard_group()  # inside optim.sharded: every leaf is this rank's shard
    shards = [group is not None or isinstance(x, DTensor) for x in leaves]
    if not any(shards):
        return torch.linalg.vector_norm(norms, 2.0)
    # Shards of tensors split over ranks: their squares are summed over the group.
    squares = norms.square()
    mask = torch.tensor(shards, device=squares.device)
    sharded = squares[mask].sum()
    return (squares[~mask].sum() + current_mode().run("sum_shards", sharded, group, leaves)).sqrt()


@Eager.register("sum_shards")
def _sum_shards(mode, sharded: torch.Tensor, group, leaves: list) -> torch.Tensor:
    """The sum over ranks of their shards' squares (over ``group``, else the DTensors')."""
    if group is None:
        group = next(x for x in leaves if isinstance(x, DTensor)).device_mesh.get_group()
    agree("pardist.optim's global norm (the shards' squares)", group, sharded)
    dist.all_reduce(sharded, group=group)
    return sharded


@Compiled.register("sum_shards")
def _sum_shards_traced(mode, sharded: torch.Tensor, group, leaves: list) -> torch.Tensor:
    return _collectives.psum(sharded, group or mode.plan.axis)  # over its (or the state's) axis


def clip_by_global_norm(max_norm: float, eps: float = 1e-6) -> GradientTransformation:
    """Scale gradients so that their global norm is at most ``max_norm``.

    Equal to ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` (same epsilon),
    but pure: new tensors come back and the inputs are untouched.

    Example:
        >>> import pardist, torch
        >>> clip = pardist.optim.clip_by_global_norm(1.0)
        >>> g, _ = clip.update({'w': torch.tensor([3., 4.])}, clip.init(None))
        >>> g['w']
        tensor([0.6000, 0.8000])
    """

    def update_fn(grads, state, params=None):
        leaves, treedef = _tree.tree_flatten(grads)
        coef = (max_norm / (global_norm(grads) + eps)).clamp(max=1.0)
        scaled = foreach_mul(leaves, coef) if leaves else []
        return _tree.tree_unflatten(scaled, treedef), state

    return GradientTransformation(lambda params: EmptyState(), update_fn)


def clip_by_value(limit: float) -> GradientTransformation:
    """Clamp every gradient element into ``[-limit, limit]`` (``clip_grad_value_``, purely)."""

    def update_fn(grads, state, params=None):
        return _tree.tree_map(lambda g: g.clamp(-limit, limit), grads), state

    return GradientTransformation(lambda params: EmptyState(), update_fn)
