"""``python -m pardist.launch --keep-going``: one machine's ranks, and a lost one left behind.

torchrun's agent stops every worker when one fails (and restarts them all under
``--max-restarts``), so a run that goes on without a lost rank cannot use it. This
launcher is its one-machine core: it hosts the run's store (so the store outlives any
rank, rank 0 included), starts each rank as a fresh interpreter with torchrun's
environment (each with its own hash seed, as torchrun's), and watches them. When a rank
exits with an error or is killed while others still run, it publishes the survivors'
membership (``runtime._survive``) instead of stopping them; they regroup inside the step
that saw it go. A rank stopped (SIGSTOP) for ``transport._alive.STOPPED_S`` is killed
first: it holds the others up, and must never come back into a group that went on. It
exits 0 when every surviving rank has finished, and says which ranks were lost and how.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

from pardist.runtime import _join, _listen, _survive
from pardist.transport import _alive, _segments

__all__ = ["run"]

WHERE = "pardist.launch --keep-going"
_POLL_S = 0.02


def _command(args) -> list[str]:
    if args.no_python:
        return [args.training_script, *args.training_script_args]
    if args.module:
        return [sys.executable, "-u", "-m", args.training_script, *args.training_script_args]
    return [sys.executable, "-u", args.training_script, *args.training_script_args]


def _environment(rank: int, world: int, port: int, env: dict) -> dict:
    out = dict(os.environ, **env)
    out.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        PARDIST_LAUNCHER_PID=str(os.getpid()),
    )
    out[_survive.ENV] = "1"
    if world > 1:
        out.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks share the cores
    return out


def run(args, env: dict) -> int:
    """Start ``args``'s script in ``--nproc`` ranks and watch them; the exit code."""
    world = int(args.nproc_per_node)
    store = _listen.store_server(
        "127.0.0.1",
        0,
        single_node=True,
        timeout=datetime.timedelta(seconds=300),
        world_size=world,
        wait_for_workers=False,
    )
    word = _survive.launcher_view(store, env.get(_join.SECRET, ""))
    procs = [
        subprocess.Popen(_command(args), env=_environment(r, world, store.port, env))
        for r in range(world)
    ]
    lost: dict[int, str] = {}
    stopped, fenced = _alive.Stopped(), {}

    def stop(signum, _frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)
        for proc in procs:
            proc.wait()
        print(f"{WHERE}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        running = set(range(world))
        while running:
            time.sleep(_POLL_S)
            for rank in sorted(running):
                code = procs[rank].poll()
                if code is None:
                    if stopped.held(rank, _alive.state(procs[rank].pid) == "T"):
                        procs[rank].kill()  # fenced off: it can never come back mid-step
                        fenced[rank] = _alive.fenced("the launcher")
                    continue
                running.discard(rank)
                if code != 0:
                    lost[rank] = fenced.get(rank) or _survive.how_it_died(code)
                    if running:  # the others go on without it
                        _survive.publish(word, world, lost)
    finally:
        _segments.clean_stale()
    return _report(world, lost)


def _report(world: int, lost: dict[int, str]) -> int:
    if not lost:
        return 0
    names = "; ".join(f"rank {r} {how}" for r, how in sorted(lost.items()))
    if len(lost) == world:
        print(f"{WHERE}: every rank was lost ({names}).", file=sys.stderr, flush=True)
        return 1
    print(
        f"{WHERE}: finished with {world - len(lost)} of {world} ranks; lost {names} "
        "(the others went on without it).",
        file=sys.stderr,
        flush=True,
    )
    return 0
