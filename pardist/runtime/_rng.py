"""Random numbers inside a step: a stream per rank and step, derived from the seed.

``seed_everything(0)`` on every rank (needed so that replicas start alike) would
otherwise give every rank the same dropout mask, so N ranks would not be one
process on the concatenated batch. As in JAX (``fold_in(key, axis_index)``), a
step draws from a stream derived from three numbers: the seed
(``torch.initial_seed()``, what ``seed_everything`` set), the rank's index along
the step's data axes, and the count of steps run so far in this process
(``seed_everything`` restarts it). The global generators are seeded with it for the
step and restored afterwards, so randomness outside steps (augmentation,
shuffling) is untouched: torch's (CPU and the current accelerator), NumPy's and
Python's ``random`` (which models draw from too: wav2vec2's SpecAugment masks with
NumPy).

Reproducible across restarts: save :func:`rng_count` in the checkpoint and give
it back with :func:`set_rng_count` after loading.

The hook for other index schemes (the deterministic mode's row groups):
``stream(index)`` takes any int, and a ``stream`` entered inside another one
reseeds from ``(seed, index, the outer step's count)`` without counting a step,
so each row group can draw from its own stream, the same at every world size.
"""

from __future__ import annotations

import hashlib
import random
import weakref

import numpy as np
import torch

from pardist.runtime import _numpy_rng, _python_rng

__all__ = ["group_seed", "rank_index", "rng_count", "set_rng_count", "stream"]

_state = {"count": 0, "depth": 0, "seed": 0}


def rng_count() -> int:
    """How many steps have drawn from pardist's step streams in this process.

    Save it with the checkpoint and restore it with :func:`set_rng_count`, so that
    a resumed run draws the same dropout masks as an uninterrupted one.

    Example:
        >>> import pardist
        >>> n = pardist.rng_count()
        >>> pardist.set_rng_count(n)
    """
    return _state["count"]


def set_rng_count(n: int) -> None:
    """Continue the step streams from ``n`` (a value :func:`rng_count` returned)."""
    if isinstance(n, torch.Tensor):
        n = int(n)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise TypeError(
            f"pardist.set_rng_count: n={n!r}; give the non-negative int that "
            "pardist.rng_count() returned when the checkpoint was saved."
        )
    _state["count"] = n


def derive(seed: int, index: int, count: int) -> int:
    """The stream's seed: a hash of (seed, index, count), below ``2**63``."""
    text = f"pardist-step-rng:{seed}:{index}:{count}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def group_seed(group: int) -> int:
    """The seed of row group ``group``'s stream in the running step (deterministic mode):
    from the seed and the step count, not the rank, so the same at every world size."""
    seed = _state["seed"] if _state["depth"] > 0 else torch.initial_seed()
    return derive(seed, -1 - group, _state["count"])


def _seed(value: int, cuda: bool, made: tuple | None = None) -> None:
    """Every generator seeded with ``value``; NumPy's and Python's from the states
    ``made`` ahead for it (:func:`_planned`) where given, by their seed calls otherwise."""
    torch.default_generator.manual_seed(value)
    if cuda:
        torch.cuda.manual_seed(value)  # the current device only
    if made is None:
        np.random.seed(value % 2**32)  # NumPy's legacy seed must fit in 32 bits
        random.seed(value)
    else:
        _numpy_rng.restore(made[0])
        _python_rng.restore(made[1])


_AHEAD = 16  # steps whose seeded states are made at once
_plans: dict = {}  # (seed, index) -> {count: (value, (NumPy's state, Python's state))}


def _planned(seed: int, index: int, count: int) -> tuple[int, tuple]:
    """The seed of ``(seed, index, count)``'s stream, and the states NumPy's and Python's
    generators have when seeded with it, made for ``_AHEAD`` steps at a time.

    Seeding those two generators is a call into each library per step (and a hash),
    code a step's forward and backward leave out of the caches; made ahead on spare
    generators, a step puts their states in place by one copy each."""
    plan = _plans.get((seed, index))
    if plan is None or count not in plan:
        if len(_plans) >= 4:  # a few (seed, index) pairs in turn: steps over other axes
            _plans.clear()
        counts = range(count, count + _AHEAD)
        values = [derive(seed, index, c) for c in counts]
        _plans[(seed, index)] = plan = {
            c: (v, (_numpy_rng.seeded(v), _python_rng.seeded(v))) for c, v in zip(counts, values)
        }
    return plan.pop(count)


def _cuda() -> bool:
    """Whether CUDA is in use (initialised: a step's tensors can be there)."""
    return torch.cuda.is_initialized()


_INDEX: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rank_index(mesh, axes: tuple) -> int:
    """This rank's index along the step's data ``axes`` of ``mesh`` (0 with none), cached."""
    known = _INDEX.setdefault(mesh, {})
    if axes not in known:
        known[axes] = mesh.index(axes) if axes else 0
    return known[axes]


class stream:  # noqa: N801 (used as a function: ``with stream(index):``)
    """Draw random numbers from the stream of ``index`` (a rank, a row group) and this step.

    Outermost: the global generators are saved, seeded, and restored on exit, and
    the step count advances. Nested: reseeded for ``index`` at the same count.
    (A class, not a generator-based context manager: entered on every step.)
    """

    __slots__ = ("index", "saved")

    def __init__(self, index: int):
        self.index, self.saved = index, None

    def __enter__(self) -> None:
        if _state["depth"] > 0:
            _seed(derive(_state["seed"], self.index, _state["count"]), _cuda())
            return
        cuda = _cuda()
        self.saved = (
            torch.default_generator.get_state(),
            torch.cuda.get_rng_state() if cuda else None,
            _numpy_rng.save(),
            _python_rng.save(),
        )
        _state["seed"] = torch.initial_seed()
        value, made = _planned(_state["seed"], self.index, _state["count"])
        _seed(value, cuda, made)
        _state["depth"] += 1

    def __exit__(self, *exc) -> None:
        if self.saved is None:  # nested
            return
        cpu_state, cuda_state, np_state, py_state = self.saved
        self.saved = None
        _state["depth"] -= 1
        _state["count"] += 1
        torch.default_generator.set_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)
        _numpy_rng.restore(np_state)
        _python_rng.restore(py_state)
