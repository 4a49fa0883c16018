"""Shared-memory gradient sums that run beside the backward of a compiled step.

Between CPU ranks of one host a compiled step averages its gradients through shared
memory, which no compiler can schedule: inductor runs a custom operator where the
graph calls it. So each bucket is two operators, as torch's functional collectives
are an issue and a wait:

- ``pardist::shm_sum_start`` divides the bucket's gradients straight into this rank's
  region of shared memory and hands the sum to the rank's helper thread, which runs
  the buckets one after another, in the order they were started (the same on every
  rank: each start takes the one before as an input, so no compiler can reorder them).
  It returns a ticket. Where the host has no core to spare for each rank's helper (the
  ranks' torch threads take them all), the start sums on the rank's own thread.
- ``pardist::shm_sum_wait`` waits for that sum and returns it where it lies, in the
  common area of shared memory: the update reads it there, as the eager step's does
  (no copy: 100 MB a step for a 25M-parameter model). That memory is every rank's and
  the next step rewrites it, so inductor must never compute into it: ``_guard`` keeps
  inductor from reusing the wait's output for another tensor or writing into it in
  place, and copies a sum the graph returns or writes (other backends copy every sum).
  The wait writes nothing: inductor before torch 2.15 computes a tensor that feeds a
  ``cat`` straight into the cat's buffer (batch norm's backward concatenates its two
  sums for their all-reduce) and can reuse that buffer while an operator's writes to
  the tensor are still to be read.

:func:`issue_early`, a pass over the graph after inductor's own, orders the backward so
that each bucket's gradients are made before the next bucket's, and each start right
after them (as DDP's buckets fill). The rest of the backward then runs while the
helper sums, and the waits stay where the update reads the sums (each wait takes the
last start's ticket: inductor's memory pass would otherwise pull a wait up to its
start). Every sum is computed as the synchronous transport computes it (rank 0's
quotient plus rank 1's, ...): the same bits, only sooner.

Nothing passed in is written, so two parameters that autograd gave one gradient tensor
(``w + delta``) are each reduced once.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import os
import queue
import threading

import torch
import torch.fx

from pardist.compile import _ops
from pardist.runtime import _process, inductor_graph_pass
from pardist.transport import _shm

__all__ = ["abandon", "issue_early", "sum_buckets"]

# By ticket: the sum in flight, and the byte where its mean's memory begins.
_pending: dict[int, tuple[concurrent.futures.Future, int]] = {}
_tickets = itertools.count(1)
_free = {"at": 0}  # the first byte of the regions that no sum in flight uses


class _Helper:
    """One daemon thread running jobs in the order submitted (a daemon: a rank that exits
    while its helper still waits for a rank that died does not wait on at exit)."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="pardist-shm-sum", daemon=True).start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, args, done = job
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - raised by the wait, on the rank's thread
                done.set_exception(e)

    def submit(self, fn, *args) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((fn, args, done))
        return done


_helper: dict[str, _Helper] = {}


def abandon() -> None:
    """Forget the sums in flight: the step raised before it waited for them (and its
    next call must not keep their memory)."""
    _pending.clear()
    _free["at"] = 0


def _forget() -> None:
    abandon()
    helper = _helper.pop("thread", None)
    if helper is not None:
        helper.jobs.put(None)  # ends after the jobs before it


_process.on_shutdown(_forget)
os.register_at_fork(after_in_child=_helper.clear)  # (a forked child has no helper thread)


def _helped(ranks: int) -> bool:
    """Whether each of this host's ``ranks`` has a core for a helper beside its own torch
    threads; else the sums run on the rank's thread (a helper competing for the cores
    the backward computes on gains nothing). ``PARDIST_SHM_HELPER``: 1 always, 0 never."""
    forced = os.environ.get("PARDIST_SHM_HELPER", "")
    if forced in ("0", "1"):
        return forced == "1"
    return ranks * (torch.get_num_threads() + 1) <= _cores()


@functools.cache
def _cores() -> int:
    """The cores this process may run on (read once: not a system call per bucket)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def _run(helped: bool, fn, *args) -> concurrent.futures.Future:
    """``fn(*args)`` on the helper thread, or now on this one; its future either way.
    Once a helper runs, every job goes through it (waited for at once where not
    ``helped``), so that two never use a region at the same time."""
    if helped and "thread" not in _helper:
        _helper["thread"] = _Helper()
    if "thread" in _helper:
        done = _helper["thread"].submit(fn, *args)
        if not helped:
            concurrent.futures.wait([done])
        return done
    done = concurrent.futures.Future()
    done.set_result(fn(*args))
    return done


@torch.library.custom_op("pardist::shm_sum_start", mutates_args=())
def shm_sum_start(
    xs: list[torch.Tensor],
    group: str,
    divisors: list[float],
    offset: int,
    total: int,
    after: torch.Tensor | None,
) -> torch.Tensor:
    """Start summing ``xs`` (one dtype), each divided by its divisor, over ``group``.

    ``after``: the previous bucket's ticket of the same mean (None for its first). A
    mean's buckets take ``total`` bytes of the regions, past those of every other sum
    in flight (a step may take two means, each started before either is waited for),
    this bucket at ``offset`` of them; its sum goes to the same place in the common
    area. Returns this bucket's ticket, for :func:`shm_sum_wait`.
    """
    with torch.profiler.record_function("pardist.shm_sum_start"):  # (as every torch shows it)
        return _start(xs, group, divisors, offset, total, after)


def _start(xs, group, divisors, offset, total, after) -> torch.Tensor:
    dtype, numel = xs[0].dtype, sum(x.numel() for x in xs)
    if after is None:  # a new mean: memory no sum in flight uses (every rank alike)
        base = _free["at"] if _pending else 0
        _free["at"] = base + total
    else:
        base = _pending[int(after)][1]
    offset += base
    arena = _ops._arena(group, base + total, key=f"{group} beside")
    if arena is None:  # no room in /dev/shm: summed now, through the smaller transport
        flat = torch.cat([(x if d == 1 else x / d).reshape(-1) for x, d in zip(xs, divisors)])
        done = _run(False, _ops.shm_all_reduce, flat, group, "sum")
    else:
        at = offset
        for x, d in zip(xs, divisors):
            mine = arena.view(arena.index, at, x.numel(), dtype).view(x.shape)
            torch.div(x, d, out=mine) if d != 1 else mine.copy_(x)
            at += x.numel() * dtype.itemsize
        done = _run(_helped(arena.size), arena.reduce_into, offset, numel, dtype, offset)
    ticket = next(_tickets)
    _pending[ticket] = done, base
    return torch.tensor(ticket, dtype=torch.int64)


@shm_sum_start.register_fake
def _(xs, group, divisors, offset, total, after):
    return torch.empty((), dtype=torch.int64)


@torch.library.custom_op("pardist::shm_sum_wait", mutates_args=())
def shm_sum_wait(
    ticket: torch.Tensor, last: torch.Tensor, numel: int, dtype: torch.dtype
) -> torch.Tensor:
    """Wait for the sum that ``ticket`` started: its ``numel`` elements, flat, where they
    lie in shared memory (not copied: the graph reads them there until the next step's
    sums rewrite them: ``_guard``).

    ``last``: the step's last ticket (order only: no wait runs before every bucket has
    started, whatever a compiler reorders). Raises what the helper raised (a rank
    that timed out, or left the step).
    """
    with torch.profiler.record_function("pardist.shm_sum_wait"):  # (inductor may not show it)
        done, _ = _pending.pop(int(ticket))
        try:
            return done.result()
        except BaseException:
            abandon()  # the step is lost: its other buckets are not waited for
            raise


@shm_sum_wait.register_fake
def _(ticket, last, numel, dtype):
    return torch.empty(numel, dtype=dtype)


def sum_buckets(
    tensors: list, buckets: list[list[int]], divisors: list[float], group: str
) -> list[torch.Tensor]:
    """Every bucket of ``tensors`` (indices per bucket, one dtype each) divided and summed
    over ``group``, in their order: all started, then all waited for. The sums are views
    of shared memory, valid until the next step's: a graph copies those it returns or
    writes (``_guard``)."""
    offsets, total = [], 0
    for index in buckets:
        offsets.append(total)
        nbytes = sum(tensors[i].numel() * tensors[i].element_size() for i in index)
        total += -(-nbytes // _shm.ALIGN) * _shm.ALIGN
    tickets, ticket = [], None
    for index, offset in zip(buckets, offsets):
        by = [float(divisors[i]) for i in index]
        xs = [tensors[i] for i in index]
        ticket = torch.ops.pardist.shm_sum_start(xs, group, by, offset, total, ticket)
        tickets.append(ticket)
    sums = list(tensors)
    for index, ticket in zip(buckets, tickets):
        numel, dtype = sum(tensors[i].numel() for i in index), tensors[index[0]].dtype
        flat, at = torch.ops.pardist.shm_sum_wait(ticket, tickets[-1], numel, dtype), 0
        for i in index:
            sums[i] = flat[at : at + tensors[i].numel()].view(tensors[i].shape)
            at += tensors[i].numel()
    return sums


def _issue_early(graph: torch.fx.Graph) -> None:
    """Order the graph so that each ``shm_sum_start`` runs as soon as it can: first what
    the first start needs and that start, then what the second needs and it, and so on,
    then the rest; in the graph's own order within each part (a topological order still,
    and the same on every rank). The backward then makes each bucket's gradients before
    it computes the next bucket's, as DDP's buckets fill, however the graph was traced."""
    start = torch.ops.pardist.shm_sum_start.default
    nodes = list(graph.nodes)
    starts = [n for n in nodes if n.target is start]
    if not starts:
        return
    position = {n: i for i, n in enumerate(nodes)}
    placed: set = set()
    order: list = []
    for node in starts:
        needed, todo = [], [node]
        while todo:
            n = todo.pop()
            if n not in placed:
                placed.add(n)
                needed.append(n)
                todo.extend(n.all_input_nodes)
        order.extend(sorted(needed, key=position.__getitem__))
    order.extend(n for n in nodes if n not in placed)
    anchor = nodes[-1]  # the output; placeholders stay first
    for n in reversed(order):
        if n.op not in ("placeholder", "output"):
            if n.next is not anchor:
                anchor.prepend(n)
            anchor = n


def issue_early():
    """:func:`_issue_early` as inductor's ``post_grad_custom_post_pass`` (cacheable: its
    key hashes this file and ``_guard``'s, whose lowering of the wait the graph holds)."""
    guard = os.path.join(os.path.dirname(__file__), "_guard.py")
    return inductor_graph_pass(_issue_early, (__file__, guard))
