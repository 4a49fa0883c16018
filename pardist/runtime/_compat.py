"""The one place pardist reaches into torch's private names.

Every private torch name (``torch._...``, ``torch.distributed._...``, ``torch._C``,
private attributes of public classes) that pardist uses is imported or wrapped here,
with why it is needed and since which torch version it behaves as pardist uses it.
Nothing else in pardist names a private torch API (``tests/test_compat.py`` checks),
so a torch release that changes one breaks this module, not pardist's logic.
"""

from __future__ import annotations

import re

import torch

# The oldest torch pardist supports; pyproject.toml says the same. Checked first, before
# anything below touches a private name, so an older torch gets one clear line at
# ``import pardist`` instead of a traceback from deep inside torch.
MINIMUM_TORCH = (2, 11)


def _check_version(version: str) -> None:
    found = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if found < MINIMUM_TORCH:
        want = ".".join(map(str, MINIMUM_TORCH))
        raise ImportError(
            f"pardist needs torch>={want}, but torch {version} is installed: "
            f"pip install 'torch>={want}'"
        ) from None


_check_version(torch.__version__)

import torch.distributed._functional_collectives as funcol  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
from torch._C import DisableTorchFunctionSubclass  # noqa: E402

__all__ = [
    "dcp_storage_info",
    "DisableTorchFunctionSubclass",
    "MINIMUM_TORCH",
    "TorchCompileInductorWrapper",
    "assert_async",
    "checkpoint_op",
    "clone_all",
    "dtensor_like",
    "dtensor_local",
    "dtensor_spec",
    "disable_functorch",
    "disable_torch_function",
    "enable_torch_function",
    "enable_saved_tensors_hooks",
    "flatten_dense",
    "foreach_mul",
    "foreach_norm",
    "funcol",
    "functorch",
    "fused_adam_",
    "fused_adamw_",
    "fused_kernel_devices",
    "inductor_graph_pass",
    "inductor_layout_opt",
    "inductor_lowering",
    "inductor_overlap_passes",
    "make_wrapper_subclass",
    "mark_optimizer_stepped",
    "matches_machine_hostname",
    "never_a_frame",
    "outside_dispatch_modes",
    "pytree",
    "pytree_children",
    "reroute_checkpoints",
    "saved_tensors_hooks_enabled",
    "storage_holders",
    "torchrun_parser",
    "tracing",
    "views_of",
]

# --- imported above (dynamo: on first use) ---------------------------------------------
# dynamo (torch._dynamo): compile=True drives dynamo itself (exc.BackendCompilerFailed,
#   exc.RestartAnalysis, lookup_backend, config.patch) and marks pardist's own entry
#   points ``disable(reason=...)``; ``reason=`` since 2.8, the rest as used since 2.5.
#   ``_compat.dynamo`` imports it on first use (a compiled step's), not with pardist: it
#   is a second of every process's start (issue 56).
# funcol (torch.distributed._functional_collectives): traceable collectives that a
#   compiled step records as graph nodes; as used since 2.5 (still private in 2.15).
# pytree (torch.utils._pytree): the tree flattening torch.func and dynamo use, so that
#   pardist's trees flatten as torch's do; key paths (``flatten_with_keys_fn``,
#   GetAttrKey) since 2.3. torch has no public pytree module (2.15 included).
# DisableTorchFunctionSubclass (torch._C): answers metadata of a tensor subclass
#   without re-entering its __torch_function__; as used since 2.0.

# torch._C._functorch: whether torch.func transforms are running, and unwrapping their
# wrapper tensors (peek_interpreter_stack, is_functorch_wrapped_tensor, get_unwrapped):
# pardist.grad nests inside or around torch.func and must know which. As used since 2.0.
functorch = torch._C._functorch
# torch._C._DisableFuncTorch: plain tensors inside a transform, for pardist's own bookkeeping
# there (the ranks agreeing on a tree's shapes by pickled objects); as used since 2.0.
disable_functorch = torch._C._DisableFuncTorch


# torch.optim.lr_scheduler's check that optimizer.step() ran before scheduler.step(): the
# wrapped step sets ``optimizer._opt_called`` (since 1.1); a converted optimizer's update
# is its step (pardist.optim.from_torch), so it sets the flag, and the script's own
# scheduler.step() is not warned of.
def mark_optimizer_stepped(optimizer) -> None:
    optimizer._opt_called = True


# torch._C.DisableTorchFunction / _EnableTorchFunction: every TorchFunctionMode off (or back
# on) for a block, in C; pardist's own code runs so inside a typed step, untouched by its
# tracking mode (the user's code back on). As torch's own overrides use them, since 1.13.
disable_torch_function = torch._C.DisableTorchFunction
enable_torch_function = torch._C._EnableTorchFunction

# torch._foreach_mul / torch._foreach_norm: one kernel for a list of tensors (gradient
# clipping, loss-scale unscaling), as torch's own optimizers use them; since 1.13.
foreach_mul = torch._foreach_mul
foreach_norm = torch._foreach_norm

# torch._fused_adam_ / torch._fused_adamw_: the fused optimizer kernels torch.optim uses
# with fused=True; CPU support since 2.4, the signature as called since 2.4.
fused_adam_ = torch._fused_adam_
fused_adamw_ = torch._fused_adamw_

# torch._assert_async: a check on a tensor's value that a compiled graph can hold (Python
# cannot branch on it there); raises when the graph runs. With a message since 2.1.
assert_async = torch._assert_async

# inductor's hooks (the wrapper torch.compile builds, graph passes, lowerings, layout):
# the second file of the seam, imported when a step compiles or with the names below.
from pardist.runtime._compat_inductor import (  # noqa: E402
    TorchCompileInductorWrapper,
    inductor_graph_pass,
    inductor_layout_opt,
    inductor_lowering,
    inductor_overlap_passes,
    never_a_frame,
)


def outside_dispatch_modes():
    """A context in which no TorchDispatchMode sees the ops run
    (torch.utils._python_dispatch._disable_current_modes, since 1.13): work that belongs
    to pardist, not to the region a mode watches (a selective checkpoint's recomputation
    must run exactly the forward's ops)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def tracing() -> bool:
    """Whether dynamo traces this call (``torch.compiler.is_compiling``, public since
    2.3): pardist's eager fast paths (maps in C, caches keyed by ``id``, Python numbers
    read off tensors) step aside for what a graph can hold. The one place pardist asks."""
    return torch.compiler.is_compiling()


def fused_kernel_devices() -> tuple[str, ...]:
    """Device types with fused optimizer kernels.

    torch.utils._foreach_utils._get_fused_kernels_supported_devices: the list
    torch.optim checks for fused=True; since 2.1 (includes "cpu" since 2.4).
    """
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return tuple(_get_fused_kernels_supported_devices())


def matches_machine_hostname(host: str) -> bool:
    """Whether ``host`` names this machine (an address or a hostname of it).

    torch.distributed.elastic.rendezvous.utils._matches_machine_hostname: what torchrun
    uses to decide whether a rendezvous endpoint is local; since 1.10.
    """
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return _matches_machine_hostname(host)


def torchrun_parser():
    """torch.distributed.run's argument parser, alike on every version.

    ``--master-port`` defaults to 29500 up to torch 2.11 and to None (not given) since
    2.12. pardist.launch reads None as "no port given" (one machine then gets a port
    from the OS), so the old default would make every one-machine job use 29500 and
    two of them collide. Here it is None everywhere (or PET_MASTER_PORT, as torchrun).
    """
    import os

    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.set_defaults(master_port=os.environ.get("PET_MASTER_PORT"))
    return parser


def pytree_children(node) -> list | None:
    """One level of a pytree node as ``[(key, child)]``, or None for a leaf.

    torch.utils._pytree._get_node_type and SUPPORTED_NODES (the registry, with each
    type's ``flatten_with_keys_fn``): pytree has no public one-level flatten with keys;
    as used since 2.3.
    """
    entry = pytree.SUPPORTED_NODES.get(pytree._get_node_type(node))
    if entry is None:
        return None
    children, _ = entry.flatten_with_keys_fn(node)
    return list(children)


def make_wrapper_subclass(cls, shape, *, dtype, device) -> torch.Tensor:
    """torch.Tensor._make_wrapper_subclass: a tensor subclass with metadata and no data.

    What DTensor and torch's own subclasses are built with; keyword form since 2.0.
    """
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)


def dcp_storage_info() -> type:
    """DCP's ``_StorageInfo`` (filesystem.py): a record its checkpoint index pickles, which
    pardist's index reader allows by its module and name (``runtime/_safe_index``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def dtensor_local(d) -> torch.Tensor:
    """DTensor._local_tensor: this rank's shard, outside autograd.

    DTensor.to_local() is public but differentiable (and waits on async shards);
    pardist needs the plain tensor it wraps. Attribute name as used since 2.0. In a
    graph dynamo traces, ``to_local()`` (the attribute is not traceable).
    """
    return d.to_local() if tracing() else d._local_tensor


def dtensor_like(local: torch.Tensor, like):
    """``local`` as a DTensor with ``like``'s mesh, placements and global shape, without a
    collective: torch's own ``DTensor(local, spec)``, or in a graph dynamo traces
    ``DTensor.from_local`` (a DTensorSpec is not traceable)."""
    from torch.distributed.tensor import DTensor

    if tracing():
        return DTensor.from_local(
            local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride(),
            run_check=False,
        )  # fmt: skip
    return DTensor(local, like._spec, requires_grad=False)


def dtensor_spec(d):
    """DTensor._spec: the DTensorSpec (mesh, placements, shape) to build a DTensor with.

    ``DTensor(local, spec, requires_grad=...)`` is how torch itself makes one without a
    collective; as used since 2.4.
    """
    return d._spec


# torch._C._storage_Use_Count(storage._cdata): how many references hold a tensor's
# storage. pardist reuses a buffer it handed out only when no caller still holds a
# view of it. The raw number differs by version: asking makes a temporary storage
# object that counts itself on torch >= 2.10 (a lone tensor reads 2), not on <= 2.9
# (reads 1). So the count of a lone fresh tensor is measured once, here, and
# subtracted, instead of assuming a constant.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _raw_use_count(t: torch.Tensor) -> int:
    return _use_count(t.untyped_storage()._cdata)


_LONE = _raw_use_count(torch.empty(1)) if _use_count is not None else 1


def storage_holders(t: torch.Tensor) -> int:
    """How many tensors hold ``t``'s storage: 1 for a lone tensor on every torch version.

    Without torch's counter, a number so large that no buffer is ever taken for free.
    """
    if _use_count is None:
        return 1 << 30
    return _raw_use_count(t) - _LONE + 1


# torch._foreach_clone (2.13+): clones a list of tensors in one call into C, each as
# Tensor.clone() does (memory format preserved). It has no vmap batching rule.
_foreach_clone = getattr(torch, "_foreach_clone", None)


def clone_all(tensors: list) -> list:
    """``[t.clone() for t in tensors]``, in one call where torch can (not under vmap)."""
    if _foreach_clone is not None and tensors:
        try:
            return _foreach_clone(tensors)
        except RuntimeError:  # a functorch transform without a rule for it
            pass
    return [t.clone() for t in tensors]


# DDP's and apex's bucket helpers (torch._utils._flatten_dense_tensors and its inverse):
# the loops of view(-1) / narrow().view() in C++, since torch 1.0.
_flatten = getattr(torch._C._nn, "flatten_dense_tensors", None)
_unflatten = getattr(torch._C._nn, "unflatten_dense_tensors", None)


def flatten_dense(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened (row-major) and concatenated, in one call into C++."""
    if _flatten is None:  # pragma: no cover - every supported torch has it
        return torch.cat([t.reshape(-1) for t in tensors])
    return _flatten(tensors)


def views_of(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Row-major views of ``flat`` shaped like each of ``like`` (nonempty), one after
    another, in one call into C++ (``like`` may be meta tensors: only shapes are read)."""
    if _unflatten is None:  # pragma: no cover - every supported torch has it
        out, start = [], 0
        for t in like:
            out.append(flat[start : start + t.numel()].view(t.shape))
            start += t.numel()
        return out
    return _unflatten(flat, like)


# torch._C._dynamo.guards.TensorGuards: the C++ check dynamo runs on a compiled graph's
# tensor inputs (Python type, dispatch keys, dtype, device, sizes, strides; in
# torch/csrc/dynamo/guards.cpp since 2.0, called with these keywords since 2.1).
try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - a torch without it: no guard, every check runs
    _TensorGuards = None


def tensor_guard(tensors: list[torch.Tensor]):
    """A guard made for ``tensors``, whose ``check(*others)`` says in one pass in C
    whether ``others`` match them position by position; None where this torch has none."""
    if _TensorGuards is None:
        return None
    try:
        guard = _TensorGuards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],  # every size static
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )
        return guard if guard.check(*tensors) else None
    except (TypeError, RuntimeError):  # another torch's signature: no guard
        return None


# torch.utils.checkpoint's two implementations, as ``checkpoint()`` looks them up by their
# module-global names on every call: the non-reentrant generator, which takes the function
# whose second run is the recomputation (``checkpoint()`` itself runs the first) as its
# first argument (``_checkpoint_without_reentrant_generator`` since 2.1;
# ``_checkpoint_without_reentrant_generator_impl`` since 2.14, the older name a shim that
# calls it); ``CheckpointFunction``, the reentrant autograd Function. Both are kept as they
# are; ``reroute_checkpoints`` only puts a front on each.
_ckpt = torch.utils.checkpoint
_GENERATOR = next(
    name
    for name in (
        "_checkpoint_without_reentrant_generator_impl",
        "_checkpoint_without_reentrant_generator",
    )
    if hasattr(_ckpt, name)
)
_without_reentrant = getattr(_ckpt, _GENERATOR)
_Reentrant = _ckpt.CheckpointFunction


def reroute_checkpoints(lookup) -> None:
    """Give torch.utils.checkpoint's recomputations to ``lookup()`` where it has a say.

    ``lookup()`` returns None (torch as it is) or ``wrap``: a recomputation then runs
    ``wrap(fn)`` instead of ``fn``, and ``use_reentrant=True`` runs as
    ``use_reentrant=False`` (the same recomputation, which autograd.grad and nested
    checkpoints can run; the reentrant one gives no gradient to parameters when no
    input requires one). Idempotent: the fronts ask ``lookup`` on every call, and pass
    straight through where it says None, so checkpoints outside pardist are untouched.
    """
    if getattr(getattr(_ckpt, _GENERATOR), "pardist_lookup", None):
        return

    def generator(fn, *args, **kwargs):
        wrap = lookup()
        return _without_reentrant(fn if wrap is None else wrap(fn), *args, **kwargs)

    class Reentrant:
        @staticmethod
        def apply(function, preserve_rng_state, *args):
            if lookup() is None:
                return _Reentrant.apply(function, preserve_rng_state, *args)
            return _ckpt.checkpoint(
                function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state
            )

    generator.pardist_lookup = lookup
    setattr(_ckpt, _GENERATOR, generator)
    _ckpt.CheckpointFunction = Reentrant


# torch._C._autograd._saved_tensors_hooks_is_enabled / _saved_tensors_hooks_enable: torch.func
# disables saved-tensor hooks while its grad transform runs; when dynamo graph-breaks inside
# a traced torch.func.grad and the eager remainder raises, they stay disabled (torch 2.11 to
# 2.15), and every later checkpoint in the process fails. A compiled step that falls back
# to eager puts them back as they were. Since 2.0.
def saved_tensors_hooks_enabled() -> bool:
    return torch._C._autograd._saved_tensors_hooks_is_enabled()


def enable_saved_tensors_hooks() -> None:
    torch._C._autograd._saved_tensors_hooks_enable()


# torch.ops.higher_order.tag_activation_checkpoint: what dynamo records for a
# torch.utils.checkpoint call in a graph (since 2.1); None where this torch has none.
checkpoint_op = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)


def __getattr__(name: str):
    """``dynamo``: torch._dynamo, imported when a compiled step first asks for it."""
    if name == "dynamo":
        import torch._dynamo

        return torch._dynamo
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
