"""Which collective, in which call of a step: what the shared-memory ranks post and read.

Every barrier of a :class:`~pardist.transport._shm.SharedMemoryGroup` posts a signature
of the collective it starts, and every segment shows this process's *step mark*: 0
outside steps, else the step's key (bits 41-62), its count of calls entered (bits 1-40)
and 1 while inside the call (bit 0). Mixed into the signature, the mark keeps calls one
step apart from ever pairing; read by a waiting rank, it says that the rank it waits for
has left the call (docs/design.md, "The shared-memory transport"). Once the ranks are
found out of step, they stay so: every later call raises.
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref

import torch

from pardist.runtime import _faults, _process

__all__ = ["mark_step"]  # (and the helpers _shm reads)

COUNT = (1 << 40) - 1
LOST = -1  # the mark shown by a rank that found the ranks out of step
GLOO = -2  # shown while outside any step and waiting in a gloo collective (in its note)
FOUND = "found the ranks out of step"
WAITS = "waits outside the step, over gloo, in"
_MARK = {"now": 0, "shown": 0}
_segments: list = []  # every segment of this process (weak references)
_lost: dict[str, str] = {}  # "why": the ranks are out of step, for good (this process group)
_process.on_shutdown(_lost.clear)


def mark_step(mark: int, shown: int | None = None) -> int:
    """Be in the step call ``mark`` (0: none); the previous mark, to restore on leaving.

    The collectives started inside carry it in their signatures, so calls one step apart
    never pair. Every segment shows ``shown`` (default: the mark) to the other ranks,
    whose waits read it: a rank waiting in a call that another has left, or gone past,
    waits for nothing (on leaving, a call shows its mark without bit 0).
    """
    if _lost and mark & 1:  # entering a call, once out of step: refused
        raise _faults.StepMismatch(_lost["why"])
    before, _MARK["now"] = _MARK["now"], mark
    if not _lost:  # (leaving, once out of step: the others keep seeing LOST)
        _show(mark if shown is None else shown)
    return before


def check_lost() -> None:
    """Raise if the ranks were found out of step together (see :func:`out_of_step`)."""
    if "together" in _lost:
        raise _faults.StepMismatch(_lost["why"])


def now() -> int:
    """This process's step mark."""
    return _MARK["now"]


def shown_by(segment) -> int:
    """Remember ``segment`` (weakly), to show it every later mark; the mark to show now."""
    _segments[:] = [ref for ref in _segments if ref() is not None]
    _segments.append(weakref.ref(segment))
    return _MARK["now"]


def _show(value: int, note: str = "", within: set[int] | None = None) -> None:
    if within is None:
        _MARK["shown"] = value
    for ref in _segments:
        segment = ref()
        if segment is not None and (within is None or within.issuperset(segment.ranks)):
            segment.show_mark(value, note)


@contextlib.contextmanager
def over_gloo(what: str, ranks: list[int]):
    """Inside: this rank, outside any step, waits in gloo collective ``what`` over
    ``ranks``. Shown to the shared-memory segments of those ranks: a peer waiting there in
    a step's collective waits for a rank that cannot come (ranks that ran different numbers
    of steps: a shorter loader), and raises at once instead of at the timeout."""
    if _MARK["now"] != 0 or _lost or not _segments:
        yield
        return
    within = set(ranks)
    _show(GLOO, what[:200], within)
    try:
        yield
    finally:
        _show(_MARK["shown"], "", within)


@contextlib.contextmanager
def unmarked():
    """Outside any step for a while: for a barrier that must pair whatever the marks."""
    mark, _MARK["now"] = _MARK["now"], 0
    try:
        yield
    finally:
        _MARK["now"] = mark


def out_of_step(message: str, *, together: bool = False) -> None:
    """Remember, show the other ranks (their waits end too) and raise: for good.

    ``together``: every rank of the group found it at once (a gloo header), so every
    later collective of pardist's, not only the steps', may raise without a word to
    the others (where one rank found it alone, the others still pair with it outside
    steps, and learn it at their next step).
    """
    if together:
        _lost["together"] = "yes"
    _lost["why"] = (
        message + " The ranks' collectives no longer pair up: every later call fails. "
        "Restart the run (from its last checkpoint)."
    )
    _show(LOST, message.removeprefix("pardist: "))
    raise _faults.StepMismatch(message)


def departure(mine: int, theirs: int) -> str | None:
    """What a rank showing ``theirs`` did that ends my wait in the call ``mine``, if it did."""
    call, at = mine >> 1 & COUNT, theirs >> 1 & COUNT
    same = mine and theirs >> 41 == mine >> 41
    if theirs == LOST:  # (whatever this rank waits in: it will not come)
        return FOUND
    if theirs == GLOO and mine:
        return WAITS
    if same and at > call:
        return f"began call {at} of the step"
    if same and at == call and not theirs & 1:
        return f"left call {at} of the step without it"
    return None


def fewer_calls(rank: int, theirs: str, me: int, doing: str) -> str:
    """The message of a rank that waits in a step's collective while ``rank`` waits in
    ``theirs`` over gloo, outside any step (departure's WAITS)."""
    return (
        f"pardist: rank {rank} {WAITS} {theirs} while rank {me} waits in {doing} of call "
        f"{call_of(now())}: the ranks ran different numbers of calls (a loader with fewer "
        "batches on one rank?). Give every rank the same number of batches: "
        "pardist.data.shard, or drop_last=True on a DistributedSampler's loader."
    )


def call_of(mark: int) -> int:
    """The count of calls entered that ``mark`` shows."""
    return mark >> 1 & COUNT


_signatures: dict = {}


def signature(what: tuple | None) -> int:
    """A nonzero int64 naming ``what`` and the call of the step alike in every process
    (0: a plain barrier, which pairs in any call)."""
    if what is None:
        return 0
    sig = _signatures.get(what)
    if sig is None:
        if len(_signatures) > 4096:
            _signatures.clear()
        digest = hashlib.blake2b(repr(what).encode(), digest_size=8).digest()
        sig = _signatures[what] = int.from_bytes(digest, "little") >> 1 | 1
    mark = _MARK["now"]
    if mark:  # the call of the step: calls one step apart never pair
        sig = (sig ^ (mark * 0x9E3779B97F4A7C15)) & (2**63 - 1) | 1
    return sig


def describe(what: tuple | None) -> str:
    """``what`` for people: 'pardist.psum of float32 (3,)'."""
    if what is None:
        return "a barrier between the steps of a shared-memory collective"
    name, *rest = what
    if len(rest) >= 2 and isinstance(rest[0], torch.dtype):
        return f"{name} of {str(rest[0]).removeprefix('torch.')} {tuple(rest[1])}"
    return name
