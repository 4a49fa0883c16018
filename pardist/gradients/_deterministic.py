"""``pardist.grad`` in the deterministic mode: the same bits at every world size.

``data_parallel(step, deterministic=G)`` cuts the global batch into G row groups
(rank r holds groups ``r*n .. r*n+n-1``, ``n = G / world size``). Each group runs
its own forward and backward, with the kernels of its own shape, exactly as it
would in a one-process run of the same G groups; the groups run in lockstep
(``runtime._lockstep``) so that batch norm can take statistics over all of them.
Each group's gradient is its own sum, and the G gradients are added left to
right in group order (``collectives._fold``) on every rank, then divided by G:
the gradient of the mean of the groups' losses. So is the loss.

Row groups draw random numbers (dropout) from a stream of their own, derived
from the seed, the group's index and the step count: the same mask for the same
rows at every world size.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pardist.collectives import _fold
from pardist.gradients import _microbatch, _perrank
from pardist.gradients._call import Call, split_value
from pardist.runtime import Lockstep, StepContext, _rng, _tree, dtensor_spec
from pardist.transport import shard_range

__all__ = ["check_groups", "compute"]


def check_groups(groups: int, size: int, where: str) -> int:
    """The number of row groups on each rank, or an error naming G, the world size and the fix."""
    if groups % size:
        import math

        raise ValueError(
            f"{where}: deterministic={groups} row groups cannot be shared evenly by "
            f"{size} rank{'s' * (size != 1)}: {groups} is not a multiple of {size}. Use a G "
            "that every world "
            f"size you run at divides (e.g. deterministic={math.lcm(groups, size)})."
        )
    return groups // size


def compute(mode, call: Call, ctx: StepContext, leaves: list) -> tuple[torch.Tensor, Any, list]:
    """(global value, aux, flat gradients) of one call, in the deterministic mode."""
    where, groups = call.where, mode.groups
    n = check_groups(groups, ctx.size, where)
    if call.accumulate != 1 or call.mean != "ranks":
        raise ValueError(
            f"{where}: the deterministic mode already runs the batch as {groups} row groups; "
            "it takes neither accumulate nor mean='rows' (every group has the same rows). "
            "Leave them at their defaults."
        )
    fsdp = [i for i, t in enumerate(leaves) if isinstance(t, DTensor)]
    if any(
        not r and not s and i not in fsdp
        for i, (r, s) in enumerate(zip(call.replicated, call.split))
    ):
        raise ValueError(
            f"{where}: the deterministic mode differentiates replicated parameters, "
            "pardist.fsdp shards and the batch; parameters split over another axis (tensor "
            "parallelism) are not supported in it yet."
        )
    if not fsdp:
        return _compute(call, ctx, leaves, n)
    # pardist.fsdp shards: gathered whole here, each group's full gradient folded in group
    # order as a replicated parameter's, then this rank's shard of the sum kept. The fold
    # needs every group's whole gradient (a reduce-scatter would add in the backend's
    # order); it is the mode for exact bits, not for memory.
    shards = {i: leaves[i] for i in fsdp}
    whole = [t.full_tensor() if i in shards else t for i, t in enumerate(leaves)]
    ctx.call.whole_shards = True  # apply puts the gathered parameters in their own shapes
    try:
        value, aux, out = _compute(call, ctx, whole, n)
    finally:
        ctx.call.whole_shards = False
    for i, t in shards.items():
        out[i] = _shard_of(out[i], t)
    return value, aux, out


def _shard_of(full: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's piece of a flat full gradient, laid out as the pardist.fsdp shard ``like``."""
    mesh = like.device_mesh
    start, stop = shard_range(full.numel(), mesh.size(), mesh.get_local_rank())
    return DTensor(full.reshape(-1)[start:stop].clone(), dtensor_spec(like), requires_grad=False)


def _compute(call: Call, ctx: StepContext, leaves: list, n: int):
    """(global value, aux, flat gradients) of replicated ``leaves`` and the batch."""
    where, groups = call.where, ctx.mode.groups
    _check_rows(call, n, groups, ctx, where)
    parts = _microbatch.split(call.flat, call.masks, n, where) if n > 1 else None
    first = _rng.rank_index(ctx.mesh, ctx.axis) * n if ctx.size > 1 else 0
    seeds = [_rng.group_seed(first + j) for j in range(n)]
    positions = [(a, k) for a in call.nums for k in range(len(call.flat[a][0]))]
    inputs: list[list[torch.Tensor]] = [
        [
            (parts[j][a][k] if parts is not None and s else t).detach().requires_grad_()
            for t, s, (a, k) in zip(leaves, call.split, positions)
        ]
        for j in range(n)
    ]

    def run_group(j: int):
        margs = call.args
        if parts is not None:
            margs = tuple(
                _tree.tree_unflatten(p, treedef) for p, (_, treedef) in zip(parts[j], call.flat)
            )
        out = call.f(*call.with_inputs(margs, inputs[j]), **call.kwargs)
        return split_value(out, call.has_aux, where)

    with _one_thread(leaves):
        outs = Lockstep(n, seeds, where).run(run_group)
        values = [v for v, _ in outs]
        flat_inputs = [t for group in inputs for t in group]
        grads = torch.autograd.grad(
            values,
            flat_inputs,
            grad_outputs=[torch.ones_like(v) for v in values],
            allow_unused=True,
            materialize_grads=True,
        )
    per_group = [grads[j * len(leaves) : (j + 1) * len(leaves)] for j in range(n)]
    # mean='tokens': each group's value is its sum; every sum weighs over the global count
    counts = call.counts if call.counts is not None else None
    value, divisor = _fold_values(values, call.rows, ctx, groups, where, counts)
    out = [None] * len(leaves)
    by_dtype: dict = {}
    for i, t in enumerate(leaves):
        if call.split[i]:  # a batch input's gradient: its groups' in order, over all G
            out[i] = torch.cat([g[i] for g in per_group]) / (groups if counts is None else divisor)
        else:
            by_dtype.setdefault((t.dtype, t.device), []).append(i)
    if ctx.size == 1:  # every group here: fold each gradient in place, no copies
        for index in by_dtype.values():
            for i in index:
                total = per_group[0][i].clone()
                for g in per_group[1:]:
                    total.add_(g[i])
                out[i] = total.div_(divisor)
    for index in by_dtype.values() if ctx.size > 1 else ():
        sizes = [leaves[i].numel() for i in index]
        local = leaves[index[0]].new_empty(n, sum(sizes))
        for j, g in enumerate(per_group):  # one copy into the buffer the gather sends
            torch.cat([g[i].reshape(-1) for i in index], out=local[j])
        total = _fold.ordered_sum(local, ctx).div_(divisor)
        for i, piece in zip(index, total.split(sizes)):
            out[i] = piece.view(leaves[i].shape)
    aux = _aux([a for _, a in outs], call, call.rows // n) if call.has_aux else None
    return value, aux, out


@contextlib.contextmanager
def _one_thread(leaves: list):
    """CPU kernels on one thread: a kernel's sums may be split across threads, so the same
    thread count at every world size is what makes each group's bits the same."""
    threads = torch.get_num_threads()
    if threads == 1 or not any(t.device.type == "cpu" for t in leaves):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _check_rows(call: Call, n: int, groups: int, ctx: StepContext, where: str) -> None:
    rows = call.rows
    if rows < 0:
        raise ValueError(
            f"{where}: the deterministic mode cuts the batch into row groups, but the "
            "batch leaves disagree on their number of rows; name the arguments that hold "
            "the batch with batch_argnums=(...)."
        )
    if rows % n:
        total = rows * ctx.size
        raise ValueError(
            f"{where}: deterministic={groups} cuts the global batch into {groups} row groups, "
            f"but this rank's {rows} rows (a global batch of {total} at {ctx.size} "
            f"rank{'s' * (ctx.size != 1)}) "
            f"cannot be cut into {n} equal groups. Use a global batch size that is a multiple "
            f"of {groups} (e.g. {-(-total // groups) * groups}), with drop_last=True in the "
            "loader, or another G."
        )


def _fold_values(values: list, rows: int, ctx: StepContext, groups: int, where: str, counts):
    """``(value, divisor)``: the mean of every group's loss added in group order, over the
    groups; with ``counts`` (mean='tokens': the values are sums) over the global count of
    tokens, an integer, the same whatever the order. Checks that shards are equal."""
    local = torch.stack([v.detach().reshape(()).double() for v in values])
    tokens = torch.stack([c.double().cpu() for c in counts]) if counts else torch.zeros_like(local)
    local = torch.stack([local, torch.full_like(local, rows), tokens.to(local.device)], dim=1)
    every = _fold.gather_groups(local, ctx)  # (exact: float64 holds any loss's value)
    if ctx.size > 1 and not bool((every[:, 1] == rows).all()):
        n = len(values)
        shown = ", ".join(f"rank {r}: {int(every[r * n, 1])}" for r in range(ctx.size))
        raise ValueError(
            f"{where}: the deterministic mode needs every rank to hold the same number of "
            f"rows, but they differ ({shown}). Give every rank an equal share of a global "
            "batch: pardist.data.shard(loader, split_batches=True) with drop_last=True."
        )
    per_rank = every[:, 0].view(ctx.size, -1).mean(1)
    if _perrank.checked(per_rank, ctx):  # a non-finite loss: warned of, as in the default
        _perrank.report(per_rank, [rows] * ctx.size, "ranks", ctx, where)
    divisor = groups
    if counts:
        divisor = float(every[:, 2].sum())
        if divisor <= 0:
            raise ValueError(
                f"{where}: mean='tokens', but no row group had a token in this step: the mean "
                "over no tokens is undefined. Skip such a batch on every rank."
            )
    total = every[:, 0].to(values[0].dtype)
    value = total[0].clone()
    for v in total[1:]:
        value = value + v
    return value / divisor, divisor


def _aux(items: list, call: Call, rows: int) -> Any:
    """The row groups' aux as one rank's, by layout, never by value.

    A leaf at the path of a leaf of a replicated argument, with its shape and dtype (the
    batch-norm buffers that apply returns) is that argument's next value: the groups
    computed it together, and group 0's is it (groups that differ are an error). A leaf
    with the group's rows along dim 0 is per row: the groups' are joined. Any other
    (a per-group scalar) is stacked along a new dim 0, one entry per group.
    """
    if len(items) == 1:
        return items[0]
    state = {}  # path -> (shape, dtype) of the replicated arguments' leaves
    for i, arg in enumerate(call.args):
        if i not in call.nums and not call.masks[i]:
            for path, t in _tree.leaves_with_paths(arg):
                if isinstance(t, torch.Tensor):
                    state[path] = (t.shape, t.dtype)
    named = [_tree.leaves_with_paths(a) for a in items]
    treedef = _tree.tree_flatten(items[0])[1]
    leaves = []
    for column in zip(*named):
        path, x = column[0]
        if not isinstance(x, torch.Tensor):
            leaves.append(x)
            continue
        mine = (x.shape, x.dtype)
        if any(path.endswith(p) and mine == sig for p, sig in state.items()):
            _check_alike(path, [c for _, c in column], call.where)
            leaves.append(x)
        elif x.dim() > 0 and x.shape[0] == rows:
            leaves.append(torch.cat([c.detach() for _, c in column]))
        else:
            leaves.append(torch.stack([c.detach() for _, c in column]))
    return _tree.tree_unflatten(leaves, treedef)


def _check_alike(path: str, column: list, where: str) -> None:
    """The groups' values of a state leaf are the same, NaN where NaN (a NaN step's)."""
    x = column[0]
    for j, c in enumerate(column[1:], 1):
        same = (c == x) | (c != c) & (x != x) if x.is_floating_point() else c == x
        if not bool(same.all()):
            raise ValueError(
                f"{where}: row groups 0 and {j} returned different values for aux{path}, "
                "which has the path, shape and dtype of a replicated argument's leaf (its "
                "next value, as the buffers apply returns): the deterministic mode keeps one "
                "value for it. A module whose buffers follow each group's own rows cannot "
                "be made the same at every world size; return such values under another "
                "name, or train without deterministic=."
            )
