"""Uneven inputs: ranks that would run different numbers of steps raise instead of hanging.

Every step of a data-parallel loop is a collective. If one rank's loader yields
one batch fewer, that rank leaves the loop while the others wait in the next
step's all-reduce for a partner that never comes. The checks here make that an
error naming the ranks and their counts:

* before an epoch, one tiny all-gather compares the loaders' lengths (when they
  have one): the mismatch is caught before any batch is used;
* under ``PARDIST_DEBUG=1``, and always for loaders without a length, every
  batch is preceded by an all-gather of a "have a batch" flag (torch's ``Join``
  protocol), so the rank that runs out first and the ranks that still had data
  all raise at the same step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from pardist.data import _gather
from pardist.runtime import _process, debug_enabled

__all__ = ["Even", "check_even", "even", "lockstep"]


def _world() -> int:
    return _process.world_size() if _process.is_initialized() else 1


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _by_value(values: list) -> str:
    groups: dict = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    return "; ".join(f"{_ranks(rs)}: {v}" for v, rs in groups.items())


def check_even(count: int | Any, *, what: str = "batches", where: str = "pardist.data.check_even"):
    """Raise unless every rank passes the same count; return it.

    The cheap guard before a loop: one all-gather of one integer. Every rank must
    call it. A no-op when no process group is running or the world size is 1.

    Args:
        count: this rank's number of batches (or anything with ``len()``, such as
            its DataLoader).
        what: what is counted, for the error message.
        where: the function name the error message starts with.

    Returns:
        The count.

    Raises:
        ValueError: naming each rank and its count when they differ.

    Example:
        >>> import pardist
        >>> _ = pardist.init()
        >>> pardist.data.check_even(range(12))
        12
        >>> pardist.shutdown()
    """
    n = count if isinstance(count, int) else len(count)
    if _world() == 1:
        return n
    counts = [c[0] for c in _gather.all_gather_ints([n])]
    if len(set(counts)) > 1:
        raise ValueError(
            f"{where}: the ranks would run different numbers of {what} ({_by_value(counts)}). "
            "A rank with more steps would wait forever in a collective that the others never "
            "call. Give every rank the same count: shard one dataset with "
            "pardist.data.shard(loader), or stop every rank after the smallest count "
            f"(itertools.islice(loader, {min(counts)}))."
        )
    return n


def lockstep(batches: Iterator, where: str) -> Iterator:
    """Yield from ``batches`` only while every rank has a batch; raise when some run out first."""
    count = 0
    while True:
        failed = None
        try:
            item, have = next(batches), 1
        except StopIteration:
            item, have = None, 0
        except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it, then re-raise
            item, have, failed = None, -1, exc
        flags = [f[0] for f in _gather.all_gather_ints([have])]
        if failed is not None:
            raise failed
        if min(flags) == -1:
            bad = [r for r, f in enumerate(flags) if f == -1]
            raise RuntimeError(
                f"{where}: {_ranks(bad)} failed loading batch {count + 1}; see that rank's "
                "error. This rank stopped too rather than wait for it."
            )
        if all(flags):
            count += 1
            yield item
        elif not any(flags):
            return
        else:
            done = [r for r, f in enumerate(flags) if not f]
            more = [r for r, f in enumerate(flags) if f]
            raise ValueError(
                f"{where}: the ranks ran out of batches at different steps: {_ranks(done)} "
                f"yielded {count} batches and stopped, while {_ranks(more)} had at least "
                f"{count + 1}. The next step would have waited forever in a collective. Give "
                "every rank the same number of batches: shard one dataset with "
                "pardist.data.shard(loader), or stop every rank after the smallest count."
            )


def _length(iterable: Any) -> int | None:
    try:
        return len(iterable)
    except TypeError:
        return None


class Even:
    """An iterable that yields ``iterable``'s batches, raising if ranks' counts differ.

    Made by :func:`pardist.data.even`; ``len()`` and ``set_epoch`` pass through.
    """

    def __init__(self, iterable: Iterable, every_step: bool | None = None):
        self.iterable = iterable
        self.every_step = every_step

    def __len__(self) -> int:
        return len(self.iterable)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.iterable, "set_epoch"):
            self.iterable.set_epoch(epoch)

    def __iter__(self) -> Iterator:
        # A generator, so the check runs when the first batch is asked for.
        where = "pardist.data.even"
        if _world() == 1:
            yield from self.iterable
            return
        n = _length(self.iterable)
        lengths = [c[0] for c in _gather.all_gather_ints([-1 if n is None else n])]
        known = [c for c in lengths if c >= 0]
        if len(set(known)) > 1:
            shown = ["no len()" if c < 0 else c for c in lengths]
            raise ValueError(
                f"{where}: the ranks' loaders have different lengths ({_by_value(shown)}). "
                "A rank with more batches would wait forever in a collective that the others "
                "never call. Give every rank the same number of batches: shard one dataset with "
                "pardist.data.shard(loader), or stop every rank after the smallest count "
                f"(itertools.islice(loader, {min(known)}))."
            )
        every_step = self.every_step
        if every_step is None:
            every_step = debug_enabled() or len(known) < len(lengths)
        batches = iter(self.iterable)
        yield from lockstep(batches, where) if every_step else batches


def even(iterable: Iterable, *, every_step: bool | None = None) -> Even:
    """Wrap a per-rank loader so that ranks yielding different numbers of batches raise.

    For loaders you shard yourself (a per-rank file list, a streaming dataset):
    at the start of each pass the loaders' lengths are compared across ranks
    (one tiny all-gather), and, for loaders without ``len()`` or under
    ``PARDIST_DEBUG=1``, the ranks agree before every batch that each of them has
    one. Either way a mismatch raises on every rank at the same point, naming the
    ranks and their counts, instead of leaving some ranks waiting in a collective.
    Every rank must iterate it. Loaders from :func:`pardist.data.shard` are even
    by construction and need no wrapper.

    Args:
        iterable: this rank's loader (any iterable of batches).
        every_step: check before every batch (about one small all-gather per step);
            default: under ``PARDIST_DEBUG=1``, or when ``iterable`` has no length.

    Returns:
        An iterable over the same batches.

    Example:
        >>> import pardist
        >>> _ = pardist.init()
        >>> list(pardist.data.even([[0, 1], [2, 3]]))
        [[0, 1], [2, 3]]
        >>> pardist.shutdown()
    """
    return Even(iterable, every_step)
