"""Low-communication training: local SGD and DiLoCo, as a combinator over a step.

Each replica (a rank, or a node of a ``('node', 'gpu')`` mesh) runs ``every`` steps of
its own (the *inner* steps: its own optimizer, no gradient mean across replicas), then
the replicas meet once: the mean of their parameters becomes the new global
parameters (local SGD), or, in DiLoCo (Douillard et al. 2023), the mean of their
deltas from the last global parameters is the gradient of an *outer* optimizer
(Nesterov SGD in the paper) that updates them. Every replica then restarts from the
global parameters, keeping its inner optimizer's state. The replicas communicate
``every`` times less than data parallelism does.

The state goes in and comes out (a :class:`DiLoCoState` of tensors), so it checkpoints
and resumes exactly, the position within the ``every`` steps included. The mean over
the replicas is an all-gather summed in replica order, the same bits on every rank and
at any world size (as a one-process loop over the replicas adds them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from pardist.collectives import all_gather
from pardist.runtime import _mesh, _tree

__all__ = ["DiLoCo", "DiLoCoState", "diloco", "local_sgd"]


class DiLoCoState(NamedTuple):
    """Everything a low-communication run carries from step to step.

    Attributes:
        params: this replica's parameters.
        inner: the inner step's own state (its optimizer's, buffers), this replica's.
        anchor: the global parameters of the last meeting (what the outer step updates).
        outer: the outer optimizer's state (``()`` for local SGD).
        count: inner steps taken (an int64 tensor): the replicas meet when it is a
            multiple of ``every``.
    """

    params: Any
    inner: Any
    anchor: Any
    outer: Any
    count: torch.Tensor


# A state is data: torch.load(weights_only=True) reads a torch.save of it (issue 48).
torch.serialization.add_safe_globals([DiLoCoState])


class DiLoCo(NamedTuple):
    """``init(params, inner_state) -> state``; ``step(state, *args) -> (state, *out)``, where
    ``out`` is what the inner step returned after its params and state (its loss).

    ``saved(state)`` is the state for :func:`pardist.checkpoint.save`: the replicas' own
    parts (params, inner state) as DTensors split over the replicas' axis, one block
    each, since they differ between replicas; ``restored(tree)`` turns what
    ``pardist.checkpoint.load(path, saved(state))`` gives back into a state.
    """

    init: Callable[..., DiLoCoState]
    step: Callable[..., tuple[DiLoCoState, Any]]
    saved: Callable[[DiLoCoState], Any]
    restored: Callable[[Any], DiLoCoState]


def diloco(step: Callable, outer: Any = None, *, every: int, axis: str = "gpu") -> DiLoCo:
    """Run ``step`` as DiLoCo's inner step: the replicas over ``axis`` meet every ``every``.

    Args:
        step: the inner step, ``step(params, inner_state, *args) -> (params, inner_state,
            *out)``: a plain function (each rank a replica of its own, no collective) or a
            :func:`pardist.data_parallel` step over the axes inside a replica (``'gpu'``,
            with ``axis='node'``: data parallelism within a node, DiLoCo across nodes).
        outer: the outer optimizer (``pardist.optim.sgd(0.7, momentum=0.9,
            nesterov=True)``, the paper's), given the mean delta of the replicas'
            parameters from the last global ones as its gradient; None: local SGD (the
            mean of the replicas' parameters).
        every: inner steps between meetings (DiLoCo's H); 1 with ``outer=None`` is
            data parallelism by parameter averaging.
        axis: the mesh axis over which the replicas meet.

    Returns:
        A :class:`DiLoCo`: ``init`` and ``step``, pure functions of the state.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> opt = pardist.optim.sgd(0.1)
        >>> def inner(p, s, x):
        ...     g = pardist.grad(lambda p: (x @ p['w']).pow(2).mean())(p)
        ...     p, s = opt.update(g, s, p)
        ...     return p, s
        >>> outer = pardist.optim.sgd(0.7, momentum=0.9, nesterov=True)
        >>> run = pardist.diloco(inner, outer, every=2)
        >>> params = {'w': torch.ones(3)}
        >>> state = run.init(params, opt.init(params))
        >>> for _ in range(4):
        ...     state, *_ = run.step(state, torch.ones(2, 3))
        >>> int(state.count)
        4
        >>> pardist.shutdown()
    """
    where = f"pardist.diloco({getattr(step, '__name__', 'step')})"
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"{where}: every={every!r}; give the number of inner steps between meetings of "
            "the replicas, an int >= 1 (DiLoCo's H: 1 meets every step)."
        )
    if not isinstance(axis, str):
        raise TypeError(f"{where}: axis={axis!r}; give one mesh axis name, e.g. 'node'.")

    def init(params: Any, inner_state: Any) -> DiLoCoState:
        _check_params(params, where)
        anchor = _tree.tree_map(_copy, params)
        return DiLoCoState(
            params=params,
            inner=inner_state,
            anchor=anchor,
            outer=() if outer is None else outer.init(anchor),
            count=torch.zeros((), dtype=torch.int64),
        )

    def step_fn(state: DiLoCoState, *args: Any) -> tuple[DiLoCoState, Any]:
        if not isinstance(state, DiLoCoState):
            raise TypeError(f"{where}: state is a {type(state).__name__}; pass what init returned.")
        params, inner_state, *out = step(state.params, state.inner, *args)
        count = state.count + 1
        anchor, outer_state = state.anchor, state.outer
        if int(count) % every == 0:
            mean = _replica_mean(params, axis, where)
            if outer is None:
                anchor = mean
            else:
                _check_outer(outer, outer_state, anchor, where)
                delta = _tree.tree_map(torch.sub, anchor, mean)  # the outer gradient
                anchor, outer_state = outer.update(delta, outer_state, anchor)
            params = _tree.tree_map(_copy, anchor)  # every replica restarts from them
        new = DiLoCoState(params, inner_state, anchor, outer_state, count)
        return (new, *out)

    def saved(state: DiLoCoState) -> DiLoCoState:
        mesh = _mesh.current_mesh(where)
        size = mesh.size(axis, where)
        placements = [Shard(0) if name == axis else Replicate() for name in mesh.shape]

        def split(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            local = t.detach()[None]
            return DTensor.from_local(
                local, mesh.device_mesh, placements, run_check=False,
                shape=(size, *t.shape), stride=(t.numel(), *t.stride()) if t.dim() else (1,),
            )  # fmt: skip

        own = _tree.tree_map(split, (state.params, state.inner))
        return state._replace(params=own[0], inner=own[1])

    def restored(tree: DiLoCoState) -> DiLoCoState:
        mine = lambda t: t.to_local()[0] if isinstance(t, DTensor) else t  # noqa: E731
        own = _tree.tree_map(mine, (tree.params, tree.inner))
        return tree._replace(params=own[0], inner=own[1])

    return DiLoCo(init, step_fn, saved, restored)


def local_sgd(step: Callable, *, every: int, axis: str = "gpu") -> DiLoCo:
    """Local SGD: each replica steps alone; every ``every`` steps the parameters are
    averaged over ``axis``. :func:`diloco` with no outer optimizer."""
    return diloco(step, None, every=every, axis=axis)


def _copy(t: Any) -> Any:
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def _check_params(params: Any, where: str) -> None:
    for path, leaf in _tree.leaves_with_paths(params, "params"):
        if isinstance(leaf, DTensor):
            raise NotImplementedError(
                f"{where}: {path} is a pardist.fsdp shard; DiLoCo averages whole "
                "parameters across replicas, which FSDP shards are not. Shard within a "
                "replica's axis only when that is supported; use replicated parameters "
                "(or optim.sharded for the inner optimizer's state) for now."
            )


def _replica_mean(params: Any, axis: str, where: str) -> Any:
    """The mean over the replicas, each element's values added in replica order (exact).

    The ranks of one replica (the mesh's other axes, over which its parameters are
    replicated) split the work: each gathers only its 1/k of every parameter across the
    replicas, adds it up, and the replica's ranks then all-gather their means. Between
    replicas (the slow link) each parameter crosses once per replica, not k times.
    """
    mesh = _mesh.current_mesh(where)
    size = mesh.size(axis, where)
    if size == 1:
        return _tree.tree_map(_copy, params)
    within = tuple(name for name in mesh.shape if name != axis)
    k = mesh.size(within) if within else 1
    mine = mesh.index(within) if within else 0
    leaves, treedef = _tree.tree_flatten(params)
    width = [-(-t.numel() // k) for t in leaves]  # each rank's slice (the last one padded)
    slices = []
    for t, w in zip(leaves, width):
        flat = t.detach().reshape(-1)
        if w * k != flat.numel():
            flat = torch.cat([flat, flat.new_zeros(w * k - flat.numel())])
        slices.append(flat[mine * w : (mine + 1) * w].reshape(1, w))
    means = []
    for every in all_gather(slices, axis):  # (replicas, w) each: added in replica order
        total = every[0].clone()
        for row in every[1:]:
            total.add_(row)
        means.append(total.div_(size).reshape(1, -1))
    if k > 1:
        means = all_gather(means, within)  # (k, w) each: the replica's slices in order
    out = [m.reshape(-1)[: t.numel()].view(t.shape).clone() for t, m in zip(leaves, means)]
    return _tree.tree_unflatten(out, treedef)


def _check_outer(outer: Any, state: Any, anchor: Any, where: str) -> None:
    """The outer state has the layout ``outer.init`` gives these parameters (on meta)."""
    want = outer.init(_tree.tree_map(lambda t: t.detach().to("meta"), anchor))
    want_leaves, want_def = _tree.tree_flatten(want)
    got_def = _tree.tree_flatten(state)[1]
    if got_def != want_def:
        raise ValueError(
            f"{where}: the outer optimizer's state has the tree {got_def}, but "
            f"outer.init(params) gives {want_def}: it was made for other parameters or "
            "another optimizer. Make it with the DiLoCo's init (or outer.init(params))."
        )
    for (path, g), w in zip(_tree.leaves_with_paths(state, "state.outer"), want_leaves):
        if isinstance(w, torch.Tensor) and (
            not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype
        ):
            shown = f"{tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else repr(g)
            raise ValueError(
                f"{where}: {path} is {shown}, but the outer optimizer's state for these "
                f"parameters has {tuple(w.shape)} {w.dtype} there: it was made for other "
                "parameters. Make it with the DiLoCo's init (or outer.init(params))."
            )
