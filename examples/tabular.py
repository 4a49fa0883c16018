"""Tabular data, data parallel: embeddings for categorical columns, an MLP over all of them.

    python examples/tabular.py                                      # one process
    torchrun --standalone --nproc_per_node=2 examples/tabular.py    # two processes

fastai's tabular example in pardist's shape, on real data that needs no download:
scikit-learn's diabetes table (442 patients; Efron et al., 2004). Its ``sex`` column is
categorical (an embedding); the age, split into quartiles, is a second categorical
column (an embedding, as fastai does with binned ages); the eight blood and body
measurements are continuous. The task: is the disease's progression after one year
above the median? The script prints the held-out accuracy against the majority class,
computed exactly over all held-out rows with pardist.gather, whatever the world size.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_diabetes
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pardist


class TabularModel(nn.Module):
    """fastai's TabularModel: one embedding per categorical column, then an MLP."""

    def __init__(self, cardinalities: list[int], continuous: int, hidden: int = 64):
        super().__init__()
        self.embeds = nn.ModuleList(nn.Embedding(n, min(50, (n + 1) // 2)) for n in cardinalities)
        width = sum(e.embedding_dim for e in self.embeds) + continuous
        self.norm = nn.BatchNorm1d(continuous)
        self.mlp = nn.Sequential(
            nn.Linear(width, hidden),
            nn.ReLU(),
            nn.BatchNorm1d(hidden),
            nn.Dropout(0.1),
            nn.Linear(hidden, 2),
        )

    def forward(self, cats: torch.Tensor, conts: torch.Tensor) -> torch.Tensor:
        embedded = [e(cats[:, i]) for i, e in enumerate(self.embeds)]
        return self.mlp(torch.cat([*embedded, self.norm(conts)], dim=1))


def data(seed: int = 0):
    """(train, valid) datasets of (categorical codes, continuous columns, label)."""
    table = load_diabetes(scaled=False)
    x, target = torch.tensor(table.data, dtype=torch.float32), torch.tensor(table.target)
    sex = (x[:, 1] > x[:, 1].min()).long()  # the column holds 1 and 2
    ages = x[:, 0].contiguous()
    age = torch.bucketize(ages, torch.quantile(ages, torch.tensor([0.25, 0.5, 0.75])))
    cats = torch.stack([sex, age], dim=1)
    conts = x[:, 2:]
    label = (target > target.median()).long()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, valid = order[:cut], order[cut:]
    mean, std = conts[train].mean(0), conts[train].std(0)  # statistics of the training rows
    conts = (conts - mean) / std
    return (
        TensorDataset(cats[train], conts[train], label[train]),
        TensorDataset(cats[valid], conts[valid], label[valid]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--bs", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    pardist.init()
    pardist.seed_everything(0)
    train_set, valid_set = data()
    train = pardist.data.shard(
        DataLoader(train_set, batch_size=args.bs, shuffle=True, drop_last=True),
        split_batches=True,
    )
    valid = pardist.data.shard(DataLoader(valid_set, batch_size=64))
    apply, params, buffers = pardist.functional(TabularModel([2, 4], continuous=8))
    steps = args.epochs * len(train)
    opt = pardist.optim.adamw(pardist.optim.one_cycle(steps, args.lr), weight_decay=0.01)
    opt_state = opt.init(params)

    def loss_fn(params, buffers, cats, conts, y):
        logits, buffers = apply(params, buffers, cats, conts)
        return F.cross_entropy(logits, y), buffers

    @pardist.data_parallel(donate_argnums=(0, 2))
    def step(params, buffers, opt_state, batch):
        grad = pardist.value_and_grad(loss_fn, has_aux=True)
        (loss, buffers), grads = grad(params, buffers, *batch)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, buffers, opt_state, loss

    for epoch in range(args.epochs):
        train.set_epoch(epoch)
        for batch in train:
            params, buffers, opt_state, loss = step(params, buffers, opt_state, batch)
    preds, labels = [], []
    for cats, conts, y in valid:
        preds.append(apply(params, buffers, cats, conts, train=False)[0].argmax(1))
        labels.append(y)
    preds, labels = pardist.gather((torch.cat(preds), torch.cat(labels)), total=len(valid_set))
    accuracy = (preds == labels).float().mean().item()
    majority = max(labels.float().mean().item(), 1 - labels.float().mean().item())
    pardist.print0(
        f"held-out accuracy: {accuracy:.4f} (majority class: {majority:.4f}, "
        f"{len(valid_set)} patients, {pardist.world_size()} process(es))"
    )
    pardist.shutdown()


if __name__ == "__main__":
    main()
