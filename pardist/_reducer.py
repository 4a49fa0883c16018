"""The gradient mean of data parallelism, bucketed, as torch DDP's Reducer does it.

Gradients arrive from the backward pass one tensor at a time, roughly in reverse
parameter order. Each is divided by the number of contributions and written
into a persistent flat bucket (~25 MB, the first ~1 MB so that communication can
start early); a full bucket is all-reduced asynchronously while the backward
goes on (``overlap``), always in bucket order so every rank issues the same
collectives in the same order. The returned gradients are views of the buckets.

Buckets are reused from step to step: a fresh 100 MB buffer per step costs page
faults that dwarf the reduction. A bucket whose storage is still referenced by a
caller (who kept last step's gradients) is left to the caller and replaced, so
reuse never changes a value anyone can see.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from pardist._shm import SharedMemoryAllReduce

__all__ = ["Reducer"]

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _in_use(t: torch.Tensor) -> bool:
    if _use_count is None:
        return True  # cannot tell: never reuse
    # The tensor itself and the temporary storage object hold two references.
    return _use_count(t.untyped_storage()._cdata) > 2


@dataclasses.dataclass
class _Slot:
    bucket: int
    offset: int
    numel: int
    shape: torch.Size


class _Bucket:
    def __init__(self, dtype: torch.dtype, device: torch.device, comm_dtype: torch.dtype | None):
        self.dtype, self.device, self.comm_dtype = dtype, device, comm_dtype
        self.numel = 0
        self.slots: list[int] = []
        self.buffer: torch.Tensor | None = None
        self.comm: torch.Tensor | None = None
        self.pending = 0
        self.work = None

    def acquire(self) -> None:
        if self.buffer is None or _in_use(self.buffer):
            self.buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        if self.comm_dtype is not None and self.comm is None:
            self.comm = torch.empty(self.numel, dtype=self.comm_dtype, device=self.device)
        self.pending = len(self.slots)
        self.work = None


class Reducer:
    """Averages one fixed list of gradient tensors over process groups, in buckets.

    Args:
        like: tensors shaped like the gradients (the parameters), in their order.
        groups: process groups to reduce over, innermost first (hierarchical).
        divisor: the number of ranks the mean is over.
        comm_dtype: communicate in this dtype (bf16 / fp16 compression), or None.
        overlap: launch each bucket's all-reduce as soon as it is full.
    """

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
        self.groups, self.divisor, self.overlap = groups, divisor, overlap
        self.buckets: list[_Bucket] = []
        self.slots: list[_Slot] = [None] * len(like)  # type: ignore[list-item]
        open_by_kind: dict[tuple, int] = {}
        # Reverse order: the last layers' gradients are ready first.
        for i in reversed(range(len(like))):
            t = like[i]
            kind = (t.dtype, t.device)
            b = open_by_kind.get(kind)
            cap = first_bucket_bytes if len(self.buckets) == 0 or b == 0 else bucket_bytes
            if b is None or self.buckets[b].numel * t.element_size() >= cap:
                cd = comm_dtype if comm_dtype is not None and t.is_floating_point() else None
                self.buckets.append(_Bucket(t.dtype, t.device, cd if cd != t.dtype else None))
                b = open_by_kind[kind] = len(self.buckets) - 1
            bucket = self.buckets[b]
            self.slots[i] = _Slot(b, bucket.numel, t.numel(), t.shape)
            bucket.slots.append(i)
            bucket.numel += t.numel()
        # CPU buckets on one host go through shared memory instead of gloo's loopback TCP.
        self._shm = None
        if groups and any(b.device.type == "cpu" for b in self.buckets):
            largest = max(b.numel * (b.comm_dtype or b.dtype).itemsize for b in self.buckets)
            self._shm = SharedMemoryAllReduce.for_group(groups[0], largest)
        self._written = [False] * len(like)
        self._next = 0
        self._last = True
        self._scale = 1.0

    def begin(self, micro_batches: int = 1) -> None:
        """Start one gradient computation of ``micro_batches`` backward passes."""
        for bucket in self.buckets:
            bucket.acquire()
        self._written = [False] * len(self.slots)
        self._next = 0
        self._scale = self.divisor * micro_batches
        self._last = micro_batches == 1

    def last_micro_batch(self) -> None:
        """The next backward pass is the last: its gradients complete the buckets."""
        self._last = True

    def _view(self, i: int) -> torch.Tensor:
        slot = self.slots[i]
        flat = self.buckets[slot.bucket].buffer
        return flat.narrow(0, slot.offset, slot.numel).view(slot.shape)

    def add(self, i: int, grad: torch.Tensor) -> None:
        """Contribute the local gradient of tensor ``i`` (called from the backward)."""
        view = self._view(i)
        if self._written[i]:
            view.add_(grad.reshape(view.shape), alpha=1.0 / self._scale)
        else:
            torch.div(grad.reshape(view.shape), self._scale, out=view)
            self._written[i] = True
        if self._last:
            bucket = self.buckets[self.slots[i].bucket]
            bucket.pending -= 1
            if self.overlap and bucket.pending == 0:
                self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        if not self.groups:
            return
        data = bucket.buffer
        if bucket.comm is not None:
            bucket.comm.copy_(data)
            data = bucket.comm
        if self._shm is not None and data.device.type == "cpu":
            self._shm.all_reduce(data)
        else:
            bucket.work = dist.all_reduce(data, group=self.groups[0], async_op=True)

    def finish(self) -> list[torch.Tensor]:
        """Reduce whatever is left, wait, and return the averaged gradients."""
        for i, written in enumerate(self._written):
            if not written:  # unused on this rank: it contributes zero
                self._view(i).zero_()
        for bucket in self.buckets:
            bucket.pending = 0
        self._launch_ready()
        for bucket in self.buckets:
            data = bucket.buffer if bucket.comm is None else bucket.comm
            if bucket.work is not None:
                bucket.work.wait()
            for group in self.groups[1:]:  # outer axes, after the inner one
                dist.all_reduce(data, group=group)
            if bucket.comm is not None:
                bucket.buffer.copy_(bucket.comm)
        return [self._view(i) for i in range(len(self.slots))]
