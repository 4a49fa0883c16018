"""ZeRO's communication: gradients reduce-scattered into flat shards, parameters all-gathered.

Every tensor of ``numel`` n is split, flattened, into ``size`` chunks of
``c = ceil(n / size)`` elements (torch.chunk's rule; the last may be shorter or
empty): rank k owns elements ``[k*c, (k+1)*c)``. Tensors are grouped into buckets
(reverse order, ~25 MB, as the all-reduce path) laid out as a ``(size, row)``
matrix in which row k holds rank k's chunk of every tensor of the bucket, side
by side. A reduce-scatter of the bucket then leaves each rank exactly its row:
its shard of every mean gradient. After the update, each rank's row of new
parameters is all-gathered and unpacked. Reduce-scatter plus all-gather move
what one all-reduce moves, so sharding costs no extra communication.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from pardist.runtime import GroupRef
from pardist.transport._agree import agree
from pardist.transport._buckets import Bucket, assign, check_layout
from pardist.transport._reducer import Reducer, _references
from pardist.transport._shm import ALIGN, SharedMemoryGroup

__all__ = ["ParamGather", "ScatterReducer", "shard_range", "signature"]

reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def signature(tensors: list[torch.Tensor]) -> tuple:
    """The shapes and dtypes that tie a sharded optimizer state to its parameters."""
    return tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors)


def shard_range(numel: int, size: int, index: int) -> tuple[int, int]:
    """Rank ``index``'s ``[start, stop)`` of a flat tensor of ``numel`` (torch.chunk's rule)."""
    chunk = -(-numel // size)
    start = min(index * chunk, numel)
    return start, min(start + chunk, numel)


@dataclasses.dataclass
class _Column:
    bucket: int
    offset: int  # first column of this tensor in the bucket's rows
    chunk: int  # c: columns it takes
    numel: int
    shape: torch.Size


def flat_layout(like: list[torch.Tensor], size: int, bucket_bytes: int, first_bucket_bytes: int):
    """Buckets of (size, row) blocks, and where each tensor's columns are."""
    chunk = lambda t: -(-t.numel() // size)  # noqa: E731
    buckets, places = assign(like, chunk, size, None, bucket_bytes, first_bucket_bytes)
    columns = [
        _Column(b, offset, chunk(t), t.numel(), t.shape) for (b, offset), t in zip(places, like)
    ]
    return buckets, columns


def _block(bucket: Bucket, size: int) -> torch.Tensor:
    return bucket.buffer.view(size, bucket.row)


def _pack(dst: torch.Tensor, flat: torch.Tensor, col: _Column, scale: float, first: bool) -> None:
    """Write ``flat / scale`` (numel n) into the (size, c) column block ``dst``, zero-padded."""
    full, rest = divmod(col.numel, col.chunk) if col.chunk else (0, 0)
    pieces = [(dst[:full], flat[: full * col.chunk].view(full, col.chunk))]
    if rest:
        pieces.append((dst[full, :rest], flat[full * col.chunk :]))
    for target, source in pieces:
        if first:
            torch.div(source, scale, out=target)
        else:
            target.add_(source, alpha=1.0 / scale)
    if first:  # padding: past the tensor's end, every row's tail is zero
        if rest:
            dst[full, rest:].zero_()
        dst[full + (1 if rest else 0) :].zero_()


def unpack_column(src: torch.Tensor, col: _Column, out: torch.Tensor) -> None:
    """Copy a (size, row) block's columns for ``col`` back into the flat tensor ``out``."""
    full, rest = divmod(col.numel, col.chunk) if col.chunk else (0, 0)
    block = src[:, col.offset : col.offset + col.chunk]
    out[: full * col.chunk].view(full, col.chunk).copy_(block[:full])
    if rest:
        out[full * col.chunk :].copy_(block[full, :rest])


class ScatterReducer(Reducer):
    """Like :class:`Reducer`, but each rank receives only its flat shard of every mean gradient."""

    _common_result = False  # each shard stays in its owner's region, for its owner alone

    def __init__(
        self,
        like: list[torch.Tensor],
        group,
        size: int,
        index: int,
        *,
        bucket_bytes: int = 25 * 2**20,
        first_bucket_bytes: int = 2**20,
    ):
        self.size, self.index = size, index
        self._bucket_args = (bucket_bytes, first_bucket_bytes)
        super().__init__(
            like, [group], size, bucket_bytes=bucket_bytes, first_bucket_bytes=first_bucket_bytes
        )

    def _build(self, like, comm_dtype, bucket_bytes, first_bucket_bytes) -> None:
        self.buckets, self.slots = flat_layout(like, self.size, bucket_bytes, first_bucket_bytes)

    def add(self, i: int, grad: torch.Tensor) -> None:
        col = self.slots[i]
        bucket = self.buckets[col.bucket]
        dst = _block(bucket, self.size)[:, col.offset : col.offset + col.chunk]
        _pack(dst, grad.reshape(-1), col, self._scale, not self._written[i])
        self._written[i] = True
        if self._last:
            bucket.pending -= 1

    def _zero(self, i: int) -> None:
        col = self.slots[i]
        _block(self.buckets[col.bucket], self.size)[:, col.offset : col.offset + col.chunk].zero_()

    def _launch(self, bucket: Bucket) -> None:
        if bucket.shared:
            self.arena.reduce_in_place(
                bucket.arena_offset, bucket.numel, bucket.dtype, gather=False
            )
            return
        if getattr(bucket, "out", None) is None or _references(bucket.out) > 1:
            bucket.out = torch.empty(bucket.row, dtype=bucket.dtype, device=bucket.device)
        bucket.work = reduce_scatter_into(
            bucket.out, bucket.buffer, group=self.groups[0], async_op=True
        )

    def _result_rows(self) -> list[torch.Tensor]:
        return [_block(b, self.size)[self.index] if b.shared else b.out for b in self.buckets]

    def finish(self) -> list[torch.Tensor]:
        """Reduce-scatter what is left; return this rank's shard of each mean gradient."""
        self._finish_buckets()
        rows = self._result_rows()
        out = []
        for col in self.slots:
            start, stop = shard_range(col.numel, self.size, self.index)
            out.append(rows[col.bucket][col.offset : col.offset + stop - start])
        return out


class ParamGather:
    """Rows of parameter shards for the optimizer to update, all-gathered into parameters."""

    def __init__(
        self,
        like: list[torch.Tensor],
        group,
        size: int,
        index: int,
        *,
        bucket_bytes: int = 25 * 2**20,
        first_bucket_bytes: int = 2**20,
    ):
        self._group, self.size, self.index = GroupRef(group), size, index
        if size > 1:
            check_layout(like, [group], "pardist.optim.sharded")
        self.buckets, self.columns = flat_layout(like, size, bucket_bytes, first_bucket_bytes)
        self.arena = None
        if size > 1 and all(b.device.type == "cpu" for b in self.buckets):
            offset = 0
            for b in self.buckets:
                b.arena_offset = offset
                offset += -(-b.numel * b.dtype.itemsize // ALIGN) * ALIGN
            self.arena = SharedMemoryGroup.create(group, offset)
        for b in self.buckets:
            if self.arena is not None:
                b.buffer = self.arena.view(index, b.arena_offset, b.numel, b.dtype)
            else:
                b.buffer = torch.zeros(b.numel, dtype=b.dtype, device=b.device)

    def shards(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copy this rank's shard of each parameter into its row; return views of the row."""
        out = []
        for p, col in zip(params, self.columns):
            start, stop = shard_range(col.numel, self.size, self.index)
            row = _block(self.buckets[col.bucket], self.size)[self.index]
            view = row[col.offset : col.offset + stop - start]
            view.copy_(p.detach().reshape(-1)[start:stop])
            out.append(view)
        return out

    def gather(self, params: list[torch.Tensor], in_place: bool) -> list[torch.Tensor]:
        """All-gather the updated rows; write full parameters (into ``params`` if in place)."""
        sources = []
        if self.arena is not None:
            self.arena.barrier(("pardist.optim.sharded (gathering parameters)",))  # rows written
            for b in self.buckets:
                sources.append(self.arena.diagonal(b.arena_offset, b.row, b.dtype))
        else:
            agree("pardist.optim.sharded (gathering parameters)", self._group.get())
            for b in self.buckets:
                block = _block(b, self.size)
                all_gather_into(block.view(-1), block[self.index].clone(), group=self._group.get())
                sources.append(block)
        out = []
        for p, col in zip(params, self.columns):
            if p.is_contiguous():
                target = p if in_place else torch.empty_like(p)
                unpack_column(sources[col.bucket], col, target.view(-1))
            else:  # shards are in logical order; the parameter keeps its layout (channels_last)
                flat = torch.empty(p.numel(), dtype=p.dtype, device=p.device)
                unpack_column(sources[col.bucket], col, flat)
                target = p if in_place else torch.empty_like(p)
                target.copy_(flat.view(p.shape))
            out.append(target)
        if self.arena is not None:
            self.arena.barrier()  # nobody rewrites a row another rank still reads
        return out
