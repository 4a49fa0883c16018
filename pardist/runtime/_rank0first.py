"""``rank0_first``: rank 0 runs a function (a download, an extraction) before the others."""

from __future__ import annotations

import torch.distributed as dist

from pardist.runtime._process import is_initialized, require_init, world_size

__all__ = ["rank0_first"]


def rank0_first(fn=None, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` on rank 0 first, then on the other ranks; return its result.

    fastai's semantics: the usual use is a download or an extraction that must
    happen once (rank 0) before the others read the result. If ``fn`` raises on
    rank 0, the other ranks raise too instead of waiting for it forever. Without
    ``fn`` it is a context manager (Accelerate's ``main_process_first()``): rank 0
    runs the block while the others wait at its start, then they run it.

    Example:
        >>> import pardist
        >>> _ = pardist.init()
        >>> pardist.rank0_first(lambda: 'data/')
        'data/'
        >>> with pardist.rank0_first():
        ...     path = 'data/'
        >>> pardist.shutdown()
    """
    if fn is None:
        return _Rank0First()
    with _Rank0First(getattr(fn, "__name__", "fn")):
        return fn(*args, **kwargs)


class _Rank0First:
    """The block runs on rank 0, then on the others (who wait for it at ``__enter__``)."""

    def __init__(self, name: str = "the block of `with pardist.rank0_first():`"):
        self.name = name

    def _group(self) -> bool:
        if not is_initialized():
            if world_size() > 1:
                require_init("rank0_first")
            return False
        return dist.get_world_size() > 1

    def __enter__(self) -> None:
        self.many = self._group()
        if not self.many or dist.get_rank() == 0:
            return
        outcome: list = [None]
        dist.broadcast_object_list(outcome, src=0)  # rank 0 has finished the block
        if outcome[0] is not None:
            raise RuntimeError(
                f"pardist.rank0_first: rank 0 failed running {self.name}, so this rank did "
                f"not: {outcome[0]}"
            )

    def __exit__(self, kind, exc, tb) -> bool:
        if self.many and dist.get_rank() == 0:
            outcome = [None if exc is None else f"{kind.__name__}: {exc}"]
            dist.broadcast_object_list(outcome, src=0)
        return False
