"""``broadcast``: every rank gets the source rank's values (its initial parameters).

Differentiable, as JAX's ``pbroadcast``: the result varies over the axis (JAX's type)
and its transpose gives the source the sum of every rank's cotangent, the others
zeros. The ranks first agree on the tree's shapes and dtypes, so that a broadcast into
a tensor of another size is an error naming the leaf, instead of filling part of it
silently (or aborting inside gloo).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pardist import transport
from pardist.collectives import _vma
from pardist.collectives._collectives import _map, guard, lift
from pardist.runtime import Eager, _faults, _mesh, _tree, current_mode, disable_functorch
from pardist.transport import Pbroadcast

__all__ = ["broadcast"]


def broadcast(tree: Any, axis: str | tuple[str, ...] = "gpu", *, src: int = 0) -> Any:
    """Copies of ``tree`` equal to the values on index ``src`` of ``axis``.

    The usual use: make every replica start from rank 0's initial parameters (outside
    a step). Differentiable as JAX's ``pbroadcast``: index ``src`` receives the sum of
    the cotangents, the other ranks zeros.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> pardist.broadcast({'w': torch.ones(2)})
        {'w': tensor([1., 1.])}
        >>> pardist.shutdown()
    """
    return current_mode().run("broadcast", tree, axis, src)


@Eager.register("broadcast")
def _broadcast(mode, tree: Any, axis, src: int) -> Any:
    mesh = _mesh.current_mesh("broadcast")
    names = mesh.axes(axis, "broadcast")
    size = mesh.size(axis, "broadcast")
    if not isinstance(src, int) or not 0 <= src < size:
        raise ValueError(
            f"pardist.broadcast: src={src!r} is not an index of axis {axis!r} (0..{size - 1})."
        )
    if size == 1:
        return _map(tree, "pardist.broadcast", lambda x: x.clone())
    group = mesh.group(axis, "broadcast")
    _agree(tree, group, src, names)
    state = _vma.current()
    guard(state, names, "pardist.broadcast")
    axes = frozenset(names) & state.live if state is not None else frozenset()

    def send(x: torch.Tensor) -> torch.Tensor:
        if state is None:
            return Pbroadcast.apply(x, group, src)
        v = state.get(x)
        with _vma.paused():
            y = Pbroadcast.apply(lift(state, x, axes), group, src)
        return state.set(y, _vma.vary(v, axes))

    return _map(tree, "pardist.broadcast", send)


def _agree(tree: Any, group, src: int, names: tuple) -> None:
    """Every rank's tree must have the source's shapes and dtypes: a broadcast into a
    tensor of another size would fill part of it silently (or abort inside gloo)."""
    mine = [
        (path, tuple(x.shape), str(x.dtype))
        for path, x in _tree.leaves_with_paths(tree, "tree")
        if isinstance(x, torch.Tensor)
    ]
    everyone: list = [None] * dist.get_world_size(group)
    transport.agree("pardist.broadcast", group)
    with _faults.collective_errors("pardist.broadcast", group), _vma.paused():
        with disable_functorch():  # (inside a transform: plain tensors carry the objects)
            dist.all_gather_object(everyone, mine, group=group)
    source = everyone[src]
    for index, theirs in enumerate(everyone):
        if theirs == source:
            continue
        if len(theirs) != len(source):
            problem = f"{len(theirs)} tensors on index {index}, {len(source)} on the source"
        else:
            a, b = next((a, b) for a, b in zip(theirs, source) if a != b)
            problem = (
                f"{a[0]} is {a[1]} {a[2]} on index {index} but {b[1]} {b[2]} on the "
                f"source (index {src})"
            )
        raise ValueError(
            f"pardist.broadcast over {names}: every rank must pass a tree of the source's "
            f"shapes and dtypes; {problem}. Build the receiving tree like the source's "
            "(the same model and arguments on every rank)."
        )
