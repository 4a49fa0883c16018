"""A conv net on scikit-learn's digits (no download), trained data parallel with torch DDP.

    python examples/porting/ddp_train.py  # one process
    torchrun --standalone --nproc_per_node=2 examples/porting/ddp_train.py  # two

Mixed precision (--amp bf16, the default, which CPUs run too, or fp16 with a dynamic
loss scale), gradient accumulation over --accum loader batches, AdamW without weight
decay on biases and norms, a warm-up + cosine schedule stepped per update, gradient
clipping, an EMA of the weights and the batch-norm buffers, the accuracy over every
rank's held-out images, and a checkpoint to resume from (run it again: it goes on from
the last epoch saved). docs/porting.md puts the two scripts side by side.
"""

import argparse
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--batch-size", type=int, default=64, help="rows per update, all ranks")
parser.add_argument("--accum", type=int, default=2, help="loader batches per update")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--warmup", type=int, default=10, help="updates of linear warm-up")
parser.add_argument("--clip", type=float, default=1.0)
parser.add_argument("--ema", type=float, default=0.95, help="the EMA's decay per update")
parser.add_argument("--amp", choices=["bf16", "fp16"], default="bf16")
parser.add_argument("--ckpt", default="ckpt", help="checkpoint directory")
args = parser.parse_args()


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1, bias=False),  # the batch norm has the bias
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 10),
    )


def make_data() -> tuple[TensorDataset, TensorDataset]:
    """Images scaled to [0, 1] and a fixed 80/20 split, the same in every process."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, valid = order[: int(0.8 * len(x))], order[int(0.8 * len(x)) :]
    return TensorDataset(x[train], y[train]), TensorDataset(x[valid], y[valid])


local_rank = int(os.environ.get("LOCAL_RANK", 0))
cuda = torch.cuda.is_available()
device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
# torchrun sets RANK and the rendezvous; under plain python, a group of one process
alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
dist.init_process_group("nccl" if cuda else "gloo", **alone)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same initial weights in every process
amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]

train_set, valid_set = make_data()
sampler = DistributedSampler(train_set, shuffle=True, seed=0)
# each rank's loader batch: an update's rows split over the ranks and the accumulation
batch = args.batch_size // world // args.accum
loader = DataLoader(train_set, batch, sampler=sampler, drop_last=True)
# each rank's piece of the held-out set (padded with repeats if the ranks do not divide it)
valid = DataLoader(valid_set, 128, sampler=DistributedSampler(valid_set, shuffle=False))
model = make_model().to(device)
ddp = DDP(model, device_ids=[local_rank] if cuda else None)

decay = [p for p in model.parameters() if p.ndim > 1]  # weights; biases and norms: none
no_decay = [p for p in model.parameters() if p.ndim <= 1]
groups = [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}]
opt = torch.optim.AdamW(groups, lr=args.lr, fused=True)  # one kernel, CPU or GPU
steps = args.epochs * (len(loader) // args.accum)  # updates in the whole run


def warmup_cosine(t: int) -> float:  # a factor of lr: 0 to 1 linearly, then a cosine to 0
    if t < args.warmup:
        return t / args.warmup
    return 0.5 * (1 + math.cos(math.pi * (min(t, steps) - args.warmup) / (steps - args.warmup)))


sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
# use_buffers: the EMA averages batch norm's running statistics too, and evaluates with them
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.ema), use_buffers=True)

start, path = 0, os.path.join(args.ckpt, "last.pt")
if os.path.exists(path):  # resume: every rank reads the same file
    ckpt = torch.load(path, map_location=device)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    scaler.load_state_dict(ckpt["scaler"])
    ema.load_state_dict(ckpt["ema"])
    start = ckpt["epoch"]
    if rank == 0:
        print(f"resumed from {path} at epoch {start}")


@torch.no_grad()
def accuracy(net: nn.Module) -> float:
    """The share of held-out images right, summed over every rank's piece."""
    net.eval()
    counts = torch.zeros(2, device=device)  # right, seen
    for x, y in valid:
        x, y = x.to(device), y.to(device)
        counts[0] += (net(x).argmax(1) == y).sum()
        counts[1] += len(y)
    dist.all_reduce(counts)
    net.train()
    return (counts[0] / counts[1]).item()


for epoch in range(start, args.epochs):
    t0 = time.perf_counter()
    sampler.set_epoch(epoch)  # a new shuffle, the same on every rank
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        update = (i + 1) % args.accum == 0
        # no_sync: keep the gradients local until the last loader batch of the update
        with contextlib.nullcontext() if update else ddp.no_sync():
            with torch.autocast(device.type, dtype=amp_dtype):
                loss = F.cross_entropy(ddp(x), y)
            scaler.scale(loss / args.accum).backward()
        if not update:
            continue
        scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
        nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        sched.step()  # per update, not per epoch
        ema.update_parameters(model)
    acc, ema_acc = accuracy(model), accuracy(ema.module)
    if rank == 0:
        os.makedirs(args.ckpt, exist_ok=True)
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
        state |= {"scaler": scaler.state_dict(), "ema": ema.state_dict(), "epoch": epoch + 1}
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # atomic: a run killed mid-save keeps the last one
        print(
            f"epoch {epoch}: loss {loss.item():.6f}, lr {sched.get_last_lr()[0]:.2e}, "
            f"accuracy {acc:.4f}, ema {ema_acc:.4f}, {time.perf_counter() - t0:.1f}s"
        )
    dist.barrier()

# again after the loop: a run resumed at its end trains no epoch
acc, ema_acc = accuracy(model), accuracy(ema.module)
if rank == 0:
    torch.save(ema.module.state_dict(), os.path.join(args.ckpt, "model.pt"))  # a plain module's
    print(f"held-out accuracy: {acc:.4f}, ema {ema_acc:.4f} ({world} process(es))")
dist.destroy_process_group()
