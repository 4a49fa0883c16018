"""A replacement for a lost rank joins the survivors (``--keep-going --max-restarts K``).

The launcher starts the replacement with the same command as soon as it learns of the
death, before it tells the survivors (``runtime._survive``), and lists it as *starting*.
The replacement's ``pardist.init`` signs in as ready and waits (:func:`wait_to_join`).
The survivors take it in at a step boundary where every rank holds the loop's whole
state, the very tree the replacement's ``pardist.checkpoint.resume`` asks for: their
next ``pardist.checkpoint.offer`` after it is ready, or their next
``pardist.checkpoint.save``, which waits for it (:func:`take_in`). The launcher's word
for a group lists the replacements on their way, so every survivor knows, with no
collective, whether there is one to take in:

1. the main rank sees which are ready (a save waits for those still starting), tells
   the others, and asks the launcher to take them in; the launcher publishes the next
   generation, the survivors followed by the replacements, as it publishes a loss;
2. the survivors leave their group and every member starts the new one;
3. the main rank sends the state over the new group (:func:`send`): the tree offered
   or saved (tensors by broadcast, loaders and other plain leaves as values), pardist's
   random count, and each step's count of calls, so that the replacement's first call
   is the survivors' next one. The replacement's ``resume`` returns it (:func:`receive`);
   no file is read.

Under ``deterministic=G`` the run then goes on, at the larger size, with the bits of
the run that lost nothing.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from pardist.runtime import _join, _process, _progress, _rng, _survive

__all__ = [
    "BUDGET",
    "adopted",
    "joining",
    "note",
    "ready_key",
    "receive",
    "replacing",
    "starting",
    "take_in",
    "take_key",
    "wait_to_join",
]

BUDGET = "PARDIST_KEEP_GOING_REPLACE"  # the launcher's budget of replacements
STARTING = "pardist/keep-going/starting"  # replacements started, not yet taken in
_joined = {"waiting": False, "counts": {}}  # a replacement in the group, before resume
_counts: dict[int, tuple[int, int]] = {}  # step key -> (calls entered, calls run)


def ready_key(launch: int) -> str:
    return f"pardist/keep-going/ready/{launch}"


def take_key(generation: int) -> str:
    return f"pardist/keep-going/take/{generation}"


def replacing() -> bool:
    """Whether the launcher may start replacements for lost ranks."""
    return _survive.enabled() and int(os.environ.get(BUDGET, "0") or 0) > 0


def joining() -> bool:
    """Whether this is a replacement taken into the group that has not had the state yet."""
    return _joined["waiting"]


def starting(store) -> list[int]:
    return json.loads(store.get(STARTING)) if store.check([STARTING]) else []


def note(key: int, entered: int, calls: int) -> None:
    """A step's counts after a call (under --keep-going): what a replacement adopts."""
    _counts[key] = (entered, calls)


def adopted(key: int) -> tuple[int, int] | None:
    """The survivors' counts of the step ``key`` at the join, for a replacement's step."""
    return _joined["counts"].pop(key, None)


def wait_to_join(store) -> None:
    """A replacement's ``pardist.init``: ready, then in the group the survivors formed."""
    _survive.remember(store, 0)
    me = _survive.launch_rank()
    store.set(ready_key(me), "1")
    deadline = time.monotonic() + _join.join_timeout().total_seconds()
    generation = 0
    while True:
        generation = _survive.latest(store, generation)
        key = _survive.members_key(generation)
        if generation and me in json.loads(store.get(key))["members"]:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"pardist.init (a replacement, launch rank {me}): the survivors did not take "
                f"it in within {_join.join_timeout().total_seconds():.0f} s. They take a "
                "replacement in at their next pardist.checkpoint.save or offer; a run that "
                "calls neither often takes longer (raise PARDIST_JOIN_TIMEOUT)."
            )
        time.sleep(0.02)
    _survive.enter(store, generation, _process.join)
    _joined["waiting"] = True


def _ready(store, ids: list[int], wait: bool) -> tuple[list[int], list[int]]:
    """The main rank: which of ``ids`` are ready, and which are gone (no longer starting);
    with ``wait``, once each is one or the other (within the join timeout)."""
    deadline = time.monotonic() + (_join.join_timeout().total_seconds() if wait else 0)
    while True:
        alive = set(starting(store))
        ready = [i for i in ids if i in alive and store.check([ready_key(i)])]
        gone = [i for i in ids if i not in alive]
        if len(ready) + len(gone) == len(ids) or time.monotonic() >= deadline:
            return ready, gone
        time.sleep(0.02)


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def take_in(named: list[tuple[str, Any]], step: int | None, wait: bool = True) -> bool:
    """At a step boundary (every survivor calls it): take in the replacements that the
    launcher started and that are ready, and send them ``named`` (the loop's state, its
    loaders as state dicts); whether any joined. ``wait``: for those still starting.

    The replacements expected come with the launcher's word for this group, the same on
    every rank: with none, this makes no collective."""
    store, expected = _survive.state()["store"], _survive.state()["expected"]
    if not replacing() or store is None or not dist.is_initialized() or not expected:
        return False
    main = dist.get_rank() == 0
    ids, gone = _broadcast(_ready(store, expected, wait) if main else None)
    _survive.state()["expected"] = [i for i in expected if i not in ids and i not in gone]
    if not ids:
        return False
    before, generation = _survive.state()["members"], _survive.state()["generation"]
    if main:
        store.set(take_key(generation), json.dumps(ids))
    generation = _survive.after(generation)
    _process.leave()
    word, generation = _survive.enter(store, generation, _process.join)
    members = word["members"]
    rank, world = members.index(_survive.launch_rank()), len(members)
    came = [m for m in members if m not in before]
    gone = [k for k, m in enumerate(before) if m not in members]
    _progress.print0(
        f"pardist (--keep-going): took in launch rank(s) {came}"
        + (f" (and lost rank(s) {gone})" if gone else "")
        + f"; going on with {world} rank(s) from step {step}."
    )
    _survive.hooks(rank, world)
    if came:
        _send(named, step)
    return bool(came)


def _meta(named: list[tuple[str, Any]], step: int | None) -> dict:
    tensors = [(k, tuple(v.shape), v.dtype) for k, v in named if isinstance(v, torch.Tensor)]
    plain = {k: v for k, v in named if not isinstance(v, torch.Tensor)}
    return dict(
        keys=[k for k, _ in named], tensors=tensors, plain=plain, step=step,
        rng=_rng.rng_count(), counts=dict(_counts),
    )  # fmt: skip


def _agree(problem: str | None) -> None:
    """Every rank raises if any could not take the state (the replacement's is named)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    found = next((p for p in everyone if p), None)
    if found:
        raise ValueError(found)


def _send(named: list[tuple[str, Any]], step: int | None) -> None:
    """Every survivor: the main rank's state, by broadcast, to the replacements."""
    meta = _broadcast(_meta(named, step) if dist.get_rank() == 0 else None)
    _agree(None)
    mine = dict(named)
    for key, shape, dtype in meta["tensors"]:
        if dist.get_rank() == 0:
            dist.broadcast(mine[key].detach().contiguous(), src=0)
        else:  # (a survivor other than the main one receives a copy it does not use)
            dist.broadcast(torch.empty(shape, dtype=dtype, device=mine[key].device), src=0)


def receive(named_like: list[tuple[str, Any]]) -> tuple[dict, int | None]:
    """A replacement's ``resume``: the main rank's values for each key of ``named_like``
    (tensors in fresh tensors shaped, typed and placed as its leaves), and the step."""
    meta = _broadcast(None)
    want = [k for k, _ in named_like]
    problem = None
    if want != meta["keys"]:
        problem = (
            f"pardist.checkpoint.resume (a replacement, --keep-going): the survivors' tree "
            f"has the leaves {meta['keys']}, this one's {want}. A replacement runs the same "
            "script: save and resume the same tree."
        )
    like = dict(named_like)
    for key, shape, dtype in meta["tensors"] if problem is None else ():
        leaf = like[key]
        if not isinstance(leaf, torch.Tensor) or (tuple(leaf.shape), leaf.dtype) != (shape, dtype):
            problem = (
                f"pardist.checkpoint.resume (a replacement, --keep-going): the survivors' "
                f"{key} is a {dtype} tensor of shape {list(shape)}, this one's "
                f"{getattr(leaf, 'dtype', type(leaf).__name__)} {list(getattr(leaf, 'shape', []))}."
            )
            break
    _agree(problem)
    out = dict(meta["plain"])
    for key, _, _ in meta["tensors"]:
        out[key] = torch.empty_like(like[key])
        dist.broadcast(out[key], src=0)
    _rng.set_rng_count(meta["rng"])
    _joined.update(waiting=False, counts=dict(meta["counts"]))
    return out, meta["step"]
