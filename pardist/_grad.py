"""``pardist.grad`` and ``pardist.value_and_grad``: torch.func's, plus the gradient mean.

Inside a data-parallel step the gradient with respect to a replicated input is
averaged over the step's axis: the gradient of the global-batch loss. That is the
transpose of replication (identity forward, mean backward), so it must happen
*inside* the function being differentiated; applied to a step's inputs outside
the transform, the backward would never run. In the common case (not nested in
another torch.func transform) the backward of that identity hands each gradient
to a bucketed :class:`~pardist._reducer.Reducer` the moment autograd produces it,
which is how torch DDP overlaps communication with the backward. Nested in
another transform, each gradient is averaged by a differentiable collective.

Outside a step both functions are exactly torch.func's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.func
from torch.distributed.tensor import DTensor, Shard

from pardist import _collectives, _fsdp, _microbatch, _tree
from pardist._context import StepContext, current_step
from pardist._reducer import Reducer
from pardist._zero import ScatterReducer, signature

__all__ = ["grad", "value_and_grad"]


class _MeanGrad(torch.autograd.Function):
    """Identity forward; the backward is a differentiable mean over the groups."""

    @staticmethod
    def forward(x, groups, size):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.groups, ctx.size = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        return _collectives._Psum.apply(g, ctx.groups) / ctx.size, None, None

    @staticmethod
    def vmap(info, in_dims, x, groups, size):
        return _MeanGrad.apply(x, groups, size), in_dims[0]


def _argnums_tuple(argnums: int | tuple[int, ...], nargs: int, where: str) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or any(not isinstance(n, int) or not -nargs <= n < nargs for n in nums):
        raise ValueError(
            f"{where}: argnums={argnums!r} does not name arguments of a call with "
            f"{nargs} positional arguments."
        )
    return tuple(n % nargs for n in nums)


def _split(out: Any, has_aux: bool, where: str) -> tuple[torch.Tensor, Any]:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"{where}: with has_aux=True, f must return (value, aux).")
        value, aux = out
    else:
        value, aux = out, None
    if not (isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()):
        what = (
            f"shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise ValueError(
            f"{where}: f must return a floating-point scalar tensor to differentiate, got "
            f"{what}. Reduce it first (e.g. loss.mean())."
        )
    return value, aux


def _scatter_reducer(ctx: StepContext, like: list[torch.Tensor]) -> ScatterReducer:
    key = ("scatter", signature(like), tuple(t.device for t in like), ctx.axis, ctx.bucket_bytes)
    if key not in ctx.reducers:
        ctx.reducers[key] = ScatterReducer(
            like,
            ctx.mesh.group(ctx.axis),
            ctx.size,
            ctx.mesh.index(ctx.axis),
            bucket_bytes=ctx.bucket_bytes,
            first_bucket_bytes=ctx.first_bucket_bytes,
        )
    return ctx.reducers[key]


def _as_shard(local: torch.Tensor, like: torch.Tensor, ctx: StepContext) -> DTensor:
    """This rank's flat shard of a mean gradient, as a DTensor that knows its layout."""
    return DTensor.from_local(
        local,
        ctx.mesh.submesh(ctx.axis),
        [Shard(0)],
        shape=(like.numel(),),
        stride=(1,),
        run_check=False,
    )


def _reducer(ctx: StepContext, like: list[torch.Tensor]) -> Reducer:
    key = (
        tuple((t.shape, t.dtype, t.device) for t in like),
        ctx.axis,
        ctx.compression,
        ctx.overlap,
        ctx.bucket_bytes,
        ctx.first_bucket_bytes,
    )
    if key not in ctx.reducers:
        ctx.reducers[key] = Reducer(
            like,
            ctx.mesh.groups(ctx.axis),
            ctx.size,
            comm_dtype=ctx.compression,
            overlap=ctx.overlap,
            bucket_bytes=ctx.bucket_bytes,
            first_bucket_bytes=ctx.first_bucket_bytes,
        )
    return ctx.reducers[key]


def _in_transform(leaves: list[torch.Tensor]) -> bool:
    """Inside another torch.func transform, or under an outer autograd graph."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return True
    return torch.is_grad_enabled() and any(t.requires_grad for t in leaves)


def _compute(
    f: Callable,
    argnums,
    has_aux: bool,
    accumulate: int,
    batch_argnums,
    args: tuple,
    kwargs: dict,
    where: str,
):
    """(value, aux, grads like args[argnums], whether value is already the global mean)."""
    nums = _argnums_tuple(argnums, len(args), where)
    batch_nums = tuple(n for n in _argnums_tuple(batch_argnums, len(args), where) if n not in nums)
    ctx = current_step()
    flat, treedefs = [], []
    for n in nums:
        part, treedef = _tree.tree_flatten(args[n])
        if not all(isinstance(t, torch.Tensor) for t in part):
            _tree.check_tensor_leaves(args[n], where=where, name=f"args[{n}]")  # names it
        flat.append(part)
        treedefs.append(treedef)
    leaves = [leaf for part in flat for leaf in part]
    differentiable = all(t.is_floating_point() or t.is_complex() for t in leaves)
    for n, part in zip(nums, [] if differentiable else flat):
        for path, leaf in zip(_tree.leaves_with_paths(args[n], f"args[{n}]"), part):
            if not (leaf.is_floating_point() or leaf.is_complex()):
                raise TypeError(
                    f"{where}: {path[0]} has dtype {leaf.dtype}; only "
                    "floating-point tensors can be differentiated."
                )
    # DTensor leaves (pardist.fsdp shards) vary over the axis: their gather's backward
    # reduce-scatters their gradients, so they take no part in the all-reduce.
    replicated = [
        ctx is not None and id(t) not in ctx.varying and not isinstance(t, DTensor) for t in leaves
    ]
    reduce = ctx is not None and ctx.size > 1 and any(replicated)
    if ctx is None or _in_transform(leaves):
        return _compute_functorch(
            f, nums, has_aux, accumulate, batch_nums, args, kwargs, ctx, replicated, where
        )
    rep = [t for t, r in zip(leaves, replicated) if r]
    rep_index = {i: j for j, i in enumerate(i for i, r in enumerate(replicated) if r)}
    scatter = reduce and bool(ctx.scatter) and signature(rep) in ctx.scatter
    # One pass with an all-reduce: the reducer is made after the forward, so that the
    # statistics the forward left to average (batch norm with sync_bn=False) ride in
    # the gradient buckets instead of costing a collective of their own.
    late = reduce and not scatter and accumulate == 1
    hand, pending = _HandOver(), []
    if (reduce or accumulate > 1) and not late:
        hand.use(ctx, rep, scatter, reduce, [], accumulate)
    local_sum: list[torch.Tensor | None] = [None] * len(leaves)
    values, auxes = [], []
    for j, margs in enumerate(_microbatch.split(args, batch_nums, accumulate, where)):
        if hand.reducer is not None and j == accumulate - 1:
            hand.reducer.last_micro_batch()
        if any(isinstance(t, DTensor) for t in leaves):  # FSDP shards: usable only by apply
            inputs = _fsdp.grad_inputs(leaves, args, nums, where)
        else:
            inputs = [t.detach().requires_grad_() for t in leaves]
        for i, x in enumerate(inputs):
            if replicated[i] and (reduce or accumulate > 1):
                # The reducer takes each gradient the moment autograd produces it.
                x.register_hook(functools.partial(hand, rep_index[i]))
        call = list(margs)
        start = 0
        for n, part, treedef in zip(nums, flat, treedefs):
            call[n] = _tree.tree_unflatten(inputs[start : start + len(part)], treedef)
            start += len(part)
        mark = len(ctx.pending_means)
        with torch.enable_grad():
            value, aux = _split(f(*call, **kwargs), has_aux, where)
        if late:
            pending = ctx.pending_means[mark:]
            del ctx.pending_means[mark:]
            hand.use(ctx, rep, False, True, pending, 1)
        if hand.carry:
            hand.reducer.add(0, value.detach())
            for k, t in enumerate(pending):
                hand.reducer.add(1 + k, t)
        if value.requires_grad:
            got = torch.autograd.grad(value, inputs, allow_unused=True)
            for i, g in enumerate(got):
                if g is not None and (hand.reducer is None or not replicated[i]):
                    local_sum[i] = g if local_sum[i] is None else local_sum[i] + g
        values.append(value.detach())
        auxes.append(
            _tree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux)
        )
    reduced = hand.reducer.finish() if hand.reducer is not None else []
    for k, t in enumerate(pending):
        t.copy_(reduced[1 + k])  # the averaged statistics, into the tensors apply returned
    grads = []
    for i, t in enumerate(leaves):
        if hand.reducer is not None and replicated[i]:
            g = reduced[hand.base + rep_index[i]]
            grads.append(_as_shard(g, t, ctx) if scatter else g)
        elif local_sum[i] is None:
            grads.append(torch.zeros_like(t))
        else:
            grads.append(local_sum[i] / accumulate if accumulate > 1 else local_sum[i])
    if reduce and hand.carry:
        # The global mean loss, copied out: callers keep losses, not bucket views.
        value, mean_done = reduced[0].to(values[0].dtype, copy=True), True
    else:
        value = torch.stack(values).mean() if accumulate > 1 else values[0]
        mean_done = False
    return value, _microbatch.stack(auxes), _regroup(grads, flat, treedefs), mean_done


class _HandOver:
    """What gradient hooks call: the reducer (which may be made after the forward)."""

    reducer: Reducer | None = None
    carry = 0  # slot 0 carries the loss, slots 1.. the statistics to average
    base = 0  # the first gradient's slot

    def use(
        self,
        ctx: StepContext,
        rep: list,
        scatter: bool,
        reduce: bool,
        pending: list,
        accumulate: int,
    ) -> None:
        if scatter:  # a sharded optimizer takes these: reduce-scatter (ZeRO-2)
            self.reducer, self.carry, self.base = _scatter_reducer(ctx, rep), 0, 0
        else:
            self.carry = 1 if rep else 0
            scalar = [torch.empty((), dtype=rep[0].dtype, device=rep[0].device)] if rep else []
            like = scalar + list(pending) + rep
            self.reducer = _reducer(ctx, like) if reduce else Reducer(like, [], 1)
            self.base = self.carry + len(pending)
        self.reducer.begin(accumulate)

    def __call__(self, index: int, grad: torch.Tensor) -> None:
        self.reducer.add(self.base + index, grad)


def _regroup(grads: list, flat: list, treedefs: list) -> Any:
    out, start = [], 0
    for part, treedef in zip(flat, treedefs):
        out.append(_tree.tree_unflatten(grads[start : start + len(part)], treedef))
        start += len(part)
    return out[0] if len(out) == 1 else tuple(out)


def _compute_functorch(
    f, nums, has_aux, accumulate, batch_nums, args, kwargs, ctx, replicated, where
):
    """torch.func.grad, with a differentiable mean on replicated inputs inside a step."""
    groups = ctx.mesh.groups(ctx.axis) if ctx is not None else []
    flags = iter(replicated)
    marks = {n: _tree.tree_map(lambda _: next(flags), args[n]) for n in nums}

    def marked(*call):
        call = list(call)
        if groups:
            for n in nums:
                call[n] = _tree.tree_map(
                    lambda x, r: _MeanGrad.apply(x, groups, ctx.size) if r else x, call[n], marks[n]
                )
        out = f(*call, **kwargs)
        _split(out, has_aux, where)  # pardist's error for a non-scalar value
        return out

    results = []
    for margs in _microbatch.split(args, batch_nums, accumulate, where):
        g, out = torch.func.grad_and_value(
            marked, argnums=nums if len(nums) > 1 else nums[0], has_aux=has_aux
        )(*margs)
        value, aux = out if has_aux else (out, None)
        results.append((value, aux, g))
    if accumulate == 1:
        return (*results[0], False)
    grads = _tree.tree_map(lambda *gs: sum(gs) / accumulate, *[r[2] for r in results])
    value = torch.stack([r[0] for r in results]).mean()
    return value, _microbatch.stack([r[1] for r in results]), grads, False


def grad(
    f: Callable,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    *,
    accumulate: int = 1,
    batch_argnums: int | tuple[int, ...] = -1,
) -> Callable:
    """The gradient of ``f`` with respect to ``args[argnums]``, as ``torch.func.grad``.

    Inside a :func:`pardist.data_parallel` step, the gradient with respect to a
    replicated input is its mean over the step's axis (computed in buckets while
    the backward runs); inputs sharded over the axis keep their local gradient.
    Outside a step it is exactly ``torch.func.grad``.

    Args:
        f: a function returning a scalar tensor (and aux, with ``has_aux``).
        argnums: which positional argument(s) to differentiate.
        has_aux: ``f`` returns ``(value, aux)``; the result is then ``(grads, aux)``.
        accumulate: split the batch into this many micro-batches (along dim 0,
            with einops) and run them one after another, reducing once: the
            result equals one pass over the whole batch, in less memory. ``aux``
            then comes back stacked along a new leading dim of size ``accumulate``.
        batch_argnums: the argument(s) that hold the batch, for ``accumulate``.

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

    @functools.wraps(f)
    def grad_f(*args, **kwargs):
        if current_step() is None and accumulate == 1:
            return torch.func.grad(f, argnums, has_aux)(*args, **kwargs)
        _, aux, grads, _ = _compute(
            f, argnums, has_aux, accumulate, batch_argnums, args, kwargs, where
        )
        return (grads, aux) if has_aux else grads

    return grad_f


def value_and_grad(
    f: Callable,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    *,
    accumulate: int = 1,
    batch_argnums: int | tuple[int, ...] = -1,
) -> Callable:
    """``(value, grads)`` (JAX's order), or ``((value, aux), grads)`` with ``has_aux``.

    Inside a data-parallel step the gradients are those of the global objective,
    the mean of ``f`` over the step's axis, and so is the returned value (a
    scalar all-reduce); ``aux`` stays per rank. Outside a step this is
    ``torch.func.grad_and_value`` with its results swapped. Arguments as for
    :func:`grad`.

    Example:
        >>> import pardist, torch
        >>> value, g = pardist.value_and_grad(lambda w: (w * w).sum())(torch.ones(2))
        >>> value, g
        (tensor(2.), tensor([2., 2.]))
    """
    where = f"pardist.value_and_grad({getattr(f, '__name__', 'f')})"

    @functools.wraps(f)
    def value_and_grad_f(*args, **kwargs):
        ctx = current_step()
        if ctx is None and accumulate == 1:
            grads, out = torch.func.grad_and_value(f, argnums, has_aux)(*args, **kwargs)
            return out, grads
        value, aux, grads, mean_done = _compute(
            f, argnums, has_aux, accumulate, batch_argnums, args, kwargs, where
        )
        if ctx is not None and ctx.size > 1 and not mean_done:
            value = _collectives.pmean(value, ctx.axis)
        return ((value, aux) if has_aux else value), grads

    return value_and_grad_f
