"""``axis_index_groups``: a collective over groups of an axis's indices, as JAX's.

``psum(x, 'gpu', axis_index_groups=[[0, 1], [2, 3]])`` sums over indices 0 and 1 of
'gpu', and separately over 2 and 3. Each rank reduces in the process group of its own
indices (one per row of the other axes), made on first use with
``use_local_synchronization``: only its members meet to make it, so ranks of other
groups are not held up.
"""

from __future__ import annotations

import torch.distributed as dist

from pardist.runtime import _faults, _process

__all__ = ["subgroup"]

_made: dict[tuple, object] = {}  # (axis group name, groups) -> process group
_process.on_shutdown(_made.clear)  # names are reused by the next init


def check(groups, size: int, where: str, equal: bool) -> tuple[tuple[int, ...], ...]:
    """``groups`` as tuples, checked to cover ``range(size)`` once (equal sizes if asked)."""
    try:
        groups = tuple(tuple(int(i) for i in g) for g in groups)
    except TypeError:
        groups = None
    flat = sorted(i for g in groups or () for i in g)
    if not groups or flat != list(range(size)):
        raise ValueError(
            f"{where}: axis_index_groups={groups!r} must be lists of the axis's indices "
            f"that cover 0..{size - 1} exactly once (the axis has size {size}), e.g. "
            f"{[list(range(size))[: size // 2], list(range(size))[size // 2 :]]}."
        )
    if equal and len({len(g) for g in groups}) != 1:
        raise ValueError(
            f"{where}: axis_index_groups={[list(g) for g in groups]} must all have the same "
            "size here (each rank's block is one group's share)."
        )
    return groups


def subgroup(axis_group, index: int, groups, where: str, equal: bool = False):
    """``(process group, its size, this rank's index in it)`` of the group holding
    ``index`` of the axis whose process group is ``axis_group``."""
    size = dist.get_world_size(axis_group)
    groups = check(groups, size, where, equal)
    mine = next(g for g in groups if index in g)
    key = (axis_group.group_name, groups)
    if key not in _made:
        ranks = dist.get_process_group_ranks(axis_group)
        members = [ranks[i] for i in mine]
        group = dist.new_group(members, use_local_synchronization=True)
        _faults.label_group(group, f"axis_index_groups {list(mine)}")
        _made[key] = _process.GroupRef(group)
    return _made[key].get(), len(mine), mine.index(index)
