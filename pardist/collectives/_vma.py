"""Varying manual axes: which mesh axes each value of a step varies over (JAX's ``vma``).

Inside a step whose mesh has axes other than its data axes (tensor parallelism,
a bare ``shard_map``), the right backward rule of a collective depends on the
types of values, not on their numbers. ``psum`` of a value that varies over
'model' is *invariant* over 'model', and its transpose is the identity; a value
invariant over 'model' that meets one varying over it is implicitly lifted
(``pvary``: identity forward, ``psum`` backward). JAX tracks this set of axes
per value (``check_vma``); pardist tracks it here, in a table from tensors to
frozensets of axis names that lives only as long as the step: nothing is
written on the caller's tensors.

Outside such a step nothing is tracked (``current()`` is None) and every
collective treats every value as varying over every axis, whose transposes are
the classic ones (``psum`` -> ``psum``). For a plain data-parallel step that is
exact: with every value equal across the non-data axes, they compute the true
gradient of the loss averaged over the data axes, whether the loss is per-rank
or already ``pmean``'d.

Axes of size 1 are never recorded: nothing can vary over them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch

from pardist.runtime import Mesh, functorch

__all__ = [
    "EMPTY",
    "Tracking",
    "current",
    "enter_grad",
    "invariant_over_data",
    "lifted_over_data",
    "mean_over_data",
    "paused",
    "seed",
    "seed_scale",
    "tracking",
    "typed_like",
]

EMPTY: frozenset[str] = frozenset()
_functorch = functorch


class Tracking:
    """The varying axes of the tensors of one running step, and what it needs to lift them.

    Args:
        mesh: the step's mesh.
        data: the step's data axes (empty for a bare ``shard_map``).
    """

    def __init__(self, mesh: Mesh, data: Iterable[str] = ()):
        self.mesh = mesh
        self.live = frozenset(a for a, n in mesh.shape.items() if n > 1)
        self.data = frozenset(data) & self.live
        self.paused = False  # inside pardist's own code: the mode leaves tensors alone
        self.tags: dict[int, tuple[weakref.ref, frozenset[str]]] = {}  # id -> (tensor, axes)
        self._lifted: dict[tuple[int, frozenset[str]], tuple[torch.Tensor, torch.Tensor]] = {}
        self._groups: dict[frozenset[str], list] = {}

    def get(self, t: torch.Tensor) -> frozenset[str]:
        """The axes ``t`` varies over; untracked tensors (constants, closures) vary over none."""
        entry = self.tags.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        if _functorch.is_functorch_wrapped_tensor(t):  # torch.func's wrapper of a tracked value
            return self.get(_functorch.get_unwrapped(t))
        return EMPTY

    def set(self, t: torch.Tensor, vma: frozenset[str]) -> torch.Tensor:
        """Record that ``t`` varies over ``vma`` (axes of size 1 dropped); returns ``t``."""
        vma = vma & self.live
        if vma or id(t) in self.tags:
            self.tags[id(t)] = (weakref.ref(t), vma)
        return t

    def ordered(self, axes: Iterable[str]) -> tuple[str, ...]:
        """``axes`` in mesh order (the order process groups are made in)."""
        axes = set(axes)
        return tuple(a for a in self.mesh.axis_names if a in axes)

    def groups(self, axes: frozenset[str]) -> list:
        """Process groups that reduce over ``axes``, innermost first."""
        if axes not in self._groups:
            self._groups[axes] = self.mesh.groups(self.ordered(axes)) if axes else []
        return self._groups[axes]

    def lifted(self, t: torch.Tensor, axes: frozenset[str], lift) -> torch.Tensor:
        """``lift(t)`` (a ``pvary`` over ``axes``), made once per tensor and forward pass.

        Lifting one value once and using it many times makes one ``psum`` in the
        backward, not one per use (the three projections of attention share one).
        """
        key = (id(t), axes)
        hit = self._lifted.get(key)
        if hit is not None and hit[0] is t:
            return hit[1]
        out = self.set(lift(t), self.get(t) | axes)
        self._lifted[key] = (t, out)  # holding t keeps its id from being reused
        return out

    def forget_lifts(self) -> None:
        """Drop the lifted copies: a new forward pass (its graph) begins or the old one ended."""
        self._lifted.clear()


_active: list[Tracking | None] = []


def current() -> Tracking | None:
    """The running step's tracking, or None where nothing is tracked."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def tracking(state: Tracking | None) -> Iterator[Tracking | None]:
    """Make ``state`` current (None: nothing tracked inside, e.g. a plain data-parallel step)."""
    _active.append(state)
    try:
        yield state
    finally:
        _active.pop()
        if state is not None:
            state.forget_lifts()


@contextlib.contextmanager
def paused() -> Iterator[Tracking | None]:
    """pardist's internals (collectives, gradient plumbing) tag their results themselves."""
    state = current()
    if state is None or state.paused:
        yield state
        return
    state.paused = True
    try:
        yield state
    finally:
        state.paused = False


# pardist.grad's side of tracking. Inside a tracked step with data axes D, the
# gradient of a replicated input is still averaged over D by the bucketed
# reducer (pardist's convention: the gradient of the loss averaged over D), so
# such inputs enter the differentiated function already varying over D, and no
# pvary over D is inserted for them. What pardist.grad differentiates is then
# pmean over D of the loss: a loss already invariant over some of D (pmean'd)
# gets its backward seed multiplied by their sizes, which the reducer's mean
# divides back out. Over the other axes JAX's rule holds: a loss that varies
# over 'model' is summed over it.


def enter_grad(inputs: list, leaves: list, replicated: list[bool]) -> None:
    """Type the detached ``inputs`` of a differentiated function like their ``leaves``."""
    state = current()
    if state is None:
        return
    state.forget_lifts()  # a new forward pass: its lifts belong to its own graph
    for x, leaf, rep in zip(inputs, leaves, replicated):
        state.set(x, state.get(leaf) | state.data if rep else state.get(leaf))


def seed_scale(value: torch.Tensor) -> int:
    """The product of the sizes of the data axes that ``value`` is invariant over."""
    state = current()
    scale = 1
    if state is not None:
        for axis in state.data - state.get(value):
            scale *= state.mesh.shape[axis]
    return scale


def seed(value: torch.Tensor) -> torch.Tensor | None:
    """The backward's seed for ``value``: None (one) unless it is invariant over data axes."""
    scale = seed_scale(value)
    return None if scale == 1 else torch.full_like(value, float(scale))


def lifted_over_data(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y``, the gradient-averaging identity of replicated ``x``, typed as varying over data."""
    state = current()
    return y if state is None else state.set(y, state.get(x) | state.data)


def invariant_over_data(t: torch.Tensor) -> bool:
    """Whether ``t`` is the same on every rank of the step's data axes (untracked: assumed)."""
    state = current()
    return state is None or not (state.get(t) & state.data)


def typed_like(results: list, leaves: list) -> list:
    """Give each gradient its input's type (a cotangent varies as its primal does)."""
    state = current()
    if state is not None:
        for g, leaf in zip(results, leaves):
            if isinstance(g, torch.Tensor):
                state.set(g, state.get(leaf))
    return results


def mean_over_data(value: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Type the loss averaged over the data axes: ``raw``'s axes less the data axes."""
    state = current()
    return value if state is None else state.set(value, state.get(raw) - state.data)
