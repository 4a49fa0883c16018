"""How FSDP units move: all-gathered before use, their gradients reduce-scattered after.

A unit's parameters use ``pardist._zero``'s layout: each flattened parameter is
cut into ``size`` chunks (torch.chunk's rule), and rank k's *row* holds its chunk
of every parameter of the unit side by side. All-gathering the rows gives the
``(size, row)`` block, from which each parameter is copied out into one flat
buffer per unit, parameter after parameter, so that every full parameter is a
contiguous view of it. Gradients go the other way: packed into a ``(size, row)``
block already divided by the number of ranks, then reduce-scattered, so that each
rank keeps its row: its shard of every mean gradient. With a replica axis (HSDP)
that row is then all-reduced across the replicas.

Between CPU ranks of one host the gathered parameters live in shared memory
(``_shm``): a few *slots*, each the size of the largest unit and its own mapping,
which every rank maps. To gather a unit, every rank copies its own shard of each
parameter to its place in a free slot, and after a barrier the slot *is* the full
buffer, on every rank: 1/N of the unit copied per rank, and nothing copied out. A
slot is free when nothing refers to its memory any more (its storage's use count:
a view kept anywhere, by autograd or a module, keeps it busy), checked after a
barrier, by which every rank has let go of what it was done with (all run the same
program). If the ranks do not choose the same free slot (or none is left), that
gather goes through the backend instead. A
reduce-scatter works on pieces of a few MB, so its shared area stays small: pack,
barrier, sum my row of the piece over every rank, barrier. Elsewhere the
backend's all-gather (started early: prefetch) and reduce-scatter do the same,
with a copy out of the gathered rows.

Each collective carries a tag naming its unit (in the barrier's exchange, or as
one extra element of each gathered row), so ranks that run different modules
fail at once, naming them, instead of mixing up parameters.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from pardist.runtime import GroupRef, collective_starts, storage_holders
from pardist.transport import (
    ALIGN,
    SharedMemoryGroup,
    agree,
    all_gather_into,
    flat_layout,
    reduce_scatter_into,
    shard_range,
    unpack_column,
)

__all__ = ["Layout", "Pool", "Transport"]

PIECE_BYTES = 8 * 2**20  # a reduce-scatter's block is processed this many bytes at a time
SLOTS = 4  # shared gathered units: the root, a parent, a child, and the one just freed
_CODE = 10**6  # an exchanged value: tag * _CODE + the slots chosen


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Layout:
    """One unit's parameters laid out for collectives, per (dtype, device) bucket."""

    def __init__(self, shapes: list, dtypes: list, device: torch.device, size: int, index: int):
        # zero-stride stand-ins: flat_layout reads numel, dtype and device only
        like = [torch.zeros((), dtype=d, device=device).expand(s) for s, d in zip(shapes, dtypes)]
        self.buckets, self.columns = flat_layout(like, size, 1 << 62, 1 << 62)
        self.size, self.index = size, index
        self.starts = [0] * len(like)  # offset of each parameter in its bucket's full buffer
        self.full = []  # numel of each bucket's full buffer
        for bucket in self.buckets:
            offset = 0
            for i in sorted(bucket.slots):
                self.starts[i] = offset
                offset += self.columns[i].numel
            self.full.append(offset)
        self.ranges = [shard_range(c.numel, size, index) for c in self.columns]


class Pool:
    """Reusable flat buffers: a fresh 100 MB tensor per use would page-fault for ~100 ms.

    A buffer is free again once nothing but the pool refers to its storage (the
    views handed out keep it busy). Free buffers too small for a request are
    dropped before a new one is made, so the pool holds no more than the most
    that was in use at once.
    """

    def __init__(self):
        self._buffers: dict[tuple, list[torch.Tensor]] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        kept = self._buffers.setdefault((dtype, device), [])
        free = [b for b in kept if storage_holders(b) <= 1]
        fits = [b for b in free if b.numel() >= numel]
        if fits:
            return min(fits, key=torch.Tensor.numel)[:numel]
        kept[:] = [b for b in kept if all(b is not f for f in free)]
        kept.append(torch.empty(numel, dtype=dtype, device=device))
        return kept[-1][:numel]


@dataclasses.dataclass
class _Pending:
    """A gather: in flight (backend), or done in shared slots (then ``work`` holds the views)."""

    layout: Layout
    tag: int
    work: list  # per bucket: (handle, block, my row) in flight, or the full buffer (shared)
    shared: bool = False


class Transport:
    """All-gathers and reduce-scatters of units over one group (the FSDP axis).

    Args:
        group: the process group of the sharding axis.
        outer: groups of the other data-parallel axes (HSDP replicas), reduced after.
        divisor: ranks the gradient mean is over (all data-parallel axes).
        layouts: every unit's layout, to size the shared-memory area.
        names: unit names, for mismatch errors (tag k names unit k - 1).
    """

    def __init__(self, group, size: int, index: int, outer: list, divisor: int, layouts, names):
        self._group, self._outer = GroupRef(group), [GroupRef(g) for g in outer]
        self.size, self.index, self.divisor, self.names = size, index, divisor, names
        self.pool, self._grads = Pool(), Pool()
        buckets = [(b, full) for lay in layouts for b, full in zip(lay.buckets, lay.full)]
        self.arena, self.slots = None, []
        if size > 1 and buckets and all(b.device.type == "cpu" for b, _ in buckets):
            block = max(_aligned(b.numel * b.dtype.itemsize) for b, _ in buckets)
            self.piece_bytes = _aligned(min(block, max(PIECE_BYTES, size * ALIGN)))
            self.arena = SharedMemoryGroup.create(group, self.piece_bytes)
        if self.arena is not None:
            # One mapping per slot: its storage's use count says whether it is in use.
            slot = max(_aligned(full * b.dtype.itemsize) for b, full in buckets)
            self.slots = [SharedMemoryGroup.create(group, 0, slot) for _ in range(SLOTS)]
            self.slots = [g for g in self.slots if g is not None]
            self._idle = [storage_holders(g._data) for g in self.slots]

    # -- checks -----------------------------------------------------------------------------
    def _exchange(self, value: int) -> list[int]:
        return self.arena.exchange(value)

    def _barrier(self) -> None:
        self.arena.barrier()

    def _check(self, tags: list[int], what: str) -> None:
        if len(set(tags)) > 1:

            def name(t: int) -> str:
                return self.names[t - 1] if 0 < t <= len(self.names) else f"unit #{t}"

            seen = ", ".join(f"rank {k}: {name(t)!r}" for k, t in enumerate(tags))
            raise RuntimeError(
                f"pardist.fsdp: at one {what}, the ranks of the sharding axis gathered "
                f"different units ({seen}, as group ranks). Every rank must run the same "
                "modules in the same order (no data-dependent control flow around "
                "modules), so that each collective has the same unit on every rank."
            )

    # -- all-gather ---------------------------------------------------------------------------
    def start_gather(self, layout: Layout, tag: int, shards: list[torch.Tensor]) -> _Pending:
        """Start gathering a unit from this rank's flat shards (finish with :meth:`finish`)."""
        collective_starts("pardist.fsdp's parameter gather")
        if self.slots:
            shared = self._gather_shared(layout, tag, shards)
            if shared is not None:
                return shared
        agree("pardist.fsdp's parameter gather", self._group.get())  # (gloo: transport.agree)
        work = []
        for bucket in layout.buckets:
            mine = self.pool.get(bucket.row + 1, bucket.dtype, bucket.device)
            for i in bucket.slots:
                start, stop = layout.ranges[i]
                offset = layout.columns[i].offset
                mine[offset : offset + stop - start].copy_(shards[i].reshape(-1))
            mine[bucket.row] = _small(tag)  # checked after the gather: one per rank's row
            block = self.pool.get(self.size * (bucket.row + 1), bucket.dtype, bucket.device)
            handle = all_gather_into(block, mine, group=self._group.get(), async_op=True)
            work.append((handle, block, mine))
        return _Pending(layout, tag, work)

    def _gather_shared(self, layout: Layout, tag: int, shards: list) -> _Pending | None:
        # After this barrier every rank has let go of the units it was done with.
        self._barrier()
        free = [k for k, g in enumerate(self.slots) if storage_holders(g._data) <= self._idle[k]]
        chosen = free[: len(layout.buckets)] if len(free) >= len(layout.buckets) else []
        views = []
        for bucket, full, k in zip(layout.buckets, layout.full, chosen):
            view = _own(self.slots[k].common(0, full, bucket.dtype))
            for i in bucket.slots:  # my shard of each parameter, at its place in the slot
                start, stop = layout.ranges[i]
                at = layout.starts[i]
                view[at + start : at + stop].copy_(shards[i].reshape(-1))
            views.append(view)
        code = sum((k + 1) * (SLOTS + 1) ** j for j, k in enumerate(chosen))
        codes = self._exchange(tag * _CODE + code)  # the barrier: every shard is in place
        self._check([c // _CODE for c in codes], "gather")
        if not chosen or len(set(codes)) > 1:
            return None  # the ranks do not agree on free slots: the backend gathers this one
        return _Pending(layout, tag, views, shared=True)

    def release(self, pending: _Pending) -> None:
        """The gather's buffers are no longer ours (a slot is free once nothing refers to it)."""
        pending.work = []

    def finish(self, pending: _Pending) -> list[torch.Tensor]:
        """Wait for a gather; return each bucket's full flat buffer (parameter after parameter)."""
        if pending.shared:
            return list(pending.work)
        layout, out = pending.layout, []
        for bucket, full_numel, (handle, block, _) in zip(
            layout.buckets, layout.full, pending.work
        ):
            handle.wait()
            block = block.view(self.size, bucket.row + 1)
            small, tags = _small(pending.tag), block[:, bucket.row].tolist()
            self._check([pending.tag if t == small else int(t) for t in tags], "gather")
            source = block[:, : bucket.row]
            full = self.pool.get(full_numel, bucket.dtype, bucket.device)
            for i in bucket.slots:
                col = layout.columns[i]
                unpack_column(source, col, full[layout.starts[i] : layout.starts[i] + col.numel])
            out.append(full)
        pending.work = []
        return out

    # -- reduce-scatter -------------------------------------------------------------------------
    def reduce_scatter(self, layout: Layout, tag: int, grads: list) -> list[torch.Tensor]:
        """This rank's flat shard of each mean gradient (None: unused, contributes zero)."""
        shards: list = [None] * len(layout.columns)
        for group in ([self._group] if self.arena is None else []) + list(self._outer):
            agree("pardist.fsdp's gradient reduce-scatter", group.get())
        for bucket in layout.buckets:
            out = self._grads.get(bucket.row, bucket.dtype, bucket.device)
            itemsize = bucket.dtype.itemsize
            width = max(1, self._piece_bytes(bucket) // (self.size * itemsize))
            for lo in range(0, bucket.row, width):
                hi = min(bucket.row, lo + width)
                if self.arena is not None:
                    piece = self.arena.view(self.index, 0, self.size * (hi - lo), bucket.dtype)
                    piece = piece.view(self.size, hi - lo)
                else:
                    piece = self.pool.get(self.size * (hi - lo), bucket.dtype, bucket.device)
                    piece = piece.view(self.size, hi - lo)
                self._pack(layout, bucket, piece, grads, lo, hi)
                self._reduce_piece(piece, out[lo:hi], tag, itemsize)
            for group in self._outer:
                dist.all_reduce(out, group=group.get())
            for i in bucket.slots:
                start, stop = layout.ranges[i]
                offset = layout.columns[i].offset
                shards[i] = out[offset : offset + stop - start]
        return shards

    def _piece_bytes(self, bucket) -> int:
        return self.piece_bytes if self.arena is not None else PIECE_BYTES

    def _pack(self, layout: Layout, bucket, piece: torch.Tensor, grads, lo: int, hi: int) -> None:
        """Columns [lo, hi) of the unit's (size, row) gradient block, divided, into ``piece``."""
        for i in bucket.slots:  # their columns tile the row: every column is written
            col = layout.columns[i]
            a, b = max(lo, col.offset), min(hi, col.offset + col.chunk)
            if a >= b:
                continue
            dst = piece[:, a - lo : b - lo]
            g = grads[i]
            if g is None:
                dst.zero_()
            else:
                _pack_window(dst, g.reshape(-1), col.chunk, col.numel, a - col.offset, self.divisor)

    def _reduce_piece(self, piece: torch.Tensor, out: torch.Tensor, tag: int, itemsize: int):
        if self.arena is None:
            reduce_scatter_into(out, piece.view(-1), group=self._group.get())
            return
        codes = self._exchange(tag * _CODE)  # every rank's piece is written
        self._check([c // _CODE for c in codes], "reduce-scatter")
        width = piece.shape[1]
        base = self.index * width * itemsize
        parts = [self.arena.view(k, base, width, out.dtype) for k in range(self.size)]
        torch.add(parts[0], parts[1], out=out)  # rank order: the same sum on every rank
        for part in parts[2:]:
            out.add_(part)
        self._barrier()  # nobody rewrites its piece while another rank still reads it


def _own(view: torch.Tensor) -> torch.Tensor:
    """The same memory as a tensor of its own, not a view of the shared mapping.

    Every write into the mapping bumps the version counter its views share, and
    autograd refuses views whose base was modified; a slot is written only while
    no view of its earlier contents is in use, which autograd cannot see.
    """
    out = torch.empty(0, dtype=view.dtype, device=view.device)
    with torch.no_grad():
        return out.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def _small(tag: int) -> int:
    """A tag that every float dtype holds exactly (bf16: integers up to 256)."""
    return (tag - 1) % 200 + 1


def _pack_window(dst: torch.Tensor, flat: torch.Tensor, chunk: int, numel: int, lo: int, scale):
    """Columns [lo, lo + width) of a parameter's (size, chunk) block, divided by ``scale``.

    Row k of the block is the parameter's chunk k (``pardist.transport._scatter._pack`` writes
    whole blocks; this writes a window of one, zero past the parameter's end).
    """
    width = dst.shape[1]
    full, rest = divmod(numel, chunk)
    if full:
        torch.div(flat[: full * chunk].view(full, chunk)[:, lo : lo + width], scale, out=dst[:full])
    if full < dst.shape[0]:
        n = max(0, min(width, rest - lo))
        if n:
            torch.div(flat[full * chunk + lo : full * chunk + lo + n], scale, out=dst[full, :n])
        dst[full, n:].zero_()
        dst[full + 1 :].zero_()
