"""Where tensors go: ``device='auto'`` for ``functional`` and ``pardist.data.shard``.

Accelerate users expect the model and the batches on the process's accelerator
without a ``.to(device)`` of their own. ``'auto'`` means :func:`pardist.device`
(the local GPU, else the CPU) and moves only tensors that are on the CPU, so a
model already on a GPU, or built on the meta device, is left where it is. An
explicit device moves everything there; ``None`` moves nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from pardist.runtime import _process, _tree

__all__ = ["move", "resolve"]


def resolve(device: Any, where: str) -> tuple[torch.device | None, bool]:
    """``(target device or None, whether only CPU tensors move)``."""
    if device is None:
        return None, False
    if isinstance(device, str) and device == "auto":
        return _process.device(), True
    try:
        return torch.device(device), False
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"{where}: device={device!r} is not a device; give 'auto' (pardist.device()), "
            "a torch.device such as 'cuda:0' or 'cpu', or None to leave tensors where they are."
        ) from e


def move(tree: Any, device: torch.device | None, only_cpu: bool) -> Any:
    """``tree`` with its tensors on ``device`` (non-blocking copies from pinned memory)."""
    if device is None:
        return tree

    def to(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.device == device:
            return x
        if only_cpu and x.device.type != "cpu":
            return x
        return x.to(device, non_blocking=x.device.type == "cpu" and x.is_pinned())

    return _tree.tree_map(to, tree)


def pinned(options: dict, device: torch.device | None) -> dict:
    """DataLoader options with ``pin_memory`` on where batches go to a CUDA device."""
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return {**options, "pin_memory": True}
    return options


def moved(batches: Any, device: torch.device | None, only_cpu: bool) -> Any:
    """Each batch of ``batches`` on ``device`` (the iterator itself when there is nothing to do)."""
    if device is None or (only_cpu and device.type == "cpu"):
        return batches
    return (move(batch, device, only_cpu) for batch in batches)
