"""Progress bars, printing and logging that appear once, on the main rank.

Every rank runs the same script; without care, N ranks draw N interleaved
progress bars and print every line N times. These helpers decide at call time
(so they work before and after ``pardist.init``) and stay silent elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

# Not tqdm.auto: its asyncio mixin calls iter() on the iterable an extra time, which
# starts (and throws away) a DataLoader's workers and would consume a loader's epoch.
from tqdm.autonotebook import tqdm

from pardist.runtime import _process

__all__ = ["RankLogger", "get_logger", "print0", "progress"]


def progress(iterable: Iterable | None = None, *, main_only: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm progress bar over ``iterable``, drawn on the main rank only.

    Every rank iterates it (the items are the same as ``iterable``'s); only rank
    0 draws. Any tqdm keyword works (``desc``, ``total``, ``leave``, ``file``...).

    Args:
        iterable: what to iterate, as for ``tqdm``.
        main_only: draw on rank 0 only; False draws on every rank.
        **kwargs: passed to ``tqdm`` (the notebook widget in Jupyter).

    Returns:
        The tqdm object (disabled on the other ranks).

    Example:
        >>> import pardist
        >>> sum(pardist.progress(range(4), desc='eval', disable=True))
        6
    """
    silent = main_only and not _process.is_main()
    kwargs["disable"] = bool(kwargs.get("disable", False)) or silent
    remaining = getattr(iterable, "remaining", None)  # a sharded loader resumed part-way
    if isinstance(remaining, int) and "total" not in kwargs and "initial" not in kwargs:
        kwargs["total"], kwargs["initial"] = len(iterable), len(iterable) - remaining
    return tqdm(iterable, **kwargs)


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on the main rank only (rank 0); a no-op on the others.

    Args:
        *args: as for ``print``.
        **kwargs: as for ``print`` (``sep``, ``end``, ``file``, ``flush``).

    Example:
        >>> import pardist
        >>> pardist.print0('epoch', 1)
        epoch 1
    """
    if _process.is_main():
        print(*args, **kwargs)


class RankLogger(logging.LoggerAdapter):
    """A logger whose records are kept on the main rank only, unless a call says otherwise.

    Every logging method takes ``main_only`` (default True): with
    ``main_only=False`` every rank logs the record, prefixed ``[rank r]``.
    """

    def log(self, level: int, msg: Any, *args: Any, main_only: bool = True, **kwargs: Any):
        if main_only:
            if not _process.is_main():
                return
        else:
            msg = f"[rank {_process.rank()}] {msg}"
        super().log(level, msg, *args, **kwargs)


def get_logger(name: str | None = None) -> RankLogger:
    """A logger that logs on the main rank only (the standard logger under ``name``).

    The records go through ``logging.getLogger(name)``, its level and handlers;
    nothing global is changed. Pass ``main_only=False`` to a call to log it on
    every rank, prefixed with the rank.

    Args:
        name: the logger's name, as for ``logging.getLogger`` (usually ``__name__``).

    Returns:
        A :class:`RankLogger`.

    Example:
        >>> import logging, sys, pardist
        >>> log = pardist.get_logger('example')
        >>> log.logger.addHandler(logging.StreamHandler(sys.stdout))
        >>> log.logger.setLevel(logging.INFO)
        >>> log.info('epoch %d', 1)
        epoch 1
        >>> log.warning('slow batch', main_only=False)
        [rank 0] slow batch
        >>> log.logger.handlers.clear()
    """
    return RankLogger(logging.getLogger(name), {})
