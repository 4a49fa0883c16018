"""``mean='tokens'``: the gradient of a sum of per-token losses over the global count of tokens.

A language model's batch is padded, and the padding differs per rank and per
micro-batch, so neither the mean over ranks nor the mean over rows is the mean over
the tokens of the global batch (Hugging Face's ``num_items_in_batch``, torchtitan's
division by the global number of valid tokens). With ``mean='tokens'`` the loss
returns ``(sum of its per-token losses, number of tokens)``, and ``pardist.grad``
gives the gradient of

    (sum of every rank's and every micro-batch's sums) / (sum of their counts)

which equals one process on the concatenated batch with ``ignore_index``. The
gradient paths compute that of the plain sums, averaged as ever (over ranks and
micro-batches); one small all-reduce adds the counts, and each gradient is then
weighed by (ranks x micro-batches) / count: every path averages every argument's
gradient over both (the batch's as the replicated ones').
A rank without tokens adds nothing; a global batch without any is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pardist.collectives import _collectives
from pardist.runtime import StepContext, assert_async, functorch, tracing

__all__ = ["counted", "weigh"]


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` without torch.func's wrappers (a count made from wrapped inputs)."""
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def counted(f: Callable, has_aux: bool, where: str, as_aux: bool = False) -> tuple[Callable, list]:
    """``f`` returning its sum as the value, and the list its counts are put in. With
    ``as_aux`` (a traced step, whose graph fills no Python list) ``f`` returns
    ``(sum, (aux, count))`` instead, and the gradient path puts each count in the list."""
    counts: list[torch.Tensor] = []

    def f_sum(*args: Any, **kwargs: Any) -> Any:
        out = f(*args, **kwargs)
        pair, aux = out if has_aux else (out, None)
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ValueError(
                f"{where}: with mean='tokens', f returns (sum of the per-token losses, "
                "number of tokens)"
                + (" and aux: ((sum, count), aux)" if has_aux else "")
                + f"; got {type(pair).__name__}. E.g. F.cross_entropy(logits, labels, "
                "ignore_index=-100, reduction='sum'), (labels != -100).sum()."
            )
        total, count = pair
        if isinstance(count, torch.Tensor):
            if count.numel() != 1:
                raise ValueError(
                    f"{where}: the token count has shape {tuple(count.shape)}; give one "
                    "number per call: (labels != -100).sum()."
                )
            if isinstance(total, torch.Tensor) and count.device != total.device:
                raise ValueError(
                    f"{where}: the token count is on {count.device} and the loss on "
                    f"{total.device}; make the count where the labels are "
                    "((labels != -100).sum() on the loss's device)."
                )
            count = count.detach().reshape(()) if as_aux else _plain(count.detach()).reshape(())
        elif isinstance(count, (int, float)) and not isinstance(count, bool):
            count = torch.tensor(float(count))
        else:
            raise TypeError(
                f"{where}: the token count is a {type(count).__name__}; give a number or a "
                "one-element tensor: (labels != -100).sum()."
            )
        if as_aux:  # (torch.func takes tensors as aux: no None for an f without one)
            return total, ((aux, count) if has_aux else count)
        counts.append(count)
        return (total, aux) if has_aux else total

    return f_sum, counts


def _global_traced(counts: list, ctx: StepContext) -> torch.Tensor:
    """The global count as a float64 tensor of the graph (its all-reduce a node of it)."""
    mine = torch.stack([c.to(torch.float64) for c in counts]).sum()
    return _collectives.psum(mine, ctx.axis) if ctx.size > 1 else mine


def _global(counts: list, ctx: StepContext | None) -> float:
    """The count over every micro-batch of every rank of the step's axis (one all-reduce)."""
    mine = torch.stack([c.to(torch.float64).cpu() for c in counts]).sum().reshape(1)
    if ctx is not None and ctx.size > 1:
        groups = ctx.mesh.groups(ctx.axis)
        if groups:
            device = counts[0].device if counts[0].device.type != "meta" else "cpu"
            mine = _collectives.reduce_groups(mine.to(device), groups, "sum").cpu()
    return float(mine.item())


def weigh(value, grads: list, leaves: list, call: Any, ctx: StepContext | None, counts: list):
    """``(value, grads)`` of the sums, averaged as ever, turned into those over the count."""
    if not counts:
        return value, grads
    if tracing():  # the total is a tensor of the graph: its checks run with it
        total = _global_traced(counts, ctx)
        assert_async(total > 0, f"{call.where}: mean='tokens', but no rank had a token")
    else:
        total = _global(counts, ctx)
        _check_total(total, call)
    k = 1 if call.listed is not None else call.accumulate
    size = ctx.size if ctx is not None else 1
    means = size * k / total  # averaged over ranks and micro-batches: undone, then / count
    # Every gradient path gives every argument's gradient averaged over the ranks and
    # micro-batches (the batch's too: its own over the ranks, split ones over k).
    out = [g if g is None else g * means for g in grads]
    return (value * means).to(value.dtype), out


def _check_total(total: float, call: Any) -> None:
    if total < 0 or total != total:
        raise ValueError(f"{call.where}: the tokens counted add up to {total}; counts are >= 0.")
    if total == 0:
        raise ValueError(
            f"{call.where}: mean='tokens', but no rank had a token in this step (the counts "
            "add up to 0 over every rank and micro-batch): the mean over no tokens is "
            "undefined. Skip such a batch on every rank, or check the labels' padding value."
        )
