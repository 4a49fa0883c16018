"""Micro-batches for gradient accumulation: which tensors hold the batch, and what comes back.

``pardist.grad(f, accumulate=k)`` runs ``f`` on k slices of the batch, one after
another, and reduces once (DDP's ``no_sync`` and fastai's gradient accumulation,
done in one place). Inside a data-parallel step the batch is every tensor that
holds this rank's shard of the step's inputs (by the step's specs), in whichever
arguments of ``f`` it sits; outside a step it is the one argument that is not
differentiated. Each is split along dim 0 with einops.

What comes back is what one process running the k micro-batches in sequence
returns. An aux output named by ``carry`` is the next value of that argument
(batch-norm buffers): micro-batch j+1 receives micro-batch j's, and the last is
returned. Other aux outputs are stacked, one entry per micro-batch.
"""

from __future__ import annotations

from typing import Any

import einops
import torch
from torch.distributed.tensor import DTensor

from pardist.runtime import _tree, holds

__all__ = ["UNSET", "batch_masks", "check_carry", "concat", "rank_rows", "rows", "split", "stack"]

UNSET: Any = type("Unset", (), {"__repr__": lambda self: "<unset>"})()  # carry not given

Masks = list  # per positional argument: None, or one bool per leaf (True: a batch leaf)


def _is_batchable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.ndim > 0


def batch_masks(
    flat: list, nums: tuple[int, ...], batch_argnums: Any, ctx: Any, where: str, strict: bool
) -> Masks:
    """Which leaves are the batch, given each argument's ``(leaves, treedef)``.

    ``strict``: the answer matters (``accumulate > 1`` or a row-weighted mean), so
    an argument pardist cannot place is an error instead of a guess.
    """
    n = len(flat)
    if batch_argnums is not None:
        chosen = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
        if not all(isinstance(i, int) and -n <= i < n for i in chosen):
            raise ValueError(
                f"{where}: batch_argnums={batch_argnums!r} does not name arguments of a "
                f"call with {n} positional arguments."
            )
        chosen = {i % n for i in chosen}
        return [
            [_is_batchable(x) for x in leaves] if i in chosen else None
            for i, (leaves, _) in enumerate(flat)
        ]
    if ctx is None:  # no specs to go by: the one argument that is not differentiated
        rest = [i for i in range(n) if i not in nums]
        if strict and not rest:
            raise ValueError(
                f"{where}: accumulate splits the batch into micro-batches, but every "
                "argument is differentiated (argnums), so none holds a batch. Pass the batch "
                "as an argument of its own."
            )
        if strict and len(rest) > 1:
            raise ValueError(
                f"{where}: outside a data_parallel step pardist cannot tell which of "
                f"args{rest} hold the batch to split into micro-batches; name them, e.g. "
                f"batch_argnums={tuple(rest)}."
            )
        return [
            [_is_batchable(x) for x in leaves] if rest == [i] else None
            for i, (leaves, _) in enumerate(flat)
        ]
    masks: Masks = []
    for leaves, _ in flat:
        if isinstance(ctx.varying, dict):  # a traced step: by identity
            flags = [holds(ctx.varying, x) and _is_batchable(x) for x in leaves]
        else:  # in C for the common case: no leaf of the argument is the batch
            flags = list(map(ctx.varying.__contains__, map(id, leaves)))
            if any(flags):
                flags = [v and _is_batchable(x) for v, x in zip(flags, leaves)]
        masks.append(flags if any(flags) else None)
    if strict:
        _check_placed(flat, nums, masks, ctx, where)
    return masks


def _check_placed(flat: list, nums: tuple, masks: Masks, ctx: Any, where: str) -> None:
    """Refuse to guess: a tensor made inside the step may be a transformed batch."""
    found = {x.shape[0] for (leaves, _), m in zip(flat, masks) if m for x, f in zip(leaves, m) if f}
    if not found:
        raise ValueError(
            f"{where}: none of the arguments holds this rank's shard of the step's batch "
            "(the tensors the step received under a sharded in_spec), so there is nothing "
            "to split into micro-batches or count rows of. Pass the batch to the function "
            "as the step received it, or name the arguments that hold it with "
            "batch_argnums=(...)."
        )
    for i, (leaves, treedef) in enumerate(flat):
        if i in nums:
            continue
        flags = masks[i] or [False] * len(leaves)
        for k, (x, flag) in enumerate(zip(leaves, flags)):
            if not flag and _is_batchable(x) and not holds(ctx.inputs, x) and x.shape[0] in found:
                path = _paths(treedef, i)[k]
                named = tuple(sorted([j for j, m in enumerate(masks) if m] + [i]))
                raise ValueError(
                    f"{where}: {path} (shape {tuple(x.shape)}) was computed inside the step "
                    "and has as many rows as the batch, so pardist cannot tell whether it "
                    "is part of the batch (the step's sharded inputs are split into "
                    "micro-batches and counted; tensors computed from them are not "
                    f"recognised). Name every batch argument, e.g. batch_argnums={named}, "
                    "or pass the batch as the step received it and transform it inside "
                    "the function."
                )


def _paths(treedef: Any, i: int) -> list[str]:
    """The paths (``args[2]['x']``) of argument ``i``'s leaves, for error messages."""
    dummy = _tree.tree_unflatten([0] * treedef.num_leaves, treedef)
    return [path for path, _ in _tree.leaves_with_paths(dummy, f"args[{i}]")]


def rows(flat: list, masks: Masks) -> dict[str, int]:
    """The dim-0 size of every batch leaf, by path if they disagree (else by one path)."""
    sizes = [
        (i, k, x.shape[0])
        for i, ((leaves, _), m) in enumerate(zip(flat, masks))
        if m
        for k, (x, f) in enumerate(zip(leaves, m))
        if f
    ]
    if not sizes:
        return {}
    if all(n == sizes[0][2] for _, _, n in sizes):  # (no set: sizes may be symbolic)
        return {"": sizes[0][2]}
    return {_paths(flat[i][1], i)[k]: n for i, k, n in sizes}


def split(flat: list, masks: Masks, k: int, where: str) -> list[list]:
    """Each of the ``k`` micro-batches, as every argument's leaves: the batch leaves split
    along dim 0 (einops), the others as they are."""
    if k == 1:
        return [[leaves for leaves, _ in flat]]
    out: list = [[] for _ in range(k)]
    for i, ((leaves, treedef), m) in enumerate(zip(flat, masks)):
        columns = []
        for j, x in enumerate(leaves):
            if not (m and m[j]):
                columns.append([x] * k)
                continue
            if x.shape[0] % k:
                good = -(-x.shape[0] // k) * k
                raise ValueError(
                    f"{where}: accumulate={k} cannot split {_paths(treedef, i)[j]} of shape "
                    f"{tuple(x.shape)} into {k} equal micro-batches: its dim 0 has "
                    f"{x.shape[0]} rows, not a multiple of {k}. Use a per-rank batch size "
                    f"divisible by {k} (e.g. {good}), or another accumulate."
                )
            columns.append(list(einops.rearrange(x, "(k b) ... -> k b ...", k=k).unbind(0)))
        for j in range(k):
            out[j].append([c[j] for c in columns])
    return out


def _layout(tree: Any) -> tuple:
    leaves, treedef = _tree.tree_flatten(tree)
    return treedef, [
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x) for x in leaves
    ]


def check_carry(
    carry: Any, nargs: int, nums: tuple, masks: Masks, has_aux: bool, where: str
) -> int | None:
    """``carry`` as an argument index (or None), checked against the call."""
    if carry is UNSET or carry is None:
        return None
    if not has_aux:
        raise ValueError(
            f"{where}: carry={carry!r} threads f's aux output into the next micro-batch, "
            "but has_aux is False. Return (value, aux) and pass has_aux=True."
        )
    if not (isinstance(carry, int) and -nargs <= carry < nargs):
        raise ValueError(
            f"{where}: carry={carry!r} does not name an argument of a call with "
            f"{nargs} positional arguments."
        )
    carry %= nargs
    if carry in nums or masks[carry]:
        role = "differentiated (argnums)" if carry in nums else "split into micro-batches"
        raise ValueError(
            f"{where}: carry={carry} names args[{carry}], which is {role}; carry names "
            "the argument whose next value f returns as aux (the batch-norm buffers)."
        )
    return carry


def after_micro_batch(
    aux: Any, carry: Any, args: tuple, nums: tuple, masks: Masks, accumulate: int, where: str
) -> None:
    """Check aux after the first micro-batch: it must fit ``carry``, or carry must be said."""
    if carry is UNSET or carry is None:
        if carry is UNSET and accumulate > 1 and aux is not None:
            mine = _layout(aux)
            for i, a in enumerate(args):
                if i not in nums and not masks[i] and _tree.tree_leaves(a) and _layout(a) == mine:
                    raise ValueError(
                        f"{where}: with accumulate={accumulate}, f's aux has the tree, shapes "
                        f"and dtypes of args[{i}]. If it is args[{i}]'s next value (the "
                        f"batch-norm buffers that apply returns), pass carry={i}: each "
                        "micro-batch then starts from the previous one's, and the last is "
                        "returned, as a plain accumulation loop would. Pass carry=None to get "
                        f"each micro-batch's aux stacked along a new dim 0 of size {accumulate}."
                    )
        return
    if _layout(aux) != _layout(args[carry]):
        raise ValueError(
            f"{where}: carry={carry} makes f's aux the next value of args[{carry}], so it must "
            f"have args[{carry}]'s tree, shapes and dtypes, but args[{carry}] has "
            f"{_describe(args[carry])} and aux has {_describe(aux)}."
        )


def _describe(tree: Any) -> str:
    named = _tree.leaves_with_paths(tree)
    shown = ", ".join(
        f"{p or 'leaf'} {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
        for p, x in named[:4]
    )
    return f"{len(named)} leaves ({shown}{', ...' if len(named) > 4 else ''})"


def stack(items: list[Any]) -> Any:
    """Per-micro-batch outputs, each leaf stacked along a new dim 0."""
    if len(items) == 1 or items[0] is None:
        return items[0]
    flat = [_tree.tree_flatten(item)[0] for item in items]
    spec = _tree.tree_flatten(items[0])[1]
    leaves = [
        torch.stack(column) if isinstance(column[0], torch.Tensor) else list(column)
        for column in zip(*flat)
    ]
    return _tree.tree_unflatten(leaves, spec)


def concat(parts: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """A split input's gradient: its micro-batches' gradients in order, over the k of them.

    The whole batch's mean loss is the mean of the micro-batches' losses, so each
    slice's gradient is its micro-batch's over k.
    """
    k = len(parts)
    rows = like.shape[0] // k
    pieces = [p if p is not None else like.new_zeros((rows, *like.shape[1:])) for p in parts]
    return torch.cat(pieces) / k


def rank_rows(flat: list, masks: list, weighted: bool, where: str) -> int:
    """This rank's number of batch rows (-1 where the batch leaves disagree)."""
    sizes = rows(flat, masks)
    if len(sizes) == 1:
        return next(iter(sizes.values()))
    if weighted:
        shown = ", ".join(f"{path} has {n}" for path, n in sizes.items())
        raise ValueError(
            f"{where}: mean='rows' weighs each rank by its rows, but the batch leaves "
            f"disagree on how many it has ({shown} along dim 0). Name the arguments that "
            "hold the batch with batch_argnums=(...), or use mean='ranks'."
        )
    return -1
