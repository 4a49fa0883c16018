"""fastai's xresnet18 (ResNet-D), the model of examples/imagenette.py and benchmarks/gpu.py."""

import torch
import torch.nn.functional as F
from torch import nn


def conv(ni: int, nf: int, stride: int = 1, act: bool = True, zero: bool = False, ks: int = 3):
    c, bn = nn.Conv2d(ni, nf, ks, stride, ks // 2, bias=False), nn.BatchNorm2d(nf)
    nn.init.kaiming_normal_(c.weight)
    nn.init.constant_(bn.weight, 0.0 if zero else 1.0)  # zero: a residual block starts as identity
    return nn.Sequential(c, bn, nn.ReLU()) if act else nn.Sequential(c, bn)


class Block(nn.Module):
    """xresnet's basic block: the shortcut average-pools instead of striding (ResNet-D)."""

    def __init__(self, ni: int, nf: int, stride: int):
        super().__init__()
        self.convs = nn.Sequential(conv(ni, nf, stride), conv(nf, nf, act=False, zero=True))
        pool = [nn.AvgPool2d(2, ceil_mode=True)] if stride > 1 else []
        self.shortcut = nn.Sequential(*pool, *([conv(ni, nf, 1, False, ks=1)] * (ni != nf)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.convs(x) + self.shortcut(x))


def xresnet18(n_classes: int, width: int = 64) -> nn.Module:
    """fastai's xresnet18: a three-conv stem, then four stages of two blocks."""
    stem = [conv(3, width // 2, 2), conv(width // 2, width // 2), conv(width // 2, width)]
    sizes = [width, width, 2 * width, 4 * width, 8 * width]
    blocks = []  # every stage but the first halves the resolution and doubles the channels
    for i, (ni, nf) in enumerate(zip(sizes, sizes[1:])):
        blocks += [Block(ni, nf, 2 if i else 1), Block(nf, nf, 1)]
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8 * width, n_classes)]
    return nn.Sequential(*stem, nn.MaxPool2d(3, 2, 1), *blocks, *head)
