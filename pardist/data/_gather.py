"""Gathering evaluation outputs whose per-rank lengths differ: ``pardist.gather``.

An evaluation epoch over ``pardist.data.shard`` gives rank ``r`` the ``r``-th
contiguous piece of the dataset, the last piece wrapped around to the start so
that every rank has the same number of samples. Concatenating the ranks' outputs
in rank order is therefore the dataset in order followed by fewer than
``world_size`` duplicated rows, and ``total=len(dataset)`` cuts those off: a
metric over the result equals the single-process metric exactly (Accelerate's
``gather_for_metrics``). The collectives here are not differentiable; inside a
training step use :func:`pardist.all_gather`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pardist.runtime import _mesh, _tree
from pardist.transport import agree

__all__ = ["all_gather_ints", "gather", "gather_batch", "gather_object"]


def _comm_device(group: Any) -> torch.device:
    """Where small bookkeeping tensors go: the CPU, unless the group has no CPU backend."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    from pardist.runtime import _process

    return _process.device()


def all_gather_ints(values: list[int], group: Any = None) -> list[list[int]]:
    """Every rank's ``values`` (same length on every rank), in group rank order.

    One tiny tensor collective: the bookkeeping behind the uneven-input checks.
    """
    group = group if group is not None else dist.group.WORLD
    mine = torch.tensor(values, dtype=torch.int64, device=_comm_device(group))
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    agree("pardist's count of each rank's batches", group, mine)
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def gather_object(obj: Any, axis: str | tuple[str, ...] = "gpu") -> list[Any]:
    """Every rank's ``obj`` (any picklable Python value), as a list in rank order of ``axis``.

    For things that are not tensors: file names, per-rank counts, predicted strings.
    Every rank of ``axis`` must call it.

    Args:
        obj: this rank's value.
        axis: the mesh axis (or tuple of axes) to gather over.

    Returns:
        A list with one entry per rank of ``axis``, the same on every rank.

    Example:
        >>> import pardist
        >>> _ = pardist.init()
        >>> pardist.gather_object({'rank': pardist.rank(), 'file': 'preds-0.csv'})
        [{'rank': 0, 'file': 'preds-0.csv'}]
        >>> pardist.shutdown()
    """
    mesh = _mesh.current_mesh("gather_object")
    mesh.axes(axis, "gather_object")
    if mesh.size(axis) == 1:
        return [obj]
    group = mesh.group(axis)
    out: list[Any] = [None] * dist.get_world_size(group)
    agree("pardist.gather_object", group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _show_shapes(metas: list[list[tuple]], i: int) -> str:
    return ", ".join(f"rank {r}: {m[i][0]} {m[i][1]}" for r, m in enumerate(metas))


def gather(tree: Any, axis: str | tuple[str, ...] = "gpu", *, total: int | None = None) -> Any:
    """Concatenate every leaf of ``tree`` along dim 0 over the ranks of ``axis``, in rank order.

    Ranks may hold different numbers of rows (each leaf is padded to the longest,
    all-gathered, and trimmed). With ``total=n`` the result keeps the first ``n``
    rows: for outputs of one epoch of a :func:`pardist.data.shard` loader
    (default mode, ``drop_last=False``) that drops the wrap-around padding, so the
    rows come back in dataset order, exactly ``n`` of them, and a metric over
    them equals the single-process metric. Every rank receives the result.

    Do not use ``total`` with ``torch.utils.data.DistributedSampler`` (it deals
    samples out round-robin, so rank order is not dataset order) or with
    ``shard(..., split_batches=True)``; there, gather without ``total``.

    Args:
        tree: a pytree of tensors with at least one dim; their trailing shapes
            and dtypes must agree across ranks.
        axis: the mesh axis (or tuple of axes) to gather over.
        total: the dataset size: keep only the first ``total`` rows of every leaf.

    Returns:
        ``tree``'s structure, each leaf the concatenation over the ranks (detached).

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> preds, labels = torch.tensor([3, 1, 4]), torch.tensor([3, 1, 5])
        >>> preds, labels = pardist.gather((preds, labels), total=3)
        >>> (preds == labels).float().mean()
        tensor(0.6667)
        >>> pardist.shutdown()
    """
    where = "pardist.gather"
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
        raise TypeError(f"{where}: total={total!r}; give the dataset size, an int >= 0.")
    mesh = _mesh.current_mesh("gather")
    mesh.axes(axis, "gather")
    size = mesh.size(axis)
    named = _tree.leaves_with_paths(tree, "tree")
    _tree.check_tensor_leaves(tree, where=where, name="tree")
    for path, x in named:
        if x.ndim == 0:
            raise ValueError(
                f"{where}: {path} is a scalar (shape ()); gather concatenates along dim 0. "
                "Use x[None] to gather one value per rank, or pardist.gather_object."
            )
    if size == 1:
        out = [x.detach() for _, x in named]
        lengths = [[x.shape[0] for x in out]]
    else:
        group = mesh.group(axis)
        mine = [(str(x.dtype).removeprefix("torch."), tuple(x.shape), p) for p, x in named]
        metas: list[Any] = [None] * size
        agree(where, group)
        dist.all_gather_object(metas, mine, group=group)
        _same_structure(metas)
        lengths = [[shape[0] for _, shape, _ in m] for m in metas]
        out = [_gather_leaf(x, i, path, metas, group) for i, (path, x) in enumerate(named)]
    if total is not None:
        out = [
            _keep(x, total, path, [ls[i] for ls in lengths], size, axis)
            for i, ((path, _), x) in enumerate(zip(named, out))
        ]
    return _tree.tree_unflatten(out, _tree.tree_flatten(tree)[1])


def _same_structure(metas: list) -> None:
    """Every rank passed a tree with the same leaves (a dict's keys may differ per rank)."""
    first = [m[2] for m in metas[0]]
    for r, m in enumerate(metas[1:], 1):
        theirs = [e[2] for e in m]
        if theirs != first:
            only0 = [p for p in first if p not in theirs]
            only_r = [p for p in theirs if p not in first]
            raise ValueError(
                f"pardist.gather: the ranks pass trees with different leaves: rank 0 has "
                f"{len(first)} ({', '.join(only0[:3]) or 'the same'} not on rank {r}), rank "
                f"{r} has {len(theirs)} ({', '.join(only_r[:3]) or 'the same'} not on rank "
                "0). Every rank must pass the same structure (the same keys in the same "
                "order)."
            )


def _gather_leaf(x: torch.Tensor, i: int, path: str, metas: list, group: Any) -> torch.Tensor:
    for r, m in enumerate(metas):
        if len(m) != len(metas[0]):
            raise ValueError(
                f"pardist.gather: the tree has {len(metas[0])} leaves on rank 0 but {len(m)} "
                f"on rank {r}. Every rank must pass the same structure."
            )
        if m[i][0] != metas[0][i][0] or m[i][1][1:] != metas[0][i][1][1:]:
            raise ValueError(
                f"pardist.gather: {path} has different dtypes or trailing shapes across ranks "
                f"({_show_shapes(metas, i)}); only dim 0 may differ. Give every rank's "
                "outputs the same shape apart from the number of rows."
            )
    longest = max(m[i][1][0] for m in metas)
    if longest == 0:
        return x.detach()[:0].clone()
    padded = x.detach().new_zeros((longest, *x.shape[1:]))
    padded[: x.shape[0]] = x.detach()
    parts = [torch.empty_like(padded) for _ in metas]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[: m[i][1][0]] for p, m in zip(parts, metas)])


def _keep(x: torch.Tensor, total: int, path: str, per_rank: list[int], size: int, axis) -> Any:
    rows = x.shape[0]
    if rows < total:
        raise ValueError(
            f"pardist.gather: total={total}, but the ranks of axis {axis!r} hold only {rows} "
            f"rows of {path} between them (per rank: {per_rank}). total is the size of the "
            "dataset whose epoch of outputs is gathered: shard it with drop_last=False and "
            "keep every batch's outputs."
        )
    if rows - total >= size:
        raise ValueError(
            f"pardist.gather: total={total}, but the ranks of axis {axis!r} hold {rows} rows "
            f"of {path} (per rank: {per_rank}), {rows - total} more; an epoch of "
            f"pardist.data.shard pads fewer than {size} rows (the wrap-around). Gather one "
            "epoch of a shard(...) loader's outputs, or slice the rows yourself."
        )
    return x[:total]


def _rows(loader: Any, batch: int) -> list[tuple[int, int]]:
    """``(rows, real rows)`` of every rank's batch number ``batch`` of the epoch: the rows
    after the real ones repeat the epoch's first samples (the ranks' shares are equal)."""
    w, bs, n = loader.world_size, loader.batch_size, loader.n
    if loader.split_batches:  # batch b of the padded order, cut in w slices of bs
        starts = [batch * bs * w + r * bs for r in range(w)]
        sizes = [bs] * w
    else:  # rank r's piece is [r * samples, (r + 1) * samples) of the padded order
        size = min(bs, loader.samples - batch * bs)
        starts = [r * loader.samples + batch * bs for r in range(w)]
        sizes = [size] * w
    return [(m, max(0, min(m, n - start))) for start, m in zip(starts, sizes)]


def gather_batch(loader: Any, tree: Any) -> Any:
    """``loader.gather(tree)``: the ranks' rows of ``loader``'s current batch, padding dropped."""
    where = "pardist.data.ShardedLoader.gather"
    if loader._current < 0 or loader._position == 0:
        raise ValueError(
            f"{where}: the loader has handed out no batch yet; call it inside the loop over "
            "the loader, with the outputs of the batch it just gave."
        )
    rows = _rows(loader, loader._position - 1)
    axis = loader.axis if loader.axis is not None else _mesh.current_mesh("gather").axis_names
    if _mesh.current_mesh("gather").size(axis) != loader.world_size:
        raise ValueError(
            f"{where}: the loader was sharded over {loader.world_size} ranks, but axis "
            f"{axis!r} has {_mesh.current_mesh('gather').size(axis)}; shard the loader with "
            "axis=... (or the process group's rank and world size)."
        )
    gathered = gather(tree, axis)
    keep = torch.cat(
        [torch.arange(real) + sum(m for m, _ in rows[:r]) for r, (_, real) in enumerate(rows)]
    )
    expected = sum(m for m, _ in rows)

    def cut(path: str, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != expected:
            raise ValueError(
                f"{where}: {path} has {x.shape[0]} rows over the ranks, but their batches hold "
                f"{expected} samples ({[m for m, _ in rows]} per rank); give one row per "
                "sample of the batch the loader just handed out."
            )
        return x[keep.to(x.device)] if len(keep) < expected else x

    named = _tree.leaves_with_paths(gathered, "tree")
    out = [cut(path, x) for path, x in named]
    return _tree.tree_unflatten(out, _tree.tree_flatten(gathered)[1])
