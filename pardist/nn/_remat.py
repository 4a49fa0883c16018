"""Activation checkpointing (JAX's remat) on ``functional``'s models, and ``pardist.remat``.

A checkpointed block keeps only its inputs for the backward, which runs it again
(recomputes it) to get the activations it needs. ``apply`` installs the caller's
tensors in pardist's private skeleton for the length of the call and puts meta
tensors back afterwards, so a recomputation that runs after ``apply`` returned (in
the backward) would find meta tensors, or worse, another call's. So each call that
runs a checkpointed block leaves a :class:`Rerun` behind, and the recomputation
runs under it: the call's params installed again, copies of its buffers (a batch
norm's running statistics are updated once, as without checkpointing), and the
contexts its forward ran in (cross-replica batch norm). That holds for
``torch.utils.checkpoint`` called by the model (both ``use_reentrant`` values,
``checkpoint_sequential``, Hugging Face's ``activation_checkpointing_enable()``) and
for :func:`remat`, which is built on it; the reentrant variant runs as the
non-reentrant one there (``runtime._compat.reroute_checkpoints``).

Random numbers replay: torch's checkpoint restores the generators' state of the
forward for the recomputation, so a dropout mask is drawn again, not anew.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from pardist.collectives import _vma
from pardist.runtime import (
    _lockstep,
    _tree,
    functorch,
    outside_dispatch_modes,
    reroute_checkpoints,
    tracing,
)

__all__ = ["POLICIES", "Remat", "Rerun", "calls", "recomputing", "remat", "remat_blocks"]

_aten = torch.ops.aten
# JAX's dots_saveable: the outputs of matrix products are kept, the rest recomputed
# (torchtitan's selective op checkpointing keeps the same, attention included).
_DOTS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _dots(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _DOTS else CheckpointPolicy.PREFER_RECOMPUTE


# name -> what the forward keeps: None, only the block's inputs (all recomputed);
# a selective-checkpoint policy; or "all" (nothing recomputed: no checkpoint at all).
POLICIES: dict[str, Any] = {
    "nothing_saveable": None,
    "dots_saveable": _dots,
    "everything_saveable": "all",
}


class Remat(NamedTuple):
    """Which blocks of a model ``functional(model, remat=...)`` recomputes, and how.

    Attributes:
        policy: a name of :data:`POLICIES` (``'nothing_saveable'``: recompute
            everything, JAX's default; ``'dots_saveable'``: keep the outputs of matrix
            products; ``'everything_saveable'``: keep everything) or a selective
            checkpoint function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``.
        blocks: ``'auto'`` (the modules of the model's longest list of alike blocks:
            transformer layers, ResNet blocks), module paths, module classes or a
            function ``(path, module) -> bool``.
        every: checkpoint every ``every``-th block only, starting with the first
            (torchtitan's selective layer checkpointing): ``every=2`` recomputes half.
    """

    policy: Any = "nothing_saveable"
    blocks: Any = "auto"
    every: int = 1


def _context_fn(policy: Any, where: str):
    """``torch.utils.checkpoint``'s context_fn for a policy (None: the default one)."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(
                f"{where}: policy={policy!r} is not a remat policy; the policies are "
                f"{sorted(POLICIES)} (or a function (ctx, op, *args, **kwargs) -> "
                "torch.utils.checkpoint.CheckpointPolicy)."
            )
        policy = POLICIES[policy]
    if policy is None or policy == "all":
        return policy
    if not callable(policy):
        raise TypeError(
            f"{where}: policy must be a name of {sorted(POLICIES)} or a function "
            f"(ctx, op, *args, **kwargs) -> CheckpointPolicy; got {policy!r}."
        )
    return functools.partial(create_selective_checkpoint_contexts, policy)


_SCALARS = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size)


def _versions(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor, int]]:
    named = _tree.leaves_with_paths(args, "args") + _tree.leaves_with_paths(kwargs, "kwargs")
    return [(path, t, t._version) for path, t in named if isinstance(t, torch.Tensor)]


def remat(fn: Callable, *, policy: Any = "nothing_saveable") -> Callable:
    """``fn`` whose activations are recomputed in the backward instead of kept (JAX's remat).

    The gradients are those of ``fn`` itself (to float rounding; the same bits where
    ``fn`` computes the same bits twice), inside a step or out, in every mode of
    :func:`pardist.data_parallel`. Dropout draws the same mask again. Built on
    ``torch.utils.checkpoint`` (non-reentrant), with its selective checkpointing
    for the policies that keep some activations.

    Args:
        fn: a pure function of tensors (and other arguments) returning a pytree of
            tensors. It must not change its arguments in place: the recomputation
            would change them again.
        policy: what the forward keeps: ``'nothing_saveable'`` (only ``fn``'s inputs;
            everything else recomputed), ``'dots_saveable'`` (also the outputs of
            matrix products), ``'everything_saveable'`` (everything: ``fn`` as it is),
            or a function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``.

    Returns:
        A function with ``fn``'s signature.

    Example:
        >>> import pardist, torch
        >>> def f(w, x):
        ...     return torch.tanh(x @ w).sum()
        >>> w, x = torch.ones(3, 2), torch.ones(4, 3)
        >>> torch.equal(pardist.grad(pardist.remat(f))(w, x), pardist.grad(f)(w, x))
        True
    """
    where = f"pardist.remat({getattr(fn, '__name__', 'fn')})"
    context = _context_fn(policy, where)
    if context == "all":
        return fn

    @functools.wraps(fn)
    def rematted(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is kept for a backward: nothing to redo
            return fn(*args, **kwargs)
        options = {} if context is None else {"context_fn": context}
        if tracing():  # dynamo's checkpoint: AOTAutograd recomputes
            return checkpoint(fn, *args, use_reentrant=False, **options, **kwargs)
        if functorch.peek_interpreter_stack() is not None:
            raise RuntimeError(_UNDER_TRANSFORM.format(where=where))
        before = _versions(args, kwargs)
        out = checkpoint(fn, *args, use_reentrant=False, **options, **kwargs)
        for path, t, version in before:
            if t._version != version:
                raise RuntimeError(
                    f"{where}: fn changed its argument {path} (shape {tuple(t.shape)}) in "
                    "place; the recomputation in the backward would change it a second "
                    "time. Return the new value instead (as functional's apply returns "
                    "new buffers), or drop the remat."
                )
        for path, leaf in _tree.leaves_with_paths(out, "output"):
            if not isinstance(leaf, (torch.Tensor, *_SCALARS)):
                raise TypeError(
                    f"{where}: fn returned a {type(leaf).__name__} at {path}; a "
                    "recomputed function returns tensors (in dicts, lists, tuples) and "
                    "plain values, so that no tensor escapes the recomputation unseen. "
                    "Return the tensors it holds instead."
                )
        return out

    return rematted


def remat_blocks(skeleton: nn.Module, option: Any, select, where: str) -> int:
    """Make the chosen blocks of ``skeleton`` (pardist's private copy) recompute; how many.

    ``select(skeleton, blocks, where)`` gives the ids of modules named by ``blocks``
    (the FSDP units' selection), for everything but ``'auto'``.
    """
    if option is None:
        return 0
    spec = Remat(policy=option) if isinstance(option, str) else option
    if not isinstance(spec, Remat):
        raise TypeError(
            f"{where}: remat must be None, a policy name of {sorted(POLICIES)} or "
            f"pardist.Remat(policy=..., blocks=..., every=...); got {option!r}."
        )
    if isinstance(spec.every, bool) or not isinstance(spec.every, int) or spec.every < 1:
        raise ValueError(f"{where}: Remat(every={spec.every!r}); give a whole number >= 1.")
    if spec.blocks == "auto":
        blocks = _repeated_blocks(skeleton)
        if not blocks:
            raise ValueError(
                f"{where}: remat blocks='auto' found no list of alike blocks in "
                f"{type(skeleton).__name__} (an nn.ModuleList or nn.Sequential of modules "
                "of one class); name them: pardist.Remat(blocks=['encoder.0', ...]), a "
                "module class, or a function (path, module) -> bool."
            )
    else:
        chosen = select(skeleton, spec.blocks, where)
        blocks = [m for _, m in skeleton.named_modules() if id(m) in chosen]
    for i, block in enumerate(blocks):
        if i % spec.every == 0:
            block.forward = remat(block.forward, policy=spec.policy)
    if _context_fn(spec.policy, where) != "all":  # (everything kept: nothing recomputed)
        _no_cache(skeleton, where)
    return len(blocks[:: spec.every])


def _no_cache(skeleton: nn.Module, where: str) -> None:
    """Hugging Face models write a key-value cache in their forward (``use_cache``, on by
    default for decoders); a recomputation would write it again. As Hugging Face's own
    gradient checkpointing does, the cache is turned off, in pardist's copy of the model
    only, and said once."""
    configs = {}
    for module in skeleton.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            configs[id(config)] = config
    if not configs:
        return
    for config in configs.values():
        config.use_cache = False
    warnings.warn(
        f"{where}: use_cache=True is incompatible with activation checkpointing (the "
        "recomputation would write the key-value cache again); remat= turns it off in "
        "pardist's copy of the model, as Hugging Face's gradient checkpointing does. Pass "
        "use_cache=False to the model's config to silence this.",
        stacklevel=4,
    )


def _repeated_blocks(skeleton: nn.Module) -> list[nn.Module]:
    """The longest list (ModuleList, Sequential) of two or more modules of one class."""
    best: list[nn.Module] = []
    for module in skeleton.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1:
                if len(children) > len(best) and any(True for _ in children[0].parameters()):
                    best = children
    return best


# --- recomputation under the call that ran the forward --------------------------------

_local = threading.local()
_local.calls = []  # (slots, params, buffers, enter) of the apply calls running in a thread


class Rerun:
    """What a recomputation of one ``apply`` call needs: its tensors and its contexts.

    ``enter()``: the contexts the call's forward ran in (cross-replica batch norm).
    """

    __slots__ = ("slots", "params", "buffers", "enter")

    def __init__(self, slots, params: dict, buffers: dict, enter: Callable):
        self.slots, self.params, self.buffers, self.enter = slots, params, buffers, enter

    def wrap(self, fn: Callable) -> Callable:
        def again(*args: Any, **kwargs: Any) -> Any:
            with self._installed():
                return fn(*args, **kwargs)

        return again

    @contextlib.contextmanager
    def _installed(self):
        slots = self.slots
        before = slots.installed()
        # Copies of the buffers: a batch norm's running statistics, updated by the
        # forward, are not updated a second time by the recomputation.
        frozen = slots.frozen_names
        with outside_dispatch_modes():  # pardist's copies: no op of the recomputed region
            buffers = {k: b if k in frozen else b.clone() for k, b in self.buffers.items()}
        slots.put(self.params, buffers)
        calls = _calls()
        calls.append((slots, self.params, self.buffers, self.enter))
        _local.recomputing = getattr(_local, "recomputing", 0) + 1
        try:
            with self.enter(), _lockstep.switching(slots.installed, slots.install), _vma.user():
                yield
        finally:
            _local.recomputing -= 1
            calls.pop()
            slots.install(before)


def _calls() -> list:
    calls = getattr(_local, "calls", None)
    if calls is None:  # a thread's first call
        calls = _local.calls = []
    return calls


def calls() -> list:
    """This thread's stack of running calls: ``apply`` pushes ``(slots, params, buffers,
    enter)`` for the length of its forward (a list push and pop: no cost to speak of)."""
    return _calls()


def recomputing() -> bool:
    """Whether this thread is recomputing a checkpointed block (in a backward)."""
    return getattr(_local, "recomputing", 0) > 0


def _current() -> Callable | None:
    """How a checkpoint started now recomputes: under the running apply call, if any."""
    stack = getattr(_local, "calls", None)
    if not stack:
        return None
    if functorch.peek_interpreter_stack() is not None:
        raise RuntimeError(_UNDER_TRANSFORM.format(where="pardist.functional's apply"))
    return Rerun(*stack[-1]).wrap


_UNDER_TRANSFORM = (
    "{where}: activation checkpointing (torch.utils.checkpoint, Hugging Face's gradient "
    "checkpointing, pardist.remat) cannot run under torch.func transforms, which disable "
    "the saved-tensor hooks that recomputation is made of. pardist.grad outside other "
    "transforms runs it. In data_parallel(step, compile=True) the whole-step graph is "
    "such a transform: the step runs eagerly instead, with the same numbers; to compile "
    "a model that checkpoints, compile its loss: pardist.grad(torch.compile(loss_fn))."
)


reroute_checkpoints(_current)
