"""Gradient accumulation on padded text: pardist's list of micro-batches against Accelerate's loop.

    torchrun --nproc-per-node 2 benchmarks/accumulate.py     # 2 ranks (needs transformers)
    python benchmarks/accumulate.py --updates 6              # one process, a quick try

A causal LM (Hugging Face GPT-2, small) trains on text of realistic, varied lengths,
k micro-batches per update with a token-weighted loss (every token of the update counts
once, however the rows are padded). Three ways run the same per-rank micro-batches,
interleaved update by update, from the same weights:

    accelerate   Accelerate's loop for this (its example "gradient accumulation for
                 autoregressive models"): prefetch k micro-batches, gather their token
                 count, ``no_sync`` on all but the last, the loss rescaled by k x ranks,
                 one DDP all-reduce; each micro-batch padded to its own longest row.
                 Plain torch DDP with the same arithmetic where accelerate is missing.
    list         pardist: ``value_and_grad(mean='tokens', accumulate='list')`` over the
                 same list of micro-batches, each padded on its own; one reduction.
    one_batch    pardist before lists: the k micro-batches padded together into one
                 batch (to the update's longest row), ``accumulate=k`` splitting it.

Prints the padded tokens the forward passes process per epoch (all ranks), the median
milliseconds per update (the slowest rank's) and both against Accelerate's, and the
largest relative difference between the ways' losses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pardist


def texts(args) -> list[torch.Tensor]:
    """Token ids of every sample: lengths log-normal, as sentences and paragraphs are."""
    g = torch.Generator().manual_seed(0)
    n = args.updates * args.accum * args.bs * pardist.world_size()
    lengths = torch.empty(n).log_normal_(4.0, 0.6, generator=g).clamp(8, args.max_len).long()
    return [torch.randint(1, args.vocab, (int(m),), generator=g) for m in lengths]


def collate(samples: list[torch.Tensor]) -> dict:
    """Pad to the longest (+1 for the shifted labels), as the Accelerate example does."""
    width = max(len(s) for s in samples) + 1
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s)] = s
    labels = torch.where(ids[:, 1:] == 0, -100, ids[:, 1:])
    return {"input_ids": ids[:, :-1], "attention_mask": (ids[:, :-1] != 0).long(), "labels": labels}


def model(args) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=args.vocab, n_embd=args.dim, n_layer=args.layers, n_head=max(args.dim // 64, 1),
        n_positions=args.max_len + 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return tf.GPT2LMHeadModel(config).to(pardist.device())


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def accelerate_way(args):
    """Accelerate's loop (or the DDP loop it runs, where accelerate is missing)."""
    net = model(args)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr)
    try:
        from accelerate import Accelerator

        acc = Accelerator(
            gradient_accumulation_steps=args.accum, cpu=pardist.device().type == "cpu"
        )
        net, opt = acc.prepare(net, opt)
        backward, world = acc.backward, acc.num_processes
    except ImportError:
        if pardist.world_size() > 1:
            net = torch.nn.parallel.DistributedDataParallel(net)
        backward, world = torch.Tensor.backward, pardist.world_size()
        args.accelerate = False

    def update(micro: list[dict]) -> float:
        local = sum(int(b["labels"].ne(-100).sum()) for b in micro)
        count = torch.tensor(float(local), device=pardist.device())
        if world > 1:
            dist.all_reduce(count)  # accelerator.gather(...).sum()
        losses = []
        for i, b in enumerate(micro):
            last = i == len(micro) - 1
            sync = contextlib.nullcontext() if last or world == 1 else net.no_sync()
            with sync:
                logits = net(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                loss = token_sum(logits, b["labels"]) / count * len(micro) * world
                # accelerate divides by its gradient_accumulation_steps; DDP by the ranks
                backward(loss if args.accelerate else loss / len(micro))
                losses.append(loss.detach() / len(micro) / world)
        opt.step()
        opt.zero_grad()
        total = torch.stack(losses).sum()
        if world > 1:
            dist.all_reduce(total)
        return float(total)

    return update


def pardist_way(args, listed: bool):
    net = model(args)
    apply, params, _ = pardist.functional(net)
    opt = pardist.optim.from_torch(torch.optim.AdamW(net.parameters(), lr=args.lr), net)

    def loss(p, b):
        logits = apply(p, {}, input_ids=b["input_ids"], attention_mask=b["attention_mask"])[0]
        return token_sum(logits.logits, b["labels"]), b["labels"].ne(-100).sum()

    accumulate = "list" if listed else args.accum
    grad = pardist.value_and_grad(loss, mean="tokens", accumulate=accumulate)

    @pardist.data_parallel(donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        value, grads = grad(params, batch)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, opt_state, value

    state = [params, opt.init(params)]

    def update(micro: list[dict]) -> float:
        batch = micro if listed else collate([s for b in micro for s in unpad(b)])
        state[0], state[1], value = step(state[0], state[1], batch)
        return float(value)

    return update


def unpad(b: dict) -> list[torch.Tensor]:
    """The samples of a padded micro-batch, as they were before padding."""
    ids = torch.cat([b["input_ids"], torch.zeros_like(b["input_ids"][:, :1])], 1)
    ids[:, 1:] = torch.where(b["labels"] == -100, ids[:, 1:], b["labels"])
    return [row[: int((row != 0).sum())] for row in ids]


def padded(way: str, micro: list[dict]) -> int:
    """The tokens the forward passes run: one batch pads every row to the update's longest."""
    if way == "one_batch":
        rows = sum(len(b["input_ids"]) for b in micro)
        return rows * max(b["input_ids"].shape[1] for b in micro)
    return sum(b["input_ids"].numel() for b in micro)


def main(args) -> None:
    pardist.init()
    torch.set_num_threads(1)
    loader = torch.utils.data.DataLoader(texts(args), batch_size=args.bs, collate_fn=collate)
    batches = list(pardist.data.shard(loader))  # this rank's micro-batches, each padded alone
    updates = [batches[u * args.accum : (u + 1) * args.accum] for u in range(args.updates)]
    args.accelerate = True
    ways = {
        "accelerate": accelerate_way(args),
        "list": pardist_way(args, listed=True),
        "one_batch": pardist_way(args, listed=False),
    }
    times = {w: [] for w in ways}
    losses = {w: [] for w in ways}
    tokens = {w: 0 for w in ways}
    for u, micro in enumerate(updates):
        for way, update in ways.items():
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            losses[way].append(update(micro))
            if pardist.device().type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor(time.perf_counter() - start)
            if dist.is_initialized():
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if u >= args.warmup:
                times[way].append(float(elapsed))
            tokens[way] += padded(way, micro)
    count = torch.tensor([float(t) for t in tokens.values()])
    if dist.is_initialized():
        dist.all_reduce(count)
    tokens = dict(zip(tokens, (int(t) for t in count.tolist())))
    ms = {w: 1000 * statistics.median(t) for w, t in times.items()}
    worst = max(
        abs(a - b) / abs(b)
        for w in ("list", "one_batch")
        for a, b in zip(losses[w], losses["accelerate"])
    )
    name = "Accelerate" if args.accelerate else "DDP (Accelerate's arithmetic)"
    lines = [
        f"{pardist.world_size()} rank(s), {args.updates} updates of {args.accum} micro-batches of "
        f"{args.bs} rows, GPT-2 {args.layers}x{args.dim}, {pardist.device().type}; "
        f"reference: {name}",
        "",
        "| way | padded tokens | vs accelerate | ms per update | vs accelerate |",
        "|---|---|---|---|---|",
    ]
    for w in ways:
        lines.append(
            f"| {w} | {tokens[w]} | {tokens[w] / tokens['accelerate']:.2f}x | {ms[w]:.1f} | "
            f"{ms[w] / ms['accelerate']:.2f}x |"
        )
    lines += ["", f"largest relative difference of the losses from Accelerate's: {worst:.2e}"]
    pardist.print0("\n".join(lines))
    if pardist.is_main() and args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"accumulate_{pardist.world_size()}")
        with open(stem + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(stem + ".json", "w") as f:
            json.dump(
                {"tokens": tokens, "ms": ms, "losses": losses, "args": vars(args)}, f, indent=1
            )
    pardist.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--bs", type=int, default=8, help="rows per micro-batch per rank")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    main(parser.parse_args())
