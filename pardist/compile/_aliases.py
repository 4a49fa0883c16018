"""A compiled step's arguments as its graph sees them, and what it returns of them.

The traced step sees aliases of its inputs made inside the graph (:func:`aliased`), so
that the step's context can hold them as a dict's keys and writes through them reach the
inputs (donation). A donated input the step returns comes back as the caller's own
tensor (:func:`donated_back`), as in the eager step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pardist.runtime import _tree, dtensor_local, pytree

__all__ = ["aliased", "donated_back"]


def aliased(node: Any, seen: list) -> Any:
    """``node`` with every tensor replaced by an alias made in the graph, each leaf appended
    to ``seen`` in pytree's order. Dicts, lists and tuples by a plain walk, any other node
    by pytree: dynamo runs ~100 bytecodes per node of pytree's flatten and unflatten (their
    TreeSpecs), which were an eighth of a GPT step's tracing."""
    if isinstance(node, torch.Tensor):  # the most nodes (pytree never enters a tensor)
        seen.append(node.view_as(node))
        return seen[-1]
    kind = type(node)
    if kind is dict:
        return {k: aliased(v, seen) for k, v in node.items()}
    if kind is list or kind is tuple:
        out = [aliased(v, seen) for v in node]
        return out if kind is list else tuple(out)
    if isinstance(node, tuple) and hasattr(kind, "_fields"):  # a NamedTuple (pytree's rule)
        return kind(*(aliased(v, seen) for v in node))
    entry = pytree.SUPPORTED_NODES.get(kind)
    if entry is not None:  # a registered node (an optimizer's state, a Mapping), one level
        children, context = entry.flatten_fn(node)
        return entry.unflatten_fn([aliased(c, seen) for c in children], context)
    if isinstance(node, tuple):  # (a structseq: pytree's own rules)
        leaves, spec = pytree.tree_flatten(node)
        new = [x.view_as(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        seen.extend(new)
        return pytree.tree_unflatten(new, spec)
    seen.append(node)  # a leaf
    return node


def donated_back(out: Any, args: tuple, donated: tuple[int, ...]) -> Any:
    """``out`` with the caller's own donated input wherever the step returned it: the
    graph returns an alias of it (the same memory, shape and strides), which is that input.
    Found after the call, by where each tensor lies, rather than in the graph: there a
    tree walk over the outputs cost dynamo a tenth of a GPT step's tracing."""
    leaves = _tree.tree_leaves(args)
    own = {_lies(x): x for x in map(leaves.__getitem__, donated) if _lies(x) is not None}
    if not own:
        return out
    return _tree.tree_map(lambda y: own.get(_lies(y), y), out)


def _lies(x: Any) -> tuple | None:
    """Where the tensor ``x`` lies: its type, memory, shape, strides and dtype (None for
    anything else, and for an empty tensor, which lies nowhere)."""
    if not isinstance(x, torch.Tensor):
        return None
    t = dtensor_local(x) if isinstance(x, DTensor) else x
    if t.numel() == 0:
        return None
    return type(x), t.data_ptr(), t.shape, t.stride(), t.dtype
