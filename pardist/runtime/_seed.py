"""Seeding: the same random state on every rank, or a different one per rank.

Two needs pull in opposite directions. Parameters must start identical on every
rank (``data_parallel`` checks that on its first call), so the model is built
after ``seed_everything(seed)`` with the same seed everywhere. Augmentation must
differ between ranks, or every rank crops and flips its different images in the
same way; ``seed_everything(seed, per_rank=True)``, :func:`rank_seed` and the
DataLoader ``worker_init_fn`` :func:`seed_worker` give each rank its own stream,
reproducibly. Loaders from ``pardist.data.shard`` already seed their workers per
rank.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

from pardist.runtime import _process, _rng

__all__ = ["rank_seed", "seed_everything", "seed_worker"]


def rank_seed(seed: int, rank: int | None = None) -> int:
    """A seed derived from ``seed`` and a rank: different per rank, the same from run to run.

    Hashes the pair, so ``(seed=0, rank=1)`` and ``(seed=1, rank=0)`` differ (unlike
    ``seed + rank``).

    Args:
        seed: the run's seed.
        rank: whose seed; default: this process's global rank.

    Returns:
        A non-negative integer below ``2**63``.

    Example:
        >>> import pardist
        >>> pardist.rank_seed(0, rank=0) != pardist.rank_seed(0, rank=1)
        True
        >>> pardist.rank_seed(0, rank=1) == pardist.rank_seed(0, rank=1)
        True
    """
    _check_int(seed, "rank_seed", "seed")
    r = _process.rank() if rank is None else rank
    digest = hashlib.blake2b(f"pardist:{seed}:{r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_everything(seed: int, *, per_rank: bool = False) -> int:
    """Seed Python's ``random``, NumPy and torch (CPU and every accelerator).

    Call it with the same seed on every rank before building the model, so that
    every replica starts from the same parameters. It also restarts the random
    streams that steps draw from (dropout, and NumPy or ``random`` inside a step), so
    seeding twice in one process replays the same masks. With ``per_rank=True`` each
    rank gets its own seed (:func:`rank_seed`): call it after building the model
    when augmentation draws from the global generators in the main process.

    Args:
        seed: the seed.
        per_rank: seed with ``rank_seed(seed)`` instead, different on every rank.

    Returns:
        The seed used.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.seed_everything(0)
        >>> a = torch.rand(2)
        >>> _ = pardist.seed_everything(0)
        >>> torch.equal(a, torch.rand(2))
        True
    """
    _check_int(seed, "seed_everything", "seed")
    seed = rank_seed(seed) if per_rank else seed
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy's legacy seed must fit in 32 bits
    torch.manual_seed(seed)  # seeds every CUDA device too
    _rng.set_rng_count(0)  # the streams inside steps start again too: the same masks
    return seed


def seed_worker(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn`` giving every worker of every rank its own seed.

    torch seeds each worker from a base seed drawn in the main process; when every
    rank's main process was seeded alike, workers with the same id on different
    ranks draw the same augmentations. This reseeds ``random``, NumPy and torch in
    the worker from that seed and the rank.

    Args:
        worker_id: the worker's id (passed by the DataLoader).

    Example:
        >>> import pardist, torch
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(range(8), num_workers=2, worker_init_fn=pardist.seed_worker)
    """
    seed_everything(rank_seed(torch.initial_seed()))


def _check_int(value, fn: str, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(
            f"pardist.{fn}: {name}={value!r}; a seed is a non-negative int, e.g. pardist.{fn}(0)."
        )
