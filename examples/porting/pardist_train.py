"""ddp_train.py ported to pardist: a conv net on scikit-learn's digits, data parallel.

    python examples/porting/pardist_train.py  # one process
    torchrun --standalone --nproc_per_node=2 examples/porting/pardist_train.py  # two

Mixed precision (--amp bf16, the default, which CPUs run too, or fp16 with a dynamic
loss scale), gradient accumulation over --accum loader batches, AdamW without weight
decay on biases and norms, a warm-up + cosine schedule stepped per update, gradient
clipping, an EMA of the weights and the batch-norm buffers, the accuracy over every
rank's held-out images, and a checkpoint to resume from (run it again: it goes on from
the last epoch saved). docs/porting.md puts the two scripts side by side.
"""

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pardist
from pardist import optim

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


pardist.init()  # torchrun's processes, or one under plain python; nccl on GPUs, else gloo
rank, world = pardist.rank(), pardist.world_size()
torch.manual_seed(0)  # the same initial weights in every process
amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]

train_set, valid_set = make_data()
# a loader batch is a whole update: shard cuts it per rank, accumulate= into micro-batches
loader = DataLoader(train_set, args.batch_size, shuffle=True, drop_last=True)
loader = pardist.data.shard(loader, split_batches=True)
valid = pardist.data.shard(DataLoader(valid_set, 128))
model = make_model()
# sync_bn=False: each rank normalizes by its own rows' statistics, as under DDP
apply, params, buffers = pardist.functional(model, sync_bn=False)

steps = args.epochs * len(loader)  # updates in the whole run (len: global batches per epoch)


def warmup_cosine(t: int) -> float:  # a factor of lr: 0 to 1 linearly, then a cosine to 0
    if t < args.warmup:
        return t / args.warmup
    return 0.5 * (1 + math.cos(math.pi * (min(t, steps) - args.warmup) / (steps - args.warmup)))


schedule = lambda t: args.lr * warmup_cosine(t)  # LambdaLR's rate at update t
group = lambda path, p: "decay" if p.ndim > 1 else "no_decay"  # biases and norms: no decay
groups = {"decay": optim.adamw(schedule, weight_decay=0.05)}
groups["no_decay"] = optim.adamw(schedule, weight_decay=0.0)
opt = optim.chain(optim.clip_by_global_norm(args.clip), optim.multi_transform(groups, group))
scaler = pardist.amp.dynamic_loss_scale()  # always on: in bf16 it changes no bits


def ema_update(ema: dict, params: dict, buffers: dict) -> dict:
    """AveragedModel(use_buffers=True)'s EMA of params and buffers: the first update copies.

    Integer buffers (batch norm's batch count) are copied; AveragedModel averages them.
    """
    avg = lambda old, new: {
        k: old[k].lerp(v, 1 - args.ema) if ema["n"] and v.is_floating_point() else v.clone()
        for k, v in new.items()
    }
    n = ema["n"] + 1  # updates averaged, AveragedModel's n_averaged
    return {"params": avg(ema["params"], params), "buffers": avg(ema["buffers"], buffers), "n": n}


ema = {"params": params, "buffers": buffers, "n": 0}
state = {"params": params, "buffers": buffers, "opt_state": opt.init(params)}
state |= {"ls": scaler.init(), "ema": ema, "epoch": 0}
state = pardist.checkpoint.resume(args.ckpt, state, total=args.epochs)  # an earlier run's, if any
params, buffers, opt_state, ls, ema, start = state.values()


def accuracy(params: dict, buffers: dict) -> float:
    """The share of held-out images right: every rank's piece gathered, in order."""
    preds, labels = [], []
    for x, y in valid:
        preds.append(apply(params, buffers, x, train=False)[0].argmax(1))
        labels.append(y)
    preds, labels = pardist.gather((torch.cat(preds), torch.cat(labels)), total=len(valid_set))
    return (preds == labels).float().mean().item()


def loss_fn(params, buffers, ls, x, y):
    with pardist.amp.autocast(amp_dtype):
        logits, buffers = apply(params, buffers, x)
        loss = F.cross_entropy(logits, y)
    return scaler.scale(loss, ls), buffers


@pardist.data_parallel(donate_argnums=(0, 2))
def train_step(params, buffers, opt_state, ls, batch):
    # accumulate: the --accum loader batches of DDP's no_sync loop, one all-reduce at the end;
    # carry=1: each micro-batch starts from the batch-norm buffers the one before left
    grad_fn = pardist.value_and_grad(loss_fn, has_aux=True, accumulate=args.accum, carry=1)
    (loss, buffers), grads = grad_fn(params, buffers, ls, *batch)
    grads, finite = scaler.unscale(grads, ls)  # then opt's chain clips the true gradients
    if finite:  # GradScaler's skip: an inf or nan on any rank skips the update on all
        params, opt_state = opt.update(grads, opt_state, params)
    return params, buffers, opt_state, scaler.adjust(ls, finite), loss / ls.scale


for epoch in range(start, args.epochs):
    t0 = time.perf_counter()
    loader.set_epoch(epoch)  # a new shuffle, the same on every rank
    for batch in loader:
        params, buffers, opt_state, ls, loss = train_step(params, buffers, opt_state, ls, batch)
        ema = ema_update(ema, params, buffers)
    acc, ema_acc = accuracy(params, buffers), accuracy(ema["params"], ema["buffers"])
    state = {"params": params, "buffers": buffers, "opt_state": opt_state}
    state |= {"ls": ls, "ema": ema, "epoch": epoch + 1}
    pardist.checkpoint.save(args.ckpt, state, step=epoch + 1, keep=2)  # all ranks; atomic
    lr = optim.current_lr(opt, opt_state)["decay"]  # the next update's, as get_last_lr()
    if rank == 0:
        print(
            f"epoch {epoch}: loss {loss.item():.6f}, lr {lr:.2e}, "
            f"accuracy {acc:.4f}, ema {ema_acc:.4f}, {time.perf_counter() - t0:.1f}s"
        )

# again after the loop: a run resumed at its end trains no epoch
acc, ema_acc = accuracy(params, buffers), accuracy(ema["params"], ema["buffers"])
plain = pardist.state_dict(ema["params"], ema["buffers"], model)  # the module's state_dict
if rank == 0:
    torch.save(plain, os.path.join(args.ckpt, "model.pt"))
    print(f"held-out accuracy: {acc:.4f}, ema {ema_acc:.4f} ({world} process(es))")
pardist.shutdown()
