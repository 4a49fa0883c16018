"""A step's call that lost a rank, under ``--keep-going``: redone over the survivors.

The call raised because a peer died (``runtime._survive`` has the launcher's word and
the survivors' new group). What each survivor then does depends on how far it got:

* The survivors compare how many calls of the step each has entered. A death inside the
  last collective of a call can let some ranks finish that call (over gloo, the ranks a
  ring's last message reached) while others did not: those behind take the finished
  call's result from one that has it (it was computed with every rank, the lost one
  included, so it is the uninterrupted run's), and return it.
* The others redo their call from its inputs, which a pure step has not changed (the
  donation of arguments is off under ``--keep-going``, so the optimizers never write
  into them), over the new group, on this rank's share of the *same* global batch:
  ``pardist.data.shard``'s loader re-reads it for the new world size, the lost rank's
  rows included. The step's random streams are rewound to the call's start, so the
  deterministic mode's row groups draw the same masks.

Under ``deterministic=G`` (with a world size that still divides G) the redone call has
the uninterrupted run's bits; in the default mode, a run at the survivors' size's. A
compiled step is compiled again, once, for the new size.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist

from pardist.compile import _step
from pardist.runtime import _compat_inductor, _mesh, _process, _rejoin, _rng, _survive
from pardist.step._specs import P

__all__ = ["adopt", "called", "note", "plan", "survive", "track"]


def _sharded(spec: Any) -> bool:
    """Whether a spec tree splits anything (``P()`` and None replicate)."""
    if isinstance(spec, P):
        return any(e is not None for e in spec)
    if isinstance(spec, dict):
        return any(map(_sharded, spec.values()))
    return isinstance(spec, (tuple, list)) and any(map(_sharded, spec))


def _reread(step, args: tuple, axes: tuple) -> tuple:
    """``args`` with each batch from ``pardist.data.shard`` replaced by this rank's new share."""
    specs = step.full_specs(args, axes)
    out = list(args)
    for i, (arg, spec) in enumerate(zip(args, specs)):
        again = _survive.reread(arg)
        if again is not None:
            out[i] = again
        elif _sharded(spec):
            raise ValueError(
                f"{step.where} (--keep-going): a rank was lost, and argument {i} of the call "
                "is a shard of the batch that did not come from a pardist.data.shard loader, "
                "so the survivors cannot re-read the lost rank's rows. Feed the step the "
                "batches of pardist.data.shard(loader, split_batches=True)."
            )
    return tuple(out)


def track(step) -> None:
    """Follow the new groups of ``--keep-going`` (a rank lost, or replacements taken in)."""
    _steps.add(step)


def _forget(rank: int, world: int) -> None:
    """A new group: every step's caches of the old one go; compiled ones compile again."""
    reset = False
    for step in list(_steps):
        step._groups.clear()
        step._specs_cache.clear()
        step.reducers.clear()
        if step.compiled is not None:  # compiled anew for the new world size, once
            if not reset:  # (dynamo's caches hold the old group's constants)
                _compat_inductor.reset_dynamo()
                reset = True
            step.compiled = _step.compiled_step(step.compile_option, step.where)


def note(step) -> None:
    """After a call: its counts, which a replacement taken in later adopts."""
    _rejoin.note(step.key, step.entered, step.calls)


def adopt(key: int, entered: int, calls: int) -> tuple[int, int]:
    """A step's counts at its first call: the survivors' (its call is then their next
    one, and the checks of a first call, which they made long ago, are not made again)."""
    theirs = _rejoin.adopted(key)
    return (entered, calls) if theirs is None else (theirs[0] + 1, theirs[1])


_steps: weakref.WeakSet = weakref.WeakSet()
_survive.on_regroup(_forget)


def _catch_up(inside) -> None:
    """Right after every regroup, on every survivor (wherever it saw the loss: inside a
    step, or between steps in a loader's or a checkpoint's collective): the survivors
    compare how far each got with the step called last. A death inside the last
    collective of a call can let some ranks finish that call while others did not; a
    survivor that finished it may already be past the step, in the next collective
    outside it. Those still inside the call take its result from one that finished it."""
    last = _recent[0]() if _recent[0] is not None else None
    if inside is not None:  # (what an attempt cut short by a further loss decided goes)
        inside._caught = None
    _survive.place()["skip"] = False
    outside = _survive.place()["outside"]
    mine = None if last is None else (last.key, last.calls, last is inside, outside)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    src, takers, skippers = plan(everyone)
    me = dist.get_rank()
    if me in skippers:
        _survive.place()["skip"] = True  # only a check, which the others passed
    if src is None:
        return
    box = [last._last if me == src else None]
    dist.broadcast_object_list(box, src=src)
    if me in takers:  # (inside the call the others finished)
        last._caught = box


def plan(everyone: list) -> tuple[int | None, set, set]:
    """From every rank's ``(step key, calls finished, inside the step, outside where)``
    (None: no step called yet): the rank that sends the finished call's result (None:
    nobody needs one), the ranks that take it, and the ranks that skip the check they
    regrouped from (their peers got past it, into the next call).

    >>> plan([(1, 8, False, "check"), (1, 7, True, None)])  # one finished, one still in it
    (0, {1}, set())
    >>> plan([(1, 8, False, "check"), (1, 8, True, None)])  # one past the check
    (None, set(), {0})
    """
    known = [m for m in everyone if m is not None]
    if not known or any(m[0] != known[0][0] for m in known):
        return None, set(), set()  # (no step yet, or last in different steps: each redoes)
    behind, ahead = min(m[1] for m in known), max(m[1] for m in known)
    if behind < ahead and (ahead - behind > 1 or len(known) < len(everyone)):
        _apart(everyone)
    past = [r for r, m in enumerate(everyone) if m and m[2] and m[1] == ahead]
    waiting = [r for r, m in enumerate(everyone) if m and not m[2] and m[1] == ahead]
    skippers = set()
    if past and waiting:  # a loss in the last message of a collective between two calls
        if any(everyone[r][3] != "check" for r in waiting):
            _apart(everyone)
        skippers = set(waiting)
    if behind == ahead:
        return None, set(), skippers
    if any(m[1] == behind and not m[2] for m in known):
        _apart(everyone)
    src = [m[1] for m in everyone].index(ahead)
    return src, {r for r, m in enumerate(everyone) if m and m[1] == behind}, skippers


def _apart(everyone: list) -> None:
    raise RuntimeError(
        "pardist (--keep-going): after a rank was lost, the survivors are too far apart to "
        f"be brought back into step (calls of the step each finished, and where: "
        f"{[m and (m[1], 'in the step' if m[2] else m[3]) for m in everyone]})."
    )


def called(step) -> None:
    """At a call's start: the step this rank called last (what ``_catch_up`` compares)."""
    _recent[0] = weakref.ref(step)


_recent: list = [None]
_inside: list = [None]
_survive.on_caught_up(lambda: _catch_up(_inside[0]))


def survive(step, error: BaseException, args: tuple, kwargs: dict, count: int) -> Any:
    """The result of the failed call, over the survivors (``error`` if nobody died)."""
    if step.mesh is not None:  # made over the old group: it cannot follow the survivors
        raise error
    _inside[0], step._caught = step, None
    try:
        _survive.regroup(error, _process.leave, _process.join)  # (every step forgets its group)
    finally:
        _inside[0] = None
    if step._caught is not None:  # the call the others finished: its result from them
        (out,), step._caught = step._caught, None
        step.calls += 1
        _rng.set_rng_count(count + 1)
        step._last = out
        return out
    _rng.set_rng_count(count)
    step.entered -= 1
    mesh = _mesh.current_mesh(step.where.removeprefix("pardist."))
    return step(*_reread(step, args, step.data_axes(mesh)), **kwargs)
