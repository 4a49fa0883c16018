"""Gradient transformations to ``chain`` before an optimizer."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pardist import _tree
from pardist.optim._base import GradientTransformation

__all__ = ["clip_by_global_norm", "clip_by_value", "global_norm"]


class EmptyState(NamedTuple):
    pass


def global_norm(tree) -> torch.Tensor:
    """The 2-norm of all leaves together, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    leaves = _tree.check_tensor_leaves(tree, where="pardist.optim.global_norm", name="tree")
    if not leaves:
        return torch.tensor(0.0)
    norms = torch._foreach_norm(leaves, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.to(leaves[0].device) for n in norms]), 2.0)


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
        scaled = torch._foreach_mul(leaves, coef) if leaves else []
        return _tree.tree_unflatten(scaled, treedef), state

    return GradientTransformation(lambda params: EmptyState(), update_fn)


def clip_by_value(limit: float) -> GradientTransformation:
    """Clamp every gradient element into ``[-limit, limit]`` (``clip_grad_value_``, purely)."""

    def update_fn(grads, state, params=None):
        return _tree.tree_map(lambda g: g.clamp(-limit, limit), grads), state

    return GradientTransformation(lambda params: EmptyState(), update_fn)
