"""Keep going when a rank dies: the survivors leave the broken group and form a smaller one.

Under ``python -m pardist.launch --keep-going`` or ``pardist.spawn(..., keep_going=True)``
the launcher hosts the run's store (it outlives every rank) and is the parent of every
rank, so it learns of a death at once (the child's pipe closes, ``waitpid``) and for
certain (a rank that is only slow is never taken for dead). It then publishes the next
*membership*: the launch ranks still running, under a generation number. A rank whose
step saw a peer go (``CollectiveTimeout`` from the shared-memory liveness check or a
closed gloo connection, or the ``StepMismatch`` of a peer that left to regroup) calls
:func:`regroup`: it waits for that membership, leaves the old process group, and starts
a new one over the survivors (its rank: its place among them), through a store prefix
of the generation, so no key of the old group is read again. What the survivors then do
with the step that failed is the step's business (``step._survivor``).

A membership is what the launcher saw, not what ranks vote: the design of torchelastic's
agent (the parent watches its children) applied per step instead of per restart. A
second death during the regroup is a newer generation, which the waiting ranks take.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import torch.distributed as dist

from pardist.runtime import _faults, _warnings

__all__ = [
    "ENV",
    "after",
    "again_if_lost",
    "enabled",
    "enter",
    "hooks",
    "how_it_died",
    "latest",
    "launch_rank",
    "launcher_view",
    "members_key",
    "on_caught_up",
    "on_regroup",
    "on_reread",
    "place",
    "publish",
    "refuse_sharded",
    "regroup",
    "reread",
    "remember",
    "state",
]

ENV = "PARDIST_KEEP_GOING"
ID = "PARDIST_KEEP_GOING_ID"  # a replacement's name in memberships (runtime._rejoin)
_WAIT_S = 20.0  # how long a rank whose step failed waits for the launcher's word
_state: dict = {"store": None, "generation": 0, "members": None, "expected": []}
_hooks: list[Callable[[int, int], None]] = []
_catchers: list[Callable[[], None]] = []
_rereaders: list[Callable] = []


def enabled() -> bool:
    """Whether this rank was started to keep going when a peer dies."""
    return os.environ.get(ENV, "") not in ("", "0")


def launch_rank() -> int:
    """This process's name in memberships: its rank when the run started (``RANK``), or
    the number the launcher gave a replacement (``PARDIST_KEEP_GOING_ID``)."""
    return int(os.environ.get(ID) or os.environ.get("RANK", "0"))


def how_it_died(code: int | None) -> str:
    """A rank's exit code (negative: the signal), in words."""
    if code is None:
        return "gone"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def members_key(generation: int) -> str:
    return f"pardist/keep-going/members/{generation}"


def launcher_view(store, secret: str, attempt: str = "0"):
    """The launcher's view of ``store`` with the keys the ranks read (``_process.start``)."""
    view = dist.PrefixStore(f"pardist/attempt_{attempt}/", store)
    return dist.PrefixStore(f"pardist-run-{secret}", view) if secret else view


def publish(view, generation: int, members: list[int], lost: dict[int, str], starting=()) -> None:
    """The launcher's word (through :func:`launcher_view`): the launch ranks ``members``
    go on, in that order, as ``generation``; ``lost`` maps each lost one to how it died;
    ``starting``: the replacements on their way, which the group may take in later."""
    word = {"members": members, "lost": {str(r): how for r, how in lost.items()}}
    word["starting"] = sorted(starting)
    view.set(members_key(generation), json.dumps(word))


def remember(store, world: int) -> None:
    """At the group's start: the run's store, through which later groups are formed."""
    _state.update(store=store, generation=0, members=list(range(world)), expected=[])


def refuse_sharded(where: str, what: str) -> None:
    """Under --keep-going, an error at once for state sharded over the ranks (``what``):
    a lost rank's shards would be gone with it, and no survivor holds another copy."""
    if enabled():
        raise ValueError(
            f"{where}: --keep-going needs replicated state, but this shards {what} over the "
            "ranks: a lost rank's shards would be gone with it, and no survivor holds "
            "another copy. Under --keep-going use a replicated optimizer and parameters (the "
            "default); with sharded state, run without --keep-going: --max-restarts resumes "
            "every rank from the last checkpoint's shards (docs/keep_going.md)."
        )


def on_regroup(hook: Callable[[int, int], None]) -> None:
    """Call ``hook(rank, world_size)`` once a new group over the survivors has started."""
    if hook not in _hooks:
        _hooks.append(hook)


def on_caught_up(catch_up: Callable[[], None]) -> None:
    """Call ``catch_up()`` on every survivor right after each regroup, wherever it saw the
    loss: its collectives are the first of the new group on every rank (step._survivor)."""
    if catch_up not in _catchers:
        _catchers.append(catch_up)


def on_reread(reader: Callable) -> None:
    """``reader(batch)``: this rank's share, in the new group, of the global batch that
    ``batch`` was a share of (a loader's), or None where ``batch`` is not one of its."""
    if reader not in _rereaders:
        _rereaders.append(reader)


def reread(batch):
    """This rank's new share of the global batch ``batch`` came from, or None (see on_reread)."""
    for reader in _rereaders:
        again = reader(batch)
        if again is not None:
            return again
    return None


def again_if_lost(fn: Callable, where: str, check: bool = False):
    """``fn()`` outside any step (a loader's check at the start of a pass, a checkpoint's
    save); where a peer was lost in it under --keep-going, ``fn()`` again over the
    survivors (as often as ranks are lost). ``check``: ``fn`` only checks that the ranks
    agree, so a rank whose peers all got past it (into the next call of the step) skips
    it instead (step._survivor's catch-up decides, the same on every rank)."""
    if not enabled() or _state["store"] is None:
        return fn()
    while True:
        try:
            with _faults.collective_errors(where, dist.group.WORLD):
                return fn()
        except _faults.KEEP_GOING_ON as error:
            from pardist.runtime import _process

            _place.update(outside="check" if check else where, skip=False)
            try:
                regroup(error, _process.leave, _process.join)
            finally:
                _place["outside"] = None
            if _place["skip"]:
                return None


def place() -> dict:
    """Where this rank is regrouping from: ``outside`` a step (None inside one: "check"
    for a check the others may have passed, else the collective's name), and whether it
    is to ``skip`` that check (set by the catch-up)."""
    return _place


_place: dict = {"outside": None, "skip": False}


def state() -> dict:
    """This rank's view: the run's ``store``, the ``generation`` and its ``members``."""
    return _state


def latest(store, after: int) -> int:
    """The newest generation the launcher has published (``after`` if none since)."""
    generation = after
    while store.check([members_key(generation + 1)]):
        generation += 1
    return generation


def _wait_for_word(store, error: BaseException, wait_s: float = _WAIT_S) -> int:
    """The newest generation after ours, once the launcher has published one."""
    deadline = time.monotonic() + wait_s
    while True:
        newest = latest(store, _state["generation"])
        if newest > _state["generation"]:
            return newest
        if time.monotonic() > deadline:  # nobody died: a real mismatch, or a hang
            raise error
        time.sleep(0.02)


def _let_go(error: BaseException | None) -> None:
    """Drop the frames of ``error``'s tracebacks: they hold the old process group, whose
    gloo connections close only once nothing does (a survivor still waiting in one of its
    collectives then learns at once that the others have left)."""
    while error is not None:
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


def _all_here(store, generation: int, members: list[int]) -> bool:
    """Wait until every member of ``generation`` signed in; False if a newer one came."""
    prefix = f"pardist/keep-going/here/{generation}"
    store.set(f"{prefix}/{launch_rank()}", "1")
    deadline = time.monotonic() + _faults.timeout_seconds()
    while True:
        if store.check([members_key(generation + 1)]):
            return False
        if all(store.check([f"{prefix}/{m}"]) for m in members):
            return True
        if time.monotonic() > deadline:
            late = [m for m in members if not store.check([f"{prefix}/{m}"])]
            raise _faults.CollectiveTimeout(
                f"pardist (--keep-going): the survivors' new group (generation {generation}) "
                f"waited {_faults.timeout_seconds():.0f} s for launch rank(s) {late}.",
                late,
                "the survivors' regroup",
            )
        time.sleep(0.01)


def enter(store, generation: int, start: Callable) -> tuple[dict, int]:
    """Sign in under ``generation`` (or a newer one, where one came meanwhile) and start
    its group with ``start(store, rank, world)``; what the launcher said, and the
    generation entered. A rank that the launcher counted out exits."""
    while True:
        word = json.loads(store.get(members_key(generation)))
        if launch_rank() not in word["members"]:  # the launcher counted this rank out
            os._exit(1)
        if _all_here(store, generation, word["members"]):
            break
        generation = latest(store, generation)
    members = word["members"]
    rank, world = members.index(launch_rank()), len(members)
    start(dist.PrefixStore(f"pardist/keep-going/group/{generation}", store), rank, world)
    expected = [m for m in word.get("starting", []) if m not in members]
    _state.update(generation=generation, members=members, expected=expected)
    return word, generation


def after(generation: int) -> int:
    """The newest generation after ``generation``, once the launcher has published one
    (within the collective timeout)."""
    error = _faults.CollectiveTimeout(
        f"pardist (--keep-going): the launcher published no membership after generation "
        f"{generation} within {_faults.timeout_seconds():.0f} s.",
        [],
        "the launcher's word",
    )
    return _wait_for_word(_state["store"], error, _faults.timeout_seconds())


def hooks(rank: int, world: int) -> None:
    """Tell the loaders and steps (:func:`on_regroup`) of the group that has started."""
    for hook in _hooks:
        hook(rank, world)


def regroup(error: BaseException, leave: Callable, start: Callable) -> dict:
    """After ``error`` (a peer lost inside a step): the group over the survivors.

    Raises ``error`` itself where this rank does not keep going or where the launcher
    published no new membership (nobody died). ``leave()`` leaves the old process group
    and ``start(store, rank, world)`` starts the new one. Returns what the launcher said:
    ``members`` (launch ranks, in the new rank order), ``lost`` (launch rank to how it
    died), ``generation``.
    """
    store = _state["store"]
    if not enabled() or store is None:
        raise error
    while True:
        word = _regroup_once(store, error, leave, start)
        try:  # a loss while the survivors compare where they are: regroup again
            with _faults.collective_errors("pardist (--keep-going)", dist.group.WORLD):
                for catch_up in _catchers:
                    catch_up()
            return word
        except _faults.KEEP_GOING_ON as again:
            error = again


def _regroup_once(store, error: BaseException, leave: Callable, start: Callable) -> dict:
    generation = _wait_for_word(store, error)
    _let_go(error)
    leave()  # first: a survivor still in one of its collectives is waiting for this one
    before = _state["members"]
    word, generation = enter(store, generation, start)
    members = word["members"]
    rank, world = members.index(launch_rank()), len(members)
    gone = [k for k, m in enumerate(before) if m not in members]
    how = "; ".join(f"rank {k}: {word['lost'].get(str(before[k]), 'lost')}" for k in gone)
    came = [m for m in members if m not in before]
    joined = f" and took in {len(came)} replacement(s)" if came else ""
    _warnings.warn(
        f"pardist (--keep-going): lost rank(s) {gone} ({how}){joined}; going on with "
        f"{world} rank(s), this one now rank {rank}.",
        _warnings.RankLostWarning,
    )
    hooks(rank, world)
    return dict(word, generation=generation)
