"""A parameter's gradient as the rank's shard of it, for an optimizer whose state is sharded."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pardist.transport import shard_range

__all__ = ["grad_shard"]


def grad_shard(g: Any, p: torch.Tensor, path: str, size: int, index: int, where: str):
    """This rank's flat shard of parameter ``p``'s gradient ``g`` (a DTensor shard that
    pardist.grad reduce-scattered, ZeRO-2, or the full gradient)."""
    if isinstance(g, DTensor):  # already this rank's shard (ZeRO-2)
        return g.to_local()
    if isinstance(g, torch.Tensor) and g.shape == p.shape:  # full: take the shard
        start, stop = shard_range(p.numel(), size, index)
        return g.reshape(-1)[start:stop]
    shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
    raise ValueError(
        f"{where}: {path} has shape {shape}; expected the full gradient "
        f"{tuple(p.shape)} or this rank's DTensor shard from pardist.grad."
    )
