"""Python's global ``random`` generator saved, seeded and restored exactly, in microseconds.

Every step draws its random numbers from its own streams and gives the caller's
generators back afterwards (``_rng.stream``). ``random.getstate`` builds a tuple of
625 Python ints (18 us, and allocations that meet the step's) and ``setstate``
parses it back (7 us): with NumPy's (``_numpy_rng``), the largest part of what the
streams cost a dispatch-bound step (docs/performance.md).

CPython keeps the generator in one C struct (``Modules/_randommodule.c``): the
object's header, ``int index``, then ``uint32_t state[624]``. The 2,500 bytes after
the header are read and written through a memoryview made once per instance (a save
is one ``bytes()``, a restore one slice assignment); the cached second Gaussian
(``gauss_next``) is an attribute of the Python ``random.Random`` and is read and
written as one. Whether this gives exactly what ``getstate`` / ``setstate`` give is
checked on first use, against them; where it does not (another interpreter, another
layout), they are used as they are.
"""

from __future__ import annotations

import _random
import ctypes
import random

__all__ = ["restore", "save", "seeded"]

_HEAD = object.__basicsize__  # PyObject_HEAD: where the Random struct's fields begin
_BYTES = ctypes.sizeof(ctypes.c_int) + 624 * 4  # int index; uint32_t state[624]


def _region(inst: random.Random) -> memoryview:
    """A view of ``inst``'s index and words (valid while ``inst`` lives)."""
    return memoryview((ctypes.c_char * _BYTES).from_address(id(inst) + _HEAD)).cast("B")


_checked: tuple = (None, None)  # the instance checked, its region (None: not exact for it)


def _global() -> memoryview | None:
    """The global generator's region (None: the fast path is not exact for it), checked
    on first use and again where ``random._inst`` was replaced."""
    global _checked
    inst = random._inst
    if _checked[0] is not inst:
        _checked = (inst, _region(inst) if _works(inst) else None)  # (holds it alive)
    return _checked[1]


def _works(inst) -> bool:
    """Whether the fast path round-trips exactly as getstate / setstate (checked once, on
    the live generator, which it leaves as it found it). The copied bytes must lie inside
    the C struct, or nothing is copied at all."""
    try:
        if not isinstance(inst, _random.Random) or _HEAD + _BYTES > _random.Random.__basicsize__:
            return False
        region = _region(inst)
        before = inst.getstate()
        saved = bytes(region), inst.gauss_next
        inst.seed(12345)
        inst.gauss(0.0, 1.0)  # leaves a cached Gaussian behind
        region[:], inst.gauss_next = saved
        ok = inst.getstate() == before
        inst.setstate(before)
        return ok
    except Exception:  # noqa: BLE001 (any surprise: use Python's own calls)
        return False


def save() -> object:
    """Python's global generator as it is now."""
    region = _global()
    if region is None:
        return ("python", random.getstate())
    return ("fast", (bytes(region), random._inst.gauss_next))


_spare: tuple = ()  # a Random seeded to make states (never drawn from), its region


def seeded(value: int) -> object:
    """The state ``random.seed(value)`` gives, as :func:`save` returns one, made without
    touching the global generator: :func:`restore` puts it there."""
    global _spare
    if _global() is None:
        return ("seed", value)
    if not _spare:
        inst = random.Random()
        _spare = (inst, _region(inst))
    _spare[0].seed(value)
    return ("fast", (bytes(_spare[1]), _spare[0].gauss_next))


def restore(saved: object) -> None:
    """Put back what :func:`save` (or :func:`seeded`) returned."""
    how, state = saved
    if how == "fast":
        _global()[:], random._inst.gauss_next = state
    elif how == "seed":
        random.seed(state)
    else:
        random.setstate(state)
