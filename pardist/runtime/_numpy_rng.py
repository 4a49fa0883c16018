"""NumPy's global generator saved and restored exactly, in microseconds.

Every step draws its random numbers from its own streams and gives the caller's
generators back afterwards (``_rng.stream``). For NumPy's global ``RandomState``,
``np.random.get_state`` and ``set_state`` cost 40-200 us a step (numpy 2.x):
MT19937's ``state`` property copies its 624 words one Python element at a time.
That was a third of a small model's per-step overhead (docs/performance.md).

The words and position live in one C struct, which the bit generator's ctypes
interface locates (``state_address``): one ``memmove`` saves or restores them.
What the legacy ``RandomState`` keeps beside them (the cached second Gaussian:
``has_gauss``, ``gauss``) is read and written through ``get_state`` /
``set_state`` while a stand-in answers for the bit generator, so the slow copy
never runs. Whether this gives exactly what ``get_state`` / ``set_state`` give
is checked on first use, against them; where it does not (another NumPy,
another bit generator), they are used as they are.
"""

from __future__ import annotations

import ctypes

import numpy as np

__all__ = ["restore", "save"]

_WORDS = 624  # MT19937: uint32 key[624], then int pos
_BYTES = _WORDS * 4 + ctypes.sizeof(ctypes.c_int)


class _StandIn:
    """Answers for the bit generator while RandomState reads or writes its own fields."""

    state = {"bit_generator": "MT19937", "state": {"key": None, "pos": 0}}


def _gauss(rs: np.random.RandomState) -> tuple:
    real, rs._bit_generator = rs._bit_generator, _StandIn()
    try:
        st = rs.get_state(legacy=False)
    finally:
        rs._bit_generator = real
    return st["has_gauss"], st["gauss"]


def _set_gauss(rs: np.random.RandomState, has_gauss: int, gauss: float) -> None:
    real, rs._bit_generator = rs._bit_generator, _StandIn()
    try:
        rs.set_state({**_StandIn.state, "has_gauss": has_gauss, "gauss": gauss})
    finally:
        rs._bit_generator = real


def _fast_save() -> tuple:
    rs = np.random.mtrand._rand
    words = ctypes.create_string_buffer(_BYTES)
    ctypes.memmove(words, rs._bit_generator.ctypes.state_address, _BYTES)
    return rs, words, _gauss(rs)


def _fast_restore(saved: tuple) -> None:
    rs, words, gauss = saved
    ctypes.memmove(rs._bit_generator.ctypes.state_address, words, _BYTES)
    _set_gauss(rs, *gauss)


def _same(a, b) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def _works() -> bool:
    """Whether the fast path round-trips exactly as get_state / set_state (checked once,
    on the live generator, which it leaves as it found it)."""
    try:
        rs = np.random.mtrand._rand
        if type(rs._bit_generator).__name__ != "MT19937":
            return False
        before = np.random.get_state()
        saved = _fast_save()
        np.random.seed(12345)
        np.random.standard_normal()  # leaves a cached Gaussian behind
        _fast_restore(saved)
        ok = _same(np.random.get_state(), before)
        np.random.set_state(before)
        return ok
    except Exception:  # noqa: BLE001 (any surprise: use NumPy's own calls)
        return False


_fast: bool | None = None


def save() -> object:
    """NumPy's global generator as it is now."""
    global _fast
    if _fast is None:
        _fast = _works()
    return ("fast", _fast_save()) if _fast else ("numpy", np.random.get_state())


def restore(saved: object) -> None:
    """Put back what :func:`save` returned."""
    how, state = saved
    if how == "fast":
        _fast_restore(state)
    else:
        np.random.set_state(state)
