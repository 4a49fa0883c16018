"""DiLoCo against plain data parallelism and HSDP, across two "nodes" with a slow link.

    python benchmarks/diloco.py                   # 2 and 4 ranks, 100 Mbit/s (about 10 min)
    python benchmarks/diloco.py --rate 1000 --ranks 2

examples/text.py's byte-level transformer on its corpus (the standard library's sources),
trained for the same samples (the same global batches, in the same order) in each mode:

    dp          data_parallel over ('node', 'gpu'): gradients all-reduced every step
    hsdp        pardist.fsdp within a node, replicated across nodes (4 ranks only)
    diloco H    data parallel within a node; across nodes pardist.diloco with AdamW inside
                and the paper's outer Nesterov SGD (lr 0.7, momentum 0.9), meeting every H

on two network namespaces joined by a veth pair whose rate ``tc ... tbf`` limits
(twonodes.py; root and iproute2 needed). Reported: held-out bits per byte of the final
(global) parameters over every held-out window, the bytes that crossed between the nodes
per training sample (the veth's counters), and the wall time of the training loop.
Writes results/diloco.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import pardist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from text import ByteLM, corpus, windows  # noqa: E402
from twonodes import TwoNodes, crossed  # noqa: E402

CONTEXT, BATCH, LR = 64, 64, 3e-3


def train(mode: str, every: int = 1, corpus_bytes: int = 300_000, epochs: int = 2) -> dict:
    """One training run on this rank (of the two nodes); rank 0's numbers."""
    pardist.seed_everything(0)
    data = corpus(corpus_bytes)
    cut = int(0.9 * len(data))
    train_set, valid_set = windows(data[:cut], CONTEXT), windows(data[cut:], CONTEXT)
    loader = pardist.data.shard(
        DataLoader(train_set, batch_size=BATCH, shuffle=True, drop_last=True),
        split_batches=True,
    )
    steps = epochs * len(loader) // 32 * 32  # a multiple of every H: the last one meets
    mesh = pardist.Mesh({"node": 2, "gpu": -1})
    model = ByteLM(CONTEXT)
    apply, params, buffers = pardist.functional(model)
    if mode == "hsdp":
        params = pardist.fsdp(params, "gpu", mesh=mesh)
    schedule = pardist.optim.warmup_cosine(LR, warmup_steps=steps // 10, total_steps=steps)
    opt = pardist.optim.chain(
        pardist.optim.clip_by_global_norm(1.0), pardist.optim.adamw(schedule, weight_decay=0.1)
    )

    def inner(params, opt_state, batch):
        loss_fn = lambda p: F.cross_entropy(apply(p, buffers, batch[0])[0].flatten(0, 1),
                                            batch[1].flatten())  # fmt: skip  # noqa: E731
        return opt.update(pardist.grad(loss_fn)(params), opt_state, params)

    if mode == "diloco":
        within = pardist.data_parallel(inner, mesh=mesh.part("gpu"))
        outer = pardist.optim.sgd(0.7, momentum=0.9, nesterov=True)
        run = pardist.diloco(within, outer, every=every, axis="node")
        state = run.init(params, opt.init(params))
        step = lambda s, batch: run.step(s, batch)[0]  # noqa: E731
    else:
        dp = pardist.data_parallel(inner, axis=("node", "gpu"), mesh=mesh, donate_argnums=(0, 1))
        state = (params, opt.init(params))
        step = lambda s, batch: dp(*s, batch)  # noqa: E731
    start, done = crossed(), 0
    t0 = time.perf_counter()
    with mesh:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                if done == steps:
                    break
                state, done = step(state, batch), done + 1
    seconds = time.perf_counter() - t0
    sent = crossed(start)
    final = state.anchor if mode == "diloco" else state[0]
    if mode == "hsdp":  # the shards gathered into the module, as for an export
        model.load_state_dict(pardist.state_dict(final, buffers, model))
        apply, final, buffers = pardist.functional(model)
    bits = held_out(apply, final, buffers, valid_set)
    return {"bits": bits, "bytes_per_sample": sent / (steps * BATCH), "seconds": seconds,
            "steps": steps}  # fmt: skip


def held_out(apply, params, buffers, valid_set) -> float:
    """Bits per byte over every held-out window (each rank its piece, gathered exactly)."""
    sums = []
    for x, y in pardist.data.shard(DataLoader(valid_set, batch_size=128)):
        logits, _ = apply(params, buffers, x, train=False)
        nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        sums.append(nll.view(len(x), -1).sum(1))
    every = pardist.gather(torch.cat(sums), total=len(valid_set))
    return every.sum().item() / (len(valid_set) * CONTEXT) / math.log(2)


RUNS = [("dp", 1), ("hsdp", 1), ("diloco", 1), ("diloco", 8), ("diloco", 32)]


def table(rows: list[dict]) -> str:
    out = ["| ranks | mode | H | held-out bits/byte | bytes across per sample | wall s |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        h = r["every"] if r["mode"] == "diloco" else "-"
        out.append(f"| {r['ranks']} | {r['mode']} | {h} | {r['bits']:.3f} | "
                   f"{r['bytes_per_sample']:.0f} | {r['seconds']:.1f} |")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100, help="Mbit/s between the nodes")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    rows = []
    with TwoNodes(args.rate) as nodes:
        for ranks in args.ranks:
            for mode, every in RUNS:
                if mode == "hsdp" and ranks < 4:
                    continue  # one rank per node: nothing to shard within it
                got = nodes.run("diloco", "train", {"mode": mode, "every": every}, ranks // 2)
                rows.append({"ranks": ranks, "mode": mode, "every": every, **got})
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = f"{args.rate:g} Mbit/s between the nodes\n\n" + table(rows)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "diloco.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "diloco.json"), "w") as f:
        json.dump({"rate_mbit": args.rate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
