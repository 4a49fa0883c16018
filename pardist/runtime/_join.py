"""Joining a run: every rank arrives once, within the join timeout, or an error says who.

torch's rendezvous waits for ``WORLD_SIZE`` ranks and knows no more: a world that never
fills is silent until the collective timeout, two processes with the same ``RANK`` give
a raw ``EADDRINUSE`` (rank 0) or silence, and a ``RANK`` outside the world a gloo
``enforce fail``. Here each rank checks its ``RANK`` before any store is made, registers
its rank in the store (a second process of that rank is refused at once), and a wait
that times out names the ranks that arrived, the ones that never did, and any twice.
"""

from __future__ import annotations

import datetime
import os

__all__ = ["SECRET", "all_here", "join_timeout", "rank_in_world", "secret_keys", "store_error"]

SECRET = "PARDIST_STORE_SECRET"


def secret_keys(store):
    """``store`` seen through a prefix made of the run's secret, where it has one.

    torch's ``TCPStore`` has no authentication: any local user who finds the port can
    connect, and read or set the keys the ranks and gloo agree through (the addresses of
    every rank, pardist's join counts). A prefix of 128 random bits makes every key the
    run uses unguessable, so such a user reads nothing of ours and changes nothing we
    read. ``python -m pardist.launch`` (one machine) and ``pardist.spawn`` draw a secret
    per run and hand it to the ranks in their environment (``/proc/<pid>/environ`` is
    readable by the same user only); ranks started by hand or on several machines share
    one by setting ``PARDIST_STORE_SECRET`` alike on each.
    """
    import torch.distributed as dist

    secret = os.environ.get(SECRET, "")
    return dist.PrefixStore(f"pardist-run-{secret}", store) if secret else store


def join_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("PARDIST_JOIN_TIMEOUT", "600")))


def rank_in_world() -> tuple[int, int]:
    """``RANK`` and ``WORLD_SIZE`` from the environment, checked before any store is made."""
    try:
        rank_, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise ValueError(
            f"pardist.init: RANK={os.environ['RANK']!r} and WORLD_SIZE="
            f"{os.environ['WORLD_SIZE']!r} must be integers (set by torchrun or pardist.launch)."
        ) from None
    if world < 1 or not 0 <= rank_ < world:
        raise ValueError(
            f"pardist.init: RANK={rank_} is outside a world of WORLD_SIZE={world} (ranks 0 to "
            f"{world - 1}). Start one process per rank 0..{max(world - 1, 0)}, each with its "
            "own RANK, or let torchrun / python -m pardist.launch set them."
        )
    return rank_, world


def all_here(store, world: int, timeout: datetime.timedelta, key: str, rank_: int) -> None:
    """Wait, up to the join timeout, until every rank has reached ``key`` in the store;
    an error naming the ranks that came and those that did not, or a rank started twice.

    The process group's start (gloo connects every pair of ranks) is bounded by the
    collective timeout: with a short ``PARDIST_TIMEOUT`` on a loaded machine, a rank
    still importing torch failed the others' start (``DistStoreError: wait timeout
    after 3000ms``). Once every rank is here the start takes moments; how long ranks
    may take to arrive is the join timeout's to bound (``--join-timeout``, passed as
    ``PARDIST_JOIN_TIMEOUT``; else 600 s).
    """
    if store.add(f"{key}/rank/{rank_}", 1) > 1:
        raise RuntimeError(
            f"pardist.init: rank {rank_} is here twice: another process started with "
            f"RANK={rank_} joined this run first. Give each process its own RANK (0 to "
            f"{world - 1}), or let torchrun / python -m pardist.launch set them."
        )
    if store.add(key, 1) == world:  # the last to arrive tells the others
        store.set(f"{key}/all", "1")
    waited = max(timeout, join_timeout())
    try:
        store.wait([f"{key}/all"], waited)
    except Exception:  # noqa: BLE001 - torch's DistStoreError: say who is missing
        try:
            counts = {r: store.add(f"{key}/rank/{r}", 0) for r in range(world)}
        except Exception:  # noqa: BLE001 - the store went with rank 0
            raise RuntimeError(
                f"pardist.init: rank {rank_}: rank 0 (which holds the run's store) stopped "
                f"before the world of {world} ranks filled; its error says why."
            ) from None
        came = [r for r, n in counts.items() if n]
        missing = [r for r, n in counts.items() if not n]
        twice = [r for r, n in counts.items() if n > 1]
        also = f"; started twice: rank {', '.join(map(str, twice))}" if twice else ""
        raise RuntimeError(
            f"pardist.init: the world of {world} ranks did not fill within "
            f"{waited.total_seconds():g} s (PARDIST_JOIN_TIMEOUT): rank(s) "
            f"{', '.join(map(str, came))} arrived, rank(s) {', '.join(map(str, missing))} "
            f"never did{also}. Start every rank (WORLD_SIZE={world} processes), or set "
            "WORLD_SIZE to the number started."
        ) from None


def store_error(e: Exception, host: str, port: int, world: int) -> RuntimeError:
    """torch's error starting the rendezvous store, in pardist's words."""
    said = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    rank_ = int(os.environ["RANK"])
    if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
        why = (
            f"the port is in use: another process listens on {host}:{port} (a second "
            "process with RANK=0, or another run on this MASTER_PORT). Give each process its "
            "own RANK, and each run its own MASTER_PORT"
        )
    elif "clients joined" in str(e) or "timed out" in str(e).lower() or "timeout" in str(e):
        why = (
            f"not every rank of WORLD_SIZE={world} connected within "
            f"{join_timeout().total_seconds():g} s (PARDIST_JOIN_TIMEOUT). Start every rank, "
            "or set WORLD_SIZE to the number started"
        )
    else:
        why = f"rank 0's store at {host}:{port} could not be reached or started"
    return RuntimeError(f"pardist.init: rank {rank_}: {why} ({said}).")
