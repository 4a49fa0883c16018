"""The gradient nested in another torch.func transform (or an outer autograd graph).

There the value must stay differentiable, since the outer transform may differentiate
through it: torch.func.grad runs as it is, and inside a step each replicated input is
marked by :class:`_MeanGrad`, an identity whose backward is a differentiable mean over
the step's axis (where the common, un-nested case hands each gradient to a bucketed
reducer instead, ``_bucketed``).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.func

from pardist.collectives import _collectives, _vma
from pardist.gradients import _bucketed, _perrank
from pardist.gradients._call import Call
from pardist.runtime import _tree, functorch, laid_out_like

__all__ = ["compute", "in_transform", "laid_out_like_args", "nested"]

_requires_grad = operator.attrgetter("requires_grad")


class _MeanGrad(torch.autograd.Function):
    """Identity forward; the backward is a differentiable mean over the groups.

    ``divisor`` (a row-weighted mean: total rows / this rank's rows) divides each
    rank's cotangent before the sum instead. It is differentiated as the plain
    mean, as every weighted reduction here is: the weights enter once, where
    first-order gradients are reduced, not again in an outer transform.
    """

    @staticmethod
    def forward(x, groups, size, divisor):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.groups, ctx.size, ctx.divisor = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, g):
        if ctx.divisor == math.inf:  # a rank without rows: no weight (nor its nan gradient)
            g = torch.zeros_like(g)
        plain = _collectives.psum_groups(g, ctx.groups) / ctx.size
        if ctx.divisor is not None:
            weighted = _collectives.psum_groups(g.detach() / ctx.divisor, ctx.groups)
            plain = plain + (weighted - plain).detach()
        return plain, None, None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return tangent  # identity forward: the tangent as it is

    @staticmethod
    def vmap(info, in_dims, x, groups, size, divisor):
        return _MeanGrad.apply(x, groups, size, divisor), in_dims[0]


def in_transform(leaves: list[torch.Tensor]) -> bool:
    """Inside another torch.func transform, or under an outer autograd graph."""
    if functorch.peek_interpreter_stack() is not None:
        return True
    return torch.is_grad_enabled() and any(map(_requires_grad, leaves))


def nested(args: tuple, argnums) -> bool:
    """Outside a step: inside another torch.func transform or an outer autograd graph,
    where torch.func.grad runs as it is (else autograd's backward does, see compute_local)."""
    if functorch.peek_interpreter_stack() is not None:
        return True
    if not torch.is_grad_enabled():
        return False
    nums = (argnums,) if isinstance(argnums, int) else argnums
    try:
        chosen = [args[n] for n in nums]
    except (IndexError, TypeError):
        return True  # torch.func names the bad argnums
    return any(t.requires_grad for t in _tree.tree_leaves(chosen) if isinstance(t, torch.Tensor))


def laid_out_like_args(grads: Any, args: tuple, nums) -> Any:
    """torch.func's gradients with their arguments' strides (in the outermost call)."""
    if functorch.peek_interpreter_stack() is not None:
        return grads  # wrapped tensors of an enclosing transform: its own call lays them out
    like = args[nums] if isinstance(nums, int) else tuple(args[n] for n in nums)
    return _tree.tree_map(laid_out_like, grads, like)


def compute(call: Call, ctx, leaves: list):
    """torch.func.grad, with a differentiable mean on replicated inputs inside a step.

    Here the value stays differentiable (an outer transform may differentiate
    through it), so it is averaged by a differentiable collective.
    """
    if call.listed is not None:
        raise ValueError(
            f"{call.where}: accumulate='list' runs inside another torch.func transform here "
            "(vmap, grad, jacrev), which pardist does not weigh micro-batches in; call it "
            "outside the transform, or give one batch (accumulate=k splits it)."
        )
    groups = ctx.mesh.groups(ctx.axis) if ctx is not None and ctx.size > 1 else []
    divisor, total = None, 0
    if groups and call.mean == "rows":
        total = _perrank.total_rows(call.rows, ctx)
        divisor = total / call.rows if call.rows > 0 else math.inf
    flags = iter(call.replicated)
    marks = {n: _tree.tree_map(lambda _: next(flags), call.args[n]) for n in call.nums}
    scale = [1]  # the backward's seed (the gradient is linear in it), set by each forward

    def marked(*args):
        args = list(args)
        if groups:
            for n in call.nums:
                args[n] = _tree.tree_map(
                    lambda x, r: (
                        _vma.lifted_over_data(_MeanGrad.apply(x, groups, ctx.size, divisor), x)
                        if r
                        else x
                    ),
                    args[n],
                    marks[n],
                )
        with _vma.user():
            out = call.f(*args, **call.kwargs)
        # pardist's error for a non-scalar; the seed, once the loss's type is known
        scale[0] = _vma.seed_scale(_bucketed.split_value(out, call.has_aux, call.where)[0])
        return out

    nums = call.nums if len(call.nums) > 1 else call.nums[0]
    values, auxes, grads = [], [], []
    for j, margs, _ in call.micro_batches():
        with _vma.in_grad():
            g, out = torch.func.grad_and_value(marked, argnums=nums, has_aux=call.has_aux)(*margs)
        if scale[0] != 1:
            g = _tree.tree_map(lambda t: t * scale[0], g)
        value, aux = out if call.has_aux else (out, None)
        call.took(j, aux)
        values.append(value)
        auxes.append(aux)
        grads.append(_tree.tree_flatten(g)[0])
    k = call.accumulate
    local = [sum(column) for column in zip(*grads)] if k > 1 else grads[0]
    parts = [list(column) for column in zip(*grads)]
    value = torch.stack(values).mean() if k > 1 else values[0]
    if groups and call.need_value and call.mean == "rows":
        # The row-weighted value, differentiated as the mean over ranks: the marks on
        # the replicated inputs (_MeanGrad) already weigh each rank by its rows, and an
        # outer transform must not weigh them twice. An empty shard adds nothing.
        mine = value if call.rows > 0 else value.new_zeros(())
        plain = _collectives.psum_groups(mine, groups) / ctx.size
        weighted = _collectives.psum_groups(mine.detach() * max(call.rows, 0), groups) / total
        value = plain + (weighted - plain).detach()
    elif groups and call.need_value:
        value = _collectives.psum_groups(value, groups) / ctx.size
    grads = call.combine(local, parts, leaves)
    if groups:  # the batch's gradients: weighed as the ranks' (1 / size, or rows / total)
        by = divisor if divisor is not None else ctx.size
        grads = _bucketed.sharded_mean(grads, leaves, call.replicated, by)
    return value, call.aux(auxes), _vma.typed_like(grads, leaves)
