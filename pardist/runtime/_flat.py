"""Fast flattening of the trees a step sees every call, with torch's own TreeSpecs.

torch.utils._pytree walks a tree in Python through its node registry, and rebuilds
one with a recursive ``unflatten``: for a model's parameter dict that is most of a
small step's overhead (issue 19: a third of the time of a 31-layer step). Trees of
dicts, lists, tuples, NamedTuples and the Mappings pardist registers (``_mappings``:
a Hugging Face batch) are flattened here by one
walk that also produces a hashable structure key; the key finds torch's TreeSpec
made the first time (so specs stay torch's, interchangeable with torch.func's), and
each spec gets a rebuilder compiled once from its structure. Any other registered
node type goes to torch's pytree unchanged. While dynamo traces (a compiled step), no
cache is read or grown: dicts, lists and tuples of tensors get torch's TreeSpec made in
one go (``_traced_flatten``), anything else torch's pytree.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

import torch

from pardist.runtime import _mappings
from pardist.runtime._compat import pytree, tracing

__all__ = ["tree_flatten", "tree_leaves", "tree_map", "tree_unflatten"]

_CONTAINERS = (dict, list, tuple)
_specs: dict = {}  # structure key -> torch TreeSpec
# Types that are leaves for torch's pytree on every supported version.
_LEAVES = {
    t
    for t in (torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None))
    if t not in pytree.SUPPORTED_NODES
}
_builders: dict[int, tuple] = {}  # id(spec) -> (spec, number of leaves, rebuild(leaves))
_LEAF = pytree.tree_flatten(0)[1]  # torch's spec of a leaf


# Registered node types flattened by torch's rules, never keyed here: their order or
# context is more than a hashable key shows (an OrderedDict's keys are a list).
_UNKEYED = {collections.OrderedDict, collections.defaultdict, collections.deque}


class _Other(Exception):
    """A node type only torch's pytree knows how to flatten."""


def _walk(node, leaves: list, keyed: bool = True):
    """Append ``node``'s leaves to ``leaves``; return its structure key (None where not
    ``keyed``: only the leaves are wanted, and no dict's keys are touched)."""
    kind = type(node)
    if kind is dict or kind is list or kind is tuple:
        values = node.values() if kind is dict else node
        if _LEAVES.issuperset(map(type, values)):  # all leaves (a dict of tensors): in C
            leaves.extend(values)
            return (kind, tuple(node) if kind is dict else len(node)) if keyed else None
        sub = []
        for v in values:
            if type(v) in _LEAVES:  # most children of a step's trees: no call
                leaves.append(v)
                sub.append(None)
            else:
                sub.append(_walk(v, leaves, keyed))
        return (kind, tuple(node) if kind is dict else len(node), tuple(sub)) if keyed else None
    if issubclass(kind, tuple) and hasattr(kind, "_fields"):  # a NamedTuple
        return (kind, len(node), tuple(_walk(v, leaves, keyed) for v in node))
    if kind not in _mappings.KNOWN and kind not in pytree.SUPPORTED_NODES:
        if isinstance(node, Mapping):
            _mappings.adopt(node)  # a BatchEncoding, a UserDict: a tree from now on
    if kind in _mappings.KNOWN:
        values, context = _mappings.flatten(node)
        sub = tuple(_walk(v, leaves, keyed) for v in values)
        return (kind, context, sub) if keyed else None
    node_def = pytree.SUPPORTED_NODES.get(kind)
    if node_def is not None and kind not in _UNKEYED:  # a registered class (ShardedState)
        children, context = node_def.flatten_fn(node)
        try:
            hash(context)
        except TypeError:
            raise _Other from None  # (a context that is no key: torch's rules, uncached)
        sub = tuple(_walk(c, leaves, keyed) for c in children)
        return (kind, context, sub) if keyed else None
    if node_def is not None or issubclass(kind, (tuple, dict, list)):
        raise _Other  # OrderedDict, structseq, deque: torch's rules
    leaves.append(node)
    return None


def tree_flatten(tree, is_leaf=None) -> tuple[list, pytree.TreeSpec]:
    """``torch.utils._pytree.tree_flatten``, with the spec found by structure."""
    if is_leaf is not None:
        return pytree.tree_flatten(tree, is_leaf=is_leaf)
    if tracing():
        return _traced_flatten(tree) or pytree.tree_flatten(tree)
    leaves: list = []
    try:
        key = _walk(tree, leaves)
    except _Other:
        return _torch_flatten(tree)
    spec = _specs.get(key)
    if spec is None:
        leaves_again, spec = pytree.tree_flatten(tree)
        if len(leaves_again) != len(leaves) or any(
            a is not b for a, b in zip(leaves, leaves_again)
        ):  # never expected: torch's rules win, uncached
            return leaves_again, spec
        _specs[key] = spec
    return leaves, spec


def tree_leaves(tree, is_leaf=None) -> list:
    """``torch.utils._pytree.tree_leaves``: by the walk of :func:`tree_flatten` with no
    structure to key (nor its keys touched), where that walk applies."""
    if is_leaf is not None:
        return pytree.tree_leaves(tree, is_leaf=is_leaf)
    if tracing():
        leaves = []
        return leaves if _traced_spec(tree, leaves, keyed=False) else pytree.tree_leaves(tree)
    leaves: list = []
    try:
        _walk(tree, leaves, keyed=False)
    except _Other:
        return _torch_flatten(tree)[0]
    return leaves


def _torch_flatten(tree) -> tuple[list, pytree.TreeSpec]:
    """torch's flatten, after registering any Mapping it would have left a leaf."""
    leaves, spec = pytree.tree_flatten(tree)
    if not _LEAVES.issuperset(map(type, leaves)) and _mappings.adopt_leaves(leaves):
        return pytree.tree_flatten(tree)
    return leaves, spec


def _source(spec, out: list, consts: list) -> str:
    """A Python expression that rebuilds ``spec`` from a list ``L`` of leaves."""
    if spec.is_leaf():
        out.append(None)
        return f"L[{len(out) - 1}]"
    start = len(out)
    children = _children(spec)
    parts = [_source(child, out, consts) for child in children]
    kind = spec.type
    if kind is dict:
        consts.append(list(spec.context))
        k = len(consts) - 1
        if children and all(c.is_leaf() for c in children):  # a dict of leaves: in C
            return f"dict(zip(C[{k}], L[{start}:{len(out)}]))"
        return "{" + ", ".join(f"C[{k}][{i}]: {p}" for i, p in enumerate(parts)) + "}"
    if kind is list:
        return "[" + ", ".join(parts) + "]"
    if kind is tuple:
        return "(" + "".join(f"{p}, " for p in parts) + ")"
    if kind in _mappings.KNOWN:
        consts.append(_mappings.rebuilder(kind, spec.context))
        return f"C[{len(consts) - 1}]([" + ", ".join(parts) + "])"
    consts.append(kind)  # a NamedTuple
    return f"C[{len(consts) - 1}](" + ", ".join(parts) + ")"


def _builder(spec):
    entry = _builders.get(id(spec))
    if entry is not None and entry[0] is spec:
        return entry
    known = all(
        s.is_leaf()
        or s.type in _CONTAINERS
        or s.type in _mappings.KNOWN
        or hasattr(s.type, "_fields")
        for s in _nodes(spec)
    )
    if not known:
        return None
    out: list = []
    consts: list = []
    source = _source(spec, out, consts)
    rebuild = eval(f"lambda L, C=C: {source}", {"C": consts})  # noqa: S307 - our own code
    entry = (spec, len(out), rebuild)
    if len(_builders) < 4096:
        _builders[id(spec)] = entry
    return entry


def _children(spec) -> list:
    # TreeSpec.children() since 2.15 (children_specs deprecated there), the list before
    children = getattr(spec, "children", None)
    return list(children()) if callable(children) else spec.children_specs


def _nodes(spec):
    yield spec
    for child in _children(spec):
        yield from _nodes(child)


def tree_unflatten(leaves, spec):
    """``torch.utils._pytree.tree_unflatten`` through a rebuilder compiled per spec."""
    if tracing():
        return _traced_unflatten(leaves, spec)
    entry = _builder(spec)
    if entry is None:
        return pytree.tree_unflatten(leaves, spec)
    leaves = list(leaves)
    if len(leaves) != entry[1]:
        return pytree.tree_unflatten(leaves, spec)  # torch's error names the mismatch
    return entry[2](leaves)


def tree_map(fn, tree, *rests, is_leaf=None):
    """``torch.utils._pytree.tree_map``: ``fn`` over the leaves of trees of one structure."""
    if is_leaf is not None:
        return pytree.tree_map(fn, tree, *rests, is_leaf=is_leaf)
    leaves, spec = tree_flatten(tree)
    if not rests:
        return tree_unflatten([fn(x) for x in leaves], spec)
    others = [tree_flatten(r) for r in rests]
    if any(s is not spec for _, s in others):  # torch's rules for prefixes and errors
        return pytree.tree_map(fn, tree, *rests)
    return tree_unflatten([fn(*xs) for xs in zip(leaves, *(o for o, _ in others))], spec)


# While dynamo traces, torch's pytree costs ~100 bytecodes a leaf (a TreeSpec made and
# walked for each): a step's parameter dict is flattened and rebuilt several times. A dict,
# list or tuple of tensors (nested), the common tree, takes a few bytecodes a leaf here, with
# torch's own spec (equal to the one torch.utils._pytree.tree_flatten makes).
def _traced_flatten(tree) -> tuple[list, pytree.TreeSpec] | None:
    leaves: list = []
    spec = _traced_spec(tree, leaves)
    return None if spec is None else (leaves, spec)


def _traced_spec(node, leaves: list, keyed: bool = True) -> pytree.TreeSpec | bool | None:
    kind = type(node)
    if kind is not dict and kind is not list and kind is not tuple:
        return None
    values = list(node.values()) if kind is dict else list(node)
    context = list(node) if kind is dict else None
    for v in values:
        if not isinstance(v, torch.Tensor):
            break
    else:  # a node of tensors only (a parameter dict): the fewest bytecodes
        leaves.extend(values)
        if not keyed:  # (tree_leaves: no spec wanted)
            return True
        return pytree.TreeSpec(kind, context, [_LEAF] * len(values))
    children = []
    for v in values:
        if isinstance(v, torch.Tensor):
            leaves.append(v)
            children.append(_LEAF)
        else:
            child = _traced_spec(v, leaves, keyed)
            if child is None:
                return None
            children.append(child)
    return pytree.TreeSpec(kind, context, children) if keyed else True


def _traced_unflatten(leaves, spec):
    kind = spec.type
    flat = spec.num_nodes == spec.num_leaves + 1  # one node over leaves only
    if not flat or (kind is not dict and kind is not list and kind is not tuple):
        return pytree.tree_unflatten(leaves, spec)
    leaves = list(leaves)
    if len(leaves) != spec.num_leaves:
        return pytree.tree_unflatten(leaves, spec)  # torch's error names the mismatch
    return dict(zip(spec.context, leaves)) if kind is dict else kind(leaves)
