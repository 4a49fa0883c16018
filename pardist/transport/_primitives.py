"""Collective primitives, each an autograd Function whose backward is its transpose.

Two families, as in JAX's ``shard_map`` (docs: "efficient transposition of
replication-inducing collectives"):

- ``psum`` of a value varying over an axis gives a value *invariant* over it;
  its transpose is ``pvary``, the identity on an (invariant) cotangent. ``pvary``
  (identity forward) lifts an invariant value to a varying one; its transpose
  is ``psum``. These two are used where pardist tracks which axes each value
  varies over (``pardist._vma``).
- Where nothing is tracked every value counts as varying, and ``Psum``'s
  transpose is ``psum`` itself.

``all_gather`` and ``psum_scatter`` transpose into each other, ``all_to_all``
into itself with its dims swapped, ``all_gather_invariant`` into ``pscatter``
(this rank's block of an invariant value). All have ``setup_context`` and vmap
rules, so they work under ``torch.func.grad`` and ``vmap``; torch's own
``torch.distributed.nn.functional`` collectives lack ``setup_context``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pardist.runtime import _faults, collective_starts
from pardist.transport import _shmgroups
from pardist.transport._agree import agree

__all__ = [
    "AllGather",
    "AllGatherInvariant",
    "AllToAll",
    "Pmax",
    "Pscatter",
    "Psum",
    "PsumInvariant",
    "PsumScatter",
    "Pvary",
    "reduce",
]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _shared(x: torch.Tensor, group):
    return _shmgroups.for_collectives(group) if x.device.type == "cpu" else None


def reduce(x: torch.Tensor, groups: list, op: str) -> torch.Tensor:
    """A reduced copy of ``x``: via shared memory for CPU ranks on one host, else the backend."""
    collective_starts(f"pardist.{'psum / pmean' if op == 'sum' else 'pmax'}")
    y = x.detach().clone(memory_format=torch.contiguous_format)
    for group in groups:
        small = y.device.type == "cpu" and y.numel() * y.element_size() <= _shmgroups.SMALL_BYTES
        shm = _shmgroups.for_small_sums(group) if small else None
        if shm is not None:  # one barrier, not three (batch-norm statistics, losses)
            y = shm.small_all_reduce(y, op)
            continue
        shm = _shared(y, group)
        if shm is not None:
            shm.all_reduce(y, op)
        else:
            name = f"pardist.{'psum / pmean' if op == 'sum' else 'pmax'}"
            agree(name, group, y)
            with _faults.collective_errors(name, group):
                dist.all_reduce(
                    y, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group
                )
    return y


def gather_parts(x: torch.Tensor, group) -> list[torch.Tensor]:
    collective_starts("pardist.all_gather")
    shm = _shared(x, group)
    parts = shm.all_gather(x) if shm is not None else None
    if parts is None:
        parts = [
            torch.empty_like(x, memory_format=torch.contiguous_format)
            for _ in range(dist.get_world_size(group))
        ]
        agree("pardist.all_gather", group, x)
        with _faults.collective_errors("pardist.all_gather", group):
            dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _collective(name: str, doc: str, forward, transpose, dims: tuple[int, ...] = ()) -> type:
    """An autograd Function for one collective, from its (forward, transpose) pair.

    ``forward(x, *static)`` runs the collective; ``transpose(grad, *static)`` is the
    backward, itself a collective of the table below. ``dims`` names the static
    arguments that are dims of ``x``: a vmap moves the batch dim first and those up
    by one; a collective without dims is elementwise over the batch.
    """

    def setup_context(ctx, inputs, output):
        ctx.static = inputs[1:]

    def backward(ctx, grad):
        return transpose(grad, *ctx.static), *([None] * len(ctx.static))

    def vmap(info, in_dims, x, *static):
        if not dims or in_dims[0] is None:
            return fn.apply(x, *static), in_dims[0]
        moved = [s + 1 if i in dims else s for i, s in enumerate(static)]
        return fn.apply(x.movedim(in_dims[0], 0), *moved), 0

    body = {"forward": forward, "setup_context": setup_context, "backward": backward, "vmap": vmap}
    fn = type(name, (torch.autograd.Function,), {k: staticmethod(v) for k, v in body.items()})
    fn.__doc__, fn.__module__ = doc, __name__
    return fn


# The gather family's ``group`` is a ProcessGroup, or a compiled graph's link to one
# (``compile/_traced.py``), which offers the same three operations as graph nodes.
def _linked(group) -> bool:
    return not isinstance(group, dist.ProcessGroup)


def _gathered(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    if _linked(group):
        return group.all_gather(x, dim)
    return torch.cat(gather_parts(x, group), dim=dim)


def _psum_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    if _linked(group):
        return group.psum_scatter(x, dim)
    size = dist.get_world_size(group)
    collective_starts("pardist.psum_scatter")
    if _shared(x, group) is not None:  # shared memory: an all-reduce is the fast path
        total = reduce(x, [group], "sum")
        block = total.shape[dim] // size
        return total.narrow(dim, dist.get_rank(group) * block, block).clone()
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
    agree("pardist.psum_scatter", group, moved)
    with _faults.collective_errors("pardist.psum_scatter", group):
        _reduce_scatter(out, moved, group=group)
    return out.movedim(0, dim)


def _pscatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    if _linked(group):
        return group.scatter(x, dim)
    block = x.shape[dim] // dist.get_world_size(group)
    return x.narrow(dim, dist.get_rank(group) * block, block).clone()


def _all_to_all(x: torch.Tensor, group, split_dim: int, concat_dim: int) -> torch.Tensor:
    collective_starts("pardist.all_to_all")
    size, me = dist.get_world_size(group), dist.get_rank(group)
    blocks = x.movedim(split_dim, 0)
    blocks = blocks.reshape(size, blocks.shape[0] // size, *blocks.shape[1:]).contiguous()
    shm = _shared(x, group)
    everyone = shm.all_gather(blocks, "pardist.all_to_all") if shm is not None else None
    if everyone is not None:
        received = [theirs[me] for theirs in everyone]
    else:
        out = torch.empty_like(blocks)
        agree("pardist.all_to_all", group, blocks)
        with _faults.collective_errors("pardist.all_to_all", group):
            dist.all_to_all_single(out, blocks, group=group)
        received = list(out.unbind(0))
    return torch.cat([b.movedim(0, split_dim) for b in received], dim=concat_dim)


# The collectives, each written once as (forward, transpose). The reductions take
# their transport ``reduce(x, groups, op)`` as an argument, so that
# pardist.collectives decides (and tests can count) how values travel.
_summed = lambda x, groups, reduce: reduce(x, groups, "sum")  # noqa: E731
Psum = _collective(
    "Psum",
    "Sum over the groups; transpose: itself (every value counts as varying).",
    _summed,
    lambda g, groups, reduce: Psum.apply(g, groups, reduce),
)
PsumInvariant = _collective(
    "PsumInvariant",
    "Sum of a varying value, invariant over the groups; transpose: ``pvary``.",
    _summed,
    lambda g, groups, reduce: Pvary.apply(g, groups, reduce),
)
Pvary = _collective(
    "Pvary",
    "Identity, typed from invariant to varying; transpose: ``psum``.",
    lambda x, groups, reduce: x.view_as(x),
    lambda g, groups, reduce: PsumInvariant.apply(g, groups, reduce),
)
AllGather = _collective(
    "AllGather",
    "Concatenate along ``dim`` in axis order; transpose: ``psum_scatter``.",
    _gathered,
    lambda g, group, dim: PsumScatter.apply(g, group, dim),
    dims=(1,),
)
PsumScatter = _collective(
    "PsumScatter",
    "Sum over the group, then keep this rank's block of ``dim``; transpose: ``all_gather``.",
    _psum_scatter,
    lambda g, group, dim: AllGather.apply(g, group, dim),
    dims=(1,),
)
AllGatherInvariant = _collective(
    "AllGatherInvariant",
    "``all_gather`` whose result is invariant over the group; transpose: ``pscatter``.",
    _gathered,
    lambda g, group, dim: Pscatter.apply(g, group, dim),
    dims=(1,),
)
Pscatter = _collective(
    "Pscatter",
    "This rank's block of ``dim`` of an invariant value; transpose: ``all_gather_invariant``.",
    _pscatter,
    lambda g, group, dim: AllGatherInvariant.apply(g, group, dim),
    dims=(1,),
)
AllToAll = _collective(
    "AllToAll",
    "Block j of ``split_dim`` goes to rank j; received blocks are concatenated along "
    "``concat_dim`` in rank order. Transpose: itself with the two dims swapped.",
    _all_to_all,
    lambda g, group, split_dim, concat_dim: AllToAll.apply(g, group, concat_dim, split_dim),
    dims=(1, 2),
)


class Pmax(torch.autograd.Function):
    """Elementwise maximum; the cotangent goes to the ranks holding it, split on ties.

    ``invariant``: the cotangent is the same on every rank (tracked); otherwise
    every rank's cotangent counts, so they are summed first.
    """

    @staticmethod
    def forward(x, groups, reduce, invariant):
        return reduce(x, groups, "max")

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.groups, ctx.reduce, ctx.invariant = inputs
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        hit = (x == y).to(grad.dtype)
        ties = ctx.reduce(hit, ctx.groups, "sum")  # ranks sharing the maximum split its cotangent
        total = grad if ctx.invariant else Psum.apply(grad, ctx.groups, ctx.reduce)
        return total * hit / ties, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, groups, reduce, invariant):
        return Pmax.apply(x, groups, reduce, invariant), in_dims[0]
