"""Every tensor a step gets must be on one device: the params'.

A batch left on the CPU while the params are on a GPU (or the reverse) fails
somewhere inside the model with torch's "Expected all tensors to be on the same
device", or, worse, the whole step quietly runs on the CPU. A step checks its
inputs on its first call (and every call under ``PARDIST_DEBUG=1``) and names
the argument and both devices. Zero-dimensional tensors (step counters,
scalars) may stay on the CPU, as torch allows.
"""

from __future__ import annotations

from typing import Any

import torch

from pardist.runtime import _tree

__all__ = ["check"]


def check(args: tuple, where: str) -> None:
    """Raise when tensors of ``args`` (not 0-dimensional) are on more than one device."""
    first: tuple[str, torch.device] | None = None
    for path, leaf in _tree.leaves_with_paths(args, "args"):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            continue
        if first is None:
            first = (path, leaf.device)
        elif leaf.device != first[1]:
            raise ValueError(_message(where, path, leaf.device, *first))


def _message(where: str, path: str, device: Any, ref_path: str, ref: Any) -> str:
    return (
        f"{where}: {path} is on {device}, but {ref_path} is on {ref}; every tensor a step "
        "gets must be on the params' device. Build the params with pardist.functional(model) "
        "(device='auto' puts them on pardist.device()), iterate pardist.data.shard(loader), "
        "whose batches arrive on pardist.device(), or move the tensor yourself: "
        f"x.to(pardist.device(), non_blocking=True)."
    )
