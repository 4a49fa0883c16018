"""Deterministic training that checkpoints its loader, killed and resumed at another world size.

    python -m pardist.launch --nproc 2 train_elastic.py CKPT_DIR --kill-step 7
    python -m pardist.launch --nproc 3 train_elastic.py CKPT_DIR --out params.pt

A batch-norm MLP with dropout, ``deterministic=12``, on 120 synthetic rows in
global batches of 24 (5 per epoch, 2 epochs), checkpointing every 3 steps with
the loader's position and the step streams' count. Rank 0 appends each step's
global batch (dataset indices, in order) to ``CKPT_DIR/../order.txt``. ``train``
is also called in-process by the tests for the uninterrupted reference.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pardist

STEPS, EVERY = 10, 3


def train(ckpt_dir: str, kill_rank: int = -1, kill_step: int = -1, log: str | None = None):
    pardist.init()
    pardist.seed_everything(0)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(120, 8, generator=g), torch.randint(0, 3, (120,), generator=g)
    data = TensorDataset(x, y, torch.arange(120))
    loader = DataLoader(data, batch_size=24, shuffle=True, drop_last=True)
    train = pardist.data.shard(loader, split_batches=True, seed=7)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3)
    )
    apply, params, buffers = pardist.functional(model)
    opt = pardist.optim.adamw(1e-2)
    state = {"params": params, "buffers": buffers, "opt_state": opt.init(params)}
    state.update(loader=train, step=0, rng=0)
    pardist.set_rng_count(0)  # (the tests also run it in reused processes)
    if (last := pardist.checkpoint.latest(ckpt_dir)) is not None:
        state = pardist.checkpoint.load(last, state)
        pardist.set_rng_count(state["rng"])
        pardist.print0(f"resumed from step {state['step']} at world size {pardist.world_size()}")

    def loss_fn(p, b, x, y):
        out, b = apply(p, b, x)
        return F.cross_entropy(out, y), b

    @pardist.data_parallel(deterministic=12)
    def step(p, b, s, batch):
        (loss, b), g = pardist.value_and_grad(loss_fn, has_aux=True)(p, b, *batch)
        p, s = opt.update(g, s, p)
        return p, b, s

    params, buffers, opt_state = state["params"], state["buffers"], state["opt_state"]
    s = state["step"]
    while s < STEPS:
        for x, y, index in train:
            params, buffers, opt_state = step(params, buffers, opt_state, (x, y))
            order = torch.cat(pardist.gather_object(index))
            if log and pardist.is_main():
                with open(log, "a") as f:
                    f.write(f"{s} {' '.join(map(str, order.tolist()))}\n")
            s += 1
            if s == kill_step and pardist.rank() == kill_rank and not _restarted():
                os.kill(os.getpid(), signal.SIGKILL)
            if s % EVERY == 0:
                state = {"params": params, "buffers": buffers, "opt_state": opt_state}
                state.update(loader=train, step=s, rng=pardist.rng_count())
                pardist.checkpoint.save(ckpt_dir, state, step=s, keep=2)
            if s == STEPS:
                break
    return params, buffers, opt_state


def _restarted() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    log = str(Path(args.ckpt_dir).parent / "order.txt")
    result = train(args.ckpt_dir, args.kill_rank, args.kill_step, log)
    if pardist.is_main() and args.out:
        torch.save(result, args.out)
    pardist.shutdown()


if __name__ == "__main__":
    main()
