"""The step context: what a running data-parallel step tells the code inside it.

It sits low in the package so that ``pardist.grad``, the optimizers and batch norm
can read the active step (its mesh, axis, donated inputs, reducers) without
importing ``data_parallel``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch

from pardist.runtime._mesh import Mesh
from pardist.runtime._modes import EAGER, Mode

__all__ = [
    "CallState",
    "Ids",
    "StepContext",
    "collective_starts",
    "compiled_plan",
    "current_mode",
    "current_step",
    "debug_enabled",
    "donating",
    "entered",
    "is_donated",
    "pop",
    "push",
    "shard_group",
    "sharded_over",
]


class CallState:
    """What one call of a step gathers as it runs; the context around it is frozen."""

    def __init__(self):
        # Tensors made in the step that must end it averaged over the axis (batch-norm
        # statistics with sync_bn=False): pardist.grad carries them with the gradients.
        self.pending_means: list = []
        # A dynamic loss scale ran in this step: it skips non-finite steps itself, so
        # pardist.grad does not report them.
        self.loss_scaled = False
        # Set while the ranks run different numbers of micro-batches (accumulate='list'):
        # the error a collective inside them raises (its name fills in {name}).
        self.uneven: str | None = None
        # The deterministic mode passes pardist.fsdp parameters gathered whole (flat):
        # apply puts them in their modules in their own shapes.
        self.whole_shards = False


def collective_starts(name: str) -> None:
    """A collective is about to run: an error where the ranks cannot all be in it."""
    ctx = _active[-1] if _active else None
    if ctx is not None and ctx.call.uneven is not None:
        raise ValueError(ctx.call.uneven.format(name=name))


@dataclasses.dataclass(frozen=True)
class StepContext:
    """One call of a data-parallel step, as seen from inside it (frozen: what the call
    gathers as it runs is in ``call``, the buckets kept between calls in ``reducers``)."""

    name: str  # "pardist.data_parallel(train_step)", for error messages
    mesh: Mesh
    axis: tuple[str, ...]
    size: int  # product of the axis sizes
    # Input leaves by id (eager), or the leaves themselves in a traced step: see holds().
    varying: set[int] | dict[torch.Tensor, None]  # sharded over the step's axis
    donated: set[int] | dict[torch.Tensor, None]  # donated by the caller
    reducers: dict[Any, Any]  # persistent across calls: reducers by key, agreed row totals
    # How this step runs (runtime._modes): eager, deterministic or compiled. Operations
    # take its rules; ``mode.plan`` is a compiled step's static facts, ``mode.groups``
    # the deterministic mode's row groups. (No default: dynamo of torch 2.11 cannot
    # hold a mode object as a default while it traces a compiled step's context.)
    mode: Mode
    scatter: frozenset = frozenset()  # parameter signatures whose optimizer state is sharded
    compression: torch.dtype | None = None
    overlap: bool = False
    bucket_bytes: int = 25 * 2**20
    first_bucket_bytes: int = 2**20
    inputs: Any = dataclasses.field(default_factory=set)  # every leaf: Ids, or traced: a dict
    call: CallState = dataclasses.field(default_factory=CallState)


class Ids:
    """The ids of a step's input leaves, as a set made on first use (most steps never ask)."""

    __slots__ = ("_ids", "_set")

    def __init__(self, ids: list[int]):
        self._ids, self._set = ids, None

    def __contains__(self, i: object) -> bool:
        if self._set is None:
            self._set = set(self._ids)
        return i in self._set


_active: list[StepContext] = []


def current_step() -> StepContext | None:
    """The innermost running data-parallel step, or None outside of one."""
    return _active[-1] if _active else None


def current_mode() -> Mode:
    """How the innermost running step runs (:data:`EAGER` outside of any step)."""
    return _active[-1].mode if _active else EAGER


def compiled_plan() -> Any:
    """The plan of the innermost running step if it is a compiled one, else None."""
    return _active[-1].mode.plan if _active else None


def push(ctx: StepContext) -> None:
    """Make ``ctx`` the running step (a compiled step's graph calls this and :func:`pop`)."""
    _active.append(ctx)


def pop() -> None:
    _active.pop()


@contextlib.contextmanager
def entered(ctx: StepContext) -> Iterator[StepContext]:
    push(ctx)
    try:
        with ctx.mesh:
            yield ctx
    finally:
        pop()


def is_donated(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor was donated to the running step (so may be updated in place)."""
    ctx = current_step()
    if ctx is None or not tensors:
        return False
    donated = ctx.donated
    if isinstance(donated, dict):  # a traced step: by identity
        return all(t in donated for t in tensors)
    return all(map(donated.__contains__, map(id, tensors)))


def holds(group: set[int] | dict[torch.Tensor, None], t: torch.Tensor) -> bool:
    """Whether ``t`` is one of ``group``: ids in eager steps (a set lookup), the tensors
    themselves as a dict's keys in a traced step (dynamo cannot trace ``id()`` of a tensor
    the graph made, torch 2.11; it hashes a tensor by identity). A lookup, not a loop over
    the group: dynamo runs every loop's bytecode while it traces."""
    if isinstance(group, dict):
        return t in group
    return id(t) in group


@contextlib.contextmanager
def donating(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Treat ``tensors`` (buffers pardist owns) as donated inside the running step."""
    ctx = current_step()
    if ctx is None:
        yield
        return
    added = [t for t in tensors if not holds(ctx.donated, t)]
    traced = isinstance(ctx.donated, dict)
    ids = set() if traced else {id(t) for t in added}
    if traced:
        ctx.donated.update((t, None) for t in added)
    else:
        ctx.donated.update(ids)
    try:
        yield
    finally:
        if traced:
            for t in added:
                del ctx.donated[t]
        else:
            ctx.donated.difference_update(ids)


_shard_groups: list = []


@contextlib.contextmanager
def sharded_over(group) -> Iterator[None]:
    """Inside: optimizer leaves are this rank's shards of tensors split over ``group``."""
    _shard_groups.append(group)
    try:
        yield
    finally:
        _shard_groups.pop()


def shard_group():
    """The group that the optimizer's current leaves are sharded over, or None."""
    return _shard_groups[-1] if _shard_groups else None


def debug_enabled() -> bool:
    """``PARDIST_DEBUG=1``: check replicated values on every call, not only the first."""
    return os.environ.get("PARDIST_DEBUG", "") not in ("", "0")
