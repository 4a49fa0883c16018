"""A training loop that checkpoints, resumes from the last checkpoint, and can be made to crash.

    python -m pardist.launch --nproc 2 --max-restarts 1 train_resume.py CKPT_DIR \
        --crash-rank 1 --crash-step 5 --out params.pt

The loop draws from torch's RNG every step, so resuming is bit-identical only if
the RNG state comes back too. ``train`` is also called in-process by the tests
for the uninterrupted reference run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

import helpers  # noqa: E402

import pardist  # noqa: E402


def train(
    ckpt_dir: str, steps: int = 8, every: int = 2, crash_rank: int = -1, crash_step: int = -1
):
    """Train the helpers' MLP for ``steps`` steps, checkpointing every ``every``; return params."""
    torch.set_num_threads(1)  # the same kernels in every process, for bit equality
    pardist.init()
    apply, params, _ = pardist.functional(helpers.mlp())
    opt = pardist.optim.adamw(1e-2)
    state = {
        "params": params,
        "opt_state": opt.init(params),
        "step": 0,
        "rng": torch.manual_seed(0).get_state(),
    }
    if (last := pardist.checkpoint.latest(ckpt_dir)) is not None:
        state = pardist.checkpoint.load(last, state)
        print(f"rank {pardist.rank()} resumed from step {state['step']}", flush=True)
    torch.set_rng_state(state["rng"])

    @pardist.data_parallel(axis="gpu")
    def step(params, opt_state, batch):
        x, y = batch
        loss_fn = lambda p: F.cross_entropy(apply(p, {}, x)[0], y)  # noqa: E731
        params, opt_state = opt.update(pardist.grad(loss_fn)(params), opt_state, params)
        return params, opt_state

    params, opt_state = state["params"], state["opt_state"]
    rank, world = pardist.rank(), pardist.world_size()
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    for s in range(state["step"], steps):
        x, y = helpers.global_batch(s, "mlp")
        x = x + 0.1 * torch.randn(x.shape)  # the same draw on every rank: shared RNG
        batch = (helpers.shard(x, rank, world), helpers.shard(y, rank, world))
        params, opt_state = step(params, opt_state, batch)
        if s == crash_step and rank == crash_rank and not restarted:
            raise RuntimeError(f"injected crash on rank {rank} at step {s}")
        if (s + 1) % every == 0:
            pardist.checkpoint.save(
                ckpt_dir,
                {
                    "params": params,
                    "opt_state": opt_state,
                    "step": s + 1,
                    "rng": torch.get_rng_state(),
                },
                step=s + 1,
                keep=2,
            )
    return params


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--crash-rank", type=int, default=-1)
    parser.add_argument("--crash-step", type=int, default=-1)
    parser.add_argument("--pid-dir", default=None, help="each rank writes its pid here")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.pid_dir:
        Path(args.pid_dir, os.environ["RANK"]).write_text(str(os.getpid()))
    params = train(
        args.ckpt_dir, args.steps, crash_rank=args.crash_rank, crash_step=args.crash_step
    )
    if pardist.is_main() and args.out:
        torch.save(params, args.out)
    pardist.shutdown()


if __name__ == "__main__":
    main()
