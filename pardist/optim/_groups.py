"""Parameter groups (optax's ``multi_transform`` and ``masked``) and the current learning rate.

torch users write ``AdamW([{'params': decay}, {'params': no_decay, 'weight_decay': 0}])``;
here each group is an optimizer of its own, chosen per leaf by a label:

    labels = {name: 'no_decay' if p.ndim == 1 else 'decay' for name, p in params.items()}
    opt = multi_transform({'decay': adamw(1e-3), 'no_decay': adamw(1e-3, weight_decay=0)}, labels)

Each group's optimizer sees a flat dict of its leaves (``{path: tensor}``), so fused
kernels, donation and ZeRO work per group as for a whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from pardist.optim._base import GradientTransformation, Optimizer, schedule_value
from pardist.runtime import _tree

__all__ = ["current_lr", "masked", "multi_transform", "step_count"]


def _labels_of(labels: Any, params: Any, where: str) -> list:
    """One label per leaf of ``params``: from a tree like it, or ``labels(path, leaf)``."""
    named = _tree.leaves_with_paths(params)
    if callable(labels) and not isinstance(labels, Mapping):
        return [labels(path, leaf) for path, leaf in named]
    flat, spec = _tree.tree_flatten(labels)
    if spec != _tree.tree_flatten(params)[1]:
        raise ValueError(
            f"{where}: labels must be a tree like params (one label per parameter) or a "
            f"function (path, param) -> label; got {len(flat)} labels for {len(named)} params."
        )
    return flat


def multi_transform(
    transforms: Mapping[Any, GradientTransformation | Optimizer],
    labels: Any | Callable[[str, torch.Tensor], Any],
) -> GradientTransformation | Optimizer:
    """A transformation (or optimizer) per group of parameters, as optax's ``multi_transform``.

    Args:
        transforms: ``{label: optimizer}``; all optimizers, or all gradient
            transformations.
        labels: a tree like the params with one label per leaf, or a function
            ``(path, param) -> label`` (path as ``"['0.bias']"``).

    Example:
        >>> import pardist, torch
        >>> opt = pardist.optim
        >>> params = {'w': torch.ones(2, 2), 'b': torch.ones(2)}
        >>> tx = opt.multi_transform(
        ...     {'decay': opt.sgd(0.1, weight_decay=0.5), 'plain': opt.sgd(0.1)},
        ...     lambda path, p: 'decay' if p.ndim > 1 else 'plain')
        >>> new, state = tx.update({'w': torch.zeros(2, 2), 'b': torch.zeros(2)},
        ...                        tx.init(params), params)
        >>> new['w'][0, 0].item(), new['b'][0].item()
        (0.949999988079071, 1.0)
    """
    where = "pardist.optim.multi_transform"
    kinds = {type(t) for t in transforms.values()}
    if not transforms or len(kinds) != 1 or not kinds <= {Optimizer, GradientTransformation}:
        raise TypeError(
            f"{where}: give {{label: optimizer}} (all pardist.optim optimizers, or all "
            f"gradient transformations); got {sorted(k.__name__ for k in kinds)}."
        )

    def groups(params) -> dict:
        found = _labels_of(labels, params, where)
        unknown = sorted({repr(x) for x in found if x not in transforms})
        if unknown:
            raise ValueError(
                f"{where}: labels {', '.join(unknown)} have no transformation; the "
                f"transformations are labelled {sorted(map(repr, transforms))}."
            )
        return {label: [i for i, x in enumerate(found) if x == label] for label in transforms}

    def split(tree, indices, names) -> dict:
        leaves = _tree.tree_leaves(tree)
        return {names[i]: leaves[i] for i in indices}

    def init_fn(params):
        names = [path for path, _ in _tree.leaves_with_paths(params)]
        return {
            label: transforms[label].init(split(params, idx, names))
            for label, idx in groups(params).items()
        }

    def update_fn(grads, state, params=None):
        like = params if params is not None else grads
        names = [path for path, _ in _tree.leaves_with_paths(like)]
        out = list(_tree.tree_leaves(like if kinds == {Optimizer} else grads))
        new_state = {}
        for label, idx in groups(like).items():
            sub_params = split(params, idx, names) if params is not None else None
            result, new_state[label] = transforms[label].update(
                split(grads, idx, names), state[label], sub_params
            )
            for i, leaf in zip(idx, _tree.tree_leaves(result)):
                out[i] = leaf
        return _tree.tree_unflatten(out, _tree.tree_flatten(like)[1]), new_state

    kind = kinds.pop()
    lrs = {label: getattr(t, "lr", None) for label, t in transforms.items()}
    return kind(init_fn, update_fn, lrs) if kind is Optimizer else kind(init_fn, update_fn)


def _keep() -> Optimizer:
    """Parameters left as they are (no state): the masked-out group of ``masked``."""
    return Optimizer(lambda params: (), lambda grads, state, params: (params, state))


def _pass() -> GradientTransformation:
    return GradientTransformation(
        lambda params: (), lambda grads, state, params=None: (grads, state)
    )


def masked(
    inner: GradientTransformation | Optimizer, mask: Any
) -> GradientTransformation | Optimizer:
    """``inner`` on the leaves where ``mask`` is True; the others pass through unchanged.

    For an optimizer, masked-out parameters are not updated at all (frozen); for a
    gradient transformation, their gradients pass through as they are. ``mask`` is a
    tree like the params of booleans, or a function ``(path, param) -> bool``.

    Example:
        >>> import pardist, torch
        >>> tx = pardist.optim.masked(pardist.optim.sgd(0.1), {'w': True, 'b': False})
        >>> params = {'w': torch.ones(1), 'b': torch.ones(1)}
        >>> new, _ = tx.update({'w': torch.ones(1), 'b': torch.ones(1)}, tx.init(params), params)
        >>> new['w'].item(), new['b'].item()
        (0.8999999761581421, 1.0)
    """
    other = _keep() if isinstance(inner, Optimizer) else _pass()
    return multi_transform({True: inner, False: other}, mask)


def step_count(state: Any) -> int | dict:
    """The steps an optimizer state has taken (per group for ``multi_transform``)."""
    if isinstance(state, dict):
        counts = {k: step_count(v) for k, v in state.items() if v != ()}
        return counts
    inner = getattr(state, "inner", None)  # optim.sharded
    if inner is not None:
        return step_count(inner)
    count = getattr(state, "count", None)
    if isinstance(count, torch.Tensor):
        return int(count)
    if isinstance(state, tuple):  # chain: the optimizer's state is the last
        for part in reversed(state):
            try:
                return step_count(part)
            except ValueError:
                continue
    raise ValueError(
        "pardist.optim.step_count: no step count in this state; pass the state of a "
        "pardist.optim optimizer (sgd, adamw, adam, or a chain / sharded / multi_transform "
        "of them)."
    )


def current_lr(opt: Optimizer, state: Any) -> float | dict:
    """The learning rate ``opt`` uses at its next step (its schedule at the state's count).

    For logging: ``print(pardist.optim.current_lr(opt, opt_state))``. Per group (a dict)
    for ``multi_transform``.

    Example:
        >>> import pardist, torch
        >>> opt = pardist.optim.sgd(pardist.optim.linear_warmup(0.1, warmup_steps=10))
        >>> state = opt.init({'w': torch.zeros(1)})
        >>> pardist.optim.current_lr(opt, state)
        0.0
    """
    lr = getattr(opt, "lr", None)
    if lr is None:
        raise ValueError(
            "pardist.optim.current_lr: this optimizer does not say its learning rate; "
            "pass a pardist.optim optimizer (sgd, adamw, adam, chain, sharded, multi_transform)."
        )
    count = step_count(state)
    if isinstance(lr, dict):
        return {k: schedule_value(v, torch.tensor(count[k])) for k, v in lr.items() if k in count}
    return schedule_value(lr, torch.tensor(count))
