"""Pytree helpers with paths, so that every error can name ``args[0]['w']``.

pardist uses torch.utils._pytree (the same trees torch.func understands): any
nesting of dict / list / tuple / NamedTuple with leaves, and any other Mapping
(``BatchEncoding``, ``UserDict``), which pardist registers the first time it meets one
(``_mappings``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from pardist.runtime import _flat, _mappings
from pardist.runtime._compat import pytree, pytree_children, tracing

__all__ = [
    "any_instance",
    "broadcast_prefix",
    "check_tensor_leaves",
    "each",
    "keystr",
    "leaves_with_paths",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
]

# torch's pytree semantics, with a fast path for the dict / list / tuple trees of steps
tree_flatten = _flat.tree_flatten
tree_unflatten = _flat.tree_unflatten
tree_leaves = _flat.tree_leaves
tree_map = _flat.tree_map
keystr = pytree.keystr


each = collections.deque(maxlen=0).extend  # runs an iterator (a map) to its end, in C


def any_instance(xs: Iterable, kind: type) -> bool:
    """Whether some element of ``xs`` is a ``kind``: by the set of their types, made in C
    (a failing ``isinstance`` walks the type's bases: 3-4x the cost per leaf)."""
    if tracing():  # what dynamo traces
        return any(isinstance(x, kind) for x in xs)
    return any(issubclass(t, kind) for t in set(map(type, xs)))


def leaves_with_paths(tree: Any, name: str = "") -> list[tuple[str, Any]]:
    """``[(name + "[0]['w']", leaf), ...]`` in flattening order."""
    flat, _ = pytree.tree_flatten_with_path(tree)
    if _mappings.adopt_leaves([leaf for _, leaf in flat]):  # a Mapping torch left a leaf
        flat, _ = pytree.tree_flatten_with_path(tree)
    return [(name + keystr(path), leaf) for path, leaf in flat]


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    """One level of ``node`` as ``[(key, child)]``, or None if ``node`` is a leaf."""
    return pytree_children(node)


def _kind(node: Any) -> str:
    if isinstance(node, Mapping):
        return "a dict"
    if isinstance(node, Sequence) and not isinstance(node, str):
        return f"a {type(node).__name__} of length {len(node)}"
    return f"a {type(node).__name__}"


def broadcast_prefix(
    prefix: Any,
    full: Any,
    *,
    is_prefix_leaf: Callable[[Any], bool],
    where: str,
    prefix_name: str,
    full_name: str,
) -> list[Any]:
    """Expand a prefix tree (a spec tree) to one entry per leaf of ``full``.

    A prefix leaf stands for the whole subtree at its position, as in JAX's
    ``shard_map``: ``(P(), P('gpu'))`` describes every leaf of two arguments.
    Dicts match by key, whatever their order.

    Raises:
        ValueError: naming both paths when the structures do not line up.
    """
    out: list[Any] = []

    def fail(path: tuple, why: str) -> None:
        raise ValueError(
            f"{where}: {prefix_name}{keystr(path)} does not fit {full_name}{keystr(path)}: "
            f"{why}. A spec tree must be a prefix of the argument tree: give one spec "
            "per leaf, or one spec for a whole subtree."
        )

    def walk(p: Any, f: Any, path: tuple) -> None:
        if is_prefix_leaf(p):
            out.extend([p] * len(tree_leaves(f)))
            return
        p_children = _children(p)
        if p_children is None:
            fail(path, f"the spec is {_kind(p)}, which is neither a spec nor a container")
        f_children = _children(f)
        if f_children is None:
            fail(path, f"the spec is {_kind(p)} but the argument is a leaf ({_kind(f)})")
        if isinstance(p, Mapping) != isinstance(f, Mapping):
            fail(path, f"the spec is {_kind(p)} but the argument is {_kind(f)}")
        by_key = dict(p_children)
        keys = [k for k, _ in f_children]
        if set(by_key) != set(keys):
            missing = [keystr((k,)) for k in keys if k not in by_key]
            extra = [keystr((k,)) for k in by_key if k not in set(keys)]
            fail(
                path,
                f"the spec is {_kind(p)}, the argument is {_kind(f)}"
                + (f"; the spec lacks {', '.join(missing)}" if missing else "")
                + (f"; the spec has extra {', '.join(extra)}" if extra else ""),
            )
        for key, child in f_children:
            walk(by_key[key], child, path + (key,))

    walk(prefix, full, ())
    return out


def check_tensor_leaves(tree: Any, *, where: str, name: str) -> list[torch.Tensor]:
    """The leaves of ``tree``, which must all be tensors; else a clear error."""
    leaves = tree_leaves(tree)
    if all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return leaves  # the common case, without building key paths
    for path, leaf in leaves_with_paths(tree, name):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{where}: {path} is {_kind(leaf)} ({leaf!r:.40}), not a tensor. This "
                "takes a tree of tensors: wrap numbers with torch.tensor(...) or leave "
                "them out of the tree."
            )
    return leaves
