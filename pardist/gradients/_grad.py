"""``pardist.grad`` and ``pardist.value_and_grad``: torch.func's, plus the gradient mean.

Inside a data-parallel step the gradient is that of the loss averaged over the step's
axis, for every argument: a replicated input's is the mean of the ranks' gradients, a
sharded input's its local gradient over the ranks. The replicated inputs' mean is the
transpose of replication (identity forward, mean backward), so it must happen
*inside* the function being differentiated; applied to a step's inputs outside
the transform, the backward would never run. In the common case (not nested in
another torch.func transform) the backward of that identity hands each gradient
to a bucketed :class:`~pardist.transport._reducer.Reducer` the moment autograd produces it
(``_bucketed``), which is how torch DDP overlaps communication with the
backward. Nested in another transform, each gradient is averaged by a
differentiable collective (``_nested``).

Outside a step both functions give torch.func's numbers; where no other transform is
running, by autograd's backward, which (unlike torch.func's) runs saved-tensor hooks, so
that activation checkpointing works there too.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.func
from torch.distributed.tensor import DTensor

from pardist.collectives import _vma
from pardist.gradients import (
    _bucketed,
    _depends,
    _deterministic,
    _lists,
    _microbatch,
    _nested,
    _perrank,
    _tokens,
    _traced_grad,
)
from pardist.gradients._call import Call
from pardist.runtime import (
    ALONE,
    Compiled,
    CompiledLoss,
    Deterministic,
    Eager,
    _tree,
    current_step,
    holds,
    tracing,
)

__all__ = ["grad", "value_and_grad"]

_MEANS = ("ranks", "rows", "tokens")
_is_floating = torch.Tensor.is_floating_point


def _argnums_tuple(argnums: int | tuple[int, ...], nargs: int, where: str) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or any(not isinstance(n, int) or not -nargs <= n < nargs for n in nums):
        raise ValueError(
            f"{where}: argnums={argnums!r} does not name arguments of a call with "
            f"{nargs} positional arguments."
        )
    return tuple(n % nargs for n in nums)


def _check_options(accumulate: int | str, mean: str, where: str) -> None:
    if accumulate != _lists.LIST and (
        isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1
    ):
        raise ValueError(
            f"{where}: accumulate={accumulate!r}; give a number of micro-batches to split the "
            "batch into, or 'list' for a batch given as a list of micro-batches."
        )
    if mean not in _MEANS:
        raise ValueError(
            f"{where}: mean={mean!r}; use 'ranks' (each rank's gradient counts equally, as "
            "in DDP), 'rows' (each row of the global batch counts equally) or 'tokens' (f "
            "returns (sum of per-token losses, count): each token of the global batch counts "
            "equally)."
        )


def _compute(f: Callable, argnums, has_aux: bool, options: dict, args: tuple, kwargs, where: str):
    """(value, aux, grads like args[argnums]); inside a step the value is the global loss."""
    nums = _argnums_tuple(argnums, len(args), where)
    ctx = current_step()
    mode = ctx.mode if ctx is not None else ALONE
    k, mean = options["accumulate"], options["mean"]
    kind, listed = mean, k == _lists.LIST  # (mean='tokens' differentiates sums: 'ranks' below)
    flat = [_tree.tree_flatten(a) for a in args]
    leaves = _differentiated(args, flat, nums, where)
    if isinstance(mode, CompiledLoss) and not _tree.any_instance(leaves, DTensor):
        f = mode.compile(f)  # compile=True where the step is no one graph (FSDP: eager)
    if mode.alone and k == 1 and mean == "ranks" and _plain(options, leaves):
        return _alone(f, nums, has_aux, options, args, kwargs, where, flat, leaves, ctx)
    counts = None
    if mean == "tokens":  # the paths differentiate the sums; _tokens divides by the count
        if not mode.counts_tokens:
            raise NotImplementedError(
                f"{where}: mean='tokens' is not supported in the {mode.name} mode; return "
                "a mean with mean='ranks'."
            )
        # (a traced step takes each count as aux: no Python list fills inside a graph)
        f, counts = _tokens.counted(f, has_aux, where, as_aux=mode.plan is not None)
        mean = "ranks"
    weighted = mean == "rows" and ctx is not None and ctx.size > 1
    groups = mode.groups
    # (a rank whose list is empty holds no batch to check: every rank learns of it below)
    strict = _lists.holds_some(args, nums) if listed else k > 1 or weighted or bool(groups)
    masks = _microbatch.batch_masks(flat, nums, options["batch_argnums"], ctx, where, strict)
    lists = _lists.listed(args, flat, masks, nums, kind, where) if listed else None
    if lists is not None:
        k = lists.k  # this rank's micro-batches (others may have more or fewer)
        if groups:
            raise ValueError(
                f"{where}: the deterministic mode runs the batch as {groups} row groups of "
                "equal rows; it takes no list of micro-batches (accumulate='list'). Give the "
                "whole batch, or drop deterministic=."
            )
    carry = _microbatch.check_carry(options["carry"], len(args), nums, masks, has_aux, where)
    split = [f for n in nums for f in (masks[n] or [False] * len(flat[n][0]))]
    # DTensor leaves (pardist.fsdp shards) vary over the axis: their gather's backward
    # reduce-scatters their gradients, so they take no part in the all-reduce.
    if ctx is not None and not isinstance(ctx.varying, dict) and _vma.current() is None:
        varying = ctx.varying  # eager, untracked: ids, and nothing varies by tracking
        replicated = [i not in varying for i in map(id, leaves)]
        if any(issubclass(t, DTensor) for t in set(map(type, leaves))):
            replicated = [r and not isinstance(t, DTensor) for r, t in zip(replicated, leaves)]
    else:
        replicated = [
            ctx is not None
            and not holds(ctx.varying, t)
            and _vma.invariant_over_data(t)
            and not isinstance(t, DTensor)
            for t in leaves
        ]
    if weighted and _tree.any_instance(leaves, DTensor):
        raise ValueError(
            f"{where}: mean='rows' is not supported with pardist.fsdp parameters yet (their "
            "gradients are reduce-scattered as the mean over ranks); use mean='ranks'."
        )
    if any(itertools.compress(split, replicated)):  # split and replicated
        raise ValueError(
            f"{where}: batch_argnums names a differentiated input that is replicated over "
            "the step's axis; only this rank's shard of the batch can be split."
        )
    f = _depends.watched(f, nums, has_aux, where)  # model(x) instead of apply: an error
    call = Call(f, nums, has_aux, k, mean, args, kwargs, where, flat, masks, carry)
    call.split, call.replicated, call.carry_option = split, replicated, options["carry"]
    if lists is not None:
        call.rows = -1 if -1 in lists.rows else sum(lists.rows)
    else:
        call.rows = _microbatch.rank_rows(flat, masks, weighted, where) if ctx is not None else -1
    call.listed = lists
    # A traced step and the deterministic mode weigh by the count themselves.
    call.counts = counts if counts is not None and (mode.plan or mode.groups) else None
    call.need_value = options["need_value"]
    value, aux, grads = mode.run("grad", call, ctx, leaves)
    if counts is not None and not mode.groups:
        value, grads = _tokens.weigh(value, grads, leaves, call, ctx, counts)
    return value, aux, _regroup(grads, [flat[n] for n in nums])


def _differentiated(args: tuple, flat: list, nums: tuple, where: str) -> list:
    """The leaves of ``args[nums]``, checked to be floating-point (or complex) tensors."""
    for n in nums:
        if not all(map(isinstance, flat[n][0], itertools.repeat(torch.Tensor))):
            _tree.check_tensor_leaves(args[n], where=where, name=f"args[{n}]")  # names it
    leaves = [leaf for n in nums for leaf in flat[n][0]]
    # (the Tensor method costs half of torch.is_floating_point; dynamo traces the latter)
    floating = torch.is_floating_point if tracing() else _is_floating
    if not all(map(floating, leaves)) and not all(
        t.is_floating_point() or t.is_complex() for t in leaves
    ):
        for n in nums:
            for (path, _), leaf in zip(_tree.leaves_with_paths(args[n], f"args[{n}]"), flat[n][0]):
                if not (leaf.is_floating_point() or leaf.is_complex()):
                    raise TypeError(
                        f"{where}: {path} has dtype {leaf.dtype}; only "
                        "floating-point tensors can be differentiated."
                    )
    return leaves


def _plain(options: dict, leaves: list) -> bool:
    """A call the ALONE mode takes as it is: nothing to split, carry or place, and
    neither nested in a transform nor FSDP-sharded (else the full path, same numbers)."""
    return (
        options["batch_argnums"] is None
        and options["carry"] in (None, _microbatch.UNSET)
        and not _nested.in_transform(leaves)
        and not _tree.any_instance(leaves, DTensor)
    )


def _alone(f, nums, has_aux: bool, options: dict, args, kwargs, where: str, flat, leaves, ctx):
    """(value, aux, grads) on one process or outside a step: autograd's, in one pass,
    with the step's check of a non-finite loss."""
    f = _depends.watched(f, nums, has_aux, where)  # model(x) instead of apply: an error
    call = Call(f, nums, has_aux, 1, "ranks", args, kwargs, where, flat, [None] * len(args), None)
    call.split, call.carry_option = [False] * len(leaves), options["carry"]
    value, aux, grads = _bucketed.compute_local(call, leaves)
    if ctx is not None and _perrank.checked(value, ctx) and not math.isfinite(value.item()):
        masks = _microbatch.batch_masks(flat, nums, None, ctx, where, strict=False)
        rows = _microbatch.rank_rows(flat, masks, False, where)
        _perrank.report(value.double().reshape(1), [rows], "ranks", ctx, where)
    return value, aux, _regroup(grads, [flat[n] for n in nums])


# The gradient's path, one rule per way a step runs (runtime._modes).
Deterministic.register("grad")(_deterministic.compute)  # the same bits at any world size
Compiled.register("grad")(_traced_grad.compute)  # inside data_parallel(compile=True)


@Eager.register("grad")
def _eager(mode, call: Call, ctx, leaves: list):
    """Autograd's backward, reducing in buckets inside a step; torch.func's grad where
    the call is nested in another transform or an outer autograd graph."""
    if _nested.in_transform(leaves):
        return _nested.compute(call, ctx, leaves)
    if ctx is None:  # autograd: checkpoints recompute
        return _bucketed.compute_local(call, leaves)
    return _bucketed.compute(call, ctx, leaves)


def _regroup(grads: list, flat: list) -> Any:
    out, start = [], 0
    for part, treedef in flat:
        out.append(_tree.tree_unflatten(grads[start : start + len(part)], treedef))
        start += len(part)
    return out[0] if len(out) == 1 else tuple(out)


def grad(
    f: Callable,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    *,
    accumulate: int = 1,
    batch_argnums: int | tuple[int, ...] | None = None,
    carry: int | None = _microbatch.UNSET,
    mean: str = "ranks",
) -> Callable:
    """The gradient of ``f`` with respect to ``args[argnums]``, as ``torch.func.grad``.

    Inside a :func:`pardist.data_parallel` step, the gradient of ``f`` averaged over
    the step's axis (JAX's ``grad`` of the ``pmean``'d loss), for every argument: a
    replicated input's is the mean of the ranks' gradients (computed in buckets while
    the backward runs), a sharded input's (the batch) its slice of one process's
    gradient on the global batch. Outside a step it is exactly ``torch.func.grad``.

    Args:
        f: a function returning a scalar tensor (and aux, with ``has_aux``).
        argnums: which positional argument(s) to differentiate.
        has_aux: ``f`` returns ``(value, aux)``; the result is then ``(grads, aux)``.
        accumulate: split the batch into this many micro-batches (along dim 0,
            with einops) and run them one after another, reducing once: the
            result equals one pass over the whole batch, in less memory. Or
            ``'list'``: the batch argument is a list of micro-batches, each a tree of
            its own shapes (padded text, each padded to its own longest row; the last
            one shorter; fewer on a rank whose loader ran out), and ``f`` runs on
            each in turn, weighed as one process running the same micro-batches
            would weigh them (see ``mean``), with one reduction per update.
        batch_argnums: the argument(s) holding the batch, which ``accumulate``
            splits. Default: inside a step, every tensor that holds this rank's
            shard of the step's batch (by the step's ``in_specs``), in whichever
            arguments of ``f`` it is; outside a step, the one argument that is not
            differentiated.
        carry: with ``accumulate`` and ``has_aux``, the argument whose next value
            ``f`` returns as aux, as ``loss_fn(params, buffers, x, y)`` returns the
            batch-norm buffers: ``carry=1`` hands micro-batch j's aux to micro-batch
            j+1 as ``args[1]`` and returns the last one, as a plain loop over the
            micro-batches would. ``carry=None``: aux is stacked along a new dim 0,
            one entry per micro-batch. Unset, an aux shaped like an argument is an
            error asking which is meant.
        mean: inside a step, how ranks are weighed in the gradient mean (and the
            loss): ``'ranks'``, each rank's gradient counts equally (DDP's
            convention; the global-batch gradient when shards are equal);
            ``'rows'``, each rank counts by its batch rows (dim 0 of its shard), so
            shards of unequal size give the gradient of the mean loss over the
            whole global batch, for a loss that is a mean over rows. With equal
            shards both give the same bits. The row counts ride in the gradient
            buckets; the first call agrees on the total once. ``'tokens'``: ``f``
            returns ``(sum of its per-token losses, number of tokens)`` and the
            gradient is that of the sums over every rank and micro-batch divided by
            their global count (padding that differs per rank and micro-batch
            weighs nothing), as one process on the whole batch with
            ``ignore_index``; one small all-reduce adds the counts. A rank without
            tokens adds nothing; a step without any is an error.

    Raises:
        FloatingPointError: under ``PARDIST_DEBUG=1``, when the loss is not finite
            on some rank; the error names the rank(s). Without it that is a
            :class:`pardist.NonFiniteLossWarning` (on CPU every step; on GPUs, whose
            host it would stall, only under ``PARDIST_DEBUG=1``). Steps that
            :func:`pardist.amp.dynamic_loss_scale` scales are skipped by it, not
            reported.

    Example:
        >>> import pardist, torch
        >>> def loss(w, x):
        ...     return (x @ w).pow(2).mean()
        >>> w, x = torch.ones(3), torch.arange(6.).reshape(2, 3)
        >>> pardist.grad(loss)(w, x)
        tensor([36., 51., 66.])
        >>> pardist.grad(loss, accumulate=2)(w, x)
        tensor([36., 51., 66.])
    """
    where = f"pardist.grad({getattr(f, '__name__', 'f')})"
    options = _options(accumulate, batch_argnums, carry, mean, where, need_value=False)

    @functools.wraps(f)
    def grad_f(*args, **kwargs):
        if _torch_func(options, args, argnums):
            out = torch.func.grad(f, argnums, has_aux)(*args, **kwargs)
            if has_aux:
                return _nested.laid_out_like_args(out[0], args, argnums), out[1]
            return _nested.laid_out_like_args(out, args, argnums)
        with _vma.internal():  # pardist's own plumbing: untyped, by hand (f: typed)
            _, aux, grads = _compute(f, argnums, has_aux, options, args, kwargs, where)
        return (grads, aux) if has_aux else grads

    return grad_f


def value_and_grad(
    f: Callable,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    *,
    accumulate: int = 1,
    batch_argnums: int | tuple[int, ...] | None = None,
    carry: int | None = _microbatch.UNSET,
    mean: str = "ranks",
) -> Callable:
    """``(value, grads)`` (JAX's order), or ``((value, aux), grads)`` with ``has_aux``.

    Inside a data-parallel step the gradients are those of the global objective,
    the mean of ``f`` over the step's axis, and so is the returned value, in
    ``f``'s own dtype (full precision, whatever the compression): every rank's
    exact loss rides in the gradient buckets. ``aux`` stays per rank. Outside a
    step this is ``torch.func.grad_and_value`` with its results swapped.
    Arguments as for :func:`grad`.

    Example:
        >>> import pardist, torch
        >>> value, g = pardist.value_and_grad(lambda w: (w * w).sum())(torch.ones(2))
        >>> value, g
        (tensor(2.), tensor([2., 2.]))
    """
    where = f"pardist.value_and_grad({getattr(f, '__name__', 'f')})"
    options = _options(accumulate, batch_argnums, carry, mean, where, need_value=True)

    @functools.wraps(f)
    def value_and_grad_f(*args, **kwargs):
        if _torch_func(options, args, argnums):
            grads, out = torch.func.grad_and_value(f, argnums, has_aux)(*args, **kwargs)
            return out, _nested.laid_out_like_args(grads, args, argnums)
        with _vma.internal():  # pardist's own plumbing: untyped, by hand (f: typed)
            value, aux, grads = _compute(f, argnums, has_aux, options, args, kwargs, where)
        return ((value, aux) if has_aux else value), grads

    return value_and_grad_f


def _options(accumulate, batch_argnums, carry, mean: str, where: str, need_value: bool) -> dict:
    _check_options(accumulate, mean, where)
    return dict(
        accumulate=accumulate,
        batch_argnums=batch_argnums,
        carry=carry,
        mean=mean,
        need_value=need_value,
    )


def _torch_func(options: dict, args: tuple, argnums) -> bool:
    """Whether the call is torch.func's own: outside a step, inside another transform, one
    batch, nothing to weigh."""
    return (
        current_step() is None
        and options["accumulate"] == 1
        and options["mean"] != "tokens"
        and _nested.nested(args, argnums)
    )
