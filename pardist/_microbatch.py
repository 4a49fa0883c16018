"""Micro-batches for gradient accumulation: split the batch, stack what comes back.

``pardist.grad(f, accumulate=k)`` runs ``f`` on k slices of the batch, one after
another, and reduces once (DDP's ``no_sync`` and fastai's gradient accumulation,
done in one place). The batch is split along dim 0 with einops.
"""

from __future__ import annotations

from typing import Any

import einops
import torch

from pardist import _tree

__all__ = ["split", "stack"]


def split(args: tuple, batch_argnums: tuple[int, ...], k: int, where: str) -> list[tuple]:
    """Split the batch arguments along dim 0 into ``k`` micro-batches (einops)."""
    if k == 1:
        return [args]
    split = list(args)
    for n in batch_argnums:
        for path, leaf in _tree.leaves_with_paths(args[n], f"args[{n}]"):
            if isinstance(leaf, torch.Tensor) and leaf.ndim and leaf.shape[0] % k:
                raise ValueError(
                    f"{where}: accumulate={k} cannot split {path} of shape "
                    f"{tuple(leaf.shape)} into equal micro-batches along dim 0; use a batch "
                    f"size divisible by {k}."
                )
        split[n] = _tree.tree_map(
            lambda x: (
                einops.rearrange(x, "(k b) ... -> k b ...", k=k)
                if isinstance(x, torch.Tensor) and x.ndim
                else x
            ),
            args[n],
        )
    return [
        tuple(
            _tree.tree_map(lambda x, j=j: x[j] if isinstance(x, torch.Tensor) and x.ndim else x, a)
            if i in batch_argnums
            else a
            for i, a in enumerate(split)
        )
        for j in range(k)
    ]


def stack(items: list[Any]) -> Any:
    if len(items) == 1 or items[0] is None:
        return items[0]
    flat = [_tree.tree_flatten(item)[0] for item in items]
    spec = _tree.tree_flatten(items[0])[1]
    leaves = [
        torch.stack(column) if isinstance(column[0], torch.Tensor) else list(column)
        for column in zip(*flat)
    ]
    return _tree.tree_unflatten(leaves, spec)
