"""``micro_batches``: a loader's batches in lists of k, one list an update (accumulation).

Accelerate's ``accumulate(model)`` and DDP's ``no_sync()`` loops step the optimizer every
k batches; in pardist one update takes its k micro-batches as one list
(``pardist.grad(..., accumulate='list')``), so a loop over ``micro_batches(loader, k)``
is that loop with one step call each. The last list of an epoch holds what is left
(an update over fewer batches, as Accelerate steps at the end of the loader), unless
``drop_last``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

__all__ = ["MicroBatches", "micro_batches"]


class MicroBatches:
    """``loader``'s batches in lists of ``k``; ``len()`` is the updates an epoch makes."""

    def __init__(self, loader: Any, k: int, drop_last: bool):
        self.loader, self.k, self.drop_last = loader, k, drop_last

    def __len__(self) -> int:
        n = len(self.loader)
        return n // self.k if self.drop_last else -(-n // self.k)

    def __iter__(self) -> Iterator[list]:
        batches = iter(self.loader)
        while True:
            group = list(itertools.islice(batches, self.k))
            if not group or (self.drop_last and len(group) < self.k):
                return
            yield group

    def set_epoch(self, epoch: int) -> None:
        """The loader's ``set_epoch`` (a sharded loader's epoch order)."""
        self.loader.set_epoch(epoch)


def micro_batches(loader: Any, k: int, *, drop_last: bool = False) -> MicroBatches:
    """``loader``'s batches in lists of ``k``, for ``pardist.grad(..., accumulate='list')``.

    ``drop_last=True`` leaves out a last list shorter than ``k`` (a loop over
    ``range(len(loader) // k)``).

    Example:
        >>> import pardist
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(list(range(10)), batch_size=2)
        >>> [[b.tolist() for b in group] for group in pardist.data.micro_batches(loader, 2)]
        [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9]]]
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"pardist.data.micro_batches: k={k!r}; a number of batches >= 1.")
    return MicroBatches(loader, k, drop_last)
