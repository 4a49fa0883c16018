"""Batch norm's arithmetic over summed statistics, shared by the cross-replica batch norm
(a psum over ranks, ``_batchnorm``) and the deterministic mode's (an ordered sum over
row groups, ``_groupnorm``).

Statistics travel as per-channel sums (count, sum, sum of squares) in float64, so
that one sum combines uneven shards and the variance keeps its precision when the
mean is large; the backward's per-channel sums of ``g`` and ``g * xhat`` likewise.
"""

from __future__ import annotations

import torch

from pardist.runtime import assert_async, tracing

__all__ = ["global_moments", "grad_sums", "input_grad", "local_moments", "update_running"]


def local_moments(x: torch.Tensor) -> torch.Tensor:
    """``x``'s per-channel count, sum and sum of squares: float64, shape (1 + 2C,)."""
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    compiling = tracing()
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
    if tracing():  # a compiled step cannot branch on the total
        assert_async(total > 1, f"pardist batch norm in a compiled step: {message}")
    elif float(total) <= 1:
        raise ValueError(
            f"{where()}: {message}; the step's ranks hold {float(total):.0f} in all (input "
            f"shape {tuple(x.shape)} on this rank)."
        )


def _addcmul(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, value: float = 1.0):
    """``t + value * a * b``: fused (one rounding) in eager; compiled steps cannot trace
    the fused kernel's decomposition under torch.func, and round the product."""
    if tracing():
        return t + value * (a * b)
    return torch.addcmul(t, a, b, value=value)


def _per_channel(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.view([1, -1] + [1] * (like.dim() - 2))


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


def update_running(running_mean, running_var, count, mean, var, momentum) -> None:
    """As torch's kernels: momentum * new + (1 - momentum) * old, with the unbiased variance."""
    with torch.no_grad():  # (not lerp_: under torch.func, compiled steps cannot trace its fma)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype) * momentum)
        if running_var is not None:
            unbiased = var * (count / (count - 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype) * momentum)
