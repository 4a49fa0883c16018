"""Train a small conv net, data parallel, on scikit-learn's 8x8 digits (real data, no download).

    python examples/digits.py                                       # one process
    torchrun --standalone --nproc_per_node=2 examples/digits.py     # two processes

Every rank runs this same script on its own shard of each batch; pardist.grad
averages the gradients, so the result is what one process would compute on
the whole batch. Prints held-out accuracy at the end.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import pardist


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def data(seed: int = 0):
    """Images scaled to [0, 1] and a fixed 80/20 split, the same on every rank."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--bs", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    pardist.init()
    rank, world, device = pardist.rank(), pardist.world_size(), pardist.device()
    torch.manual_seed(0)  # the same initial parameters on every rank
    apply, params, buffers = pardist.functional(model().to(device))  # sync batch norm
    (x_train, y_train), (x_valid, y_valid) = data()
    steps_per_epoch = len(x_train) // args.bs
    opt = pardist.optim.adamw(pardist.optim.one_cycle(args.epochs * steps_per_epoch, args.lr),
                              weight_decay=1e-2)
    opt_state = opt.init(params)

    def loss_fn(params, buffers, x, y):
        logits, new_buffers = apply(params, buffers, x)
        return F.cross_entropy(logits, y), new_buffers

    @pardist.data_parallel(axis="gpu", donate_argnums=(0, 2))
    def train_step(params, buffers, opt_state, batch):
        (loss, buffers), grads = pardist.value_and_grad(loss_fn, has_aux=True)(
            params, buffers, *batch)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, buffers, opt_state, loss

    for epoch in range(args.epochs):
        # One permutation per epoch, the same on every rank; each rank takes its
        # contiguous slice of every global batch.
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps_per_epoch):
            idx = order[step * args.bs:(step + 1) * args.bs].chunk(world)[rank]
            batch = (x_train[idx].to(device), y_train[idx].to(device))
            params, buffers, opt_state, loss = train_step(params, buffers, opt_state, batch)
        if pardist.is_main():
            print(f"epoch {epoch}: train_loss={float(loss):.4f}")

    logits, _ = apply(params, buffers, x_valid.to(device), train=False)
    accuracy = (logits.argmax(1).cpu() == y_valid).float().mean().item()
    if pardist.is_main():
        print(f"held-out accuracy: {accuracy:.4f} ({len(y_valid)} images, {world} process(es))")
    pardist.shutdown()


if __name__ == "__main__":
    main()
