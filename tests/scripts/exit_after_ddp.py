"""Train with data_parallel, then with torch DDP in the same group, then shut down and exit.

    torchrun --standalone --nproc_per_node=2 exit_after_ddp.py     # one run
    python exit_after_ddp.py --runs 10 --timeout 30                 # ten 2-rank runs

This is the script that hung at interpreter exit (issue 15): DDP's model sits in a
reference cycle, and its reducer kept the gloo group alive past shutdown, to be torn
down during interpreter exit. With ``--runs`` the script imports torch once and
forks the two ranks of every run from that process: each rank then runs ``main``
and leaves through a full interpreter exit (atexit, garbage collection, module
teardown), as a torchrun worker does, at a fraction of torchrun's start-up cost.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401 - DDP imports these, pardist.init the checkpoint: once, before
import torch.distributed.checkpoint  # noqa: F401 - the runs fork (seconds each, otherwise)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

import helpers  # noqa: E402

import pardist  # noqa: E402


def main() -> None:
    pardist.init()
    params, _, _, _ = helpers.train_pardist("mlp", "sgd", steps=2)
    ddp = helpers.train_ddp("mlp", "sgd", steps=2)
    same = all(torch.allclose(params[k], ddp[k], rtol=1e-5, atol=1e-6) for k in ddp)
    print(f"rank {pardist.rank()}: pardist equals DDP: {same}", flush=True)
    pardist.shutdown()
    sys.exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(rank: int, port: int) -> int:
    pid = os.fork()
    if pid == 0:  # the child runs main() and exits the interpreter from inside it
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        main()
    return pid


def drive(runs: int, timeout: float) -> int:
    """Run main() ``runs`` times at 2 ranks; return how many runs failed to exit cleanly."""
    torch.set_num_threads(1)
    # What the parent imported is left out of the children's garbage collections: the
    # last one, at interpreter exit, would otherwise walk all of torch (seconds each).
    # What a run makes (DDP, its process group) is collected as in any process.
    gc.freeze()
    failed = 0
    for run in range(runs):
        port = _free_port()
        pids = {_start(rank, port): rank for rank in range(2)}
        deadline = time.monotonic() + timeout
        codes: dict[int, int] = {}
        while pids.keys() - codes.keys() and time.monotonic() < deadline:
            for pid in pids.keys() - codes.keys():
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        hung = [pids[p] for p in pids.keys() - codes.keys()]
        for pid in pids.keys() - codes.keys():
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        bad = {pids[p]: c for p, c in codes.items() if c != 0}
        if hung or bad:
            failed += 1
        print(f"run {run}: hung ranks {hung}, exit codes {sorted(codes.values())}", flush=True)
    return failed


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=0, help="fork this many 2-rank runs")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per run")
    args = parser.parse_args()
    if args.runs:
        failed = drive(args.runs, args.timeout)
        print(f"{failed} of {args.runs} runs did not exit cleanly", flush=True)
        sys.exit(1 if failed else 0)
    main()
