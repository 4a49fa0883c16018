"""Failures that say who and what: collective timeouts, lost ranks, and torchrun's error files.

gloo's own timeout says ``Timed out waiting 3000ms for send operation to complete``:
not which collective, not over which axis, not which rank never came. pardist's
collectives run inside :func:`collective_errors`, which turns such an error into a
:class:`CollectiveTimeout` that names the collective, the axis (groups are labelled
with their axis names by the mesh), the late rank(s) and ``PARDIST_TIMEOUT``.

Which rank is late is found through the rendezvous store, which outlives a stuck
collective: each rank that timed out signs in under a key for this failure, and waits
a moment for the others; the ranks that never sign in are the late ones (stopped,
dead, or stuck elsewhere).

Under torchrun, :func:`record_uncaught` writes an uncaught exception into the
worker's error file (``TORCHELASTIC_ERROR_FILE``), as torch's ``@record`` decorator
would, plus the late ranks: ``python -m pardist.launch`` reads them to report the rank
that stopped rather than the healthy rank that timed out waiting for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator

import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "collective_errors",
    "describe_group",
    "forget_labels",
    "hint",
    "label_group",
    "late_ranks_of",
    "lost_peer",
    "record_uncaught",
    "set_timeout",
    "timeout_seconds",
]

PROBE_S = 2.0  # how long a rank that timed out waits for the others to sign in
# Collectives that never complete (a rank that crashed or skipped one) must turn
# into errors, not hangs. torch's default is 30 minutes; ten is long enough for a
# slow first CUDA step and short enough that a broken job is noticed.
DEFAULT_TIMEOUT_S = 600.0

_timeout_s: float | None = None  # what init gave the process group

_labels: dict[str, list[str]] = {}  # process group name -> the axes it serves
_probes: dict[str, int] = {}  # process group name -> failures probed so far


class CollectiveTimeout(RuntimeError):
    """A collective that did not complete: timed out, or a rank in it was lost.

    Attributes:
        late_ranks: the global ranks that never arrived (None where unknown).
        waited_in: the collective and axis it waited in ("pardist.psum over axis 'gpu'").
        stopped_s: where a late rank was seen stopped (SIGSTOP), how long it was waited
            for; else None (the wait was the timeout's).
    """

    def __init__(
        self,
        message: str,
        late_ranks: list[int] | None = None,
        waited_in: str = "",
        stopped_s: float | None = None,
    ):
        super().__init__(message)
        self.late_ranks, self.waited_in, self.stopped_s = late_ranks, waited_in, stopped_s


class CollectiveMismatch(RuntimeError):
    """The ranks of a group called different collectives, or gave one different shapes."""


class StepMismatch(CollectiveMismatch):
    """The ranks are at different calls of one step (one raised inside a call and went on)."""


# A step's errors that a lost peer causes, and that --keep-going survives (step._survivor).
KEEP_GOING_ON = (CollectiveTimeout, CollectiveMismatch)


def label_group(group: dist.ProcessGroup, label: str) -> None:
    """Remember that ``group`` serves the mesh axis ``label`` (for error messages)."""
    labels = _labels.setdefault(group.group_name, [])
    if label not in labels:
        labels.append(label)


def forget_labels() -> None:
    """At shutdown: group names are reused by the next process group."""
    _labels.clear()
    _probes.clear()


def describe_group(group_name: str, ranks: list[int] | None = None) -> str:
    """``axis 'gpu'`` for a group a mesh labelled, else its ranks."""
    labels = _labels.get(group_name)
    if labels:
        return "axis " + " / ".join(labels)
    return f"the process group of ranks {ranks}" if ranks is not None else "a process group"


def set_timeout(seconds: float | None) -> None:
    """Remember the timeout ``init`` gave the process group (for messages and shared memory)."""
    global _timeout_s
    _timeout_s = seconds


def timeout_seconds() -> float:
    """The collective timeout: what ``init`` was given, else ``$PARDIST_TIMEOUT``, else 600 s."""
    if _timeout_s is not None:
        return _timeout_s
    return float(os.environ.get("PARDIST_TIMEOUT") or DEFAULT_TIMEOUT_S)


def hint(late: list[int] | None) -> str:
    """What to do about a collective that timed out waiting for ``late``."""
    seconds = timeout_seconds()
    if late == []:
        return (
            "Every rank reached a collective, but not the same one: the ranks called "
            "collectives in a different order, or one skipped a collective."
        )
    who = "Which rank is late is unknown" if late is None else f"Rank(s) {late} never arrived"
    return (
        f"{who}: a rank crashed, hangs, was stopped, or skipped this "
        f"collective. If they are only slow (a long first step, a checkpoint written by "
        f"one rank), raise PARDIST_TIMEOUT (seconds; now {seconds:.0f})."
    )


def _late(group: dist.ProcessGroup) -> list[int] | None:
    """:func:`late_ranks_of`, except under --keep-going: the launcher says who died, and
    the survivors' step must not wait the probe's seconds (runtime._survive)."""
    from pardist.runtime import _survive

    return None if _survive.enabled() else late_ranks_of(group)


def late_ranks_of(group: dist.ProcessGroup, wait: float = PROBE_S) -> list[int] | None:
    """The global ranks of ``group`` that did not also fail within ``wait`` s (None: unknown).

    Every rank of ``group`` that calls this for its n-th failure signs in under the
    same key; those that have not signed in when ``wait`` is over are late.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank()
        name = group.group_name
        _probes[name] = count = _probes.get(name, 0) + 1
        prefix = f"pardist/late/{name}/{count}/"
        store.set(prefix + str(me), "1")
        deadline = time.monotonic() + wait
        while True:
            here = {r for r in ranks if store.check([prefix + str(r)])}
            if len(here) == len(ranks) or time.monotonic() > deadline:
                return [r for r in ranks if r not in here]
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store is gone too: nothing more to learn
        return None


_TIMEOUT_WORDS = ("timed out", "timeout")
_LOST_WORDS = ("connection closed", "connection reset", "broken pipe", "connection refused")


def lost_peer(what: str, group: dist.ProcessGroup | None, text: str) -> CollectiveTimeout | None:
    """A CollectiveTimeout naming the lost rank(s), where ``text`` (an error's message from
    inside ``what``) says a connection to another rank was lost; else None."""
    if group is None or not any(w in text.lower() for w in _LOST_WORDS):
        return None
    late = late_ranks_of(group)
    where = describe_group(group.group_name, dist.get_process_group_ranks(group))
    gone = f"Rank(s) {late} never arrived: gone" if late else "A rank is gone"
    return CollectiveTimeout(
        f"{what} over {where} lost the connection to another rank (it exited or was "
        f"killed) on rank {dist.get_rank()}. {gone} (killed, crashed or exited); its own "
        f"output says why. (The backend said: {text[:300]})",
        late,
        f"{what} over {where}",
    )


@contextlib.contextmanager
def collective_errors(what: str, group: dist.ProcessGroup | None) -> Iterator[None]:
    """Turn a backend's timeout or lost-peer error inside the block into a CollectiveTimeout.

    Args:
        what: the collective, as the user called it ('pardist.psum').
        group: the process group it runs over.
    """
    try:
        yield
    except CollectiveTimeout:
        raise
    except RuntimeError as exc:
        text = str(exc).lower()
        timed_out = any(w in text for w in _TIMEOUT_WORDS)
        if group is None or not (timed_out or any(w in text for w in _LOST_WORDS)):
            raise
        late = _late(group)
        where = describe_group(group.group_name, dist.get_process_group_ranks(group))
        event = (
            f"timed out after {timeout_seconds():.0f} s (PARDIST_TIMEOUT)"
            if timed_out
            else "lost the connection to another rank (it exited or was killed)"
        )
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        said = (
            hint(late)
            if timed_out or not late
            else (
                f"Rank(s) {late} never arrived: gone (killed, crashed or exited); its own "
                "output says why."
            )
        )
        raise CollectiveTimeout(
            f"{what} over {where} {event} on rank {dist.get_rank()}. {said} "
            f"(The backend said: {first})",
            late,
            f"{what} over {where}",
        ) from exc


def _timeout_in(exc: BaseException | None) -> CollectiveTimeout | None:
    """The CollectiveTimeout that ``exc`` is, or was caused by."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, CollectiveTimeout):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


_recording = False


def record_uncaught() -> None:
    """Under torchrun, write an uncaught exception to this worker's error file.

    torch's ``@record`` does this for the functions it decorates; pardist does it
    for the whole script, in torch's format (``message``, ``py_callstack``,
    ``timestamp``), and adds ``pardist_late_ranks`` (with the collective and the
    timeout) when the failure was a collective waiting for other ranks. The
    traceback is still printed as usual.
    """
    global _recording
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if _recording or not path:
        return
    _recording = True
    previous = sys.excepthook

    def hook(kind, exc, tb) -> None:
        try:
            extra = {
                "py_callstack": "".join(traceback.format_exception(kind, exc, tb)),
                "timestamp": str(int(time.time())),
            }
            timeout = _timeout_in(exc)
            if timeout is not None and timeout.late_ranks is not None:
                extra["pardist_late_ranks"] = timeout.late_ranks
                extra["pardist_waited_in"] = timeout.waited_in
                extra["pardist_timeout_s"] = timeout_seconds()
                if timeout.stopped_s is not None:
                    extra["pardist_stopped_s"] = timeout.stopped_s
            message = {"message": f"{kind.__name__}: {exc}", "extraInfo": extra}
            # Whole or not at all: the launcher stops this rank (SIGTERM) once another has
            # failed, and a file it finds half-written or empty crashed torchrun's agent
            # (JSONDecodeError), which then neither restarted nor reported the run.
            with open(f"{path}.tmp", "w") as f:
                json.dump({"message": message}, f)
            os.replace(f"{path}.tmp", path)
        except Exception:  # noqa: BLE001 - never hide the original error
            pass
        previous(kind, exc, tb)

    sys.excepthook = hook
