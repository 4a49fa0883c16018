"""A sharded loader's position, saved and resumed, at the same or another world size.

The state is global, the same on every rank: the epoch, the global batches of it
handed out, and what fixes the epoch's order (dataset size, seed, shuffle) and
its batches (the global batch size). With ``split_batches=True`` every global
batch is the same rows whatever the world size, so a run resumed at another
world size continues with exactly the global batches an uninterrupted run would
have seen (torchtitan refuses to resume after the data-parallel degree changes;
this is what lets pardist do it). Without it each rank reads a contiguous piece
of the epoch, so a pass can be resumed part-way only at the same world size;
between epochs any world size works.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["load", "skip_first_batches", "state"]

_WHERE = "pardist.data.shard"
_ORDER = ("n", "seed", "shuffle")


def _global_batch(loader: Any) -> int:
    return loader.batch_size * loader.world_size if loader.split_batches else loader.batch_size


def state(loader: Any) -> dict:
    """``loader``'s position as a dict of ints and bools."""
    if loader._current >= 0 and loader._position < loader.batches:
        epoch, done = loader._current, loader._position  # a pass under way
    elif loader._skip is not None:
        epoch, done = loader._skip  # loaded, not iterated yet
    else:
        epoch, done = loader.epoch, 0
    return {
        "epoch": epoch,
        "batches": done,
        "n": loader.n,
        "seed": loader.seed,
        "shuffle": loader.shuffle,
        "split_batches": loader.split_batches,
        "batch_size": _global_batch(loader),
        "world_size": loader.world_size,
    }


def load(loader: Any, saved: dict) -> None:
    """Make ``loader``'s next pass continue from ``saved``; an error if it cannot exactly."""
    if not isinstance(saved, dict) or not {"epoch", "batches", *_ORDER} <= saved.keys():
        raise TypeError(
            f"{_WHERE}: load_state_dict takes the dict that state_dict() returned, got "
            f"{type(saved).__name__}."
        )
    mine = state(loader)
    differ = [f"{k} {saved[k]!r} then, {mine[k]!r} now" for k in _ORDER if saved[k] != mine[k]]
    if differ:
        raise ValueError(
            f"{_WHERE}: the saved position is in another epoch order ({'; '.join(differ)}). "
            "Resume with the same dataset, seed and shuffle as the saved run."
        )
    epoch, done = int(saved["epoch"]), int(saved["batches"])
    if done:
        same = (saved["split_batches"], saved["batch_size"]) == (
            loader.split_batches,
            _global_batch(loader),
        )
        if not same:
            raise ValueError(
                f"{_WHERE}: the saved run was {done} batches into epoch {epoch} with "
                f"{_describe(saved)}; this loader has {_describe(mine)}, so the rest of the "
                "epoch would be other batches. Resume with the same batch size (or after "
                "the epoch ends)."
            )
        if not loader.split_batches and saved["world_size"] != loader.world_size:
            raise ValueError(
                f"{_WHERE}: the saved run was {done} batches into epoch {epoch} at world size "
                f"{saved['world_size']}; without split_batches each rank reads its own piece "
                f"of the epoch, so it can resume part-way only at world size "
                f"{saved['world_size']} (this is {loader.world_size}). Shard with "
                "split_batches=True (a global batch size) to resume at any world size."
            )
    loader.epoch, loader.epoch_known = epoch, True
    loader._skip = (epoch, done) if done else None
    loader._current, loader._position = -1, 0


def _describe(s: dict) -> str:
    kind = "global" if s["split_batches"] else "per-rank"
    return f"a {kind} batch size of {s['batch_size']}"


class _Skipping:
    """The rest of a sharded loader's next pass, ``n`` batches in (``skip_first_batches``)."""

    def __init__(self, loader: Any, n: int):
        self.loader, self.n = loader, n

    def __len__(self) -> int:
        return len(self.loader) - self.n

    def __iter__(self) -> Iterator:
        loader = self.loader
        if self.n and loader.shuffle and not loader.epoch_known:
            raise ValueError(
                "pardist.data.skip_first_batches: the loader shuffles, and this process has "
                "neither set its epoch nor loaded its position, so the rest of the pass would "
                "be read in epoch 0's order, not in the order of the epoch your loop resumes. "
                "Call loader.set_epoch(epoch) first, with the epoch the loop is in (Accelerate's "
                "recipe: starting_epoch = resume_step // len(loader); 0 too), or keep the loader "
                "in the checkpoint's tree: its position resumes by itself."
            )
        loader._skip = (loader.epoch, self.n)
        return iter(loader)


def skip_first_batches(loader: Any, num_batches: int = 0) -> Any:
    """The next pass of ``loader`` without its first ``num_batches`` batches (Accelerate's
    ``skip_first_batches``): what a run resumed part-way through an epoch iterates.

    Its ``len()`` is the batches it yields, as Accelerate's; ``loader`` itself keeps the
    epoch's length. A loader restored with ``load_state_dict`` (or in a checkpoint's tree)
    skips what was done on its own and needs no call of this.

    Example:
        >>> import pardist
        >>> from torch.utils.data import DataLoader
        >>> loader = pardist.data.shard(DataLoader(list(range(8)), batch_size=2), 0, 1)
        >>> rest = pardist.data.skip_first_batches(loader, 3)
        >>> len(rest), [b.tolist() for b in rest], len(loader)
        (1, [[6, 7]], 4)
    """
    from pardist.data._loader import ShardedLoader  # (it imports this module)

    if not isinstance(loader, ShardedLoader):
        raise TypeError(
            f"pardist.data.skip_first_batches: loader is a {type(loader).__name__}; pass a "
            "pardist.data.shard(...) loader (or itertools.islice a plain iterable)."
        )
    if isinstance(num_batches, bool) or not isinstance(num_batches, int):
        raise TypeError(f"pardist.data.skip_first_batches: num_batches={num_batches!r}; an int.")
    if not 0 <= num_batches <= len(loader):
        raise ValueError(
            f"pardist.data.skip_first_batches: num_batches={num_batches}, but an epoch of the "
            f"loader has {len(loader)} batches; give 0 to {len(loader)}."
        )
    return _Skipping(loader, num_batches)
