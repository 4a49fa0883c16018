"""Cross-replica batch norm: statistics over the whole global batch, for every module.

Nothing is replaced. While ``functional``'s ``apply`` runs a model in training
inside a data-parallel step over more than one rank, the model runs under a
``TorchFunctionMode`` that catches each batch-norm call normalising with batch
statistics (``F.batch_norm``, ``torch.batch_norm``) and computes those statistics
over the step's axis; every other call passes straight through. So
``nn.BatchNorm{1,2,3}d``, subclasses with their own ``forward`` (timm's
``BatchNormAct2d`` keeps its activation and drop), and modules that call
``F.batch_norm`` themselves all normalise as one process would over the
concatenated batch. Outside a step, at axis size 1 and in eval mode there is no
mode at all: ``apply`` runs exactly the module.

Each layer costs one small differentiable ``psum`` (its backward, one more): every
rank's per-channel count, sum and sum of squares, from a float32 ``var_mean`` of
its shard, summed in float64 so that the variance keeps its precision when the
mean is large. Statistics are float32 under bf16/fp16 autocast, the output has
the input's dtype, and an empty shard contributes nothing. Running statistics
are updated in place with the momentum and the unbiased global variance, as
``F.batch_norm`` does. What cannot be made cross-replica exactly (a direct call
of ``torch.native_batch_norm``, a subclass of ``nn.SyncBatchNorm`` with its own
forward, a batch-norm subclass that normalises by hand) raises, naming the
module and the fix ``sync_bn=False``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

from pardist.collectives import _collectives
from pardist.runtime._compat import assert_async
from pardist.runtime._context import current_step

__all__ = ["cross_replica_batch_norm", "prepare", "synchronised"]

_BatchNormBase = nn.modules.batchnorm._BatchNorm
# Batch-norm functions that run with running statistics only: always exact.
_INFERENCE_ONLY = ("_native_batch_norm_legit_no_training", "_batch_norm_no_update")


def _functional_args(input, running_mean, running_var, weight=None, bias=None, training=False,
                     momentum=0.1, eps=1e-5):  # fmt: skip
    return input, running_mean, running_var, weight, bias, training, momentum, eps


def _torch_args(input, weight, bias, running_mean, running_var, training, momentum, eps,
                cudnn_enabled=True):  # fmt: skip
    return input, running_mean, running_var, weight, bias, training, momentum, eps


_PARSERS = {F.batch_norm: _functional_args, torch.batch_norm: _torch_args}
# The other batch-norm functions of torch's namespace, looked up by identity: a
# compiled step cannot test names (dynamo traces no ``str in str`` on them).
_OTHERS = {
    getattr(torch, n): True
    for n in dir(torch)
    if "batch_norm" in n and callable(getattr(torch, n)) and getattr(torch, n) not in _PARSERS
}


def _other_batch_norm(func) -> bool:
    if torch.compiler.is_compiling():
        return _OTHERS.get(func, False)
    return "batch_norm" in getattr(func, "__name__", "")


def _statistics(x: torch.Tensor, axis: tuple[str, ...], where):
    """Global per-channel count, mean and biased variance of ``x`` over ``axis``.

    float64 tensors of shapes (1,), (C,), (C,). ``where()`` names the call.
    """
    count = x.numel() // x.shape[1] if x.shape[1] else 0
    total = _collectives.psum(local_moments(x), axis)
    if count <= 1:  # with 2+ rows here, there are 2+ in all
        _check_rows(total[0], x, where)
    return global_moments(total, x.shape[1])


def local_moments(x: torch.Tensor) -> torch.Tensor:
    """``x``'s per-channel count, sum and sum of squares: float64, shape (1 + 2C,)."""
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    compiling = torch.compiler.is_compiling()
    if count and x.dtype in (torch.float32, torch.float64) and not compiling:
        # torch's own batch-norm statistics kernel (a two-pass mean and biased
        # variance): 2-5x faster than var_mean's Welford on CPU. (It has no fake
        # kernel for dynamic shapes: a compiled step takes var_mean.)
        mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
    elif count:  # half precision: float32 statistics, as torch's kernels keep them
        up = x if compiling and x.dtype == torch.float64 else x.float()
        var, mean = torch.var_mean(up, [0, *range(2, x.dim())], correction=0)
    else:  # an empty shard contributes nothing (the kernels refuse empty inputs)
        var = mean = x.new_zeros(channels)
    # Sums (count, sum, sum of squares), so that one psum combines uneven shards,
    # in float64: the sum of squares less N * mean^2 then keeps the variance to
    # ~1e-16 * mean^2 / var, and the local moments came from a stable kernel.
    mean, var = mean.double(), var.double()
    return torch.cat([mean.new_ones(1), mean, _addcmul(var, mean, mean)]).mul_(count)


def global_moments(total: torch.Tensor, channels: int) -> tuple:
    """(count, mean, biased variance) from summed :func:`local_moments`."""
    moments = total[1:] / total[:1]
    mean = moments[:channels]
    return total[:1], mean, (moments[channels:] - mean * mean).clamp_(min=0)


def _check_rows(total: torch.Tensor, x: torch.Tensor, where) -> None:
    """Refuse a global batch of one value per channel (its variance is undefined)."""
    message = "batch norm over the global batch needs more than 1 value per channel when training"
    if torch.compiler.is_compiling():  # a compiled step cannot branch on the total
        assert_async(total > 1, f"pardist batch norm in a compiled step: {message}")
    elif float(total) <= 1:
        raise ValueError(
            f"{where()}: {message}; the step's ranks hold {float(total):.0f} in all (input "
            f"shape {tuple(x.shape)} on this rank)."
        )


def _addcmul(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, value: float = 1.0):
    """``t + value * a * b``: fused (one rounding) in eager; compiled steps cannot trace
    the fused kernel's decomposition under torch.func, and round the product."""
    if torch.compiler.is_compiling():
        return t + value * (a * b)
    return torch.addcmul(t, a, b, value=value)


def _per_channel(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.view([1, -1] + [1] * (like.dim() - 2))


class _BatchNorm(torch.autograd.Function):
    """Batch norm with statistics over ``axis``: one psum forward, one backward.

    The forward normalises with torch's own kernel (``torch.batch_norm`` given the
    global statistics), so it computes ``x * scale + shift`` exactly as one process
    does. The backward is SyncBatchNorm's: each rank's per-channel sums of ``g``
    and ``g * xhat`` (torch's kernel, one pass), summed over the axis, give

        dx = w * invstd * (g - sum(g) / N - xhat * sum(g * xhat) / N)

    while the weight and bias get this rank's own sums (the gradient mean over
    the axis is ``pardist.grad``'s job, as for every replicated input).
    """

    @staticmethod
    def forward(x, weight, bias, eps, axis, where):
        count, mean, var = _statistics(x, axis, where)
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = torch.batch_norm(  # eval mode: it normalises with the statistics it is given
            x, weight, bias, mean.to(compute), var.to(compute), False, 0.0, eps, True
        )
        return y, count, mean, var

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, ctx.eps, ctx.axis, _ = inputs
        _, count, mean, var = output
        ctx.mark_non_differentiable(count, mean, var)
        ctx.save_for_backward(x, weight, count, mean, var)
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (weight, bias))

    @staticmethod
    @once_differentiable
    def backward(ctx, g, *_):
        x, weight, count, mean, var = ctx.saved_tensors
        db, dw = grad_sums(g, x, weight, mean, var, ctx.eps)
        sums = _collectives.psum(torch.cat([db, dw]).double(), ctx.axis).div_(count)
        dx = input_grad(g, x, weight, sums, mean, var, ctx.eps)
        grad_w, grad_b = (None if d is None else t.to(d) for t, d in zip((dw, db), ctx.dtypes))
        return dx, grad_w, grad_b, None, None, None


def grad_sums(g, x, weight, mean, var, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum(g), sum(g * xhat))`` per channel over ``x``'s rows, in one pass of torch's kernel."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    if not x.numel():  # (torch's kernel divides by zero on an empty input)
        zeros = g.new_zeros(x.shape[1], dtype=compute)
        return zeros, zeros
    stats = mean.to(compute), var.to(compute)
    # Eval mode reads the statistics from the running slots; CUDA's kernel
    # asserts that the saved ones are defined, and empty means "not saved".
    unsaved = x.new_empty(0, dtype=compute)
    _, dw, db = torch.ops.aten.native_batch_norm_backward(
        g, x, weight, *stats, unsaved, unsaved, False, eps, [False, True, True]
    )
    return db, dw


def input_grad(g, x, weight, sums, mean, var, eps) -> torch.Tensor:
    """``dx`` from the global per-channel means of ``g`` and ``g * xhat`` (``sums``, float64).

    Per-channel factors in float64 (C values): with few rows per channel the
    terms of dx nearly cancel, and float32 factors would show in it.
    """
    channels = x.shape[1]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    invstd = torch.rsqrt(var + eps)
    k = invstd if weight is None else invstd * weight.double()
    a = (k * invstd).mul_(sums[channels:])  # the xhat term, per unit of (x - mean)
    shift = _addcmul(k * sums[:channels], a, mean, value=-1).neg_()
    factors = torch.cat([shift, k, a]).to(compute)
    shift, k, a = (_per_channel(f, x) for f in factors.split(channels))
    return _addcmul(_addcmul(shift, g, k), x, a, value=-1).to(x.dtype)


# torch.autograd.Function.apply binds arguments with inspect.signature on every call
# (100+ us); a signature computed once is what inspect.signature then returns.
_BatchNorm.forward.__signature__ = inspect.signature(_BatchNorm.forward)


def cross_replica_batch_norm(
    x, running_mean, running_var, weight, bias, momentum, eps, axis, where
) -> torch.Tensor:
    """``F.batch_norm(..., training=True)`` with statistics over ``axis``."""
    if x.dim() < 2:
        raise ValueError(f"{where()}: expected at least 2D input (got {x.dim()}D input)")
    if eps <= 0:
        raise ValueError(f"{where()}: batch_norm eps must be positive during training, got {eps}")
    y, count, mean, var = _BatchNorm.apply(x, weight, bias, eps, axis, where)
    update_running(running_mean, running_var, count, mean, var, momentum)
    return y


def update_running(running_mean, running_var, count, mean, var, momentum) -> None:
    """As torch's kernels: momentum * new + (1 - momentum) * old, with the unbiased variance."""
    with torch.no_grad():  # (not lerp_: under torch.func, compiled steps cannot trace its fma)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype) * momentum)
        if running_var is not None:
            unbiased = var * (count / (count - 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype) * momentum)


class _Running(threading.local):
    """The cross-replica modes entered on this thread (the deterministic mode's row
    groups run the model on threads of their own)."""

    def __init__(self) -> None:
        self.stack: list[_CrossReplica] = []


_RUNNING = _Running()


class _CrossReplica(TorchFunctionMode):
    """Batch-norm calls with batch statistics, computed over ``axis``; the rest untouched."""

    def __init__(
        self, axis: tuple[str, ...], skeleton: nn.Module | None, where: str, seen=None, groups=0
    ):
        super().__init__()
        self.axis, self.skeleton, self.where, self.seen = axis, skeleton, where, seen
        self.groups = groups  # the deterministic mode's row groups (0: off)
        self.calls = 0  # batch norms made cross-replica
        self.norms = 0  # batch-norm functions called at all (eval mode, instance norm too)

    def __enter__(self):
        _RUNNING.stack.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _RUNNING.stack.pop()
        if self.seen is not None and "none" not in self.seen and exc[0] is None:
            self.seen["none"] = self.norms == 0 and not _has_norm_modules(self.skeleton)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        parse = _PARSERS.get(func)
        if parse is not None or _other_batch_norm(func):
            self.norms += 1
        if parse is not None:
            x, rm, rv, w, b, training, momentum, eps = parse(*args, **kwargs)
            if training:
                self.calls += 1
                where = lambda: f"{self.where}: {self.module_path()}"  # noqa: E731
                if self.groups:  # statistics over every row group, in group order
                    from pardist.nn import _groupnorm

                    return _groupnorm.batch_norm(x, rm, rv, w, b, momentum, eps, where)
                return cross_replica_batch_norm(x, rm, rv, w, b, momentum, eps, self.axis, where)
        elif _other_batch_norm(func) and self._trains(func, args, kwargs):
            raise RuntimeError(
                f"{self.where}: {self.module_path()} calls {func.__name__} directly, with batch "
                "statistics; pardist can make F.batch_norm / torch.batch_norm cross-replica, "
                "not that. Call F.batch_norm instead, or use "
                "pardist.functional(model, sync_bn=False) for per-rank statistics."
            )
        return func(*args, **kwargs)

    @staticmethod
    def _trains(func, args, kwargs) -> bool:
        if func.__name__.split(".")[0] in _INFERENCE_ONLY:
            return False
        flag = kwargs.get("training", next((a for a in args if isinstance(a, bool)), True))
        return bool(flag)

    def module_path(self) -> str:
        """The innermost module of the skeleton running now (read off the call stack)."""
        if self.skeleton is None:
            return "a module"
        paths = {id(m): name for name, m in self.skeleton.named_modules()}
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if id(owner) in paths and isinstance(owner, nn.Module):
                name = paths[id(owner)]
                return f"module {name or '(the root)'!r} ({type(owner).__name__})"
            frame = frame.f_back
        return "a function of the model"


def _overrides_forward(module: nn.Module, base: type) -> bool:
    return type(module).forward is not base.forward


def _sync_batchnorm_forward(module: nn.SyncBatchNorm, x: torch.Tensor) -> torch.Tensor:
    """nn.SyncBatchNorm inside a step: its statistics over the step's axis, not the world group."""
    if _RUNNING.stack or (current_step() is not None and module.training):
        module._check_non_zero_input_channels(x)
        return _BatchNormBase.forward(module, x)  # F.batch_norm, which the mode makes cross-replica
    return nn.SyncBatchNorm.forward(module, x)


def _refuse(where: str, path: str):
    def hook(module, args):
        if _RUNNING.stack:
            raise RuntimeError(
                f"{where}: module {path!r} is a {type(module).__name__}, a subclass of "
                "nn.SyncBatchNorm with its own forward, which synchronises through "
                "torch.distributed by itself; pardist cannot make it cross-replica over the "
                "step's axis exactly. Use the plain layer it was converted from (pardist "
                "synchronises nn.BatchNorm and its subclasses itself), or "
                "pardist.functional(model, sync_bn=False)."
            )

    return hook


def _expect_call(where: str, path: str):
    """Hooks that check a batch-norm subclass's own forward normalised through F.batch_norm."""
    seen: list[int] = []

    def before(module, args):
        if _RUNNING.stack:
            seen.append(_RUNNING.stack[-1].calls)

    def after(module, args, out):
        if not _RUNNING.stack or not seen:
            return
        start = seen.pop()
        batch_stats = module.training or (module.running_mean is None)
        if batch_stats and _RUNNING.stack[-1].calls == start:
            raise RuntimeError(
                f"{where}: module {path!r} ({type(module).__name__}) is a batch norm whose "
                "forward did not call F.batch_norm or torch.batch_norm, so pardist cannot "
                "compute its statistics over the global batch. Normalise with F.batch_norm, "
                "or use pardist.functional(model, sync_bn=False) for per-rank statistics."
            )

    return before, after


def prepare(skeleton: nn.Module, where: str) -> nn.Module:
    """Ready pardist's private skeleton (never the user's module) for :func:`synchronised`."""
    for path, module in skeleton.named_modules():
        if type(module) is nn.SyncBatchNorm:
            module.forward = types.MethodType(_sync_batchnorm_forward, module)
        elif isinstance(module, nn.SyncBatchNorm):
            if _overrides_forward(module, nn.SyncBatchNorm):
                module.register_forward_pre_hook(_refuse(where, path))
            else:
                module.forward = types.MethodType(_sync_batchnorm_forward, module)
        elif isinstance(module, _BatchNormBase) and _overrides_forward(module, _BatchNormBase):
            before, after = _expect_call(where, path)
            module.register_forward_pre_hook(before)
            module.register_forward_hook(after)
    return skeleton


def synchronised(skeleton: nn.Module | None, train: bool, where: str, seen: dict | None = None):
    """The cross-replica mode if a step over more than one rank is training, else nothing.

    The mode runs a Python function for every torch call of the model (2-3 us each).
    ``seen`` (one dict per model) remembers the first call: a model with no batch-norm
    module that called no batch-norm function then runs without the mode.
    """
    ctx = current_step()
    if not train or ctx is None or (ctx.size == 1 and not ctx.deterministic):
        return contextlib.nullcontext()
    if torch.compiler.is_compiling():  # traced: a graph, no per-op cost to save
        return _CrossReplica(ctx.axis, skeleton, where, None)
    if seen is not None and seen.get("none"):
        return contextlib.nullcontext()
    return _CrossReplica(ctx.axis, skeleton, where, seen, ctx.deterministic)


def _has_norm_modules(skeleton: nn.Module | None) -> bool:
    return skeleton is None or any(
        isinstance(m, nn.modules.batchnorm._NormBase) for m in skeleton.modules()
    )
