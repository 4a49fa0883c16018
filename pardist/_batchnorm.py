"""Cross-replica batch norm: statistics over the whole global batch, on any device.

Inside a data-parallel step, each rank's per-channel count, mean and sum of
squared deviations are all-gathered over the step's axis (one small collective
per layer) and combined with Chan's parallel-variance formula, so N ranks
normalise exactly as one process would over the concatenated batch. The gather
is pardist's differentiable ``all_gather``, so gradients flow through the
statistics as they do in one process. torch's ``nn.SyncBatchNorm`` needs a GPU;
this works on CPU too, and under torch.func.

Outside a step, at world size 1 and in eval mode it is plain ``F.batch_norm``.
"""

from __future__ import annotations

import torch
from torch import nn

from pardist import _collectives
from pardist._context import current_step

__all__ = ["CrossReplicaBatchNorm", "convert_batchnorm"]


class CrossReplicaBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm{1,2,3}d whose training statistics span the data-parallel axis."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = current_step()
        if not self.training or ctx is None or ctx.size == 1:
            return super().forward(x)
        self._check_input_dim(x)
        out_dtype = x.dtype
        x = x.float()  # statistics in float32 under bf16/fp16 autocast, as cuDNN's
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = torch.tensor(float(x.numel() // x.shape[1]), device=x.device)
        mean = x.mean(dims)
        m2 = (x - mean.view(shape)).pow(2).sum(dims)
        stats = torch.cat([count.view(1), mean, m2])[None]
        everyone = _collectives.all_gather(stats, ctx.axis)  # (ranks, 1 + 2C)
        c = x.shape[1]
        counts, means, m2s = everyone[:, :1], everyone[:, 1 : 1 + c], everyone[:, 1 + c :]
        total = counts.sum()
        global_mean = (counts * means).sum(0) / total
        global_m2 = (m2s + counts * (means - global_mean).pow(2)).sum(0)
        var = global_m2 / total
        y = (x - global_mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._update_running_stats(global_mean, global_m2, total)
        return y.to(out_dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean, m2, total) -> None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = m2.detach() / (total.detach() - 1).clamp(min=1)
        self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)


def convert_batchnorm(module: nn.Module) -> nn.Module:
    """Return ``module`` with every batch-norm layer made cross-replica.

    Children are replaced in place and the (possibly new) root is returned, as
    ``nn.SyncBatchNorm.convert_sync_batchnorm`` does. Parameters and buffers keep
    their names and tensors, so state dicts load either way.
    """
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, CrossReplicaBatchNorm
    ):
        new = CrossReplicaBatchNorm.__new__(CrossReplicaBatchNorm)
        new.__dict__.update(module.__dict__)  # same parameters, buffers and settings
        return new
    for name, child in list(module.named_children()):
        module._modules[name] = convert_batchnorm(child)
    return module
