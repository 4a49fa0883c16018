"""Train a small character-level GPT with torch DDP, the way nanoGPT's train.py does.

    python examples/porting/gpt_ddp.py       # gpt_pardist.py: the port to pardist
    torchrun --standalone --nproc_per_node=2 examples/porting/gpt_ddp.py

The text is the source of a few Python standard-library modules (no download). Each
rank samples its own random windows (seeded per rank), accumulates gradients over
micro-steps with DDP's sync turned off until the last, clips, follows a warm-up +
cosine learning rate set by hand every iteration, evaluates every --eval-interval
iterations, and saves a checkpoint it can resume from (--resume): the DDP script's own
file, which either script resumes. docs/porting.md counts the lines the port changes.
"""

import argparse
import inspect
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from gpt_model import GPT, GPTConfig
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--max-iters", type=int, default=60)
parser.add_argument("--batch-size", type=int, default=8)  # per micro-step and rank
parser.add_argument("--grad-accum", type=int, default=4)  # micro-steps per iteration, all ranks
parser.add_argument("--block-size", type=int, default=64)
parser.add_argument("--n-layer", type=int, default=2)
parser.add_argument("--n-embd", type=int, default=64)
parser.add_argument("--learning-rate", type=float, default=3e-3)
parser.add_argument("--min-lr", type=float, default=3e-4)
parser.add_argument("--warmup-iters", type=int, default=10)
parser.add_argument("--weight-decay", type=float, default=0.1)
parser.add_argument("--grad-clip", type=float, default=1.0)
parser.add_argument(
    "--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"]
)
parser.add_argument("--eval-interval", type=int, default=20)
parser.add_argument("--eval-iters", type=int, default=10)
parser.add_argument("--out-dir", default="out-gpt")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--seed", type=int, default=1337)
args = parser.parse_args()

# The text: a few standard-library modules' source, one character per token.
text = "".join(inspect.getsource(m) for m in (argparse, inspect, os))
chars = sorted(set(text))
data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
n = int(0.9 * len(data))
train_data, val_data = data[:n], data[n:]

# Distributed set-up: torchrun's environment, or one process.
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    ddp_rank, ddp_local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{ddp_local_rank}" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    master_process, seed_offset = ddp_rank == 0, ddp_rank
    assert args.grad_accum % ddp_world_size == 0
    gradient_accumulation_steps = args.grad_accum // ddp_world_size
else:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    master_process, seed_offset, ddp_world_size = True, 0, 1
    gradient_accumulation_steps = args.grad_accum
device_type = "cuda" if "cuda" in device else "cpu"
torch.manual_seed(args.seed + seed_offset)  # each rank draws its own batches
ptdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype)
ctx = torch.autocast(device_type, ptdtype) if ptdtype else nullcontext()  # float32, 64: none
os.makedirs(args.out_dir, exist_ok=True)


def get_batch(split):
    source = train_data if split == "train" else val_data
    ix = torch.randint(len(source) - args.block_size, (args.batch_size,))
    x = torch.stack([source[i : i + args.block_size] for i in ix])
    y = torch.stack([source[i + 1 : i + 1 + args.block_size] for i in ix])
    return x.to(device), y.to(device)


# The model, the optimizer, and a checkpoint to resume from.
config = GPTConfig(
    block_size=args.block_size, vocab_size=len(chars), n_layer=args.n_layer, n_embd=args.n_embd
)
model = GPT(config).to(device, torch.float64 if args.dtype == "float64" else torch.float32)
scaler = torch.amp.GradScaler(device_type, enabled=args.dtype == "float16")
optimizer = model.configure_optimizers(
    args.weight_decay, args.learning_rate, (0.9, 0.95), device_type
)
iter_num, best_val_loss = 0, 1e9
ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
if args.resume and os.path.exists(ckpt_path):
    checkpoint = torch.load(ckpt_path, map_location=device)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    torch.set_rng_state(checkpoint["rng"][seed_offset])
    checkpoint = None
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == "cuda" else None)
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < args.warmup_iters:  # linear warm-up
        return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    if it > args.max_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / (args.max_iters - args.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # cosine from 1 to 0
    return args.min_lr + coeff * (args.learning_rate - args.min_lr)


# The training loop.
X, Y = get_batch("train")
t0 = time.time()
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % args.eval_interval == 0 and iter_num > 0:
        losses = estimate_loss()
        if master_process:
            print(
                f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
            )
        if losses["val"] < best_val_loss:
            best_val_loss = losses["val"]
        rng = [torch.get_rng_state()]
        if ddp:  # every rank's sampling stream, for an exact resume
            rng = [torch.empty_like(rng[0]) for _ in range(ddp_world_size)]
            dist.all_gather(rng, torch.get_rng_state())
        if master_process:
            checkpoint = {
                "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "iter_num": iter_num,
                "best_val_loss": best_val_loss,
                "rng": rng,
            }
            torch.save(checkpoint, ckpt_path)
    if iter_num >= args.max_iters:
        break
    for micro_step in range(gradient_accumulation_steps):
        if ddp:  # sync gradients only at the last micro-step
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")  # prefetch the next micro-batch
        scaler.scale(loss).backward()
    if args.grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if master_process and iter_num % 10 == 0:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf!r}, time {dt * 1000:.2f}ms")
    iter_num += 1

if ddp:
    dist.barrier()  # gloo aborts a rank that leaves while another still talks to it
    dist.destroy_process_group()
