"""The layout of gradient buckets: which tensor lies where, and every rank the same.

:func:`assign` groups tensors into buckets as torch DDP does (in reverse order, the
first bucket small so that communication starts early); :func:`check_layout` makes
sure, once, that every rank would reduce the same list of tensors. The reducers
(``_reducer``, ``_scatter``) keep one :class:`Bucket` per group of tensors and one
:class:`Slot` per tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
import torch.distributed as dist

from pardist.runtime import _faults
from pardist.transport._agree import agree

__all__ = ["Bucket", "Slot", "assign", "check_layout"]


def _differ(ranks: list[int], layouts: list[list]) -> str:
    """The first way the ranks' lists of (shape, dtype) differ from the first rank's."""
    first = layouts[0]
    for r, theirs in zip(ranks[1:], layouts[1:]):
        if len(theirs) != len(first):
            return (
                f"rank {r} has {len(theirs)} tensors to reduce where rank {ranks[0]} "
                f"has {len(first)}"
            )
        for a, b in zip(first, theirs):
            if a != b:
                return f"a {a[1]} {a[0]} gradient on rank {ranks[0]} is {b[1]} {b[0]} on rank {r}"
    return "they differ"


def check_layout(like: list[torch.Tensor], groups: list, where: str) -> None:
    """Raise on every rank if the ranks of ``groups`` would reduce different tensors.

    Run once, when buckets are laid out: buckets of different layouts would add
    unrelated gradients (or read past a shorter rank's memory) without a word.
    One small gather of a digest per group; the full lists only when they differ.
    """
    mine = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in like]
    digest = hashlib.blake2b(repr(mine).encode(), digest_size=16).hexdigest()
    for group in groups:
        ranks = dist.get_process_group_ranks(group)
        digests: list = [None] * len(ranks)
        agree(f"{where} (comparing gradient layouts)", group)
        with _faults.collective_errors(f"{where} (comparing gradient layouts)", group):
            dist.all_gather_object(digests, digest, group=group)
            if len(set(digests)) == 1:
                continue
            layouts: list = [None] * len(ranks)
            dist.all_gather_object(layouts, mine, group=group)
        raise _faults.CollectiveMismatch(
            f"{where}: the ranks of {_faults.describe_group(group.group_name, ranks)} "
            f"differentiate different parameters, so their gradients cannot be averaged: "
            f"{_differ(ranks, layouts)}. Every rank must pass the same parameter tree (the "
            "same keys, shapes and dtypes): build the model the same way on every rank."
        )


@dataclasses.dataclass
class Slot:
    bucket: int
    offset: int
    numel: int
    shape: torch.Size
    stride: tuple[int, ...]  # the parameter's (dense) strides: DDP's gradient layout contract


class Bucket:
    def __init__(self, dtype: torch.dtype, device: torch.device, comm_dtype: torch.dtype | None):
        self.dtype, self.device, self.comm_dtype = dtype, device, comm_dtype
        self.numel = 0  # rows * row
        self.row = 0
        self.slots: list[int] = []
        self.arena_offset: int | None = None  # byte offset in the shared regions
        self.buffer: torch.Tensor | None = None  # this step's: shared region or private
        self.private: torch.Tensor | None = None
        self.comm: torch.Tensor | None = None
        self.shared = False  # this step's buffer is the bucket's shared-memory region
        self.common_offset: int | None = None  # byte offset of its result in the common area
        self.pending = 0
        self.work = None
        self.shapes: list[torch.Size] = []  # its slots' shapes, in the order they lie in it
        self.concatenated = False  # add_many may write it whole (see Reducer._build)
        self.metas: list[torch.Tensor] = []  # meta tensors like its slots, if all row-major


def assign(
    like: list[torch.Tensor],
    width,
    rows: int,
    comm_dtype,
    bucket_bytes: int,
    first_bucket_bytes: int,
) -> tuple[list[Bucket], list[tuple[int, int]]]:
    """Group tensors into buckets, in reverse order (the last layers' gradients come first).

    ``like`` holds tensors, or anything with their ``dtype`` and ``device``.

    Each tensor takes ``width(t)`` elements of its bucket's row; a bucket is
    ``rows`` rows (1 for all-reduce, the group size for reduce-scatter) and closes
    once it holds ``bucket_bytes`` (``first_bucket_bytes`` for the first, so that
    communication starts early). Tensors of different dtype or device never share
    a bucket. Returns the buckets and each tensor's (bucket, column offset).
    """
    buckets: list[Bucket] = []
    places: list[tuple[int, int]] = [(0, 0)] * len(like)
    open_by_kind: dict[tuple, int] = {}
    for i in reversed(range(len(like))):
        t = like[i]
        kind = (t.dtype, t.device)
        b = open_by_kind.get(kind)
        cap = first_bucket_bytes if len(buckets) == 0 or b == 0 else bucket_bytes
        if b is None or buckets[b].numel * t.dtype.itemsize >= cap:
            cd = comm_dtype if comm_dtype is not None and t.dtype.is_floating_point else None
            buckets.append(Bucket(t.dtype, t.device, cd if cd != t.dtype else None))
            b = open_by_kind[kind] = len(buckets) - 1
        bucket = buckets[b]
        places[i] = (b, bucket.row)
        bucket.slots.append(i)
        bucket.row += width(t)
        bucket.numel = rows * bucket.row
    return buckets, places
