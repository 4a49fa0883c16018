"""``fsdp(params)``: parameters stored as flat shards over an axis (FSDP, ZeRO-3).

Each parameter of ``numel`` n is flattened and cut into ``size`` chunks of
``ceil(n / size)`` elements (torch.chunk's rule, as ``optim.sharded`` cuts its
state): rank k keeps chunk k, as a ``DTensor`` placed ``Shard(0)`` on the axis,
of global shape ``(n,)``. The tree stays a tree of tensors, so the optimizers
update the shards, ``pardist.checkpoint`` saves them shard by shard and reshards
them on load, and ``pardist.specs`` shows ``P('gpu')``.

Only :func:`pardist.functional`'s ``apply`` turns them back into parameters,
module by module, inside a data-parallel step (``_fsdp_apply``). Anywhere else a
shard is not the parameter it stands for; inside ``pardist.grad`` a shard used
outside ``apply`` raises, naming it (:class:`Guarded`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from pardist.runtime import (
    DisableTorchFunctionSubclass,
    _mesh,
    _survive,
    _tree,
    dtensor_local,
    dtensor_spec,
)
from pardist.transport import shard_range

__all__ = [
    "Guarded",
    "axes_of",
    "fsdp",
    "grad_inputs",
    "is_shard",
    "like",
    "original_shape",
    "recorded_shape",
]

# The axes each shard mesh spans (a flattened mesh has one joined name).
_AXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# (key path in the tree given to fsdp, numel) -> the parameter's shape, for error messages.
_SHAPES: dict[tuple[str, int], torch.Size] = {}


def fsdp(params: Any, axis: str | tuple[str, ...] = "gpu", *, mesh: _mesh.Mesh | None = None):
    """Store each parameter as this rank's flat shard over ``axis`` (FSDP, ZeRO-3).

    Each rank keeps about 1/N of every parameter. Inside a data-parallel step,
    ``apply`` (from :func:`pardist.functional`) gathers each module's parameters
    just before the module runs and frees them after; the backward gathers them
    again where it needs them and reduce-scatters the gradients, so
    :func:`pardist.grad` returns this rank's shard of each mean gradient. The
    optimizers (``optim.sgd``, ``optim.adamw``, ``optim.sharded`` over the same
    axis) update the shards, and ``pardist.checkpoint`` saves and reshards them.
    With ``axis='gpu'`` in a step over ``('node', 'gpu')``, parameters are sharded
    within a node and replicated across nodes (torch's HSDP).

    Use it when the replicated parameters, gradients and optimizer state do not
    fit in one device's memory. It moves 1.5x the bytes of plain data
    parallelism; when everything fits, ``data_parallel`` alone (or with
    ``optim.sharded``) is faster.

    Args:
        params: a tree of floating-point tensors (``functional``'s params).
        axis: the mesh axis (or axes) to shard over.
        mesh: default: the current mesh (``with mesh:``, else ``pardist.init``'s).

    Returns:
        The same tree with a ``DTensor`` shard of global shape ``(numel,)`` at
        every leaf.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> apply, params, buffers = pardist.functional(torch.nn.Linear(3, 2))
        >>> params = pardist.fsdp(params)
        >>> pardist.specs(params)
        {'weight': P('gpu'), 'bias': P('gpu')}
        >>> params['weight'].shape  # flat: apply knows the module's shapes
        torch.Size([6])
        >>> pardist.shutdown()
    """
    _survive.refuse_sharded("pardist.fsdp", "the parameters")
    m = mesh or _mesh.current_mesh("fsdp")
    axes = m.axes(axis, "fsdp")
    size, index, sub = m.size(axes), m.index(axes), m.submesh(axes)
    _AXES[sub] = axes
    named = _tree.leaves_with_paths(params, "")
    out = []
    for path, leaf in named:
        where = f"params{path}"
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"pardist.fsdp: {where} is a {type(leaf).__name__}, not a tensor. Pass the "
                "params tree (e.g. functional's params); keep other values out of it."
            )
        if isinstance(leaf, DTensor):
            raise ValueError(
                f"pardist.fsdp: {where} is already a DTensor ({leaf.placements} on "
                f"{leaf.device_mesh.mesh_dim_names}). Pass the full (unsharded) parameters; "
                "to reshard saved shards, load them with pardist.checkpoint.load into a "
                "`like` tree made with pardist.fsdp."
            )
        if not leaf.is_floating_point():
            raise TypeError(
                f"pardist.fsdp: {where} has dtype {leaf.dtype}; only floating-point "
                "parameters can be sharded (they are what gets trained). Keep integer "
                "values out of the params tree."
            )
        start, stop = shard_range(leaf.numel(), size, index)
        local = leaf.detach().reshape(-1)[start:stop].clone()
        _SHAPES[(path, leaf.numel())] = leaf.shape
        out.append(
            DTensor.from_local(
                local, sub, [Shard(0)], shape=(leaf.numel(),), stride=(1,), run_check=False
            )
        )
    return _tree.tree_unflatten(out, _tree.tree_flatten(params)[1])


def is_shard(x: Any) -> bool:
    """Whether ``x`` looks like an FSDP shard: a 1-D DTensor placed Shard(0) on one mesh dim."""
    return (
        isinstance(x, DTensor)
        and x.ndim == 1
        and len(x.placements) == 1
        and isinstance(x.placements[0], Shard)
    )


def axes_of(x: DTensor, mesh: _mesh.Mesh) -> tuple[str, ...] | None:
    """The axes of ``mesh`` that the shard ``x`` is split over, or None if it is on none."""
    sub = x.device_mesh
    axes = _AXES.get(sub)
    if axes is None:
        name = (sub.mesh_dim_names or ("",))[0]
        axes = (name,) if name in mesh.shape else None
    if axes is None or any(a not in mesh.shape for a in axes):
        return None
    import torch.distributed as dist

    theirs = dist.get_process_group_ranks(sub.get_group())
    return axes if theirs == dist.get_process_group_ranks(mesh.group(axes)) else None


def like(local: torch.Tensor, template: DTensor) -> DTensor:
    """``local`` as a DTensor with ``template``'s mesh, placements and global shape."""
    return DTensor(local, dtensor_spec(template), requires_grad=False)


def recorded_shape(key: str, numel: int) -> torch.Size | None:
    """The shape ``fsdp`` saw for the parameter at ``key`` (``"['0.weight']"``), or None."""
    shape = _SHAPES.get((key, numel))
    if shape is None:  # fsdp was given a subtree of this tree: match the path's tail
        shape = next((s for (k, n), s in _SHAPES.items() if n == numel and key.endswith(k)), None)
    return shape


def original_shape(key: str, numel: int) -> str:
    """The parameter's shape as ``fsdp`` saw it, found by its key path, for error messages."""
    shape = _SHAPES.get((key, numel))
    if shape is None:  # fsdp was given a subtree of this tree: match the path's tail
        shape = next((s for (k, n), s in _SHAPES.items() if n == numel and key.endswith(k)), None)
    return f"shape {tuple(shape)}" if shape is not None else f"{numel} elements"


def describe(prefix: str, key: str, shard: DTensor) -> str:
    """``args[0]['w'] (shape (3, 2)) is stored by pardist.fsdp as flat shards over 'gpu'``."""
    names = shard.device_mesh.mesh_dim_names or ("?",)
    axes = _AXES.get(shard.device_mesh, names)
    axis = axes[0] if len(axes) == 1 else tuple(axes)
    return (
        f"{prefix}{key} ({original_shape(key, shard.numel())}) is stored by pardist.fsdp "
        f"as flat shards over axis {axis!r}"
    )


_METADATA = {
    getattr(torch.Tensor, n)
    for n in "size dim numel stride is_floating_point is_complex element_size __len__".split()
} | {torch.autograd.grad, torch.autograd.backward}  # differentiating w.r.t. a shard is its use


class Guarded(DTensor):
    """An FSDP shard given to a function that ``pardist.grad`` differentiates.

    It carries the gradient like any input, and ``apply`` gathers it; any other
    operation on it would compute with a flat shard in place of the parameter,
    so it raises, naming the parameter, its shape, the axis and the fix.
    """

    _pardist_where, _pardist_prefix, _pardist_key = "pardist.grad", "params", ""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # DTensor's C++ fast path on torch 2.10-2.11 runs an operator without calling a
        # subclass's __torch_dispatch__ (torch issue 167051): the check is made here too.
        # Metadata (shape, dtype, requires_grad, ...) computes nothing with the shard.
        if getattr(func, "__name__", None) == "__get__" or func in _METADATA:
            with DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        cls.__torch_dispatch__(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        leaves = _tree.tree_leaves((args, kwargs or {}))
        guard = next(x for x in leaves if isinstance(x, Guarded))
        raise RuntimeError(
            f"{guard._pardist_where}: "
            f"{describe(guard._pardist_prefix, guard._pardist_key, guard)}, and "
            f"{func} used it outside functional's apply. A shard is not the parameter: "
            "apply gathers the full parameter module by module, only while its module "
            "runs. Use the parameter inside the module (a weight-decay term belongs in "
            "the optimizer: optim.adamw(weight_decay=...)), or leave it out of "
            "pardist.fsdp and pass it replicated; for a full copy, outside the "
            "differentiated function, use p.full_tensor().view(shape) on every rank."
        )


def grad_inputs(leaves: list, args: tuple, nums: tuple[int, ...], where: str) -> list:
    """The inputs ``pardist.grad`` differentiates: FSDP shards guarded, the rest detached."""
    keys = [(f"args[{n}]", k) for n in nums for k, _ in _tree.leaves_with_paths(args[n], "")]
    out = []
    for (prefix, key), t in zip(keys, leaves):
        if isinstance(t, DTensor):
            g = Guarded(dtensor_local(t), dtensor_spec(t), requires_grad=True)
            g._pardist_where, g._pardist_prefix, g._pardist_key = where, prefix, key
            out.append(g)
        else:
            out.append(t.detach().requires_grad_())
    return out
