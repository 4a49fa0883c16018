"""``pardist.data``: feeding every rank its own piece of a dataset, evenly.

``shard`` (fastai's DistributedDL over any DataLoader), ``even`` / ``check_even``
for loaders you shard yourself, ``untar`` (fastai's ``untar_data``); ``gather``
for exact evaluation lives here too (``pardist.gather``). May import
``pardist.runtime`` only.
"""

from pardist.data._gather import gather, gather_object
from pardist.data._groups import MicroBatches, micro_batches
from pardist.data._loader import (
    Even,
    ShardedLoader,
    check_even,
    even,
    shard,
    skip_first_batches,
    untar,
)

__all__ = [
    "Even",
    "MicroBatches",
    "ShardedLoader",
    "check_even",
    "even",
    "gather",
    "gather_object",
    "micro_batches",
    "shard",
    "skip_first_batches",
    "untar",
]
