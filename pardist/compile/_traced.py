"""Collectives inside a compiled step: traceable, differentiable, bucketed.

In a step made by ``data_parallel(step, compile=True)`` every collective becomes
a node of the step's graph. Between CPU ranks of one host that node is
pardist's shared-memory transport, called as an opaque operator (``_ops``);
elsewhere it is one of torch's functional collectives (gloo or nccl), which
inductor can also schedule around. psum and pmax are the eager collectives' own
autograd Functions (``transport.Psum``, ``transport.Pmax``: one forward and one
transpose each), given this module's transport; all_gather is ``transport.AllGather``
(or ``AllGatherInvariant``) given a ``_Link``, which does its gathers and their
transposes as graph nodes. torch's own autograd formulas for functional collectives
(``torch.library.register_autograd``) raise under ``torch.func.grad`` on torch 2.13.

Gradients are averaged in flat buckets the graph can see (reverse parameter order,
~25 MB, the first ~1 MB, one dtype each): one concatenation per bucket, one
all-reduce (or reduce-scatter, for a sharded optimizer) and views back, with the
same layout and arithmetic as the eager reducer. Between CPU ranks of one host each
bucket is a start and a wait instead (``_beside``): the start divides each gradient
straight into shared memory, as the eager reducer's hooks do, and a helper thread sums
while the backward goes on; the update reads each sum where it was summed.

Axes are looked up in the step's :class:`~pardist.compile._plan.Plan`, which holds
group names and sizes as plain constants (nothing a compiler must guard on
changes between calls).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, NamedTuple

import torch

from pardist.compile import _beside, _ops, _step  # noqa: F401  (_ops, _beside: torch.ops.pardist)
from pardist.runtime import _tree, funcol
from pardist.transport import TRACED, assign

__all__ = [
    "all_gather",
    "axis_index",
    "fsdp_gather",
    "axis_size",
    "mean",
    "mean_scatter",
    "pmax",
    "pmean",
    "psum",
]


def axis_info(plan: Any, axis: Any, where: str) -> Any:
    key = axis if isinstance(axis, str) else tuple(axis)
    if isinstance(key, tuple) and len(key) == 1:
        key = key[0]
    info = plan.axes.get(key)
    if info is None:
        raise ValueError(
            f"pardist.{where}: axis {axis!r} is not an axis of this compiled step's mesh "
            f"(known: {sorted(map(str, plan.axes))}). Name one of the mesh's axes, or the "
            "step's own axis tuple."
        )
    return info


def _all_reduce(x: torch.Tensor, links: tuple, op: str) -> torch.Tensor:
    """The graph's transport for ``Psum`` and ``Pmax``: ``links`` is ((group name,
    through shared memory), ...), innermost axis first, as the eager reducer."""
    for name, via_shm in links:
        if via_shm:
            x = torch.ops.pardist.shm_all_reduce(x, name, op)
        else:
            x = funcol.wait_tensor(torch.ops._c10d_functional.all_reduce(x.contiguous(), op, name))
    return x


def _psum(x: torch.Tensor, info: Any) -> torch.Tensor:
    """The eager ``Psum`` (its transpose: itself), over the graph's transport."""
    return TRACED.Psum.apply(x, tuple(zip(info.groups, info.shm)), _all_reduce)


def _gather(x: torch.Tensor, group: str, shm: bool, size: int, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in group order."""
    first = x.movedim(dim, 0).contiguous()
    if shm:
        y = torch.ops.pardist.shm_all_gather(first, group, size)
    else:
        y = funcol.wait_tensor(
            torch.ops._c10d_functional.all_gather_into_tensor(first, size, group)
        )
    y = y.view(size, *first.shape).movedim((0, 1), (dim, dim + 1))
    return y.reshape(*x.shape[:dim], size * x.shape[dim], *x.shape[dim + 1 :])


@dataclasses.dataclass(frozen=True)
class _Link:
    """One group spanning an axis, as the graph reaches it: the ``group`` that the eager
    gather family (``transport.AllGather`` and its transposes) is given in a graph."""

    name: str
    shm: bool
    size: int
    index: int

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _gather(x, self.name, self.shm, self.size, dim)

    def psum_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return self.scatter(_all_reduce(x, ((self.name, self.shm),), "sum"), dim)

    def scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        block = x.shape[dim] // self.size
        return x.narrow(dim, self.index * block, block)


def _coalesced(tree: Any, where: str, fn, number=None) -> Any:
    """``fn`` once per dtype over the concatenated leaves (as the eager collectives);
    ``number(x)`` for a Python number."""
    leaves, spec = _tree.tree_flatten(tree)
    out: list = [None] * len(leaves)
    kinds: dict[tuple, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if type(leaf) in (int, float, bool) and number is not None:
            out[i] = number(leaf)
            continue
        if not isinstance(leaf, torch.Tensor):
            _tree.check_tensor_leaves(tree, where=where, name="tree")  # names the leaf
        kinds.setdefault((leaf.dtype, leaf.device), []).append(i)
    for index in kinds.values():
        if len(index) == 1:
            out[index[0]] = fn(leaves[index[0]])
            continue
        flat = fn(torch.cat([leaves[i].reshape(-1) for i in index]))
        for i, piece in zip(index, flat.split([leaves[i].numel() for i in index])):
            out[i] = piece.view(leaves[i].shape)
    return _tree.tree_unflatten(out, spec)


# Every value of a compiled step counts as varying over its data axes (see _vma): each
# result is lifted back at once, which gives psum (and pmean) Psum, whose transpose is
# itself, pmax the sum of every rank's cotangent, and all_gather (invariant or not)
# all_gather's transpose. For the gradient of the loss averaged over the data axes
# (pardist.grad) that is the typed step's numbers.
def _integral(x):
    return int(x) if type(x) is bool else x


def psum(tree: Any, axis: Any, plan: Any) -> Any:
    info = axis_info(plan, axis, "psum")
    if not info.groups:
        return _coalesced(tree, "pardist.psum", lambda x: x, _integral)
    size = info.size
    number = lambda x: _integral(x) * size  # noqa: E731
    return _coalesced(tree, "pardist.psum", lambda x: _psum(x, info), number)


def pmean(tree: Any, axis: Any, plan: Any) -> Any:
    info = axis_info(plan, axis, "pmean")
    if not info.groups:
        return _coalesced(tree, "pardist.pmean", lambda x: x, float)
    return _coalesced(tree, "pardist.pmean", lambda x: _psum(x, info) / info.size, float)


def pmax(tree: Any, axis: Any, plan: Any) -> Any:
    info = axis_info(plan, axis, "pmax")
    if not info.groups:
        return _coalesced(tree, "pardist.pmax", lambda x: x, lambda x: x)
    links = tuple(zip(info.groups, info.shm))
    fn = lambda x: TRACED.Pmax.apply(x, links, _all_reduce, False)  # noqa: E731
    return _coalesced(tree, "pardist.pmax", fn, lambda x: x)


def all_gather(tree: Any, axis: Any, dim: int, plan: Any) -> Any:
    info = axis_info(plan, axis, "all_gather")
    leaves = _tree.check_tensor_leaves(tree, where="pardist.all_gather", name="tree")
    if info.size == 1:
        return _tree.tree_map(lambda x: x, tree)
    link = _Link(info.group, info.gather_shm, info.size, info.index)
    kind = TRACED.AllGather
    out = []
    for x in leaves:
        if x.ndim == 0:
            raise ValueError(
                "pardist.all_gather: a leaf is a scalar (shape ()); there is no dim "
                f"{dim} to concatenate along. Use x[None] to gather scalars into a vector."
            )
        out.append(kind.apply(x, link, dim % x.ndim))
    return _tree.tree_unflatten(out, _tree.tree_flatten(tree)[1])


def axis_index(axis: Any, plan: Any) -> int:
    return axis_info(plan, axis, "axis_index").index


def axis_size(axis: Any, plan: Any) -> int:
    return axis_info(plan, axis, "axis_size").size


class _Like(NamedTuple):  # what ``assign`` reads of a tensor
    dtype: torch.dtype
    device: torch.device
    numel: int


def _buckets(like: list[torch.Tensor], plan: Any) -> tuple[tuple[int, ...], ...]:
    """Indices of ``like`` per bucket: the eager reducer's ``assign``, one row of numel each."""
    kinds = tuple((t.dtype, t.device, t.numel()) for t in like)
    return _slots(kinds, plan.bucket_bytes, plan.first_bucket_bytes)


@_step.constant_result  # worked out once, as the graph is traced
def _slots(kinds: tuple, bucket_bytes: int, first_bucket_bytes: int) -> tuple:
    like = [_Like(*kind) for kind in kinds]
    buckets, _ = assign(like, _numel, 1, None, bucket_bytes, first_bucket_bytes)
    return tuple(tuple(b.slots) for b in buckets)


_numel = operator.attrgetter("numel")


def _comm_dtype(plan: Any, dtype: torch.dtype) -> torch.dtype | None:
    c = plan.compression
    return c if c is not None and dtype.is_floating_point and c != dtype else None


def _bucket_sum(bucket: list[torch.Tensor], by: list[float], plan: Any) -> list[torch.Tensor]:
    """Each tensor of one bucket divided by its divisor and summed over the step's axis."""
    info = plan.axes[plan.axis_key]
    comm = _comm_dtype(plan, bucket[0].dtype)
    flat = torch.cat([(t if d == 1 else t / d).reshape(-1) for t, d in zip(bucket, by)])
    reduced = _psum(flat if comm is None else flat.to(comm), info).to(flat.dtype)
    return [p.view(t.shape) for p, t in zip(reduced.split([t.numel() for t in bucket]), bucket)]


def mean(tensors: list[torch.Tensor], plan: Any, divisors: list[float] | None = None) -> list:
    """Each tensor divided by its divisor (default 1), summed over the step's axis, in
    flat buckets.

    Every contribution is divided before the sum, as the eager reducer writes it
    into its bucket, so the result is the mean with the same rounding. Between CPU
    ranks of one host (one shared-memory group, no compression, nothing to
    differentiate) each bucket's gradients are divided straight into shared memory and
    summed there beside the backward (``_beside``).
    """
    divisors = [1.0] * len(tensors) if divisors is None else divisors
    info = plan.axes[plan.axis_key]
    shared = info.shm == (True,) and plan.compression is None
    if shared and not any(t.requires_grad for t in tensors):
        return _beside.sum_buckets(tensors, _buckets(tensors, plan), divisors, info.groups[0])
    out: list = [None] * len(tensors)
    for index in _buckets(tensors, plan):
        by = [float(divisors[i]) for i in index]
        for i, s in zip(index, _bucket_sum([tensors[i] for i in index], by, plan)):
            out[i] = s
    return out


def mean_scatter(tensors: list[torch.Tensor], plan: Any) -> list[torch.Tensor]:
    """This rank's flat shard of each tensor's sum over the axis (ZeRO-2's reduce-scatter).

    Each tensor of n elements is cut into ``size`` chunks of ``ceil(n / size)``
    (the last zero-padded), and a bucket is a (size, row) matrix whose row k
    holds rank k's chunk of every tensor, as in the eager ``ScatterReducer``.
    """
    info = plan.axes[plan.axis_key]
    size, index = info.size, info.index
    out: list = [None] * len(tensors)
    for bucket in _buckets(tensors, plan):
        blocks, chunks = [], []
        for i in bucket:
            flat = tensors[i].reshape(-1)
            chunk = -(-flat.numel() // size)
            flat = torch.nn.functional.pad(flat, (0, chunk * size - flat.numel()))
            blocks.append(flat.view(size, chunk))
            chunks.append(chunk)
        matrix = torch.cat(blocks, dim=1).reshape(-1)
        if info.gather_shm:
            row = torch.ops.pardist.shm_reduce_scatter(matrix, info.group, size, index)
        else:
            row = funcol.wait_tensor(
                torch.ops._c10d_functional.reduce_scatter_tensor(matrix, "sum", size, info.group)
            )
        for i, piece in zip(bucket, row.split(chunks)):
            n = tensors[i].numel()
            chunk = -(-n // size)
            start = min(index * chunk, n)
            out[i] = piece[: min(start + chunk, n) - start]
    return out


@dataclasses.dataclass(frozen=True)
class _ShardLink(_Link):
    """The FSDP axis as a gather's graph reaches it. The transpose of the gather is a
    reduce-scatter of the gradients divided by the data-parallel ranks first (as the eager
    FSDP packs them), then summed over the replica axes (HSDP): each rank's shard of the
    mean gradient."""

    divisor: float
    replicas: tuple  # ((group name, through shared memory), ...)

    def psum_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        flat = (x / self.divisor).contiguous()  # (dim is 0: a flat (size x row) block)
        if self.shm:
            row = torch.ops.pardist.shm_reduce_scatter(flat, self.name, self.size, self.index)
        else:
            row = funcol.wait_tensor(
                torch.ops._c10d_functional.reduce_scatter_tensor(flat, "sum", self.size, self.name)
            )
        return _all_reduce(row, self.replicas, "sum") if self.replicas else row


def fsdp_gather(shards: list[torch.Tensor], numels: list[int], plan: Any) -> list[torch.Tensor]:
    """The flat full parameters of one FSDP unit from this rank's chunks of them
    (``pardist.fsdp``'s, torch.chunk's rule, zero-padded to at least ``ceil(n / size)``
    elements on every rank): the first ``ceil(n / size)`` of each, side by side in one
    row, all-gathered as one node into the ``(size, row)`` block. Its transpose
    (``_ShardLink``) reduce-scatters the block's gradient into each rank's shard of the
    mean gradient."""
    info = plan.axes[plan.fsdp]
    size = info.size
    if size == 1 and not plan.replicas:
        return [s[:n] for s, n in zip(shards, numels)]
    chunks = [-(-n // size) for n in numels]
    row = torch.cat([s[:c] for s, c in zip(shards, chunks)])  # (padded past c on every rank)
    replicas = tuple((g, shm) for r in plan.replicas for g, shm in zip(*_groups(plan, r)))
    link = _ShardLink(
        info.group or "", info.gather_shm, size, info.index, float(plan.size), replicas
    )
    if size == 1:  # (HSDP over an FSDP axis of size 1: the replicas' mean only)
        return list(
            TRACED.Pvary.apply(row, (float(plan.size), replicas), _divided_sum).split(chunks)
        )
    block = TRACED.AllGather.apply(row, link, 0).view(size, -1)
    return [part.reshape(-1)[:n] for part, n in zip(block.split(chunks, dim=1), numels)]


def _divided_sum(x: torch.Tensor, groups: tuple, op: str) -> torch.Tensor:
    divisor, links = groups
    return _all_reduce(x / divisor, links, op)


def _groups(plan: Any, axis: str) -> tuple:
    info = plan.axes[axis]
    return info.groups, info.shm


def gather_rows(rows: list[torch.Tensor], numels: list[int], plan: Any) -> list[torch.Tensor]:
    """Inverse of :func:`mean_scatter`'s layout: every rank's shard, concatenated (flat)."""
    info = plan.axes[plan.axis_key]
    size = info.size
    out: list = [None] * len(rows)
    for bucket in _buckets(rows, plan):
        chunks = [-(-numels[i] // size) for i in bucket]
        row = torch.cat(
            [
                torch.nn.functional.pad(rows[i], (0, c - rows[i].numel()))
                for i, c in zip(bucket, chunks)
            ]
        )
        block = _gather(row, info.group, info.gather_shm, size, 0).view(size, -1)
        for i, part in zip(bucket, block.split(chunks, dim=1)):
            out[i] = part.reshape(-1)[: numels[i]]
    return out
