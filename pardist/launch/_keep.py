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
import json
import os
import signal
import subprocess
import sys
import time

from pardist.runtime import _join, _listen, _rejoin, _survive
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


def _environment(rank: int, world: int, port: int, env: dict, budget: int) -> dict:
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
    out[_survive.ENV], out[_rejoin.BUDGET] = "1", str(budget)
    if world > 1:
        out.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks share the cores
    return out


class _Run:
    """The ranks of one run, as the launcher sees them: who is in the group (``members``,
    launch ranks in group order), who was lost and how, the replacements starting."""

    def __init__(self, args, env: dict, store, word, budget: int):
        self.world, self.word, self.budget = int(args.nproc_per_node), word, budget
        self.replacements = budget  # (every rank is told the whole budget)
        self.command, self.env, self.port = _command(args), env, store.port
        self.procs: dict[int, subprocess.Popen] = {}
        self.slot: dict[int, int] = {}  # launch rank -> its RANK (a replacement: the lost one's)
        self.members, self.lost, self.generation = list(range(self.world)), {}, 0
        self.starting: dict[int, int] = {}  # replacement -> the launch rank it replaces
        self.replaced: dict[int, int] = {}  # lost launch rank -> its replacement
        for rank in range(self.world):
            self._start(rank, rank)

    def _start(self, name: int, slot: int) -> None:
        env = _environment(slot, self.world, self.port, self.env, self.replacements)
        if name != slot:
            env[_survive.ID] = str(name)
        self.slot[name] = slot
        self.procs[name] = subprocess.Popen(self.command, env=env)

    def _publish(self) -> None:
        self.generation += 1
        self.word.set(_rejoin.STARTING, json.dumps(sorted(self.starting)))
        _survive.publish(self.word, self.generation, self.members, self.lost, self.starting)

    def gone(self, name: int, how: str) -> None:
        """``name`` exited with an error or was killed."""
        self.lost[name] = how
        if self.starting.pop(name, None) is not None:  # a replacement that never joined
            self.word.set(_rejoin.STARTING, json.dumps(sorted(self.starting)))
            return
        self.members.remove(name)
        if not any(self.procs[m].poll() is None for m in self.members):
            return
        if self.budget > 0:  # started first, so that the survivors' next save waits for it
            self.budget -= 1
            new = len(self.procs)
            self._start(new, self.slot[name])
            self.starting[new], self.replaced[name] = name, new
        self._publish()  # the others go on without it

    def take(self) -> None:
        """The survivors' main rank asked to take in the replacements that are ready."""
        key = _rejoin.take_key(self.generation)
        if not self.word.check([key]):
            return
        for name in json.loads(self.word.get(key)):
            if self.starting.pop(name, None) is not None and self.procs[name].poll() is None:
                self.members.append(name)
        self._publish()  # (the same members again, if the replacement died meanwhile)


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
    ranks = _Run(args, env, store, word, int(args.max_restarts or 0))
    stopped, fenced = _alive.Stopped(), {}

    def stop(signum, _frame):
        for proc in ranks.procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)
        for proc in ranks.procs.values():
            proc.wait()
        print(f"{WHERE}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        done: set[int] = set()
        while set(ranks.members) - done:
            time.sleep(_POLL_S)
            for name in sorted(set(ranks.procs) - done):
                proc = ranks.procs[name]
                code = proc.poll()
                if code is None:
                    if stopped.held(name, _alive.state(proc.pid) == "T"):
                        proc.kill()  # fenced off: it can never come back mid-step
                        fenced[name] = _alive.fenced("the launcher")
                    continue
                done.add(name)
                if code != 0:
                    ranks.gone(name, fenced.get(name) or _survive.how_it_died(code))
            ranks.take()
        for name in ranks.starting:  # the run ended before it saved again
            ranks.procs[name].terminate()
            ranks.procs[name].wait()
    finally:
        _segments.clean_stale()
    return _report(ranks)


def _report(ranks: _Run) -> int:
    lost, world = ranks.lost, ranks.world
    if not lost:
        return 0

    def said(name: int) -> str:
        new = ranks.replaced.get(name)
        if new is None:
            return f"rank {name} {lost[name]}"
        if new in ranks.members:
            return f"rank {name} {lost[name]} (replaced by launch rank {new}, which joined)"
        return f"rank {name} {lost[name]} (its replacement, launch rank {new}, never joined)"

    names = "; ".join(said(r) for r in sorted(lost))
    if not ranks.members:
        print(f"{WHERE}: every rank was lost ({names}).", file=sys.stderr, flush=True)
        return 1
    print(
        f"{WHERE}: finished with {len(ranks.members)} of {world} ranks; lost {names} "
        f"(the others went on {'and took in replacements' if ranks.replaced else 'without it'}).",
        file=sys.stderr,
        flush=True,
    )
    return 0
