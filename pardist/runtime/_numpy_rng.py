"""NumPy's global generator saved, seeded and restored exactly, in microseconds.

Every step draws its random numbers from its own streams and gives the caller's
generators back afterwards (``_rng.stream``). For NumPy's global ``RandomState``,
``np.random.get_state`` and ``set_state`` cost 40-200 us a step (numpy 2.x):
MT19937's ``state`` property copies its 624 words one Python element at a time.
That was a third of a small model's per-step overhead (docs/performance.md).

The words and position live in one C struct, which the bit generator's ctypes
interface locates (``state_address``). What the legacy ``RandomState`` keeps beside
them, the cached second Gaussian (``int has_gauss`` and the ``double gauss`` after it,
in the object's own C struct), is found once by its value: the 16 bytes that end with
it. Both regions are read and written through memoryviews made once per generator,
so a save is two ``bytes()`` and a restore two slice assignments, no call through
ctypes (whose machinery a step's forward and backward leave out of the caches).
Whether this gives exactly what ``get_state`` / ``set_state`` give is checked on first
use, against them, with and without a cached Gaussian; where it does not (another
NumPy, another bit generator, another layout), they are used as they are.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np

__all__ = ["restore", "save", "seeded"]

_WORDS = 624  # MT19937: uint32 key[624], then int pos
_BYTES = _WORDS * 4 + ctypes.sizeof(ctypes.c_int)
_AUG = 16  # int has_gauss (and its padding), then double gauss
_aug_offset: int | None = None  # where those 16 bytes begin in a RandomState (-1: none)
_views: tuple = (None, None, None, None)  # the global generator, its bit generator, views


def _memory(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def _regions(rs: np.random.RandomState) -> tuple[memoryview, memoryview]:
    """Views of ``rs``'s words and cached Gaussian (valid while ``rs`` lives)."""
    offset = _find_gauss()
    if offset < 0:  # (only _works() enables this path, and it needs the offset)
        raise RuntimeError("pardist: NumPy's cached Gaussian was not found in RandomState")
    words = _memory(rs._bit_generator.ctypes.state_address, _BYTES)
    return words, _memory(id(rs) + offset, _AUG)


def _global() -> tuple[memoryview, memoryview]:
    """The global generator's regions, made again where it (or its bit generator) changed."""
    global _views
    rs = np.random.mtrand._rand
    if _views[0] is not rs or _views[1] is not rs._bit_generator:
        _views = (rs, rs._bit_generator, *_regions(rs))  # (holds them alive)
    return _views[2], _views[3]


def _fast_save() -> tuple[bytes, bytes]:
    words, aug = _global()
    return bytes(words), bytes(aug)


def _fast_restore(saved: tuple[bytes, bytes]) -> None:
    words, aug = _global()
    words[:], aug[:] = saved


def _same(a, b) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def _find_gauss() -> int:
    """The offset of the 16 bytes ending with ``gauss`` in a RandomState's C struct (-1:
    not found), found once on the global one: a cached Gaussian set to a value whose 8
    bytes occur once in the struct, 8-aligned, past the object header and has_gauss."""
    global _aug_offset
    if _aug_offset is not None:
        return _aug_offset
    rs = np.random.mtrand._rand
    size, before = type(rs).__basicsize__, rs.get_state(legacy=False)
    value = 1.0 + 2.0**-40 + 2.0**-50  # an unlikely double
    try:
        rs.set_state({**before, "has_gauss": 1, "gauss": value})
        raw = ctypes.string_at(id(rs), size)
    finally:
        rs.set_state(before)
    at = [i for i in range(0, size - 7, 8) if raw[i : i + 8] == struct.pack("d", value)]
    _aug_offset = at[0] - 8 if len(at) == 1 and at[0] >= object.__basicsize__ + 8 else -1
    return _aug_offset


def _works() -> bool:
    """Whether the fast path round-trips exactly as get_state / set_state (checked once,
    on the live generator, which it leaves as it found it)."""
    rs = np.random.mtrand._rand
    before = np.random.get_state()
    try:
        if type(rs._bit_generator).__name__ != "MT19937" or _find_gauss() < 0:
            return False
        for cached in (False, True):  # the caller's state with and without a Gaussian
            np.random.seed(12345 + cached)
            if cached:
                np.random.standard_normal()  # draws two, keeps one
            expected = np.random.get_state()
            saved = _fast_save()
            np.random.seed(54321)
            np.random.standard_normal(3)  # leaves a cached Gaussian behind
            _fast_restore(saved)
            if not _same(np.random.get_state(), expected):
                return False
        return True
    except Exception:  # noqa: BLE001 (any surprise: use NumPy's own calls)
        return False
    finally:
        np.random.set_state(before)


_fast: bool | None = None
_spare: tuple = ()  # a RandomState seeded to make states (never drawn from), its regions


def save() -> object:
    """NumPy's global generator as it is now."""
    global _fast
    if _fast is None:
        _fast = _works()
    return ("fast", _fast_save()) if _fast else ("numpy", np.random.get_state())


def seeded(value: int) -> object:
    """The state ``np.random.seed(value % 2**32)`` gives, as :func:`save` returns one,
    made without touching the global generator: :func:`restore` puts it there."""
    global _fast, _spare
    if _fast is None:
        _fast = _works()
    if not _fast:
        return ("seed", value % 2**32)
    if not _spare:
        rs = np.random.RandomState()
        _spare = (rs, *_regions(rs))
    _spare[0].seed(value % 2**32)
    return ("fast", (bytes(_spare[1]), bytes(_spare[2])))


def restore(saved: object) -> None:
    """Put back what :func:`save` (or :func:`seeded`) returned."""
    how, state = saved
    if how == "fast":
        _fast_restore(state)
    elif how == "seed":
        np.random.seed(state)
    else:
        np.random.set_state(state)
