"""Lose a replica under torchft 0.2.0, the survivors going on: a comparison row for keep_going.py.

Not pardist: run it in an environment of its own, made with ``pip install torchft==0.2.0 numpy``:

    /tmp/ft/bin/python benchmarks/keep_going_torchft.py --runs 10 --heartbeat-ms 5000 1000

keep_going.py's workload (3 replica groups of one CPU gloo process, its MLP in float64, AdamW,
60 steps of 48 rows, 16 a replica, seeded alike) with torchft's Manager, DistributedDataParallel,
OptimizerWrapper and a `torchft_lighthouse --min_replicas 2` started here (--heartbeat-ms and
--join-timeout-ms set its timeouts; default 5 s and 60 s, the CLI's). Batches go by
manager.current_step(): an attempt should_commit() refuses is computed again. Each run, a replica
drawn as keep_going.py draws it SIGKILLs itself 20 ms into a drawn step, not to be restarted.
Reported: kill to the first step committed without it, attempts discarded, samples dropped, and
a survivor's final parameters against an uninterrupted run's.

Patched in torchft, in the workers (patch_torchft): Manager's gRPC server binds [::] (every
interface): it gets 127.0.0.1:0 (and hostname="127.0.0.1"); the checkpoint HTTP server binds
("", 0) and advertises gethostname(): it gets 127.0.0.1:0 and advertises 127.0.0.1. And
DistributedDataParallel._comm_hook's `assert fut._fut` fails when the all-reduce failed (a peer
died) or the manager had already errored (a _DummyWork), killing the survivor: the patched hook
returns a completed future of the bucket; the manager has recorded the error, so should_commit()
is False and the attempt is discarded (KEEP_GOING_TORCHFT_STOCK_HOOK=1 keeps the stock hook).
"""

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from http.server import ThreadingHTTPServer
from pathlib import Path
from statistics import median

import torch

STEPS, BATCH, REPLICAS, PER = 60, 48, 3, 16
HERE = Path(__file__).resolve()
log = lambda **fields: print(json.dumps(fields), flush=True)  # one write a line


def patch_torchft() -> None:
    import torchft.checkpointing.http_transport as http
    import torchft.ddp as ddp
    import torchft.manager as manager

    manager.ManagerServer = lambda s=manager.ManagerServer, **kw: s(**{**kw, "bind": "127.0.0.1:0"})
    http._IPv6HTTPServer = lambda _, handler: ThreadingHTTPServer(("127.0.0.1", 0), handler)
    http.HTTPTransport.address = lambda t: f"http://127.0.0.1:{t._server.server_port}/checkpoint/"

    def comm_hook(state, bucket):
        (work := state.allreduce(bucket.buffer())).wait()
        if (fut := getattr(work.get_future(), "_fut", None)) is None:  # the stock hook asserts
            (fut := torch.futures.Future()).set_result(bucket.buffer())  # an attempt discarded
        return fut

    if not os.environ.get("KEEP_GOING_TORCHFT_STOCK_HOOK"):
        ddp.DistributedDataParallel._comm_hook = staticmethod(comm_hook)


def worker(victim: int, kill_at: int, port: int, tmp: str, rid: int) -> None:
    patch_torchft()
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo, optim

    torch.manual_seed(0)
    x, y = torch.randn(STEPS * BATCH, 256, dtype=torch.float64), torch.randn(STEPS * BATCH, 1)
    layers = [torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Dropout(0.1)] * 3
    model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 1)).double()
    y, order = y.double(), torch.randperm(STEPS * BATCH)  # one shuffled epoch, like a DataLoader
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))  # RANK: from run()
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),  # as torchft's train_ddp.py
        load_state_dict=lambda s: (model.load_state_dict(s["m"]), adamw.load_state_dict(s["o"])),
        state_dict=lambda: {"m": model.state_dict(), "o": adamw.state_dict()},
        **dict(min_replica_size=2, init_sync=False, hostname="127.0.0.1", replica_id=f"r{rid}"),
        lighthouse_addr=f"http://127.0.0.1:{port}",
    )
    ddp, opt = DistributedDataParallel(manager, model), optim.OptimizerWrapper(manager, adamw)
    Path(f"{tmp}/ready{rid}").touch()  # all 3 heartbeating before the first quorum
    deadline = time.time() + 120
    while len(list(Path(tmp).glob("ready*"))) < REPLICAS and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    while (step := manager.current_step()) < STEPS:
        if rid == victim and step == kill_at:  # (a second timer, were the step redone, is moot)
            kill = lambda: (log(killed=time.time()), os.kill(os.getpid(), signal.SIGKILL))
            threading.Timer(0.02, kill).start()
        rows = order[step * BATCH + rid * PER : step * BATCH + (rid + 1) * PER]
        torch.manual_seed(1 + step * REPLICAS + rid)  # dropout: the same in an attempt redone
        opt.zero_grad()  # starts the quorum
        ((ddp(x[rows]) - y[rows]) ** 2).mean().backward()
        opt.step()  # steps AdamW only if manager.should_commit()
        done, n = manager.current_step() > step, manager.num_participants()
        log(replica=rid, step=step, committed=done, n=n, t=time.time())
    torch.save(model.state_dict(), f"{tmp}/params{rid}.pt")
    os._exit(0)  # not waiting on torchft's threads


def run(victim: int, kill_at: int, hb: int, join: int, tmp: str) -> dict:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # free, for the lighthouse
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", RANK="0", WORLD_SIZE="1")
    tmp = tempfile.mkdtemp(dir=tmp)
    lh = [Path(sys.executable).with_name("torchft_lighthouse"), "--bind", f"127.0.0.1:{port}"]
    lh += ["--min_replicas", "2", f"--heartbeat_timeout_ms={hb}", f"--join_timeout_ms={join}"]
    procs = [subprocess.Popen(lh, stderr=open(f"{tmp}/lighthouse", "w"))]
    cmd = [sys.executable, HERE, "--worker", f"{victim}", f"{kill_at}", f"{port}", tmp]
    try:
        for r in range(REPLICAS):
            out, err = open(f"{tmp}/out{r}", "w"), open(f"{tmp}/err{r}", "w")
            procs.append(subprocess.Popen([*cmd, str(r)], stdout=out, stderr=err, env=env))
        deadline = time.time() + 240  # a run never hangs: whatever is left then is killed
        while time.time() < deadline and any(p.poll() is None for p in procs[1:]):
            time.sleep(0.1)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    codes = [p.returncode for p in procs[1:]]
    survivors = [r for r in range(REPLICAS) if r != victim]
    if bad := [r for r in survivors if codes[r] != 0]:
        raise RuntimeError(f"{codes}: " + Path(f"{tmp}/err{bad[0]}").read_text()[-1500:])
    ev = [[json.loads(s) for s in open(f"{tmp}/out{r}") if s[0] == "{"] for r in range(REPLICAS)]
    killed = next((e["killed"] for e in ev[victim] if "killed" in e), 0.0)  # 0: uninterrupted
    short = lambda r: [e["t"] for e in ev[r] if e["committed"] and e["n"] < REPLICAS]  # of 2
    after = [t for r in survivors for t in short(r) if t > killed]
    return dict(  # counts: the lowest survivor's, as keep_going.py counts the lowest rank's
        recovery_s=min(after) - killed if after and killed else None,
        discarded=[sum(not e["committed"] for e in ev[r]) for r in survivors],
        dropped=PER * sum(t > killed for t in short(survivors[0])),
        steps_of_2_before_kill=sum(t < killed for t in short(survivors[0])),  # (stragglers)
        params=[torch.load(f"{tmp}/params{r}.pt") for r in survivors],
    )


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker(*map(int, sys.argv[2:5]), sys.argv[5], int(sys.argv[6]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heartbeat-ms", type=int, nargs="+", default=[5000])
    parser.add_argument("--join-timeout-ms", type=int, nargs="+", default=[60000])
    args, rows, tmp = parser.parse_args(), {}, tempfile.mkdtemp(prefix="kgft-")
    command = " ".join(["python benchmarks/keep_going_torchft.py", *sys.argv[1:]])
    want, again = (run(-1, -1, 5000, 60000, tmp)["params"][0] for _ in range(2))
    diff = lambda a: max((a[k] - want[k]).abs().max().item() for k in want)
    equal = lambda a, b: all(torch.equal(a[k], b[k]) for k in want)
    print("uninterrupted, twice:", check := dict(diff=diff(again), equal=equal(again, want)))
    for hb, join in [(h, j) for j in args.join_timeout_ms for h in args.heartbeat_ms]:
        rng, got_rows = random.Random(args.seed), rows.setdefault(f"{hb},{join}", [])
        for i in range(args.runs):
            victim, kill_at = (
                rng.randrange(REPLICAS),
                rng.randrange(5, STEPS - 15),
            )  # as keep_going.py draws
            try:
                got = dict(victim=victim, kill_at=kill_at, **run(victim, kill_at, hb, join, tmp))
                p = got.pop("params")
                got.update(diff=diff(p[0]), equal=equal(p[0], want), survivors=equal(p[0], p[1]))
            except Exception as e:  # a failed run is counted and shown, not hidden
                got = dict(victim=victim, kill_at=kill_at, error=str(e))
            print(f"heartbeat {hb}, join {join}, run {i}:", got, flush=True)
            got_rows.append(got)
    shutil.rmtree(tmp, ignore_errors=True)
    lines = [
        f"torchft 0.2.0, 3 CPU replica groups, {args.runs} runs each: a random replica SIGKILLed"
        f" 20 ms into a random step of {STEPS}, not restarted, the other 2 going on (`{command}`;"
        f" two uninterrupted runs differ by {check['diff']:.1e})\n",
        "| way | kill to next step, s (median, max) | steps computed again (median) "
        "| samples dropped | max abs diff | `torch.equal` runs |\n|---|---|---|---|---|---|",
    ]
    for key, got in rows.items():
        hb, join = (int(v) / 1000 for v in key.split(","))
        way = f"torchft 0.2.0 DDP (heartbeat {hb:g} s" + f", join timeout {join:g} s" * (join != 60)
        ok = [r for r in got if "error" not in r]
        way += f"; {len(got) - len(ok)} of {len(got)} runs failed)" if len(ok) < len(got) else ")"
        nan = [float("nan")]  # where every run failed
        rec = [r["recovery_s"] for r in ok if r["recovery_s"] is not None] or nan
        redo, drop = [r["discarded"][0] for r in ok] or nan, [r["dropped"] for r in ok] or nan
        diffs = [r["diff"] for r in ok] or nan
        lines.append(f"| {way} | {median(rec):.2f}, {max(rec):.2f} | {median(redo):.0f} | ")
        lines[-1] += f"{median(drop):.0f} (median; {min(drop)} to {max(drop)}) | {max(diffs):.1e}"
        lines[-1] += f" | {sum(r['equal'] for r in ok)} of {len(got)} |"
    print(text := "\n".join(lines) + "\n")
    out = HERE.parent / "results" / "keep_going_torchft"
    Path(f"{out}.md").write_text(text)
    body = json.dumps(dict(uninterrupted_twice=check, runs=rows), indent=1)
    Path(f"{out}.json").write_text(f'{{"command": {json.dumps(command)},\n{body[2:]}')


if __name__ == "__main__":
    main()
