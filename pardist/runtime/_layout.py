"""Gradients laid out like their parameters: DDP's gradient layout contract.

A gradient's memory layout (its strides) is whatever the backward produced:
``autograd.grad`` returns channels_last gradients for channels_last weights, and
ops such as a transposed matmul give non-contiguous ones. Values are right
either way, but torch's fused optimizer kernels (``torch._fused_adamw_``,
``_fused_sgd_``) walk parameter, gradient and state memory in step and silently
give wrong updates when their strides differ. So pardist hands out gradients
with their parameter's strides, as ``.grad`` has them, and the optimizers check.
"""

from __future__ import annotations

import torch

__all__ = ["ShardsGradients", "dense_strides", "is_dense", "laid_out_like", "same_layout"]


def dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides if it is dense and non-overlapping (channels_last, permuted), else
    contiguous strides: the layout ``torch.empty_like(t)`` gives, as DDP's buckets use."""
    if t.is_contiguous():
        return t.stride()
    return torch.empty_like(t, device="meta").stride()


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` fills its memory without gaps or overlaps (any order of dims)."""
    return t.is_contiguous() or dense_strides(t) == t.stride()


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether elementwise kernels that ignore strides see ``a`` and ``b`` element for element."""
    if a.shape != b.shape:
        return False
    if a.is_contiguous() and b.is_contiguous():
        return True
    # Strides of size-1 dims never move through memory; compare the others.
    return all(n == 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def laid_out_like(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``g``, or a copy of it with ``like``'s dense layout where the two differ."""
    if same_layout(g, like) or g.is_sparse:
        return g
    target = dense_strides(like)
    if all(n == 1 or s == t for n, s, t in zip(g.shape, g.stride(), target)):
        return g
    out = torch.empty_strided(g.shape, target, dtype=g.dtype, device=g.device)
    return out.copy_(g)


class ShardsGradients:
    """A pytree node whose parameters' gradients arrive reduce-scattered over ``axis`` (ZeRO-2).

    ``pardist.optim.sharded``'s state is one. A step finds such nodes among its
    arguments and reduce-scatters the gradients of the parameters whose
    ``signature`` (their shapes and dtypes, in order) matches, so the layout is
    decided by the state the step is given, not by the optimizer that made it.
    Subclasses set ``signature`` and ``axis`` (static: part of the tree structure).
    """

    __slots__ = ()
    signature: tuple
    axis: tuple[str, ...]
