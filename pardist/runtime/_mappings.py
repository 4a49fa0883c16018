"""Any Mapping is a tree: Hugging Face's ``BatchEncoding``, ``UserDict``, dict subclasses.

torch's pytree knows dict, OrderedDict, defaultdict, NamedTuples and the types someone
registered (Hugging Face registers its ``ModelOutput``s); any other Mapping is a
*leaf* to it. Every Hugging Face collator returns a ``BatchEncoding`` (a ``UserDict``),
so a step given one would see no tensor in it. pardist registers such a type with
torch's pytree the first time one of its trees holds one, so that steps, ``grad``,
``gather``, ``data.shard``, checkpoints, torch.func and dynamo all walk into it and
rebuild it as its own type (JAX users register their classes by hand; pardist does it
for every Mapping it can rebuild, and leaves the others leaves).

A rebuilt mapping holds the new values under the same keys, and those of its other
attributes that are plain values (numbers, strings, None: they travel in the tree's
structure, as JAX's auxiliary data does). An attribute that is not a plain value is
not carried: a ``BatchEncoding``'s fast-tokenizer ``encodings`` describe the whole
batch as it was tokenized, not the rows a rank holds, and come back as None.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping
from typing import Any

from pardist.runtime._compat import pytree, pytree_children

__all__ = ["KNOWN", "adopt", "adopt_all", "adopt_leaves", "flatten", "rebuilder"]

# type -> rebuild(context, values): the Mapping types pardist registered
KNOWN: dict[type, Callable[[tuple, list], Any]] = {}
_REFUSED: set[type] = set()  # Mappings it could not rebuild: leaves, as torch has them
_lock = threading.Lock()
_PLAIN = (type(None), bool, int, float, str, bytes)


def _attrs(node: Any, skip: str | None) -> tuple:
    """The instance attributes a rebuilt ``node`` keeps: plain values, in the structure."""
    state = getattr(node, "__dict__", None) or {}
    return tuple(
        (name, value if isinstance(value, _PLAIN) else None)
        for name, value in sorted(state.items())
        if name != skip
    )


def flatten(node: Any) -> tuple[list, tuple]:
    """``(values, context)`` of a Mapping: the context is its keys and plain attributes."""
    keys = list(node.keys())
    skip = "data" if isinstance(node, collections.UserDict) else None
    return [node[k] for k in keys], (tuple(keys), _attrs(node, skip))


def _flatten_with_keys(node: Any) -> tuple[list, tuple]:
    values, context = flatten(node)
    return [(pytree.MappingKey(k), v) for k, v in zip(context[0], values)], context


def _rebuilder(kind: type) -> Callable[[tuple, list], Any]:
    """How to make a ``kind`` holding new values: a UserDict's ``data``, a dict subclass
    filled by its own base's ``__init__``, any other Mapping by ``kind(dict)``."""
    if issubclass(kind, collections.UserDict):

        def user_dict(context: tuple, values: list) -> Any:
            keys, attrs = context
            out = kind.__new__(kind)
            out.__dict__.update(attrs)
            out.data = dict(zip(keys, values))
            return out

        return user_dict
    if issubclass(kind, dict):
        base = next(b for b in kind.__mro__ if b in (collections.OrderedDict, dict))

        def dict_subclass(context: tuple, values: list) -> Any:
            keys, attrs = context
            out = kind.__new__(kind)
            base.__init__(out, zip(keys, values))
            out.__dict__.update(attrs)
            return out

        return dict_subclass
    return lambda context, values: kind(dict(zip(context[0], values)))


def rebuilder(kind: type, context: tuple) -> Callable[[list], Any]:
    """``values -> kind`` holding them under ``context``'s keys (a registered Mapping)."""
    make = KNOWN[kind]
    return lambda values: make(context, values)


def adopt(node: Any) -> bool:
    """Register ``type(node)`` with torch's pytree if it is a Mapping it does not know and
    pardist can rebuild one (checked on ``node``: the rebuilt copy must have its type and
    keys). Whether the type is a tree node now."""
    kind = type(node)
    if kind in KNOWN or kind in pytree.SUPPORTED_NODES:
        return True
    if kind in _REFUSED or not isinstance(node, Mapping):
        return False
    with _lock:
        if kind in KNOWN or kind in pytree.SUPPORTED_NODES:
            return True
        make = _rebuilder(kind)
        try:
            values, context = flatten(node)
            again = make(context, values)
            ok = type(again) is kind and list(again.keys()) == list(context[0])
            ok = ok and all(again[k] is v for k, v in zip(context[0], values))
        except Exception:  # noqa: BLE001 - a type that cannot be rebuilt stays a leaf
            ok = False
        if not ok:
            _REFUSED.add(kind)
            return False
        pytree.register_pytree_node(
            kind,
            flatten,
            lambda values, context: make(context, list(values)),
            serialized_type_name=f"{kind.__module__}.{kind.__qualname__}",
            flatten_with_keys_fn=_flatten_with_keys,
        )
        KNOWN[kind] = make
    return True


def adopt_leaves(leaves: list) -> bool:
    """:func:`adopt_all` over the leaves torch's pytree gave; whether any became a node."""
    found = False
    for leaf in leaves:
        if type(leaf) not in _PLAIN and type(leaf) not in KNOWN and isinstance(leaf, Mapping):
            if adopt(leaf):
                adopt_all(leaf)
                found = True
    return found


def adopt_all(tree: Any) -> None:
    """:func:`adopt` every Mapping in ``tree``, however deep (under any registered node)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if type(node) in _PLAIN or not adopt(node):
            continue
        stack.extend(child for _, child in pytree_children(node) or ())
