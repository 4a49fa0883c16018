"""Resuming a run: from its newest checkpoint, or (a replacement for a lost rank under
``--keep-going --max-restarts K``) from the state a survivor sends at a step boundary.

The survivors offer that state where the loop's whole state is at hand: in every
:func:`pardist.checkpoint.save`, and in :func:`offer`, which a loop may call at every
step (it costs nothing while no replacement is on its way). ``runtime._rejoin`` is the
protocol; this module is the user's side of it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pardist.checkpoint import CheckpointError, _as_data, _flat, _same_path, _stateful, load
from pardist.runtime import _progress, _rejoin, _survive, _tree, committed_steps

__all__ = ["offer", "resume"]

_looked = {"at": False}  # whether offer has checked a tree's leaves yet


def offer(tree: Any, *, step: int | None = None) -> None:
    """A step boundary at which a replacement for a lost rank may join; every rank calls it.

    ``tree`` is what the loop needs to go on from here, the tree a :func:`save` here
    would save and the one the replacement's :func:`resume` asks for (parameters,
    optimizer state, loaders, the step or epoch counter). Under ``--keep-going
    --max-restarts K`` (a budget of replacements), when a replacement that the launcher
    started for a lost rank is ready (its ``pardist.init`` has signed in), the survivors
    take it in here: they form the larger group, the main rank sends ``tree``, pardist's
    random count and each step's count of calls over the transport, and the run goes on
    at the larger size with the next step. Nobody waits for a replacement that is still
    starting: it joins at a later call (or at a :func:`save`, which waits for it).

    Otherwise this is nothing: no collective, no copy, ``tree`` untouched (the first
    call checks that its leaves are data that a replacement can take, as :func:`save`
    does). While a replacement is on its way, one small broadcast per call. A rank lost
    in it is survived as in a step.

    Args:
        tree: the loop's state, as for :func:`save` (tensors, plain values, loaders).
        step: the step number the replacement's join line names.

    Example:
        >>> import pardist, torch
        >>> pardist.checkpoint.offer({'w': torch.ones(2), 'step': 3}, step=3)  # (no run)
    """
    if not _rejoin.replacing() or (_looked["at"] and not _survive.state()["expected"]):
        return  # (no replacement on its way: nothing to look at; the first call looks)
    where = "pardist.checkpoint.offer"
    named = _as_data(tree, where)  # (what the replacement's resume refuses from a file too)
    _looked["at"] = True
    _survive.again_if_lost(lambda: _rejoin.take_in(named, step, wait=False), where)


def _joined(like: Any) -> Any:
    named, treedef = _flat(like)
    got, step = _rejoin.receive(named)
    for key, leaf in named:
        if _stateful(leaf):  # a loader continues from the survivors' position
            leaf.load_state_dict(got[key])
            getattr(leaf, "_after_join", lambda: None)()  # (part-way through a pass)
            got[key] = leaf
    print(f"pardist.checkpoint: joined the run at step {step} (the state from rank 0)", flush=True)
    return _tree.tree_unflatten([got[key] for key, _ in named], treedef)


def resume(
    path: str | os.PathLike | None, like: Any, *, total: int | None = None, key: str = "epoch"
):
    """The newest checkpoint in ``path`` loaded like ``like`` (``like`` itself if none),
    saying on rank 0 what it did.

    "resumed from ckpt/2 at epoch 2", "nothing left to do: epoch 3 of 3 already done"
    (when ``state[key] >= total``), or "no checkpoint in ckpt: starting afresh"; and a
    warning when the run's length changed since the checkpoint (``total`` against the
    checkpoint's ``state['total']``, if the state keeps one): a schedule over the whole
    run then changes its shape from here on.

    Under ``--keep-going --max-restarts K``, a replacement for a lost rank returns the
    survivors' state instead, sent by a peer at their next :func:`save` or :func:`offer`
    ("joined the run at step 6 (the state from rank 0)"); no file is read. ``path=None``:
    no directory, ``like`` itself unless this is such a replacement.

    Example:
        >>> import pardist, tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> _ = pardist.checkpoint.save(d, {'w': torch.ones(1), 'epoch': 3}, step=3)
        >>> state = pardist.checkpoint.resume(d, {'w': torch.zeros(1), 'epoch': 0}, total=3)
        pardist.checkpoint: nothing left to do: epoch 3 of 3 already done (...)
    """
    if _rejoin.joining():  # a replacement (--keep-going): the survivors' state, not a file
        return _joined(like)
    if path is None:  # (no directory: only a replacement's state, from its peers)
        return like
    _same_path(path, "pardist.checkpoint.resume")
    state = last = None
    for step in reversed(committed_steps(path)):  # the newest that reads back whole
        try:
            last = str(Path(path) / str(step))
            state = load(last, like)
            break
        except CheckpointError as e:
            import warnings

            warnings.warn(f"{e} Skipped, for the checkpoint before it.", stacklevel=2)
            state = last = None
    if state is None:
        _progress.print0(f"pardist.checkpoint: no checkpoint in {path}: starting afresh")
        return like
    done = state.get(key) if isinstance(state, dict) else None
    if total is not None and isinstance(done, int) and done >= total:
        _progress.print0(
            f"pardist.checkpoint: nothing left to do: {key} {done} of {total} already done ({last})"
        )
    else:
        at = f" at {key} {done}" if done is not None else ""
        _progress.print0(f"pardist.checkpoint: resumed from {last}{at}")
    saved = state.get("total") if isinstance(state, dict) else None
    if total is not None and isinstance(saved, int) and saved != total:
        import warnings

        warnings.warn(
            f"pardist.checkpoint.resume: the run's length changed since {last}: {saved} "
            f"{key}s then, {total} now; a schedule over the whole run (one_cycle, "
            "warmup_cosine) changes its shape from here on.",
            stacklevel=2,
        )
    return state
