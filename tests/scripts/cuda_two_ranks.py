"""Two ranks on one GPU (gloo on CUDA tensors) against one process on the whole batch.

    PARDIST_SHM=0 torchrun --standalone --nproc-per-node 2 tests/scripts/cuda_two_ranks.py

nccl refuses two ranks on one device; gloo carries CUDA tensors, so this is the
closest one GPU gets to multi-GPU: device placement, cross-replica batch norm's
CUDA kernels and the reducer on CUDA tensors. Three SGD-momentum steps of a BN
conv net; prints the worst relative difference of params and buffers.
"""

import torch
import torch.nn.functional as F
from torch import nn

import pardist


def net():
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()]
    layers += [nn.Conv2d(16, 32, 3, stride=2), nn.BatchNorm2d(32), nn.ReLU()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)]
    return nn.Sequential(*layers).cuda()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.backends.cudnn.deterministic = True
pardist.init("gloo")
rank, world = pardist.rank(), pardist.world_size()
g = torch.Generator().manual_seed(1)
batches = [
    (
        torch.randn(32, 3, 16, 16, generator=g).cuda(),
        torch.randint(0, 10, (32,), generator=g).cuda(),
    )
    for _ in range(3)
]
model = net()
opt = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
for x, y in batches:
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
apply, params, buffers = pardist.functional(net())
popt = pardist.optim.sgd(0.1, momentum=0.9)
state = popt.init(params)


def loss_fn(p, b, x, y):
    out, b = apply(p, b, x)
    return F.cross_entropy(out, y), b


@pardist.data_parallel(axis="gpu")
def step(p, b, s, batch):
    (loss, b), grads = pardist.value_and_grad(loss_fn, has_aux=True)(p, b, *batch)
    p, s = popt.update(grads, s, p)
    return p, b, s, loss


n = 32 // world
for x, y in batches:
    params, buffers, state, loss = step(
        params, buffers, state, (x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
    )
assert all(p.is_cuda for p in params.values())
wp = max(rel(params[k], v) for k, v in model.named_parameters())
wb = max(rel(buffers[k], v) for k, v in model.named_buffers() if v.is_floating_point())
print(
    f"rank {rank}/{world} backend {torch.distributed.get_backend()} device {pardist.device()}",
    f"params rel {wp:.2e} buffers rel {wb:.2e}",
    flush=True,
)
pardist.shutdown()
