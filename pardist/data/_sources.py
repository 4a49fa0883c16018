"""What ``pardist.data.shard`` takes: a DataLoader, a Dataset or a sized sequence of samples.

A DataLoader is sharded as it is (its collate function, workers and the rest kept);
anything else with a length becomes one. What cannot be cut into equal pieces (an
IterableDataset, a loader that already has a DistributedSampler) is refused with the fix.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

__all__ = ["as_loader", "check_rank"]

_WHERE = "pardist.data.shard"


def as_loader(data: Any, batch_size, shuffle, drop_last, world_size: int) -> DataLoader:
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            f"{_WHERE}: the dataset is an IterableDataset ({type(dataset).__name__}), which "
            f"has no length to cut into {world_size} equal pieces. Split the stream yourself "
            "in its __iter__ (e.g. keep every pardist.world_size()-th item, starting at "
            "pardist.rank()), and wrap the loader in pardist.data.even(loader) so that ranks "
            "yielding different numbers of batches raise instead of hanging."
        )
    if isinstance(data, DataLoader):
        if isinstance(data.sampler, DistributedSampler):
            raise ValueError(
                f"{_WHERE}: the loader already has a DistributedSampler, so it is already "
                "split over the ranks. Build it without one (shuffle=True or False) and let "
                "shard split it."
            )
        if data.batch_size is None and batch_size is None:
            raise ValueError(
                f"{_WHERE}: the loader has no batch_size (it uses batch_sampler="
                f"{type(data.batch_sampler).__name__} or batch_size=None), and shard batches "
                "each rank's piece itself. Pass batch_size=... to shard."
            )
        return data
    if not isinstance(data, Sized):
        raise TypeError(
            f"{_WHERE}: loader is a {type(data).__name__}, which has no len(). Pass a torch "
            "DataLoader, a Dataset, or a sized sequence of samples with batch_size=..."
        )
    size = batch_size or getattr(data, "batch_size", None) or getattr(data, "bs", None)
    if size is None:
        raise ValueError(
            f"{_WHERE}: loader is a {type(data).__name__} of samples with no batch size. "
            "Pass batch_size=..., or a torch DataLoader."
        )
    dataset = getattr(data, "dataset", data)
    dataset = dataset if hasattr(dataset, "__getitem__") else list(dataset)
    return DataLoader(dataset, batch_size=size, shuffle=bool(shuffle), drop_last=bool(drop_last))


def check_rank(rank: Any, world_size: Any) -> None:
    ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, world_size))
    if not ok or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"{_WHERE}: rank={rank!r}, world_size={world_size!r}; need ints with "
            "0 <= rank < world_size (or leave both out to use this process's)."
        )
