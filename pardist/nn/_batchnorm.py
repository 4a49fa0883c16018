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
from pardist.nn._bnmath import (
    _check_rows,
    global_moments,
    grad_sums,
    input_grad,
    local_moments,
    update_running,
)
from pardist.runtime import current_step, tracing

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

_NORMS = {**_PARSERS, **_OTHERS}  # all that a compiled step looks for


def _other_batch_norm(func) -> bool:
    if tracing():
        return _OTHERS.get(func, False)
    return "batch_norm" in getattr(func, "__name__", "")


# Eager calls: which functions are not batch norm at all, found once per function. Every
# torch call of the model passes through the mode, and most are not batch norm: 0.6 us a
# call went to telling so (2.5 us an op under the mode, 1.9 under an empty mode, 1.1 with
# none). Not used while dynamo traces, whose guards would see the set grow.
_PLAIN_FUNCS: set = set()


def _statistics(x: torch.Tensor, axis: tuple[str, ...], where):
    """Global per-channel count, mean and biased variance of ``x`` over ``axis``.

    float64 tensors of shapes (1,), (C,), (C,). ``where()`` names the call.
    """
    count = x.numel() // x.shape[1] if x.shape[1] else 0
    total = _collectives.psum(local_moments(x), axis)
    if count <= 1:  # with 2+ rows here, there are 2+ in all
        _check_rows(total[0], x, where)
    return global_moments(total, x.shape[1])


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
        # Written into a tensor of their own, not concatenated: inductor (torch 2.13) computes
        # a concatenation's inputs straight into it and then all-reduces it in place over
        # torch's functional collectives, so dw and db, read below, became the sums.
        packed = x.new_empty(2 * db.numel(), dtype=torch.float64)
        packed[: db.numel()], packed[db.numel() :] = db, dw
        sums = _collectives.psum(packed, ctx.axis).div_(count)
        dx = input_grad(g, x, weight, sums, mean, var, ctx.eps)
        grad_w, grad_b = (None if d is None else t.to(d) for t, d in zip((dw, db), ctx.dtypes))
        return dx, grad_w, grad_b, None, None, None


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
        # The common case first, in few bytecodes: dynamo runs this for every torch call.
        if tracing():
            if func not in _NORMS:
                return func(*args, **kwargs) if kwargs else func(*args)
        elif func in _PLAIN_FUNCS:
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        parse = _PARSERS.get(func)
        other = parse is None and _other_batch_norm(func)
        if parse is None and not other:  # not batch norm at all (eager: traced ones are)
            try:
                _PLAIN_FUNCS.add(func)
            except TypeError:  # an unhashable callable: asked every time
                pass
            return func(*args, **kwargs)
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
        elif other and self._trains(func, args, kwargs):
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
    if not train or ctx is None or (ctx.size == 1 and not ctx.mode.groups):
        return contextlib.nullcontext()
    if tracing():  # traced: a graph, no per-op cost to save
        return _CrossReplica(ctx.axis, skeleton, where, None)
    if seen is not None and seen.get("none"):
        return contextlib.nullcontext()
    return _CrossReplica(ctx.axis, skeleton, where, seen, ctx.mode.groups)


def _has_norm_modules(skeleton: nn.Module | None) -> bool:
    return skeleton is None or any(
        isinstance(m, nn.modules.batchnorm._NormBase) for m in skeleton.modules()
    )
