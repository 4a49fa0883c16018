"""``CrossReplicaBatchNorm`` and ``convert_batchnorm``: for models run without ``functional``.

:func:`pardist.functional` makes every batch norm of a model cross-replica as it
is (``_batchnorm``); these are for models run by other means inside a step.
"""

from __future__ import annotations

import torch
from torch import nn

from pardist.nn._batchnorm import _RUNNING, _BatchNormBase, _CrossReplica, _overrides_forward
from pardist.runtime import current_step

__all__ = ["CrossReplicaBatchNorm", "convert_batchnorm"]


class CrossReplicaBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm{1,2,3}d whose training statistics span the data-parallel axis.

    :func:`pardist.functional` needs no conversion (it synchronises every batch
    norm of the model as it is); this class is for models run by other means
    inside a step, e.g. ``torch.func.functional_call``.

    Example:
        >>> import pardist, torch
        >>> bn = pardist.CrossReplicaBatchNorm(3)
        >>> bn(torch.randn(4, 3)).shape  # outside a step: plain batch norm
        torch.Size([4, 3])
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = current_step()
        if _RUNNING.stack or not self.training or ctx is None or ctx.size == 1:
            return super().forward(x)
        with _CrossReplica(ctx.axis, None, f"pardist.CrossReplicaBatchNorm({self.num_features})"):
            return super().forward(x)


def convert_batchnorm(module: nn.Module) -> nn.Module:
    """Return ``module`` with every plain batch-norm layer made a :class:`CrossReplicaBatchNorm`.

    Not needed with :func:`pardist.functional`, which synchronises every batch
    norm as it is. Children are replaced in place and the (possibly new) root is
    returned, as ``nn.SyncBatchNorm.convert_sync_batchnorm`` does; parameters and
    buffers keep their names and tensors. A subclass with its own ``forward``
    (timm's ``BatchNormAct2d``) would lose it, so it is refused, naming its path.

    Example:
        >>> import pardist, torch
        >>> net = pardist.convert_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(2)))
        >>> type(net[0]).__name__
        'CrossReplicaBatchNorm'
    """
    for path, child in module.named_modules():
        if isinstance(child, _BatchNormBase) and not _plain(child):
            raise TypeError(
                f"pardist.convert_batchnorm: module {path or '(the root)'!r} is a "
                f"{type(child).__name__} with its own forward, which converting would drop. "
                "Use pardist.functional(model), which synchronises it as it is."
            )
    return _convert(module)


def _plain(module: nn.Module) -> bool:
    """A batch norm whose forward is torch's own (so converting it changes nothing else)."""
    return (
        isinstance(module, CrossReplicaBatchNorm)
        or type(module) is nn.SyncBatchNorm
        or not _overrides_forward(module, _BatchNormBase)
    )


def _convert(module: nn.Module) -> nn.Module:
    if isinstance(module, _BatchNormBase) and not isinstance(module, CrossReplicaBatchNorm):
        new = CrossReplicaBatchNorm.__new__(CrossReplicaBatchNorm)
        new.__dict__.update(module.__dict__)  # same parameters, buffers and settings
        new.__dict__.pop("process_group", None)
        return new
    for name, child in list(module.named_children()):
        module._modules[name] = _convert(child)
    return module
