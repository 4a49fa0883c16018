"""Keeping a compiled graph out of the gradients' sums in shared memory.

The whole-step graph's update reads each bucket's sum where ``_beside``'s wait returns
it: in the common area of shared memory, which every rank reads and the next step
rewrites. A graph must therefore never compute into that memory, nor let it out:

- inductor would reuse the wait's output buffer for a later tensor of its size once the
  sum is dead, or compute a pointwise kernel in place over it (the new parameters, in
  memory the next step rewrites: 0.45 off in ``test_compile``'s spellings test without
  this). :func:`guard` lowers the wait so that inductor never does
  (``never_reuse_buffers``, inductor's own mark for buffers it must not reuse);
- a sum the graph returns, or writes into (an in-place operator, as inductor's
  reinplacing pass makes of a functional ``_foreach_add`` or a scatter), is copied
  first, at that lowering (:func:`_escapes` reads the graph as inductor lowers it);
- any other backend (``aot_eager``, a user's) gives every sum its own copy
  (:func:`copy_out`), as the wait did before it returned shared memory.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx

from pardist.compile import _beside  # noqa: F401  (registers torch.ops.pardist.shm_sum_wait)
from pardist.runtime import inductor_lowering

__all__ = ["copy_out", "guard"]


def _wait_node(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in (
        torch.ops.pardist.shm_sum_wait.default,
        torch.ops.pardist.shm_sum_wait,
    )


def copy_out(gm: torch.fx.GraphModule) -> None:
    """Give every sum in ``gm`` (dynamo's graph) its own copy, where no :func:`guard`
    keeps the compiler from writing into shared memory (any backend but inductor)."""
    for node in [n for n in gm.graph.nodes if _wait_node(n)]:
        with gm.graph.inserting_after(node):
            copy = gm.graph.call_function(torch.clone, (node,))
        node.replace_all_uses_with(copy, delete_user_cb=lambda user, c=copy: user is not c)
    gm.recompile()


def _escapes(node: torch.fx.Node) -> bool:
    """Whether the graph returns ``node`` or a view of it, or writes into one (an
    in-place operator, as inductor's reinplacing pass makes of a ``_foreach_mul``)."""
    todo = [node]
    while todo:
        n = todo.pop()
        for user in n.users:
            if user.op == "output":
                return True
            if user.target is operator.getitem:  # an element of a list of views
                todo.append(user)
                continue
            schema = getattr(user.target, "_schema", None)
            if schema is None:  # a higher-order operator, a Python function: unknown
                return True
            # The arguments that hold it, and whether the operator writes or returns them
            # (a view of it; a list of views aliases any argument).
            held = [
                a.alias_info for a, v in zip(schema.arguments, _bound(user, schema)) if _holds(v, n)
            ]
            if any(info is not None and info.is_write for info in held):
                return True
            sets = [r.alias_info.before_set for r in schema.returns if r.alias_info]
            views = set().union(*sets) if all(sets) else None
            if sets and any(i and (views is None or views & i.before_set) for i in held):
                todo.append(user)
    return False


def _holds(value, node: torch.fx.Node) -> bool:
    """Whether an argument's ``value`` is ``node`` or a list holding it."""
    return any(x is node for x in (value if isinstance(value, (list, tuple)) else [value]))


def _bound(node: torch.fx.Node, schema) -> list:
    """``node``'s arguments in ``schema``'s order (None where not given)."""
    values = list(node.args) + [None] * (len(schema.arguments) - len(node.args))
    for i, arg in enumerate(schema.arguments):
        values[i] = node.kwargs.get(arg.name, values[i])
    return values


@functools.cache
def guard() -> bool:
    """Keep inductor from writing into the sums' shared memory: the wait's output is never
    a buffer inductor reuses or computes in place (``never_reuse_buffers``), and a sum
    the graph returns or writes is copied first (the next step rewrites that memory, and
    the other ranks read it until they are done). The update then reads the sums where
    they were summed, as the eager step's does. False where this torch's inductor has
    no such hooks: :func:`copy_out` then gives every sum its own copy."""
    return inductor_lowering(torch.ops.pardist.shm_sum_wait.default, _lower)


def _lower(out, clone, graph):
    """The wait's lowering, given inductor's fallback kernel's output ``out``, its clone
    lowering and the graph being lowered."""
    never = getattr(graph, "never_reuse_buffers", None)
    if never is None:  # (caught: the step runs eagerly, saying why)
        raise RuntimeError(
            "pardist: this torch's inductor has no never_reuse_buffers, which keeps it "
            "from computing into the gradients' sums in shared memory. Compile with "
            "PARDIST_SHM=0 (torch's functional collectives) or another torch version."
        )
    never.add(out.get_name())  # (the copy's buffer too would otherwise be this one)
    node = getattr(graph, "current_node", None)
    return clone(out) if node is None or not _wait_node(node) or _escapes(node) else out
