"""Python's global ``random`` generator saved and restored exactly, in microseconds.

Every step draws its random numbers from its own streams and gives the caller's
generators back afterwards (``_rng.stream``). ``random.getstate`` builds a tuple of
625 Python ints (18 us, and allocations that meet the step's) and ``setstate``
parses it back (7 us): with NumPy's (``_numpy_rng``), the largest part of what the
streams cost a dispatch-bound step (docs/performance.md).

CPython keeps the generator in one C struct (``Modules/_randommodule.c``): the
object's header, ``int index``, then ``uint32_t state[624]``. One ``memmove`` of
the 2,500 bytes after the header saves or restores them; the cached second
Gaussian (``gauss_next``) is an attribute of the Python ``random.Random`` and is
read and written as one. Whether this gives exactly what ``getstate`` /
``setstate`` give is checked on first use, against them; where it does not
(another interpreter, another layout), they are used as they are.
"""

from __future__ import annotations

import _random
import ctypes
import random

__all__ = ["restore", "save"]

_HEAD = object.__basicsize__  # PyObject_HEAD: where the Random struct's fields begin
_BYTES = ctypes.sizeof(ctypes.c_int) + 624 * 4  # int index; uint32_t state[624]


def _fast_save() -> tuple:
    inst = random._inst
    words = ctypes.create_string_buffer(_BYTES)
    ctypes.memmove(words, id(inst) + _HEAD, _BYTES)
    return words, inst.gauss_next


def _fast_restore(saved: tuple) -> None:
    words, gauss_next = saved
    inst = random._inst
    ctypes.memmove(id(inst) + _HEAD, words, _BYTES)
    inst.gauss_next = gauss_next


def _works() -> bool:
    """Whether the fast path round-trips exactly as getstate / setstate (checked once, on
    the live generator, which it leaves as it found it). The copied bytes must lie inside
    the C struct, or nothing is copied at all."""
    try:
        inst = random._inst
        if not isinstance(inst, _random.Random) or _HEAD + _BYTES > _random.Random.__basicsize__:
            return False
        before = random.getstate()
        saved = _fast_save()
        random.seed(12345)
        random.gauss(0.0, 1.0)  # leaves a cached Gaussian behind
        _fast_restore(saved)
        ok = random.getstate() == before
        random.setstate(before)
        return ok
    except Exception:  # noqa: BLE001 (any surprise: use Python's own calls)
        return False


_fast: bool | None = None
_checked: object = None  # the instance the fast path was checked on


def save() -> object:
    """Python's global generator as it is now."""
    global _fast, _checked
    if _checked is not random._inst:  # first use (or a replaced instance): check it
        _fast, _checked = _works(), random._inst
    return ("fast", _fast_save()) if _fast else ("python", random.getstate())


def restore(saved: object) -> None:
    """Put back what :func:`save` returned."""
    how, state = saved
    if how == "fast":
        _fast_restore(state)
    else:
        random.setstate(state)
