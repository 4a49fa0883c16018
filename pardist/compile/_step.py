"""``data_parallel(step, compile=True)``: the whole step as one compiled graph.

JAX users jit their data-parallel step: one graph for the forward, the backward,
the gradient mean and the update. A pure step over parameter trees is the
easiest thing in PyTorch to compile, since there is no module state and no hook
on a model. ``data_parallel`` keeps its eager bookkeeping outside the graph
(specs, the first call's replication check, donation), and hands the step to
``torch.compile`` inside a step context whose collectives, ``pardist.grad`` and
optimizers take traceable paths: gradients by ``torch.func.grad_and_value``,
means in flat buckets of the graph (``_traced``), batch-norm statistics by a
traced all-gather, updates by torch's foreach kernels.

Everything the traced code reads from outside is a :class:`Plan` of constants
made once per step signature, so a second call does not recompile; each step
gets its own code object, so steps never share dynamo's recompilation budget.

A step that cannot be compiled (Python control flow on tensor values, an
unsupported call) falls back to the eager step with one warning that names the
reason; ranks agree on that choice before any of them runs the graph, so they
never mix compiled and eager collectives.
"""

from __future__ import annotations

import functools
import logging
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pardist.compile import _aliases, _backend, _beside
from pardist.compile._plan import AxisInfo, Plan, make_plan
from pardist.runtime import (
    CallState,
    Compiled,
    CompiledLoss,
    Mode,
    StepContext,
    _compat,
    _context,
    _tree,
    enable_saved_tensors_hooks,
    saved_tensors_hooks_enabled,
)

__all__ = [
    "EAGER",
    "AxisInfo",
    "CompiledStep",
    "Plan",
    "compiled_step",
    "constant_result",
    "outer_compile",  # noqa: F822 (made on first use: the module's __getattr__)
]

EAGER = object()  # returned when the step must run eagerly
_OPTIONS = ("fullgraph", "dynamic", "backend", "mode", "options")


def _run_traced(fn, plan: Plan, args: tuple, kwargs: dict):
    """The function dynamo traces: the step inside a context of the plan's constants.

    The step sees aliases of its inputs, made inside the graph, and the context holds
    those aliases themselves as a dict's keys (not their ``id()``: dynamo cannot trace
    the id of a tensor the graph made, torch 2.11, and guards on the ids of inputs; it
    hashes a tensor by identity). Writes through an alias reach the input (donation), and
    a donated input the step returns comes back as the input itself (``_aliases``),
    as in the eager step. Identity is looked up, never searched: dynamo runs every loop's
    bytecode as it traces (a search per output over the donated inputs took a fifth of a
    GPT's tracing).
    """
    seen: list = []
    args = _aliases.aliased(args, seen)
    if kwargs:
        kwargs = _tree.tree_map(
            lambda x: x.view_as(x) if isinstance(x, torch.Tensor) else x, kwargs
        )
    ctx = StepContext(
        name=plan.name,
        mesh=None,
        axis=plan.axis,
        size=plan.size,
        varying=dict.fromkeys(seen[i] for i in plan.sharded),
        donated=dict.fromkeys(seen[i] for i in plan.donated),
        inputs=dict.fromkeys(x for x in seen if isinstance(x, torch.Tensor)),
        reducers={},
        scatter=plan.scatter,
        compression=plan.compression,
        bucket_bytes=plan.bucket_bytes,
        first_bucket_bytes=plan.first_bucket_bytes,
        mode=Compiled(plan),
        call=CallState(),
    )
    _context.push(ctx)
    try:
        return fn(*args, **kwargs)
    finally:
        _context.pop()


def _own_code(f: types.FunctionType) -> types.FunctionType:
    """A copy of ``f`` with its own code object: dynamo keeps caches per code object."""
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__)
    return functools.update_wrapper(g, f)


# Distinct input signatures (shapes, dtypes) a step compiles for before it runs eagerly:
# within dynamo's recompile limit (8), so that varying shapes never crash a step.
MAX_SIGNATURES = 6


_constants: list = []  # (module globals, name): functions a graph holds as constants


def constant_result(fn: Callable) -> Callable:
    """``fn``, to be ``torch.compiler.assume_constant_result`` in graphs: decorated when the
    first step compiles (the decorator imports dynamo: not with pardist). Call it by its
    module's global name, as a traced function does."""
    _constants.append((fn.__globals__, fn.__name__))
    return fn


def _decorate_constants() -> None:
    while _constants:
        where, name = _constants.pop()
        where[name] = torch.compiler.assume_constant_result(where[name])


class CompiledStep:
    """The compiled form of one ``data_parallel`` step, with its eager fallback."""

    def __init__(self, options: dict, where: str):
        _decorate_constants()
        unknown = set(options) - set(_OPTIONS)
        if unknown:
            raise TypeError(
                f"{where}: compile= takes True or a dict of torch.compile arguments "
                f"{_OPTIONS}; got {sorted(unknown)}."
            )
        opts = {"fullgraph": True, "dynamic": None, "backend": "inductor", **options}
        self.backend = _backend.Backend(
            opts["backend"], opts.get("mode"), opts.get("options"), opts["dynamic"]
        )
        self.compiled = torch.compile(
            _own_code(_run_traced),
            fullgraph=opts["fullgraph"],
            dynamic=opts["dynamic"],
            backend=self.backend,
        )
        self.plans: dict = {}
        self.fallback: str | None = None  # why the step runs eagerly, once decided
        self.loss_options = {k: opts.get(k) for k in ("backend", "mode", "options", "dynamic")}
        self.losses: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # How the step runs once it cannot be one graph: its loss compiled in an eager
        # step, the most a graph can hold of it (None: eagerly, as for model axes).
        self.eager_mode: Mode | None = CompiledLoss(self.compiled_loss)
        self.calls = 0
        self.signatures: list = []  # the inputs' (shape, dtype)s compiled for, in order
        self.batches: list = []  # their sharded inputs' (shape, dtype)s, for warnings
        self.sizes: tuple | None = None  # the first call's batch sizes
        self.dynamic = False  # whether the batch dimension is marked dynamic

    def __call__(self, step: Any, args: tuple, kwargs: dict, mesh, axes, sharded, donated, scatter):
        if self.fallback is not None:
            return EAGER
        model = {a: n for a, n in mesh.shape.items() if n > 1 and a not in axes}
        if model or not axes:
            # Values that vary over model axes need pardist's tracking of varying axes
            # (JAX's transposes), which lives in eager Python. The mesh is the same on
            # every rank, so every rank decides this alike without agreeing.
            self.fallback = (
                f"its mesh has axes beyond the data axes {axes}: {model}; tensor parallelism "
                "is compiled only where those axes have size 1"
                if axes
                else "it has no data axis"
            )
            self.eager_mode = None  # (pardist's tracking of varying axes is eager Python)
            _warn(step.where, self.fallback, None)
            return EAGER
        leaves = _tree.tree_leaves(args)
        varying = tuple(sharded) + tuple(
            i for i, x in enumerate(leaves) if isinstance(x, DTensor) and i not in sharded
        )
        key = (id(mesh), axes, varying, tuple(donated), scatter)
        if key not in self.plans:
            # pardist.fsdp shards: the axes they are split over, or why not compiled
            # (sharding registers this rule: it sits above compile)
            fsdp, chunks = Compiled(None).run("fsdp_layout", args, mesh, axes)
            if fsdp:  # (a loss over pardist.fsdp shards is not compiled in an eager step)
                self.eager_mode = None
            if isinstance(fsdp, str):
                self.fallback, self.eager_mode = fsdp, None
                _warn(step.where, self.fallback, None)
                return EAGER
            self.plans[key] = make_plan(step, mesh, axes, varying, donated, scatter, fsdp, chunks)
        first = self.calls == 0
        self.calls += 1
        if self._changed(leaves, self.plans[key].sharded):
            _warn(step.where, self.fallback, self.eager_mode)
            return EAGER
        self.backend.agreeing, self.backend.verdict = first, None
        hooks = saved_tensors_hooks_enabled()
        plan = self.plans[key]
        try:
            with quiet_loggers():
                if not first:
                    return self._run(step, plan, args, kwargs)
                # Hyper-parameters read as Python floats (batch norm's momentum, eps) are
                # constants: specialized now, dynamo need not trace twice to learn it.
                with _compat.dynamo.config.patch(specialize_float=True):
                    return self._run(step, plan, args, kwargs)
        except Exception as e:
            _beside.abandon()  # sums it started and never waited for
            if hooks and not saved_tensors_hooks_enabled():  # left off by torch.func: back on
                enable_saved_tensors_hooks()
            if not first:
                if not any(k in type(e).__name__ for k in ("RecompileLimit", "CacheLimit")):
                    raise
                self.fallback = f"{_backend.reason(e)}; shapes seen: {self._shapes()}"
                _warn(step.where, self.fallback, self.eager_mode)
                return EAGER
            if self.backend.verdict is None:  # this rank failed before compiling
                verdict = _backend.agree(_backend.reason(e))
            else:  # the ranks agreed already (inside the backend)
                verdict = self.backend.verdict
                if not verdict:  # compiled everywhere, then failed while running: a real error
                    raise
            self.fallback = verdict
            _warn(step.where, verdict, self.eager_mode)
            return EAGER
        finally:
            self.backend.agreeing = False

    def _run(self, step: Any, plan: Plan, args: tuple, kwargs: dict) -> Any:
        given, stands = args, None
        if plan.fsdp is not None:  # chunks of one length: the same graph on every rank
            given, stands = Compiled(plan).run("fsdp_pad", args)
        out = self.compiled(step.fn, plan, given, kwargs)
        if plan.donated:
            out = _aliases.donated_back(out, given, plan.donated)
        return out if stands is None else Compiled(plan).run("fsdp_trim", out, args, stands)

    def _changed(self, leaves: list, sharded: tuple[int, ...]) -> bool:
        """Note the inputs' shapes and dtypes; True once they changed too often to compile.

        Once a batch size differs from the first call's, the batch dimension of the
        sharded inputs is marked dynamic: one graph for every batch size of 2 or more
        (torch.compile's automatic dynamic shapes, without a recompile per size; sizes
        0 and 1 get their own). Past MAX_SIGNATURES signatures, the step runs eagerly.
        """
        batch = [(tuple(leaves[i].shape), leaves[i].dtype) for i in sharded if _batched(leaves[i])]
        sizes = tuple(shape[0] for shape, _ in batch)
        if self.sizes is None:
            self.sizes = sizes
        dynamic = self.dynamic or sizes != self.sizes
        signature = (
            tuple((x.shape, x.dtype) for x in leaves if isinstance(x, torch.Tensor))
            if not dynamic
            else tuple(
                (min(x.shape[0], 2), x.shape[1:], x.dtype)
                if i in sharded and _batched(x)
                else (x.shape, x.dtype)
                for i, x in enumerate(leaves)
                if isinstance(x, torch.Tensor)
            )
        )
        if dynamic and not self.dynamic:
            self.dynamic, self.signatures = True, [None]  # the first call's static graph
        if signature not in self.signatures:
            self.signatures.append(signature)
            self.batches.append(batch)
            if len(self.signatures) > MAX_SIGNATURES:
                self.fallback = (
                    f"its inputs came in {len(self.signatures)} signatures (shapes, dtypes), "
                    f"more than the {MAX_SIGNATURES} graphs it compiles; shapes seen: "
                    f"{self._shapes()}"
                )
                return True
        if self.dynamic:
            for i in sharded:
                if _batched(leaves[i]):
                    _compat.dynamo.maybe_mark_dynamic(leaves[i], 0)
        return False

    def _shapes(self) -> str:
        """The sharded inputs' shapes and dtypes seen, shortest first, for a warning."""
        seen = [", ".join(f"{s} {d}" for s, d in batch) for batch in self.batches]
        return "; ".join(seen[:4]) + (f"; ... ({len(seen)} in all)" if len(seen) > 4 else "")

    def compiled_loss(self, f: Callable) -> Callable:
        """``f`` compiled for an eager step (graph breaks allowed): the loss a ``pardist.grad``
        differentiates where the whole step is not one graph."""
        try:
            return self.losses[f]
        except (KeyError, TypeError):
            pass
        options = {k: v for k, v in self.loss_options.items() if v is not None}
        inner = torch.compile(f, fullgraph=False, **options)

        @functools.wraps(f)
        def compiled(*args: Any, **kwargs: Any) -> Any:
            with quiet_loggers():
                return inner(*args, **kwargs)

        try:
            self.losses[f] = compiled
        except TypeError:  # (not weakly referable: compiled anew, dynamo's cache is per code)
            pass
        return compiled


def quiet_loggers():
    """Dynamo set to trace past ``logging.Logger`` calls as no-ops instead of stopping: a
    model's loss that logs (Hugging Face's ``logger.warning_once`` in ``loss_function``)
    compiles. What they would have logged is not logged from inside a graph."""
    methods = {
        getattr(logging.Logger, name)
        for name in ("debug", "info", "warning", "warn", "error", "critical", "exception")
        + ("log", "warning_once", "info_once", "warning_advice")
        if callable(getattr(logging.Logger, name, None))
    }
    return _compat.dynamo.config.patch(ignore_logger_methods=methods)


def _batched(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() > 0


# What a fallback's reason says about its cause, and what to do about it.
_CONTROL_FLOW = ("data-dependent", "data dependent", "generic_jump", "control flow", "item()")


def _warn(where: str, reason: str, mode: Mode | None) -> None:
    how = (
        "It runs eagerly with its loss compiled (each pardist.grad's function, by "
        "torch.compile): the most of it a graph can hold, with the same numbers."
        if mode is not None
        else "It runs eagerly instead, with the same numbers."
    )
    if any(word in reason.lower() for word in _CONTROL_FLOW):
        advice = "Keep Python control flow off tensor values (use torch.where), or pass"
    else:
        advice = "Pass"
    warnings.warn(
        f"{where}: compile=True could not make the whole step one graph ({reason}). {how} "
        f"{advice} compile=False to silence this.",
        stacklevel=4,
    )


def compiled_step(compile: bool | dict, where: str) -> CompiledStep | None:  # noqa: A002
    """``data_parallel``'s ``compile=`` argument as a :class:`CompiledStep` (or None)."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return CompiledStep({}, where)
    if isinstance(compile, dict):
        return CompiledStep(dict(compile), where)
    raise TypeError(
        f"{where}: compile= takes True, False or a dict of torch.compile arguments, "
        f"got {type(compile).__name__}."
    )


def _outer_compile(step: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.compile(data_parallel(step))``: compile the step the way compile=True does.

    Dynamo cannot trace data_parallel's bookkeeping (the first call's checks are
    collectives over Python objects), so the outer compilation stops here and
    the step compiles itself, collectives and all.
    """
    if step.compiled is None:
        step.compiled = CompiledStep({}, step.where)
    return step(*args, **kwargs)


def __getattr__(name: str):
    """``outer_compile``, made disabled for dynamo where dynamo first asks for it (it traces
    ``data_parallel``'s ``__call__`` then, and is imported: not with pardist)."""
    if name == "outer_compile":
        disabled = _compat.dynamo.disable(
            _outer_compile, reason="pardist.data_parallel compiles its step itself (compile=True)"
        )
        globals()["outer_compile"] = disabled
        return disabled
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
