"""Collective primitives, each an autograd Function with its transpose and its type rule.

As in JAX's ``shard_map`` with ``check_vma=True`` ("efficient transposition of
replication-inducing collectives"): ``psum`` of a value varying over an axis gives
a value *invariant* over it, and its transpose is ``pvary``, the identity on an
(invariant) cotangent; ``pvary`` (identity forward) lifts an invariant value to a
varying one, and its transpose is ``psum``. Each Function's ``typing`` says how it
changes the axes a value varies over; ``pardist.collectives`` applies it
(``_vma``). Where nothing is typed every value counts as varying, each result is
lifted back at once, and ``Psum`` (``pvary`` of ``psum``) transposes to itself.

The table below ``_collective`` is the one place that says what each collective
transposes to. All have ``setup_context``, forward-mode (``jvp``) and vmap rules,
so they work under ``torch.func.grad``, ``jvp``, ``jacfwd``, ``hessian`` and
``vmap``; torch's own ``torch.distributed.nn.functional`` collectives lack
``setup_context``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pardist.runtime import _faults, collective_starts, tracing
from pardist.transport import _shmgroups
from pardist.transport._agree import agree

__all__ = [
    "AllGather",
    "AllGatherInvariant",
    "AllToAll",
    "Pbroadcast",
    "Pmax",
    "Ppermute",
    "Pscatter",
    "Psum",
    "PsumInvariant",
    "PsumScatter",
    "Pvary",
    "reduce",
]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_EAGERLY: dict = {}


def _eagerly(fn):
    """``fn`` out of dynamo's graph (``torch.compiler.disable``, made on first use: dynamo
    is loaded then). Where dynamo traces a collective (a user's ``torch.compile`` of a loss
    in an eager step), the shared-memory and gloo paths run as they do eagerly; torch 2.11
    traced on into the shared-memory wait."""
    if fn not in _EAGERLY:
        _EAGERLY[fn] = torch.compiler.disable(fn)
    return _EAGERLY[fn]


def _shared(x: torch.Tensor, group):
    return _shmgroups.for_collectives(group) if x.device.type == "cpu" else None


def reduce(x: torch.Tensor, groups: list, op: str) -> torch.Tensor:
    """A reduced copy of ``x``: via shared memory for CPU ranks on one host, else the backend."""
    if tracing():
        return _eagerly(_reduce)(x, groups, op)
    return _reduce(x, groups, op)


def _reduce(x: torch.Tensor, groups: list, op: str) -> torch.Tensor:
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
    if tracing():
        return _eagerly(_gather_parts)(x, group)
    return _gather_parts(x, group)


def _gather_parts(x: torch.Tensor, group) -> list[torch.Tensor]:
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


class _Family:
    """The collectives by name, in one variant: the eager Functions (with forward-mode
    rules) or the compiled graph's (without: dynamo traces no custom ``jvp``)."""


EAGER, TRACED = _Family(), _Family()


def family() -> _Family:
    """The variant for this call: TRACED while dynamo traces it (a user's ``torch.compile``
    of a loss in an eager step: torch 2.11's dynamo cannot take a Function with a custom
    ``jvp`` and traced into the collective), else EAGER."""
    return TRACED if tracing() else EAGER


FAMILIES = {"eager": EAGER, "traced": TRACED}  # (a backward reaches its family by a constant
# key of a global: dynamo traces that, not a closure's object)


def _collective(
    name: str, doc: str, forward, transpose, dims: tuple[int, ...] = (), typing: str = "varying"
) -> type:
    """An autograd Function for one collective, from its forward and transpose.

    ``forward(x, *static)`` runs the collective; ``transpose(F, grad, *static)`` is the
    backward, itself a collective of the table below, taken from the family ``F`` (the
    Function's own variant). Each is linear, so its forward-mode rule (``jvp``) is the
    collective itself applied to the tangent, and ``torch.func.jvp``, ``jacfwd`` and
    ``hessian`` work through it. ``dims`` names the static arguments that are dims of
    ``x``: a vmap moves the batch dim first and those up by one; a collective without
    dims is elementwise over the batch. ``typing`` is the type rule
    (``pardist.collectives._vma``): ``'invariant'`` (the result is the same on every rank
    of the axes), ``'varying'`` (it differs per rank), or ``'untyped'`` (every value
    counts as varying: the result lifted back at once). The compiled graph's variant,
    without the forward-mode rule, is ``TRACED.<name>`` (also ``fn.traced``).
    """

    def make(key: str, forward_mode: bool) -> type:
        def setup_context(ctx, inputs, output):
            ctx.static = inputs[1:]

        def backward(ctx, grad):
            return transpose(FAMILIES[key], grad, *ctx.static), *([None] * len(ctx.static))

        def jvp(ctx, tangent, *_):
            return fn.apply(tangent, *ctx.static)

        def vmap(info, in_dims, x, *static):
            if not dims or in_dims[0] is None:
                return fn.apply(x, *static), in_dims[0]
            moved = [s + 1 if i in dims else s for i, s in enumerate(static)]
            return fn.apply(x.movedim(in_dims[0], 0), *moved), 0

        body = {"forward": forward, "setup_context": setup_context, "backward": backward}
        body["vmap"] = vmap
        if forward_mode:
            body["jvp"] = jvp
        fn = type(name, (torch.autograd.Function,), {k: staticmethod(v) for k, v in body.items()})
        fn.__doc__, fn.__module__, fn.typing = doc, __name__, typing
        setattr(FAMILIES[key], name, fn)
        return fn

    eager, traced = make("eager", True), make("traced", False)
    eager.traced = traced.traced = traced
    return eager


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


# The collectives, each written once: forward, transpose, type rule; the forward-mode
# rule is the forward itself (all are linear). This table is the one place that says what
# each transposes to. The reductions take their transport ``reduce(x, groups, op)`` as an
# argument, so that pardist.collectives decides (and tests can count) how values travel.
#
#   collective           result      transpose               (JAX)
#   PsumInvariant        invariant   Pvary                   psum (check_vma=True)
#   Pvary                varying     PsumInvariant           pvary
#   Psum                 untyped     Psum                    psum (check_vma=False): pvary(psum)
#   AllGather            varying     PsumScatter             all_gather
#   AllGatherInvariant   invariant   Pscatter                all_gather_invariant
#   PsumScatter          varying     AllGather               psum_scatter
#   Pscatter             varying     AllGatherInvariant      dynamic_slice of axis_index
#   AllToAll             varying     AllToAll, dims swapped  all_to_all
#   Ppermute             varying     Ppermute, inverse perm  ppermute
#   Pbroadcast           varying     psum, to the source     pbroadcast
#   Pmax                 invariant   to the maximum's ranks  (none: JAX has no pmax gradient)
#
# Where nothing is typed (outside steps, compiled steps) every value counts as varying
# and each result is lifted back at once: Psum for PsumInvariant, AllGather for
# AllGatherInvariant (pvary's transpose, a psum, then Pscatter: a psum_scatter), Pmax
# with every rank's cotangent summed.
_summed = lambda x, groups, reduce: reduce(x, groups, "sum")  # noqa: E731
Psum = _collective(
    "Psum",
    "Sum over the groups; transpose: itself (every value counts as varying).",
    _summed,
    lambda F, g, groups, reduce: F.Psum.apply(g, groups, reduce),
    typing="untyped",
)
PsumInvariant = _collective(
    "PsumInvariant",
    "Sum of a varying value, invariant over the groups; transpose: ``pvary``.",
    _summed,
    lambda F, g, groups, reduce: F.Pvary.apply(g, groups, reduce),
    typing="invariant",
)
Pvary = _collective(
    "Pvary",
    "Identity, typed from invariant to varying; transpose: ``psum``.",
    lambda x, groups, reduce: x.view_as(x),
    lambda F, g, groups, reduce: F.PsumInvariant.apply(g, groups, reduce),
)
AllGather = _collective(
    "AllGather",
    "Concatenate along ``dim`` in axis order; transpose: ``psum_scatter``.",
    _gathered,
    lambda F, g, group, dim: F.PsumScatter.apply(g, group, dim),
    dims=(1,),
)
PsumScatter = _collective(
    "PsumScatter",
    "Sum over the group, then keep this rank's block of ``dim``; transpose: ``all_gather``.",
    _psum_scatter,
    lambda F, g, group, dim: F.AllGather.apply(g, group, dim),
    dims=(1,),
)
AllGatherInvariant = _collective(
    "AllGatherInvariant",
    "``all_gather`` whose result is invariant over the group; transpose: ``pscatter``.",
    _gathered,
    lambda F, g, group, dim: F.Pscatter.apply(g, group, dim),
    dims=(1,),
    typing="invariant",
)
Pscatter = _collective(
    "Pscatter",
    "This rank's block of ``dim`` of an invariant value; transpose: ``all_gather_invariant``.",
    _pscatter,
    lambda F, g, group, dim: F.AllGatherInvariant.apply(g, group, dim),
    dims=(1,),
)
AllToAll = _collective(
    "AllToAll",
    "Block j of ``split_dim`` goes to rank j; received blocks are concatenated along "
    "``concat_dim`` in rank order. Transpose: itself with the two dims swapped.",
    _all_to_all,
    lambda F, g, group, split_dim, concat_dim: F.AllToAll.apply(g, group, concat_dim, split_dim),
    dims=(1, 2),
)
Ppermute = _collective(
    "Ppermute",
    "Rank ``src`` sends to rank ``dst`` for each pair of ``perm``; a rank no pair sends to "
    "gets zeros. Transpose: the inverse permutation.",
    lambda x, group, perm: _permute(x, group, perm),
    lambda F, g, group, perm: F.Ppermute.apply(g, group, tuple((d, s) for s, d in perm)),
)
Pbroadcast = _collective(
    "Pbroadcast",
    "Every rank gets index ``source``'s value; transpose: the sum of the cotangents, to "
    "the source (zeros elsewhere).",
    lambda x, group, source: _broadcast(x, group, source),
    lambda F, g, group, source: _to_source(F, g, group, source),
)


def _permute(x: torch.Tensor, group, perm: tuple) -> torch.Tensor:
    """What ``perm`` sends this rank (zeros if nothing): one all-to-all with empty splits
    (shared memory: an all-gather, each rank keeping its source's block)."""
    collective_starts("pardist.ppermute")
    size, me = dist.get_world_size(group), dist.get_rank(group)
    dst = dict(perm)
    src = {d: s for s, d in perm}
    shm = _shared(x, group)
    everyone = shm.all_gather(x.contiguous(), "pardist.ppermute") if shm is not None else None
    if everyone is not None:
        return everyone[src[me]].clone() if me in src else torch.zeros_like(x)
    flat = x.contiguous().reshape(-1)
    out = torch.zeros_like(flat)
    sends = [flat.numel() if dst.get(me) == k else 0 for k in range(size)]
    takes = [flat.numel() if src.get(me) == k else 0 for k in range(size)]
    agree("pardist.ppermute", group, x)
    with _faults.collective_errors("pardist.ppermute", group):
        dist.all_to_all_single(
            out if me in src else flat.new_empty(0),
            flat if me in dst else flat.new_empty(0),
            output_split_sizes=takes,
            input_split_sizes=sends,
            group=group,
        )
    return out.view(x.shape)


def _broadcast(x: torch.Tensor, group, source: int) -> torch.Tensor:
    """Index ``source``'s ``x`` on every rank of ``group``."""
    collective_starts("pardist.broadcast")
    y = x.detach().clone(memory_format=torch.contiguous_format)
    agree("pardist.broadcast", group, y)
    with _faults.collective_errors("pardist.broadcast", group):
        dist.broadcast(y, src=dist.get_global_rank(group, source), group=group)
    return y


def _to_source(F: _Family, g: torch.Tensor, group, source: int) -> torch.Tensor:
    """The sum of the cotangents on the source, zeros elsewhere (JAX's transpose of
    pbroadcast). The sum is made varying again at once (``Psum``: it is selected per
    rank), and the zeros are a factor, not a new tensor, so that every rank's graph holds
    the same collectives (a rank whose backward never reached them would leave the others
    waiting at a second derivative)."""
    total = F.Psum.apply(g, [group], reduce)
    return total * (1.0 if dist.get_rank(group) == source else 0.0)


def _pmax(key: str, forward_mode: bool) -> type:
    """Elementwise maximum; the cotangent goes to the ranks holding it, split on ties.

    ``invariant``: the cotangent is the same on every rank (typed); otherwise every
    rank's cotangent counts, so they are summed first. The tangent (forward mode) is
    the mean of the holders' tangents.
    """

    def forward(x, groups, reduce, invariant):
        return reduce(x, groups, "max")

    def setup_context(ctx, inputs, output):
        _, ctx.groups, ctx.reduce, ctx.invariant = inputs
        ctx.save_for_backward(inputs[0], output)
        if forward_mode:
            ctx.save_for_forward(inputs[0], output)

    def hits(ctx, like):
        x, y = ctx.saved_tensors
        hit = (x == y).to(like.dtype)
        return hit, ctx.reduce(hit, ctx.groups, "sum")  # ranks sharing the maximum split it

    def backward(ctx, grad):
        hit, ties = hits(ctx, grad)
        total = grad if ctx.invariant else FAMILIES[key].Psum.apply(grad, ctx.groups, ctx.reduce)
        return total * hit / ties, None, None, None

    def jvp(ctx, tangent, *_):
        hit, ties = hits(ctx, tangent)
        return FAMILIES[key].PsumInvariant.apply(tangent * hit, ctx.groups, ctx.reduce) / ties

    def vmap(info, in_dims, x, groups, reduce, invariant):
        return fn.apply(x, groups, reduce, invariant), in_dims[0]

    body = {"forward": forward, "setup_context": setup_context, "backward": backward}
    body["vmap"] = vmap
    if forward_mode:
        body["jvp"] = jvp
    fn = type("Pmax", (torch.autograd.Function,), {k: staticmethod(v) for k, v in body.items()})
    fn.__doc__, fn.__module__, fn.typing = _pmax.__doc__, __name__, "invariant"
    FAMILIES[key].Pmax = fn
    return fn


Pmax = _pmax("eager", True)
Pmax.traced = _pmax("traced", False)
