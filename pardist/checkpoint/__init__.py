"""Checkpoints of pytrees with torch.distributed.checkpoint (DCP): save, load, latest, resume.

A checkpoint is a directory that DCP writes (``.metadata`` plus ``*.distcp`` data
files) and that pardist commits atomically: every rank writes into
``<path>.tmp-<run>`` (the run's own), rank 0 adds the commit marker ``pardist.json``
and renames the directory into place. A process killed during a save leaves a ``.tmp-``
directory that :func:`latest` and :func:`load` ignore (the next run's save removes it),
and the previous checkpoint intact. Loading reads data, never code (``runtime._safe_dcp``):
docs/checkpoints.md says what that protects against and what it does not.

What is written, and by whom:

* Replicated leaves (plain tensors and Python values, the same on every rank:
  parameters, optimizer state, the step, shared RNG states, the data position)
  are written once, by rank 0; the other ranks write nothing. So a data-parallel
  checkpoint is complete on rank 0's disk, and loads at any world size. ``save``
  checks that they really agree across ranks and names the first that does not.
* Sharded leaves are ``torch.distributed.tensor.DTensor``: each rank writes its own
  shards, and :func:`load` reshards them to the layout of ``like``'s DTensors,
  at any world size. This is where sharded optimizer state plugs in.

Typical use, the same under ``python`` and ``torchrun``::

    state = {'params': params, 'opt_state': opt_state, 'step': 0}
    if (ckpt := pardist.checkpoint.latest('ckpts')) is not None:
        state = pardist.checkpoint.load(ckpt, state)      # resume
    ...
    pardist.checkpoint.save('ckpts', state, step=state['step'], keep=3)

``resume`` and ``offer`` (a replacement's state, under ``--keep-going``) are in
``_resume``. May import ``pardist.runtime``, ``pardist.transport`` and ``pardist.step``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pardist import transport
from pardist.runtime import (
    MARKER,
    CheckpointError,
    _rejoin,
    _safe_dcp,
    _survive,
    _tree,
    cause,
    claim_folder,
    commit,
    committed_steps,
    described,
    save_error,
    verify,
)
from pardist.step import _replication

__all__ = ["MARKER", "CheckpointError", "latest", "load", "offer", "resume", "save", "steps"]

steps = committed_steps  # the steps of the committed checkpoints in a directory


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _flat(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """``[(key, leaf)]`` with keys such as ``tree['params']['w']``, and the treedef."""
    named = _tree.leaves_with_paths(tree, "tree")
    return named, _tree.tree_flatten(tree)[1]


def _stateful(leaf: Any) -> bool:
    """DCP's ``Stateful``: a leaf saved as its ``state_dict()`` (a pardist.data.shard loader)."""
    return not isinstance(leaf, torch.Tensor) and callable(getattr(leaf, "load_state_dict", None))


def _as_data(tree: Any, where: str) -> list[tuple[str, Any]]:
    """``tree``'s ``[(key, leaf)]``, loaders as their state dicts; a leaf that a load would
    need code to rebuild is refused (``where`` names the caller)."""
    named = [(k, leaf.state_dict() if _stateful(leaf) else leaf) for k, leaf in _flat(tree)[0]]
    for key, leaf in named:  # what a load must read as data, never as code
        if not isinstance(leaf, torch.Tensor):
            _safe_dcp.check_leaf(key, leaf, where)
    return named


def _same_path(path: Any, where: str) -> None:
    """Every rank was given the same checkpoint path (else an error naming them, on every
    rank): a folder per rank (``tempfile.mkdtemp()`` on each) would have each rank read
    and write its own, and their collectives part ways."""
    if not _distributed() or dist.get_world_size() == 1:
        return
    mine = os.path.abspath(os.fspath(path))
    paths: list[Any] = [None] * dist.get_world_size()
    transport.agree(where, dist.group.WORLD)  # every rank here, at the same call of any step
    dist.all_gather_object(paths, mine)
    if len(set(paths)) > 1:
        shown = "; ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
        raise ValueError(
            f"{where}: the ranks were given different paths ({shown}). Give every rank the "
            "same checkpoint directory, one that every rank can read (a shared filesystem "
            "across hosts): make it once, e.g. on rank 0, and share its name "
            "(pardist.gather_object)."
        )


def _on_rank0(what: str, fn, *args) -> Any:
    """Run ``fn`` on rank 0 only; every rank returns its result or raises its error."""
    outcome: list[Any] = [None]
    if _rank() == 0:
        try:
            outcome[0] = ("ok", fn(*args))
        except CheckpointError as exc:  # (it says what failed, in pardist's words)
            outcome[0] = ("err", str(exc))
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            outcome[0] = ("err", f"pardist.checkpoint.save: rank 0 failed to {what}: {exc!r}")
    if _distributed() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    status, value = outcome[0]
    if status == "err":
        raise CheckpointError(value)
    return value


def save(
    path: str | os.PathLike, tree: Any, *, step: int | None = None, keep: int | None = None
) -> str:
    """Save a pytree atomically with torch.distributed.checkpoint; every rank calls it.

    Args:
        path: the checkpoint directory; with ``step``, the directory of
            checkpoints, and this one goes to ``path/<step>`` (orbax's layout).
        tree: any pytree (dicts, lists, tuples, NamedTuples) of tensors, DTensors,
            plain Python values (numbers, strings, and lists and dicts of them: what
            ``torch.load(weights_only=True)`` reads back; anything else is refused,
            naming it) and ``pardist.data.shard`` loaders (saved as their position;
            ``load`` makes the loader in ``like`` continue from it). Plain leaves must
            be the same on every rank (they are written once, by rank 0); DTensor
            leaves are written shard by shard by the ranks that hold them.
        step: the step number, which names the checkpoint inside ``path``.
        keep: with ``step``, keep only the newest ``keep`` checkpoints in ``path``.

    Returns:
        The path of the committed checkpoint.

    Raises:
        ValueError: a plain leaf differs between ranks (named by its path).
        TypeError: a leaf that loading would have to run code to rebuild.

    Example:
        >>> import pardist, tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> state = {'w': torch.ones(2), 'step': 3}
        >>> path = pardist.checkpoint.save(d, state, step=3)
        >>> pardist.checkpoint.latest(d) == path
        True
        >>> pardist.checkpoint.load(path, {'w': torch.zeros(2), 'step': 0})
        {'w': tensor([1., 1.]), 'step': 3}
    """
    if keep is not None and (step is None or keep < 1):
        raise ValueError(f"pardist.checkpoint.save: keep={keep!r} needs step= and keep >= 1.")
    # (--keep-going: a rank lost in the save, the survivors save again without it)
    return _survive.again_if_lost(lambda: _save(path, tree, step, keep), "pardist.checkpoint.save")


def _save(path, tree: Any, step: int | None, keep: int | None) -> str:
    _same_path(path, "pardist.checkpoint.save")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.tensor import DTensor

    final = Path(path) / str(int(step)) if step is not None else Path(path)
    named = _as_data(tree, "pardist.checkpoint.save")
    if _distributed() and dist.get_world_size() > 1:
        plain = [(p, leaf) for p, leaf in named if not isinstance(leaf, DTensor)]
        differs = _replication.mismatch(plain, dist.group.WORLD)
        if differs:
            raise ValueError(
                f"pardist.checkpoint.save: {differs}. A checkpoint keeps one copy of each "
                "plain leaf, written by rank 0, so they must be the same on every rank. Keep "
                "per-rank values out of the tree (or derive them from shared ones, e.g. seed "
                "from the step and the rank), or make a sharded value a DTensor."
            )

    def prepare() -> str:  # this run's temporary folder (a killed save's is removed)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"pardist.checkpoint.save: cannot make {final.parent} ({described(e)})."
            ) from None
        run = claim_folder(final.parent)
        shutil.rmtree(final.with_name(f"{final.name}.tmp-{run}"), ignore_errors=True)
        shutil.rmtree(final.with_name(f"{final.name}.tmp"), ignore_errors=True)  # (older)
        return run

    # Named by rank 0's run (its pid), the same on every rank: two runs saving into one
    # directory never write into one folder.
    tmp = final.with_name(f"{final.name}.tmp-{_on_rank0(f'prepare {final}', prepare)}")
    try:
        dcp.save(
            dict(named),
            storage_writer=_safe_dcp.writer_class()(tmp),
            planner=DefaultSavePlanner(flatten_state_dict=False, dedup_save_to_lowest_rank=True),
            no_dist=not _distributed(),
        )
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # a partial save: free what it took
        last = latest(final.parent) if step is not None else None
        group = dist.group.WORLD if _distributed() else None
        raise save_error(exc, tmp, last, group) from exc
    done = _on_rank0(f"commit {final}", commit, tmp, final, step, len(named), keep)
    _rejoin.take_in(named, step)  # --keep-going: replacements for lost ranks join here
    return done


def latest(path: str | os.PathLike, *, verify_files: bool = False) -> str | None:
    """The newest committed checkpoint saved with ``step=`` in ``path``, or None.

    Interrupted saves (``<step>.tmp-<run>``) are never returned, so resuming after a crash
    picks the last checkpoint that was written whole. A checkpoint whose commit marker
    cannot be read (or, with ``verify_files``, whose files changed since they were
    saved) is skipped with a warning that names it, for the one before it: a restart
    under ``--max-restarts`` does not fail on the same damaged file every time.

    Example:
        >>> import pardist, tempfile
        >>> pardist.checkpoint.latest(tempfile.mkdtemp()) is None
        True
    """
    for step in reversed(committed_steps(path)):
        found = Path(path) / str(step)
        try:
            verify(found, files=verify_files)
        except CheckpointError as e:
            import warnings

            warnings.warn(f"{e} Skipped, for the checkpoint before it.", stacklevel=2)
            continue
        return str(found)
    return None


def _check_against(path: Path, named: list[tuple[str, Any]]) -> None:
    try:
        metadata = _safe_dcp.reader_class()(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a damaged or crafted index: never a crash
        raise CheckpointError(
            f"pardist.checkpoint.load: {path / '.metadata'} cannot be read "
            f"({type(e).__name__}: {str(e)[:300]}). Load an earlier checkpoint."
        ) from None
    missing = [key for key, _ in named if key not in metadata]
    if missing:
        have = ", ".join(sorted(metadata)[:8]) + (" ..." if len(metadata) > 8 else "")
        raise KeyError(
            f"pardist.checkpoint.load: {missing[0]} is not in the checkpoint {path} "
            f"({len(missing)} of {len(named)} leaves missing; it holds {have}). Pass a "
            "`like` tree with the structure that was saved."
        )
    for key, leaf in named:
        saved = "a tensor" if hasattr(metadata[key], "chunks") else "a Python value"
        given = "a tensor" if isinstance(leaf, torch.Tensor) else "a Python value"
        if saved != given and not _stateful(leaf):
            raise TypeError(
                f"pardist.checkpoint.load: {key} is {saved} in the checkpoint {path} but "
                f"{given} ({type(leaf).__name__}) in `like`. Build `like` with the types that "
                "were saved (a tensor of the saved shape where a tensor was saved)."
            )
        size = getattr(metadata[key], "size", None)
        if isinstance(leaf, torch.Tensor) and size is not None and tuple(size) != leaf.shape:
            raise ValueError(
                f"pardist.checkpoint.load: {key} has shape {tuple(size)} in the checkpoint "
                f"{path} but shape {tuple(leaf.shape)} in `like`. Build `like` with the "
                "shapes that were saved (the global shapes, for DTensors)."
            )


def load(path: str | os.PathLike, like: Any) -> Any:
    """Load a checkpoint into a new tree shaped like ``like``; every rank calls it.

    Nothing is mutated: tensors are loaded into fresh tensors with the dtype and
    device of ``like``'s leaves. Works at any world size: replicated leaves are
    read whole by every rank, and DTensor leaves of ``like`` are filled with their
    shards in ``like``'s layout, resharded from whatever layout was saved. Leaves
    of the checkpoint that ``like`` lacks are not read.

    Args:
        path: a committed checkpoint, e.g. ``save``'s result or ``latest(dir)``.
        like: a tree with the saved structure; its leaves give shapes, dtypes and
            devices (their values are not used).

    Returns:
        A tree with ``like``'s structure and the checkpoint's values.

    Raises:
        FileNotFoundError: ``path`` is not a committed checkpoint.
        KeyError / ValueError / TypeError: ``like`` asks for a leaf the checkpoint
            lacks, or with another shape, or a tensor where a Python value was saved (or
            the other way round).
        CheckpointError: the checkpoint is damaged (a file changed since it was saved,
            an index that is not DCP's), named by file.
    """
    import torch.distributed.checkpoint as dcp

    _same_path(path, "pardist.checkpoint.load")
    path = Path(path)
    if not (path / MARKER).is_file():
        hint = (
            f" It holds checkpoints {steps(path)}: pass pardist.checkpoint.latest('{path}')."
            if steps(path)
            else " A save that was interrupted leaves no marker; load an earlier checkpoint."
        )
        raise FileNotFoundError(
            f"pardist.checkpoint.load: {path} is not a committed pardist checkpoint (no "
            f"{MARKER}).{hint}"
        )
    named, treedef = _flat(like)
    verify(path)  # every file as committed, before any is read (the index is a pickle)
    _check_against(path, named)
    state = {
        key: torch.empty_like(leaf)
        if isinstance(leaf, torch.Tensor)
        else leaf.state_dict()
        if _stateful(leaf)
        else leaf
        for key, leaf in named
    }
    planner = _safe_dcp.planner_class()(flatten_state_dict=False, allow_partial_load=True)
    try:
        dcp.load(
            state,
            storage_reader=_safe_dcp.reader_class()(str(path)),
            planner=planner,
            no_dist=not _distributed(),
        )
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise CheckpointError(
            f"pardist.checkpoint.load: reading {path} failed ({cause(exc)[1]})."
        ) from exc
    # Tensors are filled in place; Python values land in the planner's own dict.
    loaded = planner.state_dict
    for key, leaf in named:
        if _stateful(leaf):  # a loader continues from its saved position, a scheduler its rates
            leaf.load_state_dict(_safe_dcp.restored(state[key], loaded[key]))
            loaded[key] = leaf
    return _tree.tree_unflatten([loaded[key] for key, _ in named], treedef)


# (at the end: _resume uses the functions above)
from pardist.checkpoint._resume import offer, resume  # noqa: E402
