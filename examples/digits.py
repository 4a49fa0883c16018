"""Train a small conv net, data parallel, on scikit-learn's 8x8 digits (real data, no download).

    python examples/digits.py                                       # one process
    torchrun --standalone --nproc_per_node=2 examples/digits.py     # two processes

Every rank runs this same script. Training: each global batch is cut into one
slice per rank, and pardist.grad averages the gradients, so N processes take
the very steps one process would on the whole batch. Evaluation: each rank
predicts its own piece of the held-out set and pardist.gather puts the pieces
back together, so the accuracy is exact, whatever the number of processes.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pardist


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=2, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def data(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Images scaled to [0, 1] and a fixed 80/20 split, the same on every rank."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train, valid = order[: int(0.8 * len(x))], order[int(0.8 * len(x)) :]
    return TensorDataset(x[train], y[train]), TensorDataset(x[valid], y[valid])


def accuracy(apply, params, buffers, valid, n: int) -> float:
    """Exact accuracy over all ``n`` held-out images, however many ranks share them."""
    device, preds, labels = pardist.device(), [], []
    for x, y in valid:  # this rank's contiguous piece of the held-out set
        logits, _ = apply(params, buffers, x.to(device), train=False)
        preds.append(logits.argmax(1))
        labels.append(y.to(device))
    # Every rank's predictions, in dataset order, without the wrap-around padding.
    preds, labels = pardist.gather((torch.cat(preds), torch.cat(labels)), total=n)
    return (preds == labels).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--bs", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    pardist.init()
    world, device = pardist.world_size(), pardist.device()
    pardist.seed_everything(0)  # the same initial parameters on every rank
    apply, params, buffers = pardist.functional(model().to(device))  # sync batch norm
    # rank0_first: where data is downloaded or cached, rank 0 does it before the others.
    train_set, valid_set = pardist.rank0_first(data)
    # One permutation per epoch shared by every rank; each global batch of args.bs
    # images is cut into one slice per rank (split_batches).
    train = pardist.data.shard(
        DataLoader(train_set, batch_size=args.bs, shuffle=True, drop_last=True),
        split_batches=True,
    )
    # Evaluation: one contiguous piece of the held-out set per rank.
    valid = pardist.data.shard(DataLoader(valid_set, batch_size=128))
    opt = pardist.optim.adamw(
        pardist.optim.one_cycle(args.epochs * len(train), args.lr), weight_decay=1e-2
    )
    opt_state = opt.init(params)

    def loss_fn(params, buffers, x, y):
        logits, new_buffers = apply(params, buffers, x)
        return F.cross_entropy(logits, y), new_buffers

    @pardist.data_parallel(axis="gpu", donate_argnums=(0, 2))
    def train_step(params, buffers, opt_state, batch):
        (loss, buffers), grads = pardist.value_and_grad(loss_fn, has_aux=True)(
            params, buffers, *batch
        )
        params, opt_state = opt.update(grads, opt_state, params)
        return params, buffers, opt_state, loss

    for epoch in range(args.epochs):
        train.set_epoch(epoch)
        for x, y in pardist.progress(train, desc=f"epoch {epoch}", leave=False):
            batch = (x.to(device), y.to(device))
            params, buffers, opt_state, loss = train_step(params, buffers, opt_state, batch)
        valid_acc = accuracy(apply, params, buffers, valid, len(valid_set))
        pardist.print0(f"epoch {epoch}: train_loss={float(loss):.4f} valid_acc={valid_acc:.4f}")

    pardist.print0(
        f"held-out accuracy: {valid_acc:.4f} ({len(valid_set)} images, {world} process(es))"
    )
    pardist.shutdown()


if __name__ == "__main__":
    main()
