"""Batch norm in the deterministic mode: global statistics, summed over row groups in order.

Each row group of ``data_parallel(step, deterministic=G)`` runs the model on a
thread of its own, in lockstep (``runtime._lockstep``). At a batch-norm call
every group hands over its input, and one joint autograd node computes, for each
group, its per-channel count, sum and sum of squares with the kernel of its own
shape; adds the G groups' in group order over every rank
(``collectives._fold``); and normalises each group with the global statistics.
Its backward does the same with the per-channel sums of ``g`` and ``g * xhat``.
The formulas are those of the cross-replica batch norm (``_batchnorm``), so the
deterministic mode computes what the default mode computes, in an order that
does not depend on the world size.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from pardist.collectives import _fold
from pardist.nn import _bnmath, _remat
from pardist.runtime import _lockstep, current_step

__all__ = ["batch_norm"]


def batch_norm(x, running_mean, running_var, weight, bias, momentum, eps, where) -> torch.Tensor:
    """``F.batch_norm(..., training=True)`` for this thread's row group, over every group."""
    at = _lockstep.current()
    if at is None and _remat.recomputing():
        raise RuntimeError(
            f"{where()}: a batch norm inside a checkpointed block cannot be recomputed in "
            "the deterministic mode: its statistics join all the row groups, and the "
            "backward recomputes one group at a time. Checkpoint only blocks without "
            "batch norm (pardist.Remat(blocks=...)), or train without deterministic=."
        )
    if at is None:
        raise RuntimeError(
            f"{where()}: in a deterministic step, batch norm trains only inside "
            "pardist.grad / pardist.value_and_grad, which runs the row groups; call the "
            "model through them (or with train=False outside them)."
        )
    if x.dim() < 2:
        raise ValueError(f"{where()}: expected at least 2D input (got {x.dim()}D input)")
    if eps <= 0:
        raise ValueError(f"{where()}: batch_norm eps must be positive during training, got {eps}")
    lock = at[0]
    mine = (x, running_mean, running_var, weight, bias)
    return lock.meet(mine, lambda every: _joint(every, momentum, eps, where), "a batch norm")


def _joint(every: list, momentum: float, eps: float, where) -> list[torch.Tensor]:
    """Every group's output, from their statistics added in group order."""
    xs, means, vars_, weights, biases = zip(*every)
    n = len(xs)
    shapes = {tuple(x.shape[1:]) for x in xs}
    if len(shapes) > 1:
        raise ValueError(f"{where()}: the row groups reached this batch norm with shapes {shapes}.")
    tensors = [*xs, *(w for w in weights if w is not None), *(b for b in biases if b is not None)]
    out = _GroupedBatchNorm.apply(n, weights[0] is not None, biases[0] is not None, eps, where,
                                  *tensors)  # fmt: skip
    ys, (count, mean, var) = out[:n], out[n:]
    for rm, rv in zip(means, vars_):  # every group's copy of the buffers moves alike
        _bnmath.update_running(rm, rv, count, mean, var, momentum)
    return list(ys)


class _GroupedBatchNorm(torch.autograd.Function):
    """One node for all of this rank's row groups: inputs ``xs, weights, biases``."""

    @staticmethod
    def forward(ctx, n, has_weight, has_bias, eps, where, *tensors):
        ctx_step = current_step()
        xs = tensors[:n]
        weights = tensors[n : 2 * n] if has_weight else [None] * n
        biases = tensors[len(tensors) - n :] if has_bias else [None] * n
        channels = xs[0].shape[1]
        local = torch.stack([_bnmath.local_moments(x) for x in xs])
        total = _fold.ordered_sum(local, ctx_step)
        if float(total[0]) <= 1:
            _bnmath._check_rows(total[0], xs[0], where)
        count, mean, var = _bnmath.global_moments(total, channels)
        compute = torch.float64 if xs[0].dtype == torch.float64 else torch.float32
        ys = [
            torch.batch_norm(x, w, b, mean.to(compute), var.to(compute), False, 0.0, eps, True)
            for x, w, b in zip(xs, weights, biases)
        ]
        ctx.n, ctx.has_weight, ctx.has_bias, ctx.eps, ctx.step = (
            n,
            has_weight,
            has_bias,
            eps,
            ctx_step,
        )
        ctx.dtypes = (
            weights[0].dtype if has_weight else None,
            biases[0].dtype if has_bias else None,
        )
        ctx.save_for_backward(count, mean, var, *xs, *(w for w in weights if w is not None))
        ctx.mark_non_differentiable(count, mean, var)
        return (*ys, count, mean, var)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        n = ctx.n
        count, mean, var, *rest = ctx.saved_tensors
        xs = rest[:n]
        weights = rest[n:] if ctx.has_weight else [None] * n
        gs = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads[:n], xs)]
        sums = [_bnmath.grad_sums(g, x, w, mean, var, ctx.eps) for g, x, w in zip(gs, xs, weights)]
        local = torch.stack([torch.cat([db, dw]).double() for db, dw in sums])
        total = _fold.ordered_sum(local, ctx.step).div_(count)
        dxs = [_bnmath.input_grad(g, x, w, total, mean, var, ctx.eps)
               for g, x, w in zip(gs, xs, weights)]  # fmt: skip
        dw = [dw.to(ctx.dtypes[0]) for _, dw in sums] if ctx.has_weight else []
        db = [db.to(ctx.dtypes[1]) for db, _ in sums] if ctx.has_bias else []
        return (None, None, None, None, None, *dxs, *dw, *db)
