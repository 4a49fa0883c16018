"""What ``python -m pardist.launch`` says when a job fails: the rank that caused it, and how.

torchrun reports the rank whose failure it saw first, with a table of every rank's
exit code. That rank is often not the cause: when a rank is stopped or hangs, the
healthy ranks time out waiting for it and exit first. pardist's workers record the
ranks they waited for in their error files (``_faults.record_uncaught``), so the
launcher can name the rank that stopped. It says, in one line, whether that rank
raised (its traceback is above, or in its log file), exited with a code of its
own (the script's own error message is above), was killed by a signal, or stopped
responding while the others timed out.
"""

from __future__ import annotations

import os

__all__ = ["explain"]


def _recorded(failure) -> tuple[str | None, dict]:
    """A failed worker's error file: its exception, and what pardist added (late ranks...)."""
    message = failure.message
    if not isinstance(message, dict):
        return None, {}
    extra = message.get("extraInfo", {})
    return message.get("message"), {k: v for k, v in extra.items() if k.startswith("pardist_")}


def _who(rank: int, failures: dict) -> str:
    failure = failures.get(rank)
    if failure is None:
        return f"rank {rank} (on another node)"
    return f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"


def _where_output(failure) -> str:
    """Where a worker's stderr went: this terminal, or torchrun's log file for it."""
    log = os.path.join(os.path.dirname(str(failure.error_file)), "stderr.log")
    return f"in {log}" if os.path.isfile(log) and os.path.getsize(log) else "above"


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 300 else line[:297] + "..."


def _ended_by_another(failure) -> bool:
    """Whether a rank failed in a collective that another rank's failure ended."""
    message, _ = _recorded(failure)
    return message is not None and message.startswith("CollectiveTimeout")


_CONSEQUENCES = ("StepMismatch", "CollectiveTimeout")  # errors a late rank gets from the others


def _failed_by_itself(failure) -> bool:
    """Whether a late rank failed on its own, not by the launcher or by waiting for another.

    Only asked about ranks that another rank timed out waiting for. The launcher
    stops the others with SIGTERM, then SIGKILL after a grace period: a rank that
    is stopped (SIGSTOP, a debugger) or stuck in C code cannot act on SIGTERM, so
    SIGKILL here is the launcher's, not the out-of-memory killer's (a rank killed
    before the others time out is reported first, and never gets here).
    """
    message, extra = _recorded(failure)
    if message is not None:  # what the waiting rank's timeout did to it is not its own:
        # continued after the others gave up, it finds them gone from the call it is in
        return "pardist_late_ranks" not in extra and not message.startswith(_CONSEQUENCES)
    return failure.exitcode > 0 or failure.signal_name() not in ("SIGTERM", "SIGKILL")


# What a signal that ended a rank says about the cause.
_SIGNALS = {
    "SIGABRT": "aborted inside its own process (SIGABRT: abort() or a failed C++ assertion "
    "in torch, a backend or an extension; its last output says which)",
    "SIGSEGV": "crashed inside its own process (SIGSEGV: a segmentation fault in native code)",
    "SIGBUS": "crashed inside its own process (SIGBUS: a bad memory access, e.g. /dev/shm full)",
    "SIGKILL": "was killed by SIGKILL (no traceback: sent from outside the process, often by "
    "the out-of-memory killer)",
}
_OTHER = "was killed by {} (no traceback: a signal sent from outside the process)"


def _tail(failure, lines: int = 5) -> str:
    """The last lines of a worker's stderr, where torchrun kept it in a log file."""
    log = os.path.join(os.path.dirname(str(failure.error_file)), "stderr.log")
    try:
        with open(log, errors="replace") as f:
            last = [line.rstrip() for line in f.readlines()[-lines:] if line.strip()]
    except OSError:
        return "; its output is above"
    return "; the last lines of its stderr: " + " | ".join(last) if last else ""


def _culprit_line(rank: int, failures: dict) -> str:
    """What rank ``rank`` itself did: raised, exited with a code, or was killed."""
    failure = failures.get(rank)
    if failure is None:
        return f"{_who(rank, failures)} failed"
    message, _ = _recorded(failure)
    if message is not None:
        return (
            f"{_who(rank, failures)} failed first: {_first_line(message)} "
            f"(its traceback is {_where_output(failure)})"
        )
    if failure.exitcode < 0:
        name = failure.signal_name()
        return f"{_who(rank, failures)} {_SIGNALS.get(name, _OTHER).format(name)}" + _tail(failure)
    if failure.exitcode == 1:  # an uncaught error before pardist.init, or sys.exit(1)
        return (
            f"{_who(rank, failures)} exited first, with code 1; its own output, "
            f"{_where_output(failure)}, says why"
        )
    return (
        f"{_who(rank, failures)} exited first, with code {failure.exitcode} (its own exit, "
        f"not an exception); its own output is {_where_output(failure)}"
    )


def explain(exc, where: str) -> tuple[str, int]:
    """One line naming the rank that caused a ChildFailedError, and the exit code to use.

    Args:
        exc: torchrun's ChildFailedError, with every failed local rank.
        where: the launcher's name, to start the line with.
    """
    failures = exc.failures
    rank, failure = exc.get_first_failure()
    if "pardist_late_ranks" not in _recorded(failure)[1] and _ended_by_another(failure):
        # A lost connection ends a rank's collective as soon as its peer dies, often
        # within the second by which torch orders failures: the peer came first.
        first = [r for r, f in sorted(failures.items()) if not _ended_by_another(f)]
        rank, failure = (first[0], failures[first[0]]) if first else (rank, failure)
    code = failure.exitcode if failure.exitcode > 0 else 1
    message, extra = _recorded(failure)
    late = extra.get("pardist_late_ranks")
    if late is None:  # the first to fail failed on its own
        return f"{where}: {_culprit_line(rank, failures)}. The other ranks were stopped.", code
    why = (
        f"{extra['pardist_stopped_s']:.0f} s, seeing it stopped (SIGSTOP),"
        if "pardist_stopped_s" in extra
        else f"{extra.get('pardist_timeout_s', 0):.0f} s (PARDIST_TIMEOUT)"
    )
    waited = (
        f"{_who(rank, failures)} waited {why} in {extra.get('pardist_waited_in') or 'a collective'}"
    )
    if not late:
        return (
            f"{where}: the ranks waited for each other in different collectives (a rank "
            f"skipped one, or called them in another order): {waited}, and every other "
            "rank waited too. Every rank was then stopped.",
            1,
        )
    own = [r for r in late if r in failures and _failed_by_itself(failures[r])]
    if own:  # a late rank that raised, exited or was killed: that came first
        return f"{where}: {_culprit_line(own[0], failures)}. The other ranks were stopped.", 1
    names = ", ".join(_who(r, failures) for r in late)
    return (
        f"{where}: {names} stopped responding (stopped, hung, or lost): {waited} for it, "
        "then failed (its error is above). Every rank was then stopped.",
        1,
    )
