"""The loss must depend on what ``pardist.grad`` differentiates.

Calling the module itself inside the loss (``model(x)`` instead of ``apply(params,
buffers, x)``) differentiates the module's own tensors, not the params passed
in: their gradients are zero, the optimizer moves nothing, and the loss stays
flat without a word. On the first call inside a step, the loss's autograd graph
is searched for the differentiated leaves; when it reaches none, that is an
error. One leaf with no path (an unused parameter, a legitimately zero
gradient) is fine: only a loss that reaches none of them is.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from pardist.runtime import _tree, functorch, tracing

__all__ = ["check", "watched"]

_CHECKED: set = set()  # code objects whose loss reached its leaves once (lambdas re-made per step)


def watched(f, nums: tuple, has_aux: bool, where: str):
    """``f``, checked by :func:`check` until one call has been checked."""
    code = getattr(f, "__code__", None)
    if (code is not None and code in _CHECKED) or tracing():  # (a graph is not searched)
        return f

    def f_checked(*args, **kwargs):
        out = f(*args, **kwargs)
        value = out[0] if has_aux and isinstance(out, tuple) else out
        leaves = [t for n in nums for t in _tree.tree_leaves(args[n])]
        if check(value, leaves, nums, where) and code is not None:
            _CHECKED.add(code)
        return out

    return f_checked


def _reaches(value: torch.Tensor, leaves: list[torch.Tensor]) -> bool:
    """Whether the autograd graph of ``value`` accumulates into any of ``leaves``."""
    if not value.requires_grad:
        return False
    wanted = {id(t) for t in leaves}
    seen, todo = set(), [value.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None and id(variable) in wanted:
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False


def check(value: torch.Tensor, leaves: list, argnums: tuple, where: str) -> bool:
    """Raise when ``value`` has no autograd path to any of the differentiated ``leaves``.

    Only for plain autograd leaves (pardist.grad's eager path inside a step);
    wrapped tensors of torch.func transforms, FSDP shards and traced values are
    not searched. Returns whether the check ran (and passed).
    """
    if not leaves or not isinstance(value, torch.Tensor):
        return False
    if functorch.peek_interpreter_stack() is not None:
        return False
    if tracing():
        return False
    if not all(
        isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.is_leaf and t.requires_grad
        for t in leaves
    ):
        return False
    if _reaches(value, leaves):
        return True
    names = ", ".join(f"args[{n}]" for n in argnums)
    raise ValueError(
        f"{where}: the loss does not depend on the params it differentiates ({names}): "
        "no gradient reaches any of them, so they would never be trained. The loss most "
        "likely calls the module itself (model(x)), which uses the module's own tensors. "
        "Run the model through apply from pardist.functional instead: "
        "apply, params, buffers = pardist.functional(model), then "
        "out, new_buffers = apply(params, buffers, x) inside the loss."
    )
