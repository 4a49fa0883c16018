"""``pardist.data``: feeding every rank its own piece of a dataset, evenly.

:func:`shard` follows fastai's ``DistributedDL``: an epoch's order (the dataset
order, or one permutation shared by every rank) is cut into ``world_size``
contiguous pieces of ``ceil(n / world_size)`` samples, the last wrapped around to
the start, and each rank batches its piece with the loader's batch size. Every
rank thus runs the same number of steps, and the ranks' pieces, concatenated in
rank order, are the epoch in order followed by fewer than ``world_size``
repeats, which is what lets :func:`pardist.gather` (``total=n``) recover exact
evaluation metrics. Under the hood it is an ordinary torch ``DataLoader`` over a
per-rank list of indices, so workers, pinning and collation are torch's own.

:func:`even` and :func:`check_even` guard loaders you shard yourself.
:func:`untar` downloads and extracts a data set once (fastai's ``untar_data``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, RandomSampler, Sampler, SequentialSampler

from pardist.data import _even, _gather, _position, _regroup, _sources
from pardist.data._download import untar
from pardist.data._even import Even, check_even, even
from pardist.data._position import skip_first_batches
from pardist.runtime import _mesh, _placement, _process, _seed, _survive, debug_enabled
from pardist.transport import agree

__all__ = ["Even", "ShardedLoader", "check_even", "even", "shard", "skip_first_batches", "untar"]

_WHERE = "pardist.data.shard"
# DataLoader arguments that shard decides; every other one is copied from the loader.
_DECIDED = {
    "self",
    "dataset",
    "batch_size",
    "shuffle",
    "sampler",
    "batch_sampler",
    "drop_last",
    "generator",
}


_END = object()


class _Indices(Sampler[int]):
    """The inner DataLoader's sampler: this rank's indices for the current epoch."""

    def __init__(self) -> None:
        self.indices: list[int] = []

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _options(loader: DataLoader) -> dict[str, Any]:
    names = inspect.signature(DataLoader.__init__).parameters
    return {k: getattr(loader, k) for k in names if k not in _DECIDED and hasattr(loader, k)}


def _plain(sampler: Any) -> bool:
    """Whether ``sampler`` is a plain in-order or shuffled pass over the dataset."""
    if type(sampler) is SequentialSampler:
        return True
    return (
        type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None
    )


class ShardedLoader:
    """This rank's batches of a dataset cut evenly over the ranks; made by :func:`shard`.

    Iterate it once per epoch; ``len()`` is the number of batches of an epoch, the
    same on every rank, as a DataLoader's (also after :meth:`load_state_dict` resumed
    it part-way: epoch arithmetic such as ``resume_step // len(loader)`` holds);
    :attr:`remaining` is what the next pass yields. Attributes: ``loader`` (the
    original), ``dataset``, ``rank``, ``world_size``, ``batch_size`` (per rank),
    ``epoch`` (the next pass's), ``samples`` (per rank per epoch).
    """

    def __init__(
        self,
        loader: DataLoader,
        rank: int,
        world_size: int,
        *,
        batch_size: int,
        shuffle: bool | None,
        drop_last: bool | None,
        split_batches: bool,
        seed: int | None,
        check: bool,
        device: tuple = (None, False),
        axis: str | tuple[str, ...] | None = None,
    ):
        self.loader, self.dataset, self.axis = loader, loader.dataset, axis
        self.rank, self.world_size, self.split_batches = rank, world_size, split_batches
        sampler = loader.sampler
        self.shuffle = isinstance(sampler, RandomSampler) if shuffle is None else bool(shuffle)
        self._sampler = None if shuffle is not None or _plain(sampler) else sampler
        generator = getattr(sampler, "generator", None)
        self.seed = seed if seed is not None else generator.initial_seed() if generator else 0
        self.drop_last = loader.drop_last if drop_last is None else bool(drop_last)
        self.n = len(self._sampler) if self._sampler is not None else len(self.dataset)
        if self.n == 0:
            raise ValueError(f"{_WHERE}: the dataset is empty; there is nothing to shard.")
        if split_batches:
            if batch_size % world_size:
                raise ValueError(
                    f"{_WHERE}: split_batches=True cuts each batch of {batch_size} into "
                    f"{world_size} equal parts, but {batch_size} is not a multiple of "
                    f"{world_size}. Use a batch size that is (e.g. "
                    f"{math.ceil(batch_size / world_size) * world_size}), or split_batches="
                    f"False to give every rank batches of {batch_size}."
                )
            self.batch_size = batch_size // world_size
            self.batches = self.n // batch_size if self.drop_last else -(-self.n // batch_size)
            self.samples = self.batches * self.batch_size
        else:
            self.batch_size = batch_size
            self.samples = -(-self.n // world_size)
            self.batches = (
                self.samples // batch_size if self.drop_last else -(-self.samples // batch_size)
            )
        self.epoch = 0
        self.epoch_known = False  # set_epoch, load_state_dict or a pass told us the epoch
        self._current, self._position = -1, 0  # the pass under way, its batches handed out
        self._skip: tuple[int, int] | None = None  # (epoch, batches) to resume from
        self._check = check
        self._indices, self._generator = _Indices(), torch.Generator()
        self.device, self._only_cpu = device
        self._options = _placement.pinned(_options(loader), self.device)
        self._inner = self._make_inner()
        # --keep-going (data._regroup): the pass under way, how it was cut, the last batch.
        self._global_batch = batch_size
        self._pass_order = self._layout = self._last_batch = self._joined = None
        self._moved = False
        if check and axis is None and _survive.enabled():
            _regroup.track(self)

    def _make_inner(self) -> DataLoader:
        return DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=self._indices,
            drop_last=self.drop_last and not self.split_batches,
            generator=self._generator,
            **self._options,
        )

    def resize(self, rank: int, world_size: int) -> None:
        """Be rank ``rank`` of ``world_size`` from the next pass on (a group of survivors)."""
        _regroup.resize(self, rank, world_size)
        self._inner = self._make_inner()

    def __len__(self) -> int:
        """The number of batches of an epoch, as a DataLoader's ``len()``; a pass resumed
        part-way yields :attr:`remaining` of them."""
        return self.batches

    @property
    def remaining(self) -> int:
        """The batches the next pass yields: ``len()`` less those a resumed epoch had
        already handed out (``len()`` itself for a pass from the start)."""
        return self.batches - (self._skip[1] if self._skip and self._skip[0] == self.epoch else 0)

    def state_dict(self) -> dict:
        """Where this loader is: the epoch and the global batches of it handed out.

        The same on every rank, and independent of the world size with
        ``split_batches=True``: :meth:`load_state_dict` at another world size then
        continues with exactly the global batches an uninterrupted run would see.
        :func:`pardist.checkpoint.save` calls it for a loader in the saved tree.
        """
        return _position.state(self)

    def _after_join(self) -> None:
        _regroup.joined(self)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (:meth:`state_dict`'s): the next pass resumes that epoch."""
        _position.load(self, state)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation for the next pass (as ``DistributedSampler``).

        Without it, each pass uses the next epoch number: a new order every pass, as
        Accelerate's loaders give (the first pass of a process is epoch 0's). Call it on
        every rank, and before resuming part-way through an epoch in a new process.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise TypeError(f"{_WHERE}: set_epoch({epoch!r}); an epoch is an int >= 0.")
        self.epoch, self.epoch_known = epoch, True

    def _order(self, epoch: int, share: bool) -> torch.Tensor:
        """The whole epoch's order of dataset indices, the same on every rank."""
        if self._sampler is None:
            if not self.shuffle:
                return torch.arange(self.n)
            return torch.randperm(
                self.n, generator=torch.Generator().manual_seed(self.seed + epoch)
            )
        if hasattr(self._sampler, "set_epoch"):
            self._sampler.set_epoch(epoch)
        order = [list(self._sampler)]
        if share:  # a custom sampler may draw differently per rank: rank 0's order wins
            agree(f"{_WHERE}'s order of epoch {epoch}", dist.group.WORLD)
            dist.broadcast_object_list(order, src=0)
        if len(order[0]) != self.n:
            raise ValueError(
                f"{_WHERE}: loader.sampler gave {len(order[0])} indices, but its "
                f"len() was {self.n} when the loader was sharded."
            )
        return torch.as_tensor(order[0], dtype=torch.int64)

    def indices(self, epoch: int | None = None) -> torch.Tensor:
        """The dataset indices this rank reads in ``epoch`` (default: the next pass), in order.

        For a loader with a custom sampler this is this rank's sampler order, which
        a pass replaces with rank 0's.
        """
        order = self._order(self.epoch if epoch is None else epoch, share=False)
        return self._cut(order)

    def _cut(self, order: torch.Tensor, skip: int = 0) -> torch.Tensor:
        """This rank's indices of the epoch ``order``, from batch ``skip`` on."""
        w, r, bs = self.world_size, self.rank, self.batch_size
        if self.split_batches:
            padded = order[torch.arange(self.batches * bs * w) % self.n]
            return padded.view(self.batches, w, bs)[skip:, r].reshape(-1)
        padded = order[torch.arange(self.samples * w) % self.n]
        return padded[r * self.samples + skip * bs : (r + 1) * self.samples]

    def _agree(self, epoch: int) -> None:
        mine = [self.n, self.batches, epoch]
        everyone = _gather.all_gather_ints(mine)
        if any(theirs != everyone[0] for theirs in everyone):
            shown = "; ".join(
                f"rank {r}: {n} samples, {b} batches, epoch {e}"
                for r, (n, b, e) in enumerate(everyone)
            )
            raise ValueError(
                f"{_WHERE}: the ranks disagree at the start of a pass ({shown}). A rank with "
                "more batches would wait forever in a collective. Build the same dataset and "
                "loader on every rank, iterate it on every rank, and call "
                "loader.set_epoch(epoch) on every rank before each epoch."
            )

    def __iter__(self) -> Iterator:
        # A generator: nothing happens until the first batch is asked for, so an
        # iterator made and dropped (as some wrappers do) neither takes an epoch nor
        # calls a collective.
        epoch, self.epoch, self.epoch_known = self.epoch, self.epoch + 1, True
        skip = self._skip[1] if self._skip and self._skip[0] == epoch else 0
        self._skip = None
        share = self._check and _process.is_initialized() and dist.get_world_size() > 1
        share, self._joined = share and self._joined != epoch, None  # (data._regroup.joined)
        if share:
            _survive.again_if_lost(lambda: self._agree(epoch), _WHERE, check=True)
        order = self._order(epoch, share)
        self._indices.indices = self._cut(order, skip).tolist()
        self._current, self._position = epoch, skip
        self._pass_order, self._layout, self._moved = order, None, False
        # Workers are seeded from a draw of the loader's generator (as torch does),
        # mixed with the rank, so that augmentation differs between ranks.
        draw = int(torch.empty((), dtype=torch.int64).random_(generator=self.loader.generator))
        self._generator.manual_seed(_seed.rank_seed(draw, self.rank))
        batches = _placement.moved(iter(self._inner), self.device, self._only_cpu)
        batches = _even.lockstep(batches, _WHERE) if share and debug_enabled() else batches
        keep = _survive.enabled()
        while True:
            if self._moved:  # the survivors of a lost rank go on (data._regroup)
                self._moved, batches = False, _regroup.rest(self)
            batch = next(batches, _END)
            if batch is _END:
                break
            self._position += 1
            if keep:
                self._last_batch = batch
            yield batch
        self._pass_order = self._layout = self._last_batch = None

    def gather(self, tree: Any) -> Any:
        """Every rank's outputs for the batch this loader last handed out, without the rows
        that pad the epoch (Accelerate's ``gather_for_metrics``); every rank calls it.

        ``tree``'s leaves have one row per sample of this rank's batch (predictions,
        labels). The result holds the ranks' rows in rank order, less the wrap-around
        repeats that make the ranks' shares equal (they fall in the last batches), so a
        metric summed over an epoch's batches counts each sample exactly once, as one
        process would. The rows come in the ranks' order, not the dataset's; for
        outputs in dataset order gather the whole epoch with ``pardist.gather(...,
        total=n)``.

        Example:
            >>> import pardist, torch
            >>> from torch.utils.data import DataLoader
            >>> _ = pardist.init()
            >>> valid = pardist.data.shard(DataLoader(list(range(5)), batch_size=4))
            >>> [valid.gather(batch).tolist() for batch in valid]
            [[0, 1, 2, 3], [4]]
            >>> pardist.shutdown()
        """
        return _gather.gather_batch(self, tree)

    def __repr__(self) -> str:
        return (
            f"ShardedLoader(rank={self.rank}, world_size={self.world_size}, n={self.n}, "
            f"batch_size={self.batch_size}, batches={self.batches}, "
            f"shuffle={self.shuffle}, split_batches={self.split_batches})"
        )


def shard(
    loader: Any,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    batch_size: int | None = None,
    shuffle: bool | None = None,
    drop_last: bool | None = None,
    split_batches: bool = False,
    seed: int | None = None,
    axis: str | tuple[str, ...] | None = None,
    device: Any = "auto",
) -> ShardedLoader:
    """This rank's share of ``loader``: fastai's ``DistributedDL`` over a torch DataLoader.

    The epoch's order is cut into ``world_size`` contiguous pieces of
    ``ceil(n / world_size)`` samples (the last wrapped around to the start), and
    this rank's piece is batched with the loader's batch size; every rank gets
    the same number of batches. The loader's dataset, collate_fn, workers,
    pin_memory, drop_last, worker_init_fn and the rest are kept. If the loader
    shuffles (its sampler is a ``RandomSampler``), every epoch uses one
    permutation shared by all ranks, drawn from ``seed + epoch``; call
    ``set_epoch(epoch)`` before each epoch (else each pass takes the next epoch).
    A custom sampler's order is taken from rank 0 each epoch. DataLoader workers
    are seeded differently on every rank.

    With ``split_batches=True`` (Accelerate's mode) the loader's batch size is the
    global batch: each global batch of the epoch is cut into ``world_size``
    equal slices, one per rank, so N ranks see the very batches one process
    would. Use it for training; evaluate with the default mode, whose outputs
    :func:`pardist.gather` puts back in dataset order.

    When rank and world size come from the process group (the usual call), each
    pass first checks (one tiny all-gather) that every rank has the same number
    of samples, batches and epoch, and under ``PARDIST_DEBUG=1`` the ranks also
    agree before every batch; a mismatch raises instead of hanging.

    Args:
        loader: a torch DataLoader over a map-style dataset; or a Dataset or a
            sized sequence of samples, with ``batch_size``.
        rank: which piece; default this process's rank.
        world_size: how many pieces; default the world size.
        batch_size: override the loader's batch size.
        shuffle: override shuffling (default: whether the loader shuffles).
        drop_last: override the loader's ``drop_last``.
        split_batches: the batch size is global; give each rank a slice of each batch.
        seed: the shuffle seed; default the loader's generator's seed, else 0.
        axis: take rank and world size from this mesh axis instead (for meshes
            whose other axes hold model parallelism).
        device: where batches are delivered: ``'auto'`` (the default) moves CPU
            tensors to :func:`pardist.device` (from pinned memory, non-blocking,
            when that is a GPU; nothing to do on a CPU machine); a device moves
            every tensor there; None yields them as the loader made them.

    Returns:
        A :class:`ShardedLoader`.

    Example:
        >>> import pardist
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(list(range(50)), batch_size=12)
        >>> [b.tolist() for b in pardist.data.shard(loader, rank=1, world_size=4)]
        [[13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [25]]
        >>> [b.tolist() for b in pardist.data.shard(loader, rank=3, world_size=4)]
        [[39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 0], [1]]
    """
    explicit = rank is not None or world_size is not None
    if axis is not None:
        if explicit:
            raise ValueError(f"{_WHERE}: give axis=... or rank/world_size, not both.")
        mesh = _mesh.current_mesh("data.shard")
        mesh.axes(axis, "data.shard")
        rank, world_size = mesh.index(axis), mesh.size(axis)
    rank = _process.rank() if rank is None else rank
    world_size = _process.world_size() if world_size is None else world_size
    _sources.check_rank(rank, world_size)
    torch_loader = _sources.as_loader(loader, batch_size, shuffle, drop_last, world_size)
    return ShardedLoader(
        torch_loader,
        rank,
        world_size,
        batch_size=batch_size or torch_loader.batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        split_batches=split_batches,
        seed=seed,
        check=not explicit,
        device=_placement.resolve(device, _WHERE),
        axis=axis,
    )
