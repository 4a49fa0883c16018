"""The gradient mean of data parallelism, bucketed, as torch DDP's Reducer does it.

Gradients arrive from the backward pass one tensor at a time, roughly in reverse
parameter order. Each is divided by the number of contributions and written
into a persistent flat bucket (~25 MB, the first ~1 MB so that communication can
start early); a full bucket is all-reduced asynchronously while the backward
goes on (``overlap``), always in bucket order so every rank issues the same
collectives in the same order. The returned gradients are views of the buckets
with their parameters' strides (channels_last stays channels_last), as DDP's are.

Buckets are reused from step to step: a fresh 100 MB buffer per step costs page
faults that dwarf the reduction. A bucket whose storage is still referenced by a
caller (who kept last step's gradients) is left to the caller and replaced, so
reuse never changes a value anyone can see.

For CPU ranks on one host the buckets live in shared memory (``_shm``): each
rank writes its gradients into its own region, each sums its 1/N chunk of every
rank's copy into one common result that all of them read, with no copy in or
out. Those gradients are then one memory seen by every rank of the host, so an
in-place change to them would change every rank's; pardist never makes one, and
the next step raises if a caller did. Where /dev/shm is short of room buckets
are staged through a smaller shared region; elsewhere gloo or nccl reduce.
"""

from __future__ import annotations

import itertools
import operator
import os

import torch
import torch.distributed as dist

from pardist.runtime import (
    GroupRef,
    _faults,
    _tree,
    dense_strides,
    flatten_dense,
    storage_holders,
    views_of,
)
from pardist.transport._agree import agree
from pardist.transport._buckets import Bucket, Slot, assign, check_layout
from pardist.transport._shm import ALIGN, SharedMemoryGroup

__all__ = ["Reducer"]

# How many tensors hold a storage: 1 for a lone tensor, on every torch version.
_references = storage_holders


_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")
# The largest mean gradient (bytes) of a bucket that add_many writes by one concatenation:
# about where a second pass over it costs what the calls per gradient it saves cost.
_CONCAT_BYTES = 32 * 1024


class Reducer:
    """Averages one fixed list of gradient tensors over process groups, in buckets.

    Args:
        like: tensors shaped like the gradients (the parameters), in their order.
        groups: process groups to reduce over, innermost first (hierarchical).
        divisor: the number of ranks the mean is over.
        comm_dtype: communicate in this dtype (bf16 / fp16 compression), or None.
        overlap: launch each bucket's all-reduce as soon as it is full.
    """

    _common_result = True  # shared-memory buckets reduce into one result all ranks read

    def __init__(
        self,
        like: list[torch.Tensor],
        groups: list,
        divisor: int,
        *,
        comm_dtype: torch.dtype | None = None,
        overlap: bool = False,
        bucket_bytes: int = 25 * 2**20,
        first_bucket_bytes: int = 2**20,
    ):
        self._groups = [GroupRef(g) for g in groups]  # by name: never keeps a group alive
        self.divisor, self.overlap = divisor, overlap
        check_layout(like, groups, "pardist.grad")
        self._build(like, comm_dtype, bucket_bytes, first_bucket_bytes)
        self.arena = self.staging = None
        if groups:
            self._share_cpu_buckets(groups[0])
        self._written = [False] * len(like)
        self._next = 0
        self._last = True
        self._scale = 1.0

    @property
    def groups(self) -> list:
        return [ref.get() for ref in self._groups]

    def _build(self, like, comm_dtype, bucket_bytes: int, first_bucket_bytes: int) -> None:
        self.buckets, places = assign(
            like, lambda t: t.numel(), 1, comm_dtype, bucket_bytes, first_bucket_bytes
        )
        self.slots = [
            Slot(b, offset, t.numel(), t.shape, dense_strides(t))
            for (b, offset), t in zip(places, like)
        ]
        for bucket in self.buckets:  # its slots in the order they lie in it
            bucket.shapes = [self.slots[i].shape for i in bucket.slots]
            # Where every slot is laid out row-major (and none is empty), the bucket is its
            # gradients flattened and concatenated: finish takes the slots' views in one
            # call, and add_many writes a bucket of small slots by one concatenation (it
            # costs a second pass over the bucket, which pays only where the four calls
            # per gradient it saves cost more).
            metas = [torch.empty(self.slots[i].shape, device="meta") for i in bucket.slots]
            row_major = all(
                self.slots[i].stride == meta.stride() and meta.numel() > 0
                for i, meta in zip(bucket.slots, metas)
            )
            bucket.metas = metas if row_major else []
            small = bucket.numel * bucket.dtype.itemsize <= _CONCAT_BYTES * len(bucket.slots)
            bucket.concatenated = row_major and small

    def _share_cpu_buckets(self, group) -> None:
        """Put CPU buckets in shared memory if the group shares a host (else None)."""
        cpu = [b for b in self.buckets if b.device.type == "cpu"]
        if not cpu:
            return
        if all(b.comm_dtype is None for b in cpu) and os.environ.get("PARDIST_SHM") != "staging":
            offset = 0
            for b in cpu:
                b.arena_offset = offset
                offset += -(-b.numel * b.dtype.itemsize // ALIGN) * ALIGN
            # One common result, unless an outer axis must reduce it further in place.
            common = self._common_result and len(self._groups) == 1
            self.arena = SharedMemoryGroup.create(group, offset, offset if common else 0)
            if self.arena is not None:
                for b in cpu:
                    b.common_offset = b.arena_offset if common else None
                self._idle_references = _references(self.arena._data)
                self._version = self.arena._data._version  # after our own last write
                return
            for b in cpu:
                b.arena_offset = None
        largest = max(b.numel * (b.comm_dtype or b.dtype).itemsize for b in cpu)
        self.staging = SharedMemoryGroup.create(group, largest)

    def begin(self, micro_batches: int = 1, divisor: float | None = None) -> None:
        """Start one gradient computation of ``micro_batches`` backward passes.

        ``divisor`` replaces the number of ranks for this rank's contributions (a
        row-weighted mean divides by total rows / this rank's rows).
        """
        for bucket in self.buckets:
            bucket.buffer = None  # our own views must not count as a caller's
        # Gradients handed out last time are views of the buckets: a caller who
        # still holds any keeps them, and this step reduces in fresh buffers. All
        # ranks must choose alike, or their collectives would not match.
        shared = self.arena is not None and self._may_reuse_arena()
        for bucket in self.buckets:
            bucket.shared = shared and bucket.arena_offset is not None
            if bucket.shared:
                bucket.buffer = self.arena.view(
                    self.arena.index, bucket.arena_offset, bucket.numel, bucket.dtype
                )
            else:
                if bucket.private is None or _references(bucket.private) > 1:
                    bucket.private = torch.empty(
                        bucket.numel, dtype=bucket.dtype, device=bucket.device
                    )
                bucket.buffer = bucket.private
            if bucket.comm_dtype is not None and bucket.comm is None:
                bucket.comm = torch.empty(
                    bucket.numel, dtype=bucket.comm_dtype, device=bucket.device
                )
            bucket.pending = len(bucket.slots)
            bucket.work = None
        self._written = [False] * len(self.slots)
        self._next = 0
        self._scale = (self.divisor if divisor is None else divisor) * micro_batches
        self._headers()
        self._last = micro_batches == 1

    def _headers(self) -> None:
        """The reduction's header over each group that gloo serves (transport._agree)."""
        if not self._groups:
            return
        what = f"pardist.grad's gradient reduction ({len(self.buckets)} buckets)"
        groups = self.groups
        backend = getattr(self, "staging", None) is None and not all(b.shared for b in self.buckets)
        for group in groups if backend else groups[1:]:
            agree(what, group)

    def _may_reuse_arena(self) -> bool:
        """Whether every rank may write the shared buckets again; raises if one was changed."""
        common = any(b.common_offset is not None for b in self.buckets)
        changed = common and self.arena._data._version != self._version
        idle = _references(self.arena._data) <= self._idle_references
        codes = self.arena.exchange(2 * changed + idle, ("pardist.grad (starting a step)",))
        culprits = [k for k, code in enumerate(codes) if code & 2]
        if culprits:
            self._version = self.arena._data._version  # reported once, on every rank
            raise RuntimeError(
                f"pardist.grad: the gradients it returned were changed in place on group "
                f"rank(s) {culprits} (an in-place op such as mul_ or clamp_, or a torch "
                "optimizer stepping on them). Between CPU ranks of one host they are one "
                "shared memory, so the change reached every rank. Transform gradients out "
                "of place (as pardist.optim does), clone them first, or set PARDIST_SHM=0."
            )
        return all(code & 1 for code in codes)

    def last_micro_batch(self) -> None:
        """The next backward pass is the last: its gradients complete the buckets."""
        self._last = True

    def overlaps(self) -> bool:
        """Whether buckets start reducing during the backward (then gradients must be
        added as autograd produces them); shared-memory buckets wait for its end."""
        return self.overlap and any(not b.shared for b in self.buckets)

    def _view(self, i: int) -> torch.Tensor:
        slot = self.slots[i]
        flat = self.buckets[slot.bucket].buffer
        # (not cached: a view kept here would count as a caller's reference to the
        # bucket, and the next step would have to reduce in fresh memory)
        return flat.as_strided(slot.shape, slot.stride, flat.storage_offset() + slot.offset)

    def add(self, i: int, grad: torch.Tensor, divisor: float | None = None) -> None:
        """Contribute the local gradient of tensor ``i`` (called from the backward).

        ``divisor`` (1 for values that must arrive exact) replaces the usual one.
        """
        view = self._view(i)
        scale = self._scale if divisor is None else divisor
        if grad.shape != view.shape:
            grad = grad.reshape(view.shape)
        if self._written[i]:
            view.add_(grad, alpha=1.0 / scale)
        else:
            torch.div(grad, scale, out=view)
            self._written[i] = True
        if self._last:
            bucket = self.buckets[self.slots[i].bucket]
            bucket.pending -= 1
            # Shared-memory buckets wait for the end of the backward: their reduction
            # is a synchronous copy, which would only stall the backward here.
            if self.overlap and bucket.pending == 0 and not bucket.shared:
                self._launch_ready()

    def add_many(self, pairs: list[tuple[int, torch.Tensor]], divided: list = ()) -> None:
        """``add(i, grad)`` for every pair, and ``add(i, t, divisor)`` for every triple of
        ``divided``, after the backward (no hooks).

        A bucket they fill whole, in the last backward with nothing in it yet, whose
        tensors have its dtype and slots' shapes and whose slots are row-major and small,
        is written by one division of their concatenation, then each slot with a divisor
        of its own divided again from its tensor: the numbers of ``add``'s
        division per tensor (the same IEEE division of the same values), in a few calls
        into C instead of four per tensor.
        """
        given = dict(pairs)
        divisors = {}
        for i, t, by in divided:
            given[i], divisors[i] = t, by
        for bucket in self.buckets if self._last else ():
            grads = list(map(given.get, bucket.slots))
            if not (
                bucket.concatenated
                and all(map(operator.is_not, grads, itertools.repeat(None)))  # (not `in`: ==)
                and not any(map(self._written.__getitem__, bucket.slots))
                and all(map(bucket.dtype.__eq__, map(_dtype, grads)))
                and list(map(_shape, grads)) == bucket.shapes
            ):
                continue
            torch.div(flatten_dense(grads), self._scale, out=bucket.buffer)
            for i in divisors.keys() & bucket.slots if divisors else ():
                if divisors[i] != self._scale:
                    torch.div(given[i], divisors[i], out=self._view(i))
            _tree.each(map(self._written.__setitem__, bucket.slots, itertools.repeat(True)))
            _tree.each(map(given.pop, bucket.slots))
            bucket.pending = 0
            if self.overlap and not bucket.shared:
                self._launch_ready()
        for i, grad in given.items():
            if i in divisors:
                self.add(i, grad, divisors[i])
            else:
                self.add(i, grad)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        if not self._groups:
            return
        if bucket.shared and bucket.common_offset is not None:
            bucket.buffer = self.arena.reduce_into(
                bucket.arena_offset, bucket.numel, bucket.dtype, bucket.common_offset
            )
            return
        if bucket.shared:
            self.arena.reduce_in_place(bucket.arena_offset, bucket.numel, bucket.dtype)
            return
        data = bucket.buffer
        if bucket.comm is not None:
            bucket.comm.copy_(data)
            data = bucket.comm
        if self.staging is not None and data.device.type == "cpu":
            self.staging.all_reduce(data, name="pardist.grad's gradient bucket")
        else:
            bucket.work = dist.all_reduce(data, group=self.groups[0], async_op=True)

    def _zero(self, i: int) -> None:
        self._view(i).zero_()

    def _finish_buckets(self) -> None:
        if not all(self._written):
            for i in itertools.compress(itertools.count(), map(operator.not_, self._written)):
                self._zero(i)  # unused on this rank: it contributes zero
        for bucket in self.buckets:
            bucket.pending = 0
        self._launch_ready()
        copied = [b for b in self.buckets if b.shared and b.common_offset is None]
        if self.arena is not None and self._groups and copied:
            self.arena.barrier()  # every rank has copied out before regions are rewritten
        groups = self.groups  # outer axes are reduced after the inner one
        for bucket in self.buckets:
            data = bucket.buffer if bucket.comm is None else bucket.comm
            if bucket.work is not None:
                with _faults.collective_errors("pardist.grad's gradient reduction", groups[0]):
                    bucket.work.wait()
            for group in groups[1:]:
                with _faults.collective_errors("pardist.grad's gradient reduction", group):
                    dist.all_reduce(data, group=group)
            if bucket.comm is not None:
                bucket.buffer.copy_(bucket.comm)
        if self.arena is not None:
            self._version = self.arena._data._version  # what callers change comes after

    def finish(self) -> list[torch.Tensor]:
        """Reduce whatever is left, wait, and return the averaged gradients."""
        self._finish_buckets()
        out: list = [None] * len(self.slots)
        for bucket in self.buckets:
            if bucket.metas:  # row-major slots, one after another: in one call
                for i, view in zip(bucket.slots, views_of(bucket.buffer, bucket.metas)):
                    out[i] = view
            else:
                for i in bucket.slots:
                    out[i] = self._view(i)
        return out
