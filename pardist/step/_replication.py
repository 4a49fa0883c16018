"""Checking that values meant to be replicated really are the same on every rank.

Diverging replicas are the silent failure of data parallelism: a step that used
``torch.func.grad`` and forgot the gradient mean, parameters initialised with
different seeds, a per-rank loss returned as if it were global. The check costs
one small gather of a fingerprint per tensor, so it runs on a step's first call
and on every call under ``PARDIST_DEBUG=1``. Before it, the ranks compare the
layout they pass (specs, and the block shapes of tensors split over non-data
axes), so that ranks calling with different specs fail at once, not in a
collective that never completes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pardist.transport import agree

__all__ = ["fingerprint", "layout_mismatch", "mismatch", "replicated_groups", "seeds_differ"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of ``t``'s bit patterns: equal tensors give equal fingerprints."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
    return torch.stack([bits.sum(), (bits * bits).sum()])


def _describe(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", str(leaf.dtype), tuple(leaf.shape))
    if isinstance(leaf, (int, float, bool, str, type(None))):
        return ("value", leaf)
    return ("object", type(leaf).__name__)


def _show(description: Any) -> str:
    kind, *rest = description
    if kind == "tensor":
        return f"shape {rest[1]} ({rest[0].replace('torch.', '')})"
    return repr(rest[0])


def _listed(paths: list[str]) -> str:
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return f"{shown} {'is' if len(paths) == 1 else 'are'}"


def _structure(first: list, theirs: list, r0: int, r: int) -> str | None:
    """How two ranks' leaf paths differ (keys one rank has and the other lacks), or None."""
    a, b = [path for path, _ in first], [path for path, _ in theirs]
    if a == b:
        return None
    only_a = [p for p in a if p not in set(b)]
    only_b = [p for p in b if p not in set(a)]
    parts = [f"{_listed(only)} only on rank {k}" for only, k in ((only_b, r), (only_a, r0)) if only]
    detail = "; ".join(parts) or "the same leaves come in a different order"
    if len(a) != len(b):
        return f"the tree has {len(a)} leaves on rank {r0} but {len(b)} on rank {r}: {detail}"
    return f"the trees differ between rank {r0} and rank {r}: {detail}"


def mismatch(named: list[tuple[str, Any]], group: dist.ProcessGroup) -> str | None:
    """Compare ``[(path, leaf)]`` across ``group``; describe the first difference, or None.

    Every rank of ``group`` must call this with its own values.
    """
    if dist.get_world_size(group) == 1:
        return None
    ranks = dist.get_process_group_ranks(group)
    mine = [(path, _describe(leaf)) for path, leaf in named]
    gathered: list[Any] = [None] * len(ranks)
    agree("pardist's check that replicas are equal", group)
    dist.all_gather_object(gathered, mine, group=group)
    for r, theirs in zip(ranks[1:], gathered[1:]):
        structure = _structure(gathered[0], theirs, ranks[0], r)
        if structure:
            return structure
        for (path, a), (_, b) in zip(gathered[0], theirs):
            if a != b:
                return f"{path} is {_show(a)} on rank {ranks[0]} but {_show(b)} on rank {r}"
    tensors = [leaf for _, leaf in named if isinstance(leaf, torch.Tensor)]
    if not tensors:
        return None
    device = tensors[0].device  # the default backend pairs each device with its own
    prints = torch.stack([fingerprint(t).to(device) for t in tensors])
    everyone = [torch.empty_like(prints) for _ in ranks]
    dist.all_gather(everyone, prints, group=group)
    paths = [path for path, leaf in named if isinstance(leaf, torch.Tensor)]
    for r, theirs in zip(ranks[1:], everyone[1:]):
        differs = (theirs != everyone[0]).any(dim=1).nonzero()
        if len(differs):
            return f"{paths[int(differs[0])]} differs between rank {ranks[0]} and rank {r}"
    return None


def layout_mismatch(
    named: list, specs: list, mesh, axes, lists: frozenset = frozenset()
) -> str | None:
    """Compare specs and non-data block shapes across every rank of the mesh.

    ``lists``: the positions of arguments that are lists; where one holds data shards
    (a list of micro-batches), its length may differ per rank (a loader that ran out)
    and only what each entry holds is compared.
    """
    if mesh.size(mesh.axis_names) == 1:
        return None
    data = set(axes)
    if lists:
        named, specs = _entries_alike(named, specs, lists, data)

    def block(leaf: Any, spec) -> tuple | None:
        if not isinstance(leaf, torch.Tensor) or not set(spec.axes) - data:
            return None  # replicated shapes are compared with their values; batches may differ
        shape = list(leaf.shape)
        for d, entry in enumerate(spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            if entry is not None and data & set(names):
                shape[d] = None
        return tuple(shape)

    mine = [(path, repr(s), block(leaf, s)) for (path, leaf), s in zip(named, specs)]
    group = mesh.group(mesh.axis_names)
    ranks = dist.get_process_group_ranks(group)
    everyone: list[Any] = [None] * len(ranks)
    agree("pardist's check of the inputs' specs", group)
    dist.all_gather_object(everyone, mine, group=group)
    first = everyone[0]
    for r, theirs in zip(ranks[1:], everyone[1:]):
        structure = _structure([e[:2] for e in first], [e[:2] for e in theirs], ranks[0], r)
        if structure:
            return structure
        for (path, spec0, block0), (_, spec1, block1) in zip(first, theirs):
            if (spec0, block0) != (spec1, block1):
                shape = lambda b: "" if b is None else f" with block shape {b}"  # noqa: E731
                return (
                    f"{path} has in_spec {spec0}{shape(block0)} on rank {ranks[0]} but "
                    f"{spec1}{shape(block1)} on rank {r}"
                )
    return None


def _entries_alike(named: list, specs: list, lists: frozenset, data: set) -> tuple[list, list]:
    """The data leaves of list arguments as ``args[i][*]...``, once per path."""
    out, seen = [], set()
    for (path, leaf), spec in zip(named, specs):
        head, _, rest = path.partition("][")
        if head.startswith("args[") and rest and set(spec.axes) & data:
            if int(head[5:]) in lists:
                path = f"{head}][*]" + rest.partition("]")[2]
                if path in seen:
                    continue
                seen.add(path)
        out.append(((path, leaf), spec))
    return [e[0] for e in out], [e[1] for e in out]


def replicated_groups(named: list, specs: list, mesh, manual=None) -> list:
    """``[(axes, [(path, leaf)])]``: the leaves replicated over exactly those axes (of the
    ``manual`` ones, default all: ``shard_map(axis_names=)`` leaves the others alone).

    DTensors (sharded state) carry their own layout and are left out.
    """
    live = [a for a, n in mesh.shape.items() if n > 1 and (manual is None or a in manual)]
    groups: dict[tuple[str, ...], list] = {}
    for (path, leaf), spec in zip(named, specs):
        over = tuple(a for a in live if a not in spec.axes)
        if over and not isinstance(leaf, DTensor):
            groups.setdefault(over, []).append((path, leaf))
    return sorted(groups.items())


def seeds_differ(group: dist.ProcessGroup) -> bool:
    """Whether torch's seed differs between the ranks of ``group`` (a script that seeds
    each rank with its own number builds a different model on each); every rank calls it."""
    seeds: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seeds, torch.initial_seed(), group=group)
    return len(set(seeds)) > 1
