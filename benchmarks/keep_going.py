"""Lose a rank: ``--keep-going`` against ``--max-restarts`` from a checkpoint.

    python benchmarks/keep_going.py                  # 10 kills each, 3 ranks
    python benchmarks/keep_going.py --runs 3 --ranks 4
    python benchmarks/keep_going.py --runs 5 --steps 150 --ways rejoin offer  # join points

One training run (an MLP of 3 x Linear(256, 256) with dropout, AdamW, float64,
``deterministic=12``, 60 steps of a 48-row global batch from
``pardist.data.shard(split_batches=True)``) is started with ``python -m pardist.launch``
five ways: uninterrupted; with ``--keep-going``; with ``--max-restarts 1``,
checkpointing every 10 steps and resuming from the last checkpoint (the way to survive a
lost rank without --keep-going); and with both, where a replacement joins the survivors
and receives their state from a peer: at their next save (every 10 steps), or at the
first step after it is ready (``pardist.checkpoint.offer`` after every step, no
checkpoint at all; ``--ways ... offer``, in a run long enough for a replacement to
start: ``--steps 150``). In all but the first, one random rank SIGKILLs itself 20 ms
into a random step of 5 to 44. Reported per way, over the runs: the seconds from the
kill to the next completed step, the longest wait between two steps after that (a save
waiting for a replacement), the steps computed again (those since the last checkpoint),
the samples dropped, and the final parameters against the uninterrupted run's (max abs difference;
how many runs were ``torch.equal``); for the replacements, when the run was back at its
size. Writes benchmarks/results/keep_going.{md,json} (keep_going_join.{md,json} for
another length or other ways).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

STEPS, BATCH, EVERY = 60, 48, 10  # (--steps: another length)
HERE = Path(__file__).resolve()


def worker(out: str, victim: int, kill_at: int, ckpt: str | None, offer: bool) -> None:
    """One rank of a run; logs each completed step to stdout as a JSON line."""
    import pardist

    pardist.init()
    me = int(os.environ["RANK"])
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    pardist.seed_everything(0)
    x, y = torch.randn(STEPS * BATCH, 256, dtype=torch.float64), torch.randn(STEPS * BATCH, 1)
    loader = DataLoader(TensorDataset(x, y.double()), batch_size=BATCH, shuffle=True)
    data = pardist.data.shard(loader, split_batches=True)
    layers = [torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Dropout(0.1)] * 3
    model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 1)).double()
    apply, params, buffers = pardist.functional(model)
    opt = pardist.optim.adamw(1e-3)
    state = {"params": params, "opt": opt.init(params), "data": data, "step": 0, "rng": 0}
    if ckpt or offer:  # (offer: no directory; a replacement's state from a peer)
        state = pardist.checkpoint.resume(ckpt, state, key="step")
        pardist.set_rng_count(state["rng"])  # dropout's streams continue where they were

    def loss_fn(p, x, y):
        return ((apply(p, buffers, x)[0] - y) ** 2).mean()

    @pardist.data_parallel(deterministic=12)
    def step(p, s, batch):
        loss, g = pardist.value_and_grad(loss_fn)(p, *batch)
        p, s = opt.update(g, s, p)
        return p, s, loss

    params, opt_state, done = state["params"], state["opt"], state["step"]
    for batch in data:
        if me == victim and done == kill_at and first_attempt:
            kill = lambda: (log(killed=time.time()), os.kill(os.getpid(), signal.SIGKILL))  # noqa: E731
            threading.Timer(0.02, kill).start()
        params, opt_state, _ = step(params, opt_state, batch)
        done += 1
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        log(rank=me, step=done, t=time.time(), world=pardist.world_size(), attempt=attempt)
        if ckpt and done % EVERY == 0:
            saved = dict(params=params, opt=opt_state, data=data, step=done)
            saved["rng"] = pardist.rng_count()
            pardist.checkpoint.save(ckpt, saved, step=done)
        if offer and done < STEPS:  # a replacement that is ready joins here
            offered = dict(params=params, opt=opt_state, data=data, step=done)
            pardist.checkpoint.offer(dict(offered, rng=pardist.rng_count()), step=done)
    if pardist.is_main():
        torch.save(params, out)
    pardist.shutdown()


def log(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")  # one write: ranks share the pipe
    sys.stdout.flush()


def run(way: str, ranks: int, victim: int, kill_at: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"{way}-{time.monotonic_ns()}.pt")
    saves = way in ("restart", "rejoin")
    ckpt = "offer" if way == "offer" else ""
    ckpt = tempfile.mkdtemp(prefix="ckpt-", dir=tmp) if saves else ckpt  # a new one
    flags = {"none": [], "keep": ["--keep-going"], "restart": ["--max-restarts", "1"]}.get(
        way, ["--keep-going", "--max-restarts", "1"]
    )
    cmd = [sys.executable, "-m", "pardist.launch", "--nproc", str(ranks), *flags]
    cmd += [str(HERE), "--worker", out, str(victim), str(kill_at), ckpt, str(STEPS)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{way}: exit {done.returncode}\n{done.stderr[-3000:]}")
    events = [
        json.loads(line[line.index("{") :]) for line in done.stdout.splitlines() if "{" in line
    ]
    killed = next((e["killed"] for e in events if "killed" in e), None)
    steps = [e for e in events if "step" in e]
    # the first step the survivors completed after dealing with the loss (steps that
    # ranks still in flight finished before the launcher restarted them do not count)
    after = [
        e["t"]
        for e in steps
        if killed is not None and e["t"] > killed and (e["world"] < ranks or e["attempt"] > 0)
    ]
    computed = len({(e["rank"], e["step"]) for e in steps}) if steps else 0
    shrunk = min((e["t"] for e in steps if e["world"] < ranks), default=None)
    full = [e["t"] for e in steps if shrunk is not None and e["t"] > shrunk and e["world"] == ranks]
    per_rank = [e for e in steps if e["rank"] == min(e["rank"] for e in steps)]
    stall = 0.0  # the longest wait between two steps of one rank, once going on again
    for rank in {e["rank"] for e in steps} if after else ():
        times = sorted(e["t"] for e in steps if e["rank"] == rank and e["t"] >= min(after))
        stall = max([stall, *(b - a for a, b in zip(times, times[1:], strict=False))])
    return dict(
        params=torch.load(out),
        recovery_s=(min(after) - killed) if after else None,
        redone=len(per_rank) - len({e["step"] for e in per_rank}),
        computed=computed,
        full_s=(min(full) - killed) if full and killed is not None else None,
        stall_s=stall,
    )


def _length(steps: int) -> None:
    global STEPS
    STEPS = steps


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        out, victim, kill_at, ckpt = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        _length(int(sys.argv[6]))
        offer = ckpt == "offer"
        return worker(out, victim, kill_at, None if offer else ckpt or None, offer)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    ways = ["keep", "rejoin", "restart"]  # (and "offer": with --steps 150, see the docstring)
    parser.add_argument("--ways", nargs="+", choices=[*ways, "offer"], default=ways)
    args = parser.parse_args()
    _length(args.steps)
    rng = random.Random(args.seed)
    rows = {way: [] for way in args.ways}
    with tempfile.TemporaryDirectory() as tmp:
        want = run("none", args.ranks, -1, -1, tmp)["params"]
        for i in range(args.runs):
            # (5 to 44: a replacement is ready, and joins, well before the run ends)
            victim, kill_at = rng.randrange(args.ranks), rng.randrange(5, 45)
            for way in rows:
                got = run(way, args.ranks, victim, kill_at, tmp)
                diff = max((got["params"][k] - want[k]).abs().max().item() for k in want)
                equal = all(torch.equal(got["params"][k], want[k]) for k in want)
                rows[way].append(
                    dict(
                        victim=victim,
                        kill_at=kill_at,
                        diff=diff,
                        equal=equal,
                        recovery_s=got["recovery_s"],
                        redone=got["redone"],
                        full_s=got["full_s"],
                        stall_s=got["stall_s"],
                    )
                )
                print(f"run {i} {way}: {rows[way][-1]}", flush=True)
    write(rows, args)


def write(rows: dict, args) -> None:
    parts = args.steps != 60 or list(rows) != ["keep", "rejoin", "restart"]
    command = f" --steps {args.steps} --ways {' '.join(rows)}" if parts else ""
    names = {
        "keep": "`--keep-going`",
        "rejoin": "`--keep-going --max-restarts 1`, a replacement joins at the next save",
        "offer": "`--keep-going --max-restarts 1`, `offer` every step, no checkpoint",
        "restart": "`--max-restarts 1`, checkpoint every 10",
    }
    lines = [
        f"{args.ranks} CPU ranks, {args.runs} runs each, SIGKILL of a random rank 20 ms into "
        f"a random step of 5-44 of {STEPS} (`python benchmarks/keep_going.py --runs {args.runs} "
        f"--ranks {args.ranks}{command}`)",
        "",
        "| way | kill to next step, s (median, max) | longest wait between steps after it, s "
        "(median) | steps computed again (median) | samples dropped | max abs diff "
        "| `torch.equal` runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for way, got in rows.items():
        rec = [r["recovery_s"] for r in got if r["recovery_s"] is not None]
        dropped = "0 (`torch.equal`)" if all(r["equal"] for r in got) else "not known"
        lines.append(
            f"| {names[way]} | {statistics.median(rec):.2f}, {max(rec):.2f} | "
            f"{statistics.median(r['stall_s'] for r in got):.2f} | "
            f"{statistics.median(r['redone'] for r in got):.0f} | {dropped} | "
            f"{max(r['diff'] for r in got):.1e} | {sum(r['equal'] for r in got)} of {len(got)} |"
        )
    for way, where in (("rejoin", f"next save (every {EVERY} steps)"), ("offer", "offer")):
        full = [r["full_s"] for r in rows.get(way, []) if r["full_s"] is not None]
        if full:
            lines += [
                "",
                f"With a replacement joining at the {where}, the run was back at {args.ranks} "
                f"ranks {statistics.median(full):.2f} s (median; max {max(full):.2f} s) after "
                f"the kill, in {len(full)} of {len(rows[way])} runs.",
            ]
    text = "\n".join(lines) + "\n"
    print(text)
    results = HERE.parent / "results"
    name = "keep_going" if not command else "keep_going_join"  # (a part: a file of its own)
    (results / f"{name}.md").write_text(text)
    (results / f"{name}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
