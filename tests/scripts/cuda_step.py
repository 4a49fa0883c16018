"""A data-parallel step on CUDA (nccl, world size 1) against plain torch, same process.

    python tests/scripts/cuda_step.py

A conv net with batch norm in channels_last, three AdamW steps: pardist's step
(functional, data_parallel, value_and_grad, optim.adamw) and plain torch
(the module, torch.optim.AdamW fused) must agree in float32 (TF32 off,
deterministic cuDNN), and closely under bf16 autocast. Prints one line per check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import pardist


def net() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()]
    layers += [nn.Conv2d(16, 32, 3, stride=2), nn.BatchNorm2d(32), nn.ReLU()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)]
    return nn.Sequential(*layers).cuda().to(memory_format=torch.channels_last)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def train(bf16: bool, steps: int = 3) -> float:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 10, (32,), generator=g))]
    batches = [
        (x.cuda().contiguous(memory_format=torch.channels_last), y.cuda())
        for x, y in batches * steps
    ]
    model = net()
    opt = torch.optim.AdamW(model.parameters(), 1e-2, fused=True)
    for x, y in batches:
        with torch.autocast("cuda", torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    apply, params, buffers = pardist.functional(net())
    popt = pardist.optim.adamw(1e-2)
    state = popt.init(params)

    def loss_fn(p, b, x, y):
        with pardist.amp.autocast("bf16", enabled=bf16):
            out, b = apply(p, b, x)
        return F.cross_entropy(out.float(), y), b

    @pardist.data_parallel(axis="gpu")
    def step(p, b, s, batch):
        (loss, b), grads = pardist.value_and_grad(loss_fn, has_aux=True)(p, b, *batch)
        p, s = popt.update(grads, s, p)
        return p, b, s, loss

    for batch in batches:
        params, buffers, state, loss = step(params, buffers, state, batch)
    assert loss.device.type == "cuda" and all(p.is_cuda for p in params.values())
    worst = max(rel(params[k], v) for k, v in model.named_parameters())
    worst_buffers = max(
        rel(buffers[k], v) for k, v in model.named_buffers() if v.is_floating_point()
    )
    return max(worst, worst_buffers)


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    pardist.init()
    assert pardist.device().type == "cuda", pardist.device()
    backend = torch.distributed.get_backend()
    print(f"device {pardist.device()} backend {backend}")
    print(f"float32 worst relative difference {train(False):.2e}")
    print(f"bf16 worst relative difference {train(True):.2e}")
    pardist.shutdown()


if __name__ == "__main__":
    main()
