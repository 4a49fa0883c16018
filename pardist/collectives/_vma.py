"""Varying manual axes: which mesh axes each value of a step varies over (JAX's ``vma``).

Every step on more than one process types its values as ``jax.shard_map`` does with
``check_vma=True``: a batch shard varies over the data axes, a replicated input over
none, an operation's result over the union of its operands', and each collective
changes the set by its own rule (``psum`` of a value varying over 'gpu' is invariant
over 'gpu'). The right transpose of a collective follows from these types, not from
which combinator runs: ``psum`` of a varying value transposes to the identity, and an
invariant value meeting a varying one is lifted (``pvary``: identity forward, ``psum``
backward). pardist keeps the set per tensor in a table that lives as long as the step
(nothing is written on the caller's tensors).

One mark more than JAX: inside :func:`pardist.grad` of a data-parallel step, the
replicated inputs enter *lifted* over the data axes, as if ``pvary``'d once at the top
of the differentiated function (their ``psum``, divided by the ranks, is the bucketed
gradient mean). Their values are still the same on every rank, so a lifted axis is kept
apart, as a one-tuple ``('gpu',)``: it counts as varying for the gradient (no second
``pvary``, no second ``psum``) and as invariant for the value (a parameter's norm computed
there may be returned under ``P()``). :func:`value_axes` and :func:`grad_axes` read the
two sides; a set never holds an axis both ways.

Outside any step nothing is typed (``current()`` is None) and every value counts as
varying over every axis: each collective's result is lifted back at once (``pvary`` of
it), so ``psum``'s transpose is ``psum`` (the gradient of the sum of every rank's
objective, as ``torch.distributed.nn``'s collectives give). A compiled step types the
same coarse way over its data axes (see ``pardist/compile``): for the gradient of the
loss averaged over them the two typings give the same numbers.

Axes of size 1 are never recorded: nothing can vary over them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch

from pardist.runtime import Mesh, disable_torch_function, enable_torch_function, functorch

__all__ = [
    "EMPTY",
    "Tracking",
    "current",
    "drop",
    "enter_grad",
    "grad_axes",
    "in_grad",
    "internal",
    "invariant",
    "invariant_over_data",
    "lift_marks",
    "lifted_over_data",
    "mean_over_data",
    "normal",
    "paused",
    "seed",
    "seed_scale",
    "tracking",
    "typed_like",
    "user",
    "value_axes",
    "vary",
]

EMPTY: frozenset = frozenset()
_functorch = functorch


def lift_marks(axes: Iterable[str]) -> frozenset:
    """``axes`` as lifted marks: varying for the gradient, invariant in value."""
    return frozenset((a,) for a in axes)


def value_axes(v: frozenset) -> frozenset:
    """The axes over which the value itself differs between ranks."""
    return v if all(type(a) is str for a in v) else frozenset(a for a in v if type(a) is str)


def grad_axes(v: frozenset) -> frozenset:
    """The axes a cotangent of the value varies over (lifted ones included)."""
    return (
        v if all(type(a) is str for a in v) else frozenset(a if type(a) is str else a[0] for a in v)
    )


def normal(v: frozenset) -> frozenset:
    """``v`` without the lifted marks of axes it varies over anyway."""
    if all(type(a) is str for a in v):
        return v
    return frozenset(a for a in v if type(a) is str or a[0] not in v)


def drop(v: frozenset, axes: frozenset) -> frozenset:
    """``v`` made invariant over ``axes`` (a reduction over them): both marks go."""
    return frozenset(a for a in v if (a if type(a) is str else a[0]) not in axes)


def vary(v: frozenset, axes: frozenset) -> frozenset:
    """``v`` made varying over ``axes`` (an all_gather, a permutation over them)."""
    return normal(v | axes)


class Tracking:
    """The varying axes of the tensors of one running step, and what it needs to lift them.

    Args:
        mesh: the step's mesh.
        data: the step's data axes (empty for a bare ``shard_map``).
        manual: the axes the step is manual over (``shard_map(axis_names=...)``; all
            by default): collectives over any other axis are an error.
    """

    def __init__(self, mesh: Mesh, data: Iterable[str] = (), manual: Iterable[str] | None = None):
        self.mesh = mesh
        self.live = frozenset(a for a, n in mesh.shape.items() if n > 1)
        self.manual = None if manual is None else frozenset(manual)
        if self.manual is not None:
            self.live &= self.manual
        self.data = frozenset(data) & self.live
        self.data_lifted = lift_marks(self.data)
        self._known = self.live | self.data_lifted  # what a recorded set may hold
        self.paused = False  # inside pardist's own code: the mode leaves tensors alone
        self.grads = 0  # pardist.grad calls running (their functions differentiated)
        # A gradient taken outside pardist.grad, or a lift a gradient will flow through
        # there: the step needs the types for its numbers on every call.
        self.outside_grads = False
        self.tags: dict[int, tuple[weakref.ref, frozenset]] = {}  # id -> (tensor, axes)
        self._lifted: dict[tuple[int, frozenset[str]], tuple[torch.Tensor, torch.Tensor]] = {}
        self._groups: dict[frozenset[str], list] = {}

    def get(self, t: torch.Tensor) -> frozenset:
        """The axes ``t`` varies over; untracked tensors (constants, closures) vary over none."""
        entry = self.tags.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        if _functorch.is_functorch_wrapped_tensor(t):  # torch.func's wrapper of a tracked value
            return self.get(_functorch.get_unwrapped(t))
        return EMPTY

    def set(self, t: torch.Tensor, vma: frozenset) -> torch.Tensor:
        """Record that ``t`` varies over ``vma`` (axes of size 1 dropped); returns ``t``."""
        if vma and not vma <= self._known:
            vma = frozenset(a for a in vma if (a if type(a) is str else a[0]) in self.live)
        if vma:
            self.tags[id(t)] = (weakref.ref(t), vma)
        elif id(t) in self.tags:  # varying over nothing: no entry (a lookup that misses)
            del self.tags[id(t)]
        return t

    def check(self, names: Iterable[str], where: str) -> None:
        """An error where a collective names an axis the step is not manual over."""
        if self.manual is not None and not set(names) <= self.manual:
            extra = sorted(set(names) - self.manual)
            raise ValueError(
                f"{where}: axis {extra} is not one of the step's manual axes "
                f"(axis_names={sorted(self.manual)}); name one of those, or add it to "
                "axis_names."
            )

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
        out = self.set(lift(t), vary(self.get(t), axes))
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
    """Make ``state`` current (None: nothing tracked inside: one process, or outside steps)."""
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


@contextlib.contextmanager
def internal() -> Iterator[None]:
    """Inside: pardist's own code (the gradient's plumbing, buckets, bookkeeping), which
    types what it makes by hand. The tracking mode is switched off for it entirely
    (``DisableTorchFunction``, in C: no cost per operation), so that only the user's own
    operations pay for typing; :func:`user` switches it back on for the user's code
    that pardist calls (the loss, a recomputed checkpoint)."""
    state = current()
    if state is None:
        yield
        return
    paused, state.paused = state.paused, True
    try:
        with disable_torch_function():
            yield
    finally:
        state.paused = paused


@contextlib.contextmanager
def user() -> Iterator[None]:
    """Inside: the user's code, called from pardist's own (:func:`internal`): typed."""
    state = current()
    if state is None:
        yield
        return
    paused, state.paused = state.paused, False
    try:
        with enable_torch_function():
            yield
    finally:
        state.paused = paused


@contextlib.contextmanager
def in_grad() -> Iterator[None]:
    """Inside: the function :func:`pardist.grad` differentiates (its inputs enter lifted)."""
    state = current()
    if state is None:
        yield
        return
    state.grads += 1
    try:
        yield
    finally:
        state.grads -= 1


# pardist.grad's side of tracking. Inside a step with data axes D, pardist.grad
# differentiates the loss averaged over D, pmean_D(loss). Its replicated inputs enter
# the differentiated function lifted over D (their psum is the bucketed reducer's,
# divided by the ranks), so no pvary over D is inserted for them. A loss that varies
# over D gets the backward seed one; a loss already invariant over some of D (pmean'd
# or over an all_gather) gets the product of their sizes, which the reducer's mean
# divides back out: the transpose of pmean_D on an invariant value. Over the other
# axes JAX's rule holds: a loss that varies over 'model' is summed over it.


def enter_grad(inputs: list, leaves: list, replicated: list[bool]) -> None:
    """Type the detached ``inputs`` of a differentiated function like their ``leaves``."""
    state = current()
    if state is None:
        return
    state.forget_lifts()  # a new forward pass: its lifts belong to its own graph
    lifted = state.data_lifted
    for x, leaf, rep in zip(inputs, leaves, replicated):
        state.set(x, normal(state.get(leaf) | lifted) if rep else state.get(leaf))


def seed_scale(value: torch.Tensor) -> int:
    """The product of the sizes of the data axes that ``value``'s gradient is invariant over."""
    state = current()
    scale = 1
    if state is not None:
        for axis in state.data - grad_axes(state.get(value)):
            scale *= state.mesh.shape[axis]
    return scale


def seed(value: torch.Tensor) -> torch.Tensor | None:
    """The backward's seed for ``value``: None (one) unless it is invariant over data axes."""
    scale = seed_scale(value)
    return None if scale == 1 else torch.full_like(value, float(scale))


def lifted_over_data(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y``, the gradient-averaging identity of replicated ``x``, typed as lifted over data."""
    state = current()
    return y if state is None else state.set(y, normal(state.get(x) | state.data_lifted))


def invariant_over_data(t: torch.Tensor) -> bool:
    """Whether ``t``'s value is the same on every rank of the step's data axes (untracked:
    assumed)."""
    state = current()
    return state is None or not (value_axes(state.get(t)) & state.data)


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
    return value if state is None else state.set(value, drop(state.get(raw), state.data))


def invariant(tensors: Iterable[torch.Tensor], axes: Iterable[str] | None = None) -> None:
    """Type ``tensors`` (means pardist computed over ``axes``, default the data axes) as
    invariant over them."""
    state = current()
    if state is None:
        return
    over = state.data if axes is None else frozenset(axes)
    for t in tensors:
        state.set(t, drop(state.get(t), over))
