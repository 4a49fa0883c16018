"""A sharded loader that follows the survivors of a lost rank (``--keep-going``).

When a rank dies, ``runtime._survive`` starts a group over the survivors and tells every
:class:`~pardist.data.ShardedLoader` sharded over the process group its new rank and
world size. A pass under way is then finished as the world that began it cut its global
batches (:class:`Layout`): global batch ``k`` is every old rank's ``k``-th batch, in
rank order (with ``split_batches=True``, the loader's own batch ``k``), and each survivor
reads a contiguous share of it, so the lost rank's rows are read by the survivors and
no sample is dropped or seen twice. The batch that the failed call was given is read
again, as this rank's share (:func:`reread`). Later passes are cut for the new world as
:func:`pardist.data.shard` would have cut them; with ``split_batches=True`` these are
the very global batches of the uninterrupted run.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.data import DataLoader

from pardist.runtime import _placement, _survive

__all__ = ["Layout", "joined", "resize", "rest", "track"]

_WHERE = "pardist.data.shard (--keep-going)"
_loaders: weakref.WeakSet = weakref.WeakSet()  # every loader sharded over the group


class Layout:
    """The global batches of a pass, as the world that began it cut them."""

    def __init__(self, loader, order: torch.Tensor):
        self.order, self.n, self.split = order, loader.n, loader.split_batches
        self.world, self.bs, self.samples = loader.world_size, loader.batch_size, loader.samples
        self.batches = loader.batches

    def rows(self, k: int) -> torch.Tensor:
        """The dataset indices of global batch ``k``, the old ranks' rows in rank order."""
        w, bs = self.world, self.bs
        if self.split:
            return self.order[(torch.arange(w * bs) + k * w * bs) % self.n]
        mine = torch.arange(k * bs, min((k + 1) * bs, self.samples))
        return self.order[(torch.arange(w)[:, None] * self.samples + mine).reshape(-1) % self.n]

    def share(self, k: int, rank: int, world: int) -> list[int]:
        """Rank ``rank``'s contiguous share (of ``world``) of global batch ``k``."""
        rows = self.rows(k)
        if len(rows) % world:
            raise ValueError(
                f"{_WHERE}: global batch {k} of this pass has {len(rows)} rows, which the "
                f"{world} surviving rank(s) cannot share equally. Use a global batch size "
                "that every world size you may shrink to divides (as deterministic=G needs)."
            )
        return rows.view(world, -1)[rank].tolist()


def resize(loader, rank: int, world: int) -> None:
    """``loader``'s rank, world size and batch sizes for a group of ``world`` survivors."""
    if loader.split_batches and loader._global_batch % world:
        raise ValueError(
            f"{_WHERE}: the global batch of {loader._global_batch} cannot be cut into "
            f"{world} equal parts for the surviving ranks. Use a batch size that every "
            "world size you may shrink to divides."
        )
    loader.rank, loader.world_size = rank, world
    if loader.split_batches:
        loader.batch_size = loader._global_batch // world
        loader.samples = loader.batches * loader.batch_size
    else:
        loader.samples = -(-loader.n // world)
        bs = loader.batch_size
        loader.batches = loader.samples // bs if loader.drop_last else -(-loader.samples // bs)


def joined(loader) -> None:
    """A replacement's loader, given the survivors' position (``checkpoint.resume``): where
    that is part-way through a pass, its first pass makes none of the collectives of a
    pass's start (the survivors are part-way through theirs, and make none)."""
    if loader._skip is not None:
        loader._joined = loader._skip[0]


def track(loader) -> None:
    """Follow the process group's survivors (loaders whose rank the group decides)."""
    _loaders.add(loader)


def _fetch(loader, batches: list[list[int]], workers: bool = True):
    options = dict(loader._options)
    if not workers:
        options.update(num_workers=0, persistent_workers=False, prefetch_factor=None)
    inner = DataLoader(
        loader.dataset, batch_sampler=batches, generator=loader._generator, **options
    )
    return _placement.moved(iter(inner), loader.device, loader._only_cpu)


def rest(loader):
    """The batches this rank reads for the rest of the pass under way, in the new group."""
    layout, rank, world = loader._layout, loader.rank, loader.world_size
    shares = [layout.share(k, rank, world) for k in range(loader._position, layout.batches)]
    return _fetch(loader, shares)


def _regroup(rank: int, world: int) -> None:
    for loader in list(_loaders):
        if loader._pass_order is not None and loader._layout is None:
            loader._layout = Layout(loader, loader._pass_order)
        loader.resize(rank, world)
        if loader._layout is not None:
            for k in range(loader._position, loader._layout.batches):  # say so now
                loader._layout.share(k, rank, world)
        loader._moved = True


def _reread(batch):
    for loader in list(_loaders):
        if loader._last_batch is not None and loader._last_batch is batch:
            k = loader._position - 1
            share = loader._layout.share(k, loader.rank, loader.world_size)
            again = next(_fetch(loader, [share], workers=False))
            loader._last_batch = again
            return again
    return None


_survive.on_regroup(_regroup)
_survive.on_reread(_reread)
