"""All-reduce through shared memory, for CPU ranks on one host.

gloo moves a CPU all-reduce over loopback TCP; between processes on one machine
that is 2-3x slower than memory allows (measured here: 100 MB in 99 ms with gloo,
51 ms through shared memory). NCCL does the same within a node on GPUs.

Each rank of a group owns one region of a ``/dev/shm`` segment that every rank
maps. To sum a tensor laid out at the same offset in every region, each rank
adds the other regions' copies of its own 1/N chunk into its own region, then
copies every summed chunk from its owner: every rank ends with bit-identical
results, so replicas stay identical. The gradient reducer keeps its buckets
*in* the regions, so gradients are written once and reduced in place.

Ranks synchronise on a sequence counter each, wait on a futex, and post the signature
of their collective: a mismatch raises on every rank (docs/design.md, "The
shared-memory transport"). It relies on x86-64's store ordering, so it is enabled only
there; elsewhere, across network namespaces and when /dev/shm lacks room, gloo is used.
``PARDIST_SHM=0`` turns it off; ``PARDIST_SHM=staging`` stages gradients through a
bucket-sized region (the fallback when /dev/shm is small).
"""

from __future__ import annotations

import os
import platform
import re
import time

import torch
import torch.distributed as dist

from pardist.runtime import _faults
from pardist.transport import _alive, _segments, _stepmark
from pardist.transport._futex import crowded, futex_wait, futex_wake

__all__ = ["SharedMemoryGroup"]

_FLAG_BYTES = 64  # per rank, one cache line: counter, 2 exchange, 2 signature, 1 step slot
_NOTE_BYTES = 256  # per rank: what it was doing, written only when the ranks disagree
_SEQ, _EXCHANGE, _SIGNATURE, _STEP = 0, 1, 3, 5  # int64 slots in a rank's line
ALIGN = 64
_SPIN_S = 20e-6


_SETUP = "pardist: setting up a shared-memory segment"


class SharedMemoryGroup:
    """One ``region_bytes`` region per rank of ``group``, all mapped by every rank,
    and optionally a ``common_bytes`` area that belongs to no rank in particular.

    Create with :meth:`create`, which every rank of the group must call at the
    same point; it returns None where shared memory cannot be used.
    """

    def __init__(
        self,
        region: torch.Tensor,
        index: int,
        ranks: list[int],
        region_bytes: int,
        common_bytes: int,
        group_name: str = "",
        peers: _alive.Peers | None = None,
    ):
        size = len(ranks)
        self.index, self.size, self.region_bytes = index, size, region_bytes
        self.ranks, self.group_name = ranks, group_name
        self._data = region[: size * region_bytes + common_bytes]
        sync = region[size * region_bytes + common_bytes :]
        self._flags = sync[: size * _FLAG_BYTES].view(torch.int64).numpy()
        stride = _FLAG_BYTES // 8
        self._signatures = [self._flags[_SIGNATURE + p :: stride] for p in (0, 1)]  # by parity
        wake = sync[size * _FLAG_BYTES : size * _FLAG_BYTES + 4].view(torch.int32)
        self._wake, self._wake_address = wake.numpy(), wake.data_ptr()
        notes = sync[(size + 1) * _FLAG_BYTES : (size + 1) * _FLAG_BYTES + size * _NOTE_BYTES]
        # (numpy views: written through torch, a note would bump the version counter the
        # segment shares with the gradient arena, whose reuse check would see a change)
        self._notes = notes.view(size, _NOTE_BYTES).numpy()
        self._seq = 0
        self._doing: tuple | None = ("a shared-memory collective",)
        self.timeout = _faults.timeout_seconds()
        self._peers = peers or _alive.Peers([])
        self.show_mark(_stepmark.shown_by(self))

    def show_mark(self, value: int, note: str = "") -> None:
        """Show the other ranks my step mark (``_stepmark``), which their waits read, and
        with it a note (why this rank found the ranks out of step), posted first."""
        if note:
            self._write_note(note)
        self._flags[self.index * (_FLAG_BYTES // 8) + _STEP] = value

    def _write_note(self, text: str) -> None:
        data = text.encode()[: _NOTE_BYTES - 1]
        note = self._notes[self.index]
        note[:] = 0
        note[: len(data)] = list(data)

    def _note(self, k: int) -> str:
        return bytes(self._notes[k]).rstrip(b"\0").decode(errors="replace")

    @staticmethod
    def nbytes(size: int, region_bytes: int, common_bytes: int) -> int:
        """The segment's size: regions, common area, then counters, wake word and notes."""
        return size * region_bytes + common_bytes + (size + 1) * _FLAG_BYTES + size * _NOTE_BYTES

    @classmethod
    def create(
        cls, group: dist.ProcessGroup, region_bytes: int, common_bytes: int = 0
    ) -> SharedMemoryGroup | None:
        size = dist.get_world_size(group)
        region_bytes = -(-region_bytes // ALIGN) * ALIGN
        common_bytes = -(-common_bytes // ALIGN) * ALIGN
        total = cls.nbytes(size, region_bytes, common_bytes)
        enabled = (
            size > 1
            and platform.machine().lower() in ("x86_64", "amd64")
            and os.environ.get("PARDIST_SHM", "1") != "0"
        )
        ids: list = [None] * size
        layout = (region_bytes, common_bytes)
        with _faults.collective_errors(_SETUP, group):
            mine = (enabled, _alive.host(), layout, _alive.me())
            dist.all_gather_object(ids, mine, group=group)
        ranks = dist.get_process_group_ranks(group)
        if len({theirs for _, _, theirs, _ in ids}) != 1:
            sizes = ", ".join(f"rank {r}: {theirs}" for r, (_, _, theirs, _) in zip(ranks, ids))
            raise _faults.CollectiveMismatch(
                "pardist: the ranks of "
                f"{_faults.describe_group(group.group_name, ranks)} asked for shared-memory "
                f"regions of different sizes (bytes per rank, common: {sizes}): they hold "
                "different tensors to reduce. Every rank must pass the same parameter tree."
            )
        if not all(ok for ok, *_ in ids) or len({host for _, host, *_ in ids}) != 1:
            return None
        region = _segments.map_shared(group, total, _SETUP)
        if region is None:
            return None
        index = dist.get_rank(group)
        peers = _alive.Peers([proc for *_, proc in ids])
        return cls(region, index, ranks, region_bytes, common_bytes, group.group_name, peers)

    def view(self, rank: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at byte ``offset`` of ``rank``'s region."""
        start = rank * self.region_bytes + offset
        return self._data[start : start + numel * dtype.itemsize].view(dtype)

    def common(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at byte ``offset`` of the common area."""
        start = self.size * self.region_bytes + offset
        return self._data[start : start + numel * dtype.itemsize].view(dtype)

    def barrier(self, what: tuple | None = None) -> None:
        """Wait for every rank of the group; raise if they were not all doing ``what``.

        ``what`` names the collective this barrier starts (``(name, dtype, shape)``);
        the barriers within a collective pass None. Ranks that disagree all raise
        :class:`~pardist.runtime._faults.CollectiveMismatch`, naming what each was doing.
        """
        stride, parity = _FLAG_BYTES // 8, self._seq % 2
        sig, flags = _stepmark.signature(what), self._flags
        # Posted before the counter (x86 keeps store order), read before the next
        # barrier: a rank that hurries on writes the other slot, as exchange() does.
        flags[self.index * stride + _SIGNATURE + parity] = sig
        if what is not None:
            self._doing = what
        self._seq += 1
        self._wait(self._seq)
        if self._signatures[parity].tolist().count(sig) != self.size:
            self._disagree(what)

    def _wait(self, seq: int) -> None:
        flags, stride = self._flags, _FLAG_BYTES // 8
        flags[self.index * stride + _SEQ] = seq
        arrived = lambda: all(flags[k * stride] >= seq for k in range(self.size))  # noqa: E731
        if arrived():  # the last to arrive wakes the sleepers
            self._wake[0] = (int(self._wake[0]) + 1) % 2**31
            futex_wake(self._wake_address)
            return
        start = time.monotonic()
        while time.monotonic() - start < _SPIN_S and not crowded(start):
            if arrived():
                return
        while True:
            word = int(self._wake[0])
            if arrived():  # checked after reading the word: a wake-up cannot slip between
                return
            waited = time.monotonic() - start
            if waited > self.timeout:
                late = [self.ranks[k] for k in range(self.size) if flags[k * stride] < seq]
                where = _faults.describe_group(self.group_name, self.ranks)
                doing = f"{_stepmark.describe(self._doing)} over {where}"
                raise _faults.CollectiveTimeout(
                    f"pardist: {doing} (shared memory) waited {self.timeout:.0f} s on rank "
                    f"{self.ranks[self.index]}. {_faults.hint(late)}",
                    late,
                    doing,
                )
            self._check_step(seq)
            self._check_alive(seq)
            futex_wait(self._wake_address, word, min(0.1, self.timeout - waited + 1e-3))

    def _check_alive(self, seq: int) -> None:
        """While waiting: is a rank I wait for gone (killed, exited)? Say so now."""
        flags, stride = self._flags, _FLAG_BYTES // 8
        gone = self._peers.gone([k for k in range(self.size) if flags[k * stride] < seq])
        if gone is None:
            return
        where = _faults.describe_group(self.group_name, self.ranks)
        doing = f"{_stepmark.describe(self._doing)} over {where}"
        raise self._peers.lost(gone, self.ranks, self.index, doing)

    def _check_step(self, seq: int) -> None:
        """While waiting: has a rank left this call of the step behind, or found the ranks
        out of step? Then the ones it waits for will not come: say so now, not at timeout."""
        mine, flags, stride = _stepmark.now(), self._flags, _FLAG_BYTES // 8
        for k in range(self.size):
            # Its mark first, then its arrival: a rank posts arrival before it moves on,
            # so one that arrived and left since is seen to have arrived (not as gone).
            did = _stepmark.departure(mine, int(flags[k * stride + _STEP]))
            if k == self.index or did is None or flags[k * stride] >= seq:
                continue
            me, doing = self.ranks[self.index], _stepmark.describe(self._doing)
            if did == _stepmark.FOUND:  # its reason, with the real calls
                _stepmark.out_of_step(f"pardist: rank {self.ranks[k]} {did}: {self._note(k)}")
            if did == _stepmark.WAITS:  # the collective it waits in, after its last call
                _stepmark.out_of_step(
                    _stepmark.fewer_calls(self.ranks[k], self._note(k), me, doing)
                )
            _stepmark.out_of_step(
                f"pardist: rank {self.ranks[k]} {did} while rank {me} waits in {doing}"
                + (f" of call {_stepmark.call_of(mine)}" if mine else "")
                + ": a rank raised inside a call and went on. To skip a bad batch, decide on "
                "every rank together, before the step (docs/faults.md).",
            )

    def _disagree(self, what: tuple | None) -> None:
        """Every rank saw the same differing signatures: post what I was doing, read theirs."""
        mark = _stepmark.now()
        call = f" in call {_stepmark.call_of(mark)} of a step" if mark > 0 else ""
        self._write_note(_stepmark.describe(what) + call)
        with _stepmark.unmarked():  # (the ranks' marks may differ: this must pair anyway)
            self.barrier(("pardist: comparing what each rank was doing",))
        doing = [self._note(k) for k in range(self.size)]
        listing = "; ".join(f"rank {r}: {d}" for r, d in zip(self.ranks, doing))
        where = _faults.describe_group(self.group_name, self.ranks)
        if len({re.sub(r" in call \d+ of a step$", "", d) for d in doing}) == 1:
            raise _faults.StepMismatch(  # the same collective, in different calls of a step
                f"pardist: the ranks of {where} are at different calls of a step ({listing}): "
                "a rank raised inside a call and went on, and the collectives would pair one "
                "step apart, so every rank stops here. To skip a bad batch, decide on every "
                "rank together, before the step (docs/faults.md)."
            )
        raise _faults.CollectiveMismatch(
            f"pardist: the ranks of {where} are not in the same collective, or gave it "
            f"different shapes or dtypes ({listing}); the values it would return are "
            "meaningless, so every rank stops here. Every rank must call the same "
            "collectives, in the same order, with the same shapes and dtypes (for "
            "per-rank lengths, gather with pardist.gather)."
        )

    def exchange(self, value: int, what: tuple = ("an exchange of flags",)) -> list[int]:
        """Every rank's ``value`` (a small int), in group rank order (costs one barrier).

        Calls alternate between two slots, so a rank that hurries on to the next
        call cannot overwrite a value a slower rank has yet to read: reaching the
        slot again takes another barrier, which waits for the slow rank.
        """
        stride, slot = _FLAG_BYTES // 8, _EXCHANGE + self._seq % 2
        self._flags[self.index * stride + slot] = int(value)
        self.barrier(what)
        return [int(self._flags[k * stride + slot]) for k in range(self.size)]

    def agree(self, flag: bool, what: tuple = ("an agreement",)) -> bool:
        """True if ``flag`` is true on every rank of the group (costs one barrier)."""
        return all(self.exchange(int(flag), what))

    def reduce_in_place(
        self,
        offset: int,
        numel: int,
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
        op: str = "sum",
        gather: bool = True,
        what: tuple | None = None,
    ) -> None:
        """Sum the tensors at ``offset`` of every region into ``out`` (default: my region).

        Two barriers: after everyone has written, and after every chunk is
        summed. A region may be rewritten only after the *next* barrier (the
        next call's first, or :meth:`barrier`), when every rank has copied out.
        With ``gather=False`` it is a reduce-scatter: each rank's own chunk of its
        region ends up summed, and the rest is left as it was.
        """
        n, me = self.size, self.index
        bounds = [numel * k // n for k in range(n + 1)]
        regions = [self.view(k, offset, numel, dtype) for k in range(n)]
        self.barrier(what or ("a shared-memory reduction", dtype, (numel,), offset, op, gather))
        lo, hi = bounds[me], bounds[me + 1]
        mine = regions[me][lo:hi]
        combine = mine.add_ if op == "sum" else lambda other: torch.maximum(mine, other, out=mine)
        for k in range(n):  # each chunk is combined once, by its owner: identical everywhere
            if k != me:
                combine(regions[k][lo:hi])
        if not gather:
            return
        self.barrier()
        target = regions[me] if out is None else out.view(-1)
        for k in range(n):
            if k != me or out is not None:
                target[bounds[k] : bounds[k + 1]].copy_(regions[k][bounds[k] : bounds[k + 1]])

    def reduce_into(self, offset: int, numel: int, dtype: torch.dtype, out_offset: int):
        """The sum of the tensors at ``offset`` of every region, in the common area.

        Each rank writes only its own 1/N chunk of the result at ``out_offset``,
        and every rank then reads all of it: unlike :meth:`reduce_in_place`, no
        chunk is copied back out. The regions may be rewritten when this returns;
        the result only after the next call's first barrier, when every rank has
        moved on (the caller makes sure nobody still reads it then).
        """
        n, me = self.size, self.index
        lo, hi = numel * me // n, numel * (me + 1) // n
        parts = [self.view(k, offset, numel, dtype)[lo:hi] for k in range(n)]
        out = self.common(out_offset, numel, dtype)
        self.barrier(("a shared-memory reduction into one result", dtype, (numel,), offset))
        mine = torch.add(parts[0], parts[1], out=out[lo:hi])
        for part in parts[2:]:  # the same order on every rank: identical results
            mine.add_(part)
        self.barrier()
        return out

    def all_reduce(self, t: torch.Tensor, op: str = "sum", name: str | None = None) -> None:
        """Sum (or max) a contiguous CPU tensor over the group, in place, in region-sized passes.

        Every rank must pass the same shape and dtype; ``name`` is the collective the
        caller offers, for the error when they do not.
        """
        flat = t.view(-1)
        per_pass = self.region_bytes // t.element_size()
        name = name or ("pardist.psum / pmean" if op == "sum" else "pardist.pmax")
        for start in range(0, max(flat.numel(), 1), per_pass):
            part = flat[start : start + per_pass]
            self.view(self.index, 0, part.numel(), part.dtype).copy_(part)
            first = (name, t.dtype, tuple(t.shape), op) if start == 0 else None
            self.reduce_in_place(0, part.numel(), part.dtype, out=part, op=op, what=first)
            self.barrier()  # my region is staged again in the next pass

    def diagonal(self, offset: int, row: int, dtype: torch.dtype) -> torch.Tensor:
        """A (size, row) view whose row k is row k of rank k's (rows, row) block at ``offset``.

        After a reduce-scatter of such blocks, this is the whole reduced result.
        """
        if self.region_bytes % dtype.itemsize or offset % dtype.itemsize:
            raise ValueError("pardist: a shared-memory block is not aligned to its dtype")
        data = self._data.view(dtype)
        step = self.region_bytes // dtype.itemsize
        return data.as_strided((self.size, row), (step + row, 1), offset // dtype.itemsize)

    def all_gather(
        self, t: torch.Tensor, name: str = "pardist.all_gather"
    ) -> list[torch.Tensor] | None:
        """Every rank's copy of ``t`` (same shape everywhere), or None if it does not fit.

        The shapes are compared first, so that every rank takes the same path; ``name``
        is the collective an error names.
        """
        fits = t.numel() * t.element_size() <= self.region_bytes
        if fits:
            self.view(self.index, 0, t.numel(), t.dtype).copy_(t.reshape(-1))
        self.barrier((name, t.dtype, tuple(t.shape)))
        if not fits:
            return None
        out = [self.view(k, 0, t.numel(), t.dtype).clone().view(t.shape) for k in range(self.size)]
        self.barrier()
        return out

    def small_all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The sum (or max) of a small CPU tensor over the group, after one barrier.

        Each rank writes its copy into its region, waits for the others once, and
        combines every region in rank order (identical results on every rank).
        Calls alternate between two halves of the regions: a rank that hurries on
        writes the other half, and it reaches this half again only after the next
        call's barrier, which waits until everyone has read it. Only this method
        may use the group (see ``_shmgroups.for_small_sums``); ``t`` fits half a region.
        """
        flat = t.reshape(-1)
        half = self.region_bytes // 2
        offset = (self._seq % 2) * half  # the barrier count alternates with the calls
        self.view(self.index, offset, flat.numel(), flat.dtype).copy_(flat)
        name = "pardist.psum / pmean" if op == "sum" else "pardist.pmax"
        self.barrier((name, t.dtype, tuple(t.shape), op))  # every rank the same shape and dtype
        parts = [self.view(k, offset, flat.numel(), flat.dtype) for k in range(self.size)]
        out = parts[0].clone()
        for part in parts[1:]:
            if op == "sum":
                out.add_(part)
            else:
                torch.maximum(out, part, out=out)
        return out.view(t.shape)
