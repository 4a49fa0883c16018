"""A shard's update with the bits of the whole tensor's: the deterministic mode's optimizer
on ``pardist.fsdp`` shards.

torch's fused CPU optimizer kernels (and any vectorized elementwise loop) compute a
tensor's elements in SIMD lanes and its last ``numel % W`` elements in a scalar tail, where
W is the vector width of the CPU the kernel was built for (4 or 8 doubles, 8 or 16 floats)
and the two paths round differently (the lanes fuse a multiply-add, the tail does not).
torch's threads split a tensor at multiples of a cache line, so each thread's piece but
the last has no tail. Which path an element takes depends on its position, so a flat shard
starting at element 1,000 of a parameter, updated on its own, can end one ulp from the same
elements updated in the whole tensor, on one CPU and not on another
(``tests/test_modes.py``'s FSDP row failed on an Intel Xeon, W = 8, and passed here, W = 4).

The construction: each shard ``[a, b)`` of a tensor of ``n`` elements is updated inside a
buffer that covers ``[A, B)``, where ``A`` rounds ``a`` down to a multiple of :data:`ALIGN`
and ``B`` rounds ``b`` up to one, or is ``n`` where that passes ``n`` (the shard then ends
where the tensor does). Every element then sits at the same position modulo any vector
width or cache line dividing ``ALIGN`` as in the whole tensor, and the buffer ends in the
tail exactly where the whole tensor does: each element takes the path it takes in one
process, whatever the world size and whatever the CPU. The buffer's other elements are
zeros, updated and thrown away. It costs a copy of each shard in and out, so it runs in
the deterministic mode only, whose promise is these bits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from pardist.transport import shard_range

__all__ = ["ALIGN", "Window", "narrowed", "widened", "window"]

ALIGN = 256  # elements: a multiple of every SIMD width and cache line in elements (AVX-512's
# 64 bytes hold 8 doubles, 16 floats, 32 halves; SVE reaches 2048 bits = 256 bytes)


class Window:
    """Where a shard's elements sit in its aligned buffer: ``[lo, hi)`` of ``size``."""

    def __init__(self, start: int, stop: int, numel: int):
        begin = start - start % ALIGN
        end = -(-stop // ALIGN) * ALIGN
        end = numel if end >= numel else end
        self.lo, self.hi, self.size = start - begin, stop - begin, max(end - begin, 0)

    def widen(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` copied into a zero buffer at its aligned place."""
        buffer = local.new_zeros(self.size)
        buffer[self.lo : self.hi] = local
        return buffer

    def narrow(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.lo : self.hi]


def window(shard: Any) -> Window | None:
    """The aligned window of a ``pardist.fsdp`` shard (a 1-D DTensor placed ``Shard(0)``
    on one mesh dim), or None for any other value."""
    if not (isinstance(shard, DTensor) and shard.ndim == 1 and len(shard.placements) == 1):
        return None
    if not isinstance(shard.placements[0], Shard):
        return None
    mesh = shard.device_mesh
    start, stop = shard_range(shard.shape[0], mesh.size(), mesh.get_local_rank())
    return Window(start, stop, shard.shape[0])


def widened(leaves: list, local: list) -> tuple[list, list]:
    """Each shard of ``leaves`` (its ``local`` tensor) in its aligned buffer, and the
    windows (None where a leaf is no shard: it goes as it is)."""
    windows = [window(x) for x in leaves]
    return [w.widen(t) if w else t for w, t in zip(windows, local)], windows


def narrowed(new: list, windows: list, local: list, donated: bool) -> list:
    """The update's results back at the shards' own size: into the shards themselves
    where they were donated (updated in place, as without the buffers), else copies."""
    out = []
    for t, w, was in zip(new, windows, local):
        if w is not None and isinstance(t, torch.Tensor):
            t = was.copy_(w.narrow(t)) if donated else w.narrow(t).clone()
        out.append(t)
    return out
