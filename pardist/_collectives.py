"""Collectives over named mesh axes that autograd and torch.func differentiate correctly.

Every rank runs the same program on its own data; a differentiated function's
value on each rank is that rank's contribution, and the objective is their mean
(the global-batch loss, when shards are equal). Under that convention the
backward rules are: ``psum`` -> ``psum``, ``pmean`` -> ``pmean``,
``all_gather`` -> sum-scatter, ``pmax`` -> the summed cotangent routed to the
maxima. They are custom autograd Functions with ``setup_context`` (so they work
inside ``torch.func.grad``) and explicit vmap rules. torch's own
``torch.distributed.nn.functional`` collectives lack ``setup_context`` and raise
under torch.func, and an in-place ``dist.all_reduce`` inside a differentiated
function silently drops the reduction from the backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pardist import _mesh, _shm, _traced, _tree
from pardist._context import compiled_plan

__all__ = ["all_gather", "axis_index", "axis_size", "broadcast", "pmax", "pmean", "psum"]


def _reduce(x: torch.Tensor, groups: list, op: str) -> torch.Tensor:
    """A reduced copy of ``x``: via shared memory for CPU ranks on one host, else the backend."""
    y = x.detach().clone(memory_format=torch.contiguous_format)
    for group in groups:
        shm = _shm.for_collectives(group) if y.device.type == "cpu" else None
        if shm is not None:
            shm.all_reduce(y, op)
        else:
            dist.all_reduce(
                y, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group
            )
    return y


class _Psum(torch.autograd.Function):
    @staticmethod
    def forward(x, groups):
        return _reduce(x, groups, "sum")

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.groups = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return _Psum.apply(grad, ctx.groups), None

    @staticmethod
    def vmap(info, in_dims, x, groups):
        return _Psum.apply(x, groups), in_dims[0]


class _Pmax(torch.autograd.Function):
    @staticmethod
    def forward(x, groups):
        return _reduce(x, groups, "max")

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.groups = inputs[1]
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        hit = (x == y).to(grad.dtype)
        ties = _Psum.apply(hit, ctx.groups)  # ranks sharing the maximum split its cotangent
        return _Psum.apply(grad, ctx.groups) * hit / ties, None

    @staticmethod
    def vmap(info, in_dims, x, groups):
        return _Pmax.apply(x, groups), in_dims[0]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x, group, dim):
        shm = _shm.for_collectives(group) if x.device.type == "cpu" else None
        parts = shm.all_gather(x) if shm is not None else None
        if parts is None:
            parts = [
                torch.empty_like(x, memory_format=torch.contiguous_format)
                for _ in range(dist.get_world_size(group))
            ]
            dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.group, ctx.dim = inputs
        ctx.length = x.shape[ctx.dim]

    @staticmethod
    def backward(ctx, grad):
        # Each rank's slice is used by every rank: its cotangent is the sum over ranks.
        me = dist.get_rank(ctx.group)
        total = _Psum.apply(grad, [ctx.group])
        return total.narrow(ctx.dim, me * ctx.length, ctx.length), None, None

    @staticmethod
    def vmap(info, in_dims, x, group, dim):
        bdim = in_dims[0]
        if bdim is None:
            return _AllGather.apply(x, group, dim), None
        x = x.movedim(bdim, 0)
        return _AllGather.apply(x, group, dim + 1), 0


def _tensors(tree: Any, where: str) -> tuple[list[torch.Tensor], Any]:
    leaves = _tree.check_tensor_leaves(tree, where=where, name="tree")
    return leaves, _tree.tree_flatten(tree)[1]


def _map(tree: Any, where: str, fn) -> Any:
    leaves, spec = _tensors(tree, where)
    return _tree.tree_unflatten([fn(leaf) for leaf in leaves], spec)


def _coalesced(tree: Any, where: str, fn) -> Any:
    """Apply an elementwise collective ``fn`` once per (dtype, device), not once per leaf.

    A tree of many small tensors (batch-norm buffers, metrics) then costs one
    collective. The flattening is differentiable (cat / split), so autograd and
    torch.func see through it.
    """
    leaves, spec = _tensors(tree, where)
    out: list[torch.Tensor | None] = [None] * len(leaves)
    groups: dict[tuple, list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault((leaf.dtype, leaf.device), []).append(i)
    for index in groups.values():
        if len(index) == 1:
            out[index[0]] = fn(leaves[index[0]])
            continue
        flat = fn(torch.cat([leaves[i].reshape(-1) for i in index]))
        pieces = flat.split([leaves[i].numel() for i in index])
        for i, piece in zip(index, pieces):
            out[i] = piece.view(leaves[i].shape)
    return _tree.tree_unflatten(out, spec)


def psum(tree: Any, axis: str | tuple[str, ...]) -> Any:
    """Sum every tensor leaf of ``tree`` over the ranks of ``axis``.

    Differentiable (the backward is a ``psum`` of the cotangent). With a tuple of
    axes it reduces the innermost axis first, then the outer ones.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.psum({'n': torch.tensor(3.)}, 'gpu')
        {'n': tensor(3.)}
        >>> pardist.shutdown()
    """
    if (plan := compiled_plan()) is not None:  # inside data_parallel(compile=True)
        return _traced.psum(tree, axis, plan)
    groups = _mesh.current_mesh("psum").groups(axis, "psum")
    if not groups:
        return _map(tree, "pardist.psum", lambda x: x)
    return _coalesced(tree, "pardist.psum", lambda x: _Psum.apply(x, groups))


def pmean(tree: Any, axis: str | tuple[str, ...]) -> Any:
    """Average every tensor leaf of ``tree`` over the ranks of ``axis`` (differentiable)."""
    if (plan := compiled_plan()) is not None:
        return _traced.pmean(tree, axis, plan)
    mesh = _mesh.current_mesh("pmean")
    groups, size = mesh.groups(axis, "pmean"), mesh.size(axis, "pmean")
    if not groups:
        return _map(tree, "pardist.pmean", lambda x: x)
    return _coalesced(tree, "pardist.pmean", lambda x: _Psum.apply(x, groups) / size)


def pmax(tree: Any, axis: str | tuple[str, ...]) -> Any:
    """Elementwise maximum of every tensor leaf over the ranks of ``axis``.

    The gradient flows to the ranks holding the maximum (split evenly on ties).
    """
    if (plan := compiled_plan()) is not None:
        return _traced.pmax(tree, axis, plan)
    groups = _mesh.current_mesh("pmax").groups(axis, "pmax")
    if not groups:
        return _map(tree, "pardist.pmax", lambda x: x)
    return _coalesced(tree, "pardist.pmax", lambda x: _Pmax.apply(x, groups))


def all_gather(tree: Any, axis: str | tuple[str, ...], dim: int = 0) -> Any:
    """Concatenate every leaf along ``dim`` over the ranks of ``axis``, in axis order.

    Every rank must pass the same shapes; for per-rank lengths that differ (an
    evaluation epoch's outputs) use :func:`pardist.gather`. Differentiable: each
    rank's slice receives the sum of its cotangents over the ranks.
    """
    if (plan := compiled_plan()) is not None:
        return _traced.all_gather(tree, axis, dim, plan)
    mesh = _mesh.current_mesh("all_gather")
    if mesh.size(axis, "all_gather") == 1:
        return _map(tree, "pardist.all_gather", lambda x: x)
    group = mesh.group(axis, "all_gather")

    def gather(x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 0:
            raise ValueError(
                "pardist.all_gather: a leaf is a scalar (shape ()); there is no dim "
                f"{dim} to concatenate along. Use x[None] to gather scalars into a vector."
            )
        return _AllGather.apply(x, group, dim % x.ndim)

    return _map(tree, "pardist.all_gather", gather)


def broadcast(tree: Any, axis: str | tuple[str, ...] = "gpu", *, src: int = 0) -> Any:
    """Copies of ``tree`` equal to the values on index ``src`` of ``axis`` (not differentiable).

    The usual use: make every replica start from rank 0's initial parameters.
    """
    mesh = _mesh.current_mesh("broadcast")
    if mesh.size(axis, "broadcast") == 1:
        return _map(tree, "pardist.broadcast", lambda x: x.detach().clone())
    group = mesh.group(axis, "broadcast")
    source = dist.get_global_rank(group, src)

    def send(x: torch.Tensor) -> torch.Tensor:
        y = x.detach().clone(memory_format=torch.contiguous_format)
        dist.broadcast(y, src=source, group=group)
        return y

    return _map(tree, "pardist.broadcast", send)


def axis_index(axis: str | tuple[str, ...]) -> int:
    """This rank's position along ``axis`` (row-major over a tuple of axes)."""
    if (plan := compiled_plan()) is not None:
        return _traced.axis_index(axis, plan)
    return _mesh.current_mesh("axis_index").index(axis)


def axis_size(axis: str | tuple[str, ...]) -> int:
    """The number of ranks along ``axis`` (the product over a tuple of axes)."""
    if (plan := compiled_plan()) is not None:
        return _traced.axis_size(axis, plan)
    return _mesh.current_mesh("axis_size").size(axis)
