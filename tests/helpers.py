"""Models, data and training loops shared by the tests.

Each loop trains the same model on the same global batches three ways: with
pardist (N ranks, each on its shard), with torch DDP (N ranks), and in one
process on the whole batch. Tests compare the results.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import pardist


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def bn_mlp() -> nn.Module:
    """An MLP with batch norm: each layer's sums feed a cat (for sync batch norm's
    all-reduce) and are the gradients of its weight and bias."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Linear(16, 4),
    )


class TransformerBlock(nn.Module):
    """One pre-norm encoder layer on a (batch, 6, 16) sequence, mean-pooled into 4 classes."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            16, 2, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=True
        )
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.layer(x).mean(1))


def transformer() -> nn.Module:
    torch.manual_seed(0)
    return TransformerBlock()


MODELS = {"mlp": mlp, "bn_mlp": bn_mlp, "convnet": convnet, "transformer": transformer}
SHAPES = {"mlp": (8,), "bn_mlp": (8,), "convnet": (1, 8, 8), "transformer": (6, 16)}


def global_batch(
    step: int, model: str, n: int = 24, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    shape = (n, *SHAPES[model])
    return torch.randn(shape, generator=g, dtype=dtype), torch.randint(0, 4, (n,), generator=g)


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world)[rank]


def make_optimizer(name: str):
    if name == "sgd":
        return pardist.optim.sgd(lr=0.1, momentum=0.9, weight_decay=1e-3)
    return pardist.optim.adamw(lr=1e-2)


def torch_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(params, lr=1e-2)


def train_pardist(
    model: str = "mlp",
    opt_name: str = "sgd",
    steps: int = 4,
    *,
    sync_bn: bool = True,
    whole_batch: bool = False,
    donate: bool = False,
    compile_loss: dict | None = None,
    dtype: torch.dtype = torch.float32,
    **dp_options,
):
    """Train with data_parallel; return (params, buffers, per-step losses, per-step prints).

    ``compile_loss``: torch.compile's arguments for the loss function given to
    ``pardist.value_and_grad`` (the rest of the step stays eager). ``dtype``: the
    model's and the batches' (float64 to compare with other float64 training)."""
    apply, params, buffers = pardist.functional(MODELS[model]().to(dtype), sync_bn=sync_bn)
    opt = make_optimizer(opt_name)
    state = opt.init(params)

    def loss_fn(params, buffers, x, y):
        out, new_buffers = apply(params, buffers, x)
        return F.cross_entropy(out, y), new_buffers

    if compile_loss is not None:
        loss_fn = torch.compile(loss_fn, **compile_loss)

    def step(params, buffers, state, batch):
        (loss, new_buffers), grads = pardist.value_and_grad(loss_fn, has_aux=True)(
            params, buffers, *batch
        )
        params, state = opt.update(grads, state, params)
        return params, new_buffers, state, loss

    step = pardist.data_parallel(
        step, axis="gpu", donate_argnums=(0, 2) if donate else (), **dp_options
    )
    rank, world = pardist.rank(), pardist.world_size()
    losses, prints = [], []
    for s in range(steps):
        x, y = global_batch(s, model, dtype=dtype)
        if not whole_batch:
            x, y = shard(x, rank, world), shard(y, rank, world)
        params, buffers, state, loss = step(params, buffers, state, (x, y))
        losses.append(float(loss))
        prints.append({k: v.clone() for k, v in params.items()})
    return params, buffers, losses, prints


def train_ddp(
    model: str = "mlp", opt_name: str = "sgd", steps: int = 4, dtype: torch.dtype = torch.float32
):
    """The same training with torch DDP; returns its parameters."""
    net = nn.parallel.DistributedDataParallel(MODELS[model]().to(dtype))
    opt = torch_optimizer(opt_name, net.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    for s in range(steps):
        x, y = global_batch(s, model, dtype=dtype)
        opt.zero_grad()
        F.cross_entropy(net(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.module.named_parameters()}


def ranks_by_hand(script: str, ranks: list[int], world: int, *args: str, piped=True, **env):
    """Processes started as a user starts ranks without a launcher: ``python -c script``
    with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (a free port) set by
    hand, each with a hash seed of its own (as torchrun's ranks have), ``env`` added
    (a value None removes the variable). Output piped (stderr into stdout) unless not;
    each process's ``port`` is the run's ``MASTER_PORT``."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i, rank in enumerate(ranks):
        mine = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        mine.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        mine.update(PYTHONHASHSEED=str(101 + i), **{k: v for k, v in env.items() if v is not None})
        for k in [k for k, v in env.items() if v is None]:
            mine.pop(k, None)
        out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) if piped else {}
        procs.append(subprocess.Popen([sys.executable, "-c", script, *args], env=mine, **out))
        procs[-1].port = port  # (rank 0's store)
    return procs
