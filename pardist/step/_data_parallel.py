"""``data_parallel``: run a pure step on every rank's shard of the batch.

No module is wrapped and no hook is installed: the step is an ordinary function
of parameter trees. ``data_parallel`` is :func:`pardist.shard_map` with its
``axis`` declared as the *data* axes: the specs default to the
``step(params, opt_state, batch)`` convention, and inside the step
``pardist.grad`` averages the gradients of replicated inputs over those axes in
buckets while the backward runs (the step context carries the mesh, the axes,
what was donated and the persistent buckets). The first call (and every call
under ``PARDIST_DEBUG=1``) checks that replicated values really agree across
ranks. Other mesh axes (``'model'``) work as in ``shard_map``: tensor
parallelism inside a data-parallel step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pardist.runtime import _mesh, debug_enabled
from pardist.step import _batchcheck
from pardist.step._shard_map import Step
from pardist.step._specs import P

__all__ = ["data_parallel"]

_COMPRESSION = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    torch.bfloat16: torch.bfloat16,
    torch.float16: torch.float16,
}


class _DataParallelStep(Step):
    """A ``shard_map`` step whose ``axis`` is data parallel; keeps data_parallel's messages."""

    kind = "data_parallel"

    def data_axes(self, mesh: _mesh.Mesh) -> tuple[str, ...]:
        return mesh.axes(self.axis, self.where.removeprefix("pardist."))

    def full_specs(self, args: tuple, axes: tuple[str, ...]) -> tuple:
        if self.in_specs is None:  # the step(params, opt_state, batch) convention
            return tuple(P() for _ in args[:-1]) + (P(axes if len(axes) > 1 else axes[0]),)
        return super().full_specs(args, axes)

    def misfit(self, error: Exception, path: str, leaf: Any, nargs: int, axes) -> Exception:
        if self.in_specs is not None:
            return error
        return _batchcheck.default_misfit(self.where, self.fn, error, path, leaf, nargs, axes)

    def check_batches(self, named: list, specs: list, sharded: list, mesh, axes) -> None:
        _batchcheck.check_distinct(
            self.where, self.fn, named, specs, sharded, axes, mesh.group(axes), debug_enabled()
        )

    def replicated_input_error(
        self, problem: str, over: tuple, axes: tuple, nargs: int, seeded: bool = False
    ) -> str:
        axis = self.axis if isinstance(self.axis, str) else tuple(self.axis)
        hint = ""
        if self.in_specs is None:
            hint = " " + " ".join(_batchcheck.default_specs(self.fn, nargs, axes))
        fix = (
            "Build them the same way on every rank (seed before creating the model: "
            "pardist.seed_everything(0)), or copy rank 0's values with pardist.broadcast(tree)"
        )
        if seeded:  # DDP copies rank 0's weights when it wraps; pardist wraps nothing
            fix = (
                "The ranks were seeded differently (torch.initial_seed() differs), so each "
                "built its own model: copy rank 0's values once, after building them, with "
                "params = pardist.broadcast(params) (what DDP does when it wraps a model), or "
                "seed every rank alike before creating the model (pardist.seed_everything(0))"
            )
        return (
            f"{self.where}: replicated inputs must be identical on every rank of axis "
            f"{axis if set(over) <= set(axes) else over!r}, but {problem}. {fix}; if the "
            "input is a per-rank shard, give it a sharded spec such as P('gpu') in in_specs." + hint
        )

    def replicated_output_error(self, problem: str, over: tuple, axes: tuple) -> str:
        axis = self.axis if isinstance(self.axis, str) else tuple(self.axis)
        if not set(over) & set(axes):  # a model axis: the general advice
            return super().replicated_output_error(problem, over, axes)
        return (
            f"{self.where}: {problem}, but out_specs says it is replicated (P()). "
            f"If it holds gradients from torch.func.grad, use pardist.grad, which "
            f"averages them over {axis!r}; if it is a per-rank value (a local loss), "
            f"reduce it with pardist.pmean(x, {axis!r}) or give it a sharded out_spec "
            f"such as P({axis!r})."
        )


def data_parallel(
    fn: Callable | None = None,
    axis: str | tuple[str, ...] = "gpu",
    *,
    in_specs: Sequence[Any] | None = None,
    out_specs: Any = None,
    mesh: _mesh.Mesh | None = None,
    donate_argnums: int | Sequence[int] = (),
    compression: str | torch.dtype | None = None,
    overlap: bool = True,
    bucket_mb: float = 25.0,
    compile: bool | dict = False,  # noqa: A002 - JAX's jit and torch.compile's word
    deterministic: int | None = None,
):
    """Make ``fn`` a data-parallel step over ``axis``: each rank calls it with its own data.

    By default every positional argument is replicated except the last, whose
    leaves are this rank's shard of the global batch along dim 0: the
    ``step(params, opt_state, batch)`` convention. Inside the step,
    :func:`pardist.grad` averages the gradients of replicated inputs over
    ``axis``, so N ranks compute what one process would on the whole batch.

    Args:
        fn: the step. Also usable as a decorator: ``@data_parallel(axis='gpu')``.
        axis: the mesh axis (or tuple of axes, reduced innermost first) to be
            data parallel over.
        in_specs: a tuple with one spec tree per positional argument (each a
            prefix of that argument's tree): ``P()`` replicated, ``P('gpu')`` dim 0
            split over 'gpu'. Keyword arguments are always replicated. Specs may
            also split weights over other axes of ``mesh`` (``P(None, 'model')``):
            tensor parallelism inside the step, as in :func:`pardist.shard_map`.
        out_specs: a spec tree for the output; default: all replicated. Replicated
            outputs must agree across ranks; the first call (and every call under
            ``PARDIST_DEBUG=1``) checks, naming the output path that differs.
        mesh: the mesh to use; default: the innermost ``with mesh:``, else ``init``'s.
        donate_argnums: arguments the caller gives up: the step may reuse their
            storage for its outputs (the optimizers then update in place). The
            caller must not use them after the call; passing one again is an error.
        compression: 'bf16' or 'fp16' to communicate gradients in half precision,
            as DDP's compression hooks do; None for full precision.
        overlap: start each gradient bucket's all-reduce as soon as the backward has
            filled it (default), as DDP does; False waits for the whole backward.
            Buckets in shared memory (CPU ranks on one host) are always reduced
            after the backward: that reduction is a synchronous copy.
        bucket_mb: gradient bucket size in MiB (DDP's ``bucket_cap_mb``).
        compile: True to compile the whole step with ``torch.compile`` (JAX's
            ``jit(pmap(step))``): the forward, the backward, the gradient mean,
            batch-norm statistics and the optimizer update in one graph, with the
            eager step's numbers. A dict passes ``torch.compile`` arguments
            (``mode``, ``backend``, ``dynamic``, ``options``; ``fullgraph``
            defaults to True). A step that cannot be compiled (Python control flow
            on tensor values, tensor parallelism over a model axis of size > 1)
            runs eagerly after one warning naming the reason.
        deterministic: G, a number of row groups: the same bits at every world
            size that divides G (docs/deterministic.md). The global batch is cut
            into G groups of rows; each runs its own forward and backward, and
            every sum over rows (gradients, loss, batch-norm statistics) adds the
            G groups' sums in one fixed order. Dropout draws per group. Costs a
            gather of G partial gradients instead of one all-reduce.

    Returns:
        A function with ``fn``'s signature. Its first call (and every call under
        ``PARDIST_DEBUG=1``) also checks that the sharded arguments differ between
        ranks: every rank fed the same batch is a
        :class:`pardist.DuplicateBatchWarning` (an error under ``PARDIST_DEBUG=1``)
        that names the argument and ``pardist.data.shard``.

    Example:
        >>> import pardist, torch
        >>> _ = pardist.init()
        >>> @pardist.data_parallel(axis='gpu')
        ... def step(w, batch):
        ...     g = pardist.grad(lambda w, b: (b @ w).pow(2).mean())(w, batch)
        ...     return w - 0.1 * g
        >>> step(torch.ones(2), torch.ones(4, 2))
        tensor([0.6000, 0.6000])
        >>> pardist.shutdown()
    """
    options = dict(locals())  # the arguments as given (a decorator passes them on)
    del options["fn"]
    if fn is None:
        return lambda f: data_parallel(f, **options)
    if isinstance(fn, str):
        raise TypeError(
            "pardist.data_parallel: the first argument is the step function; "
            f"write data_parallel(axis={fn!r}) to use it as a decorator."
        )
    if not callable(fn):
        raise TypeError(
            f"pardist.data_parallel: the first argument is the step function, got "
            f"{fn!r} ({type(fn).__name__}); write data_parallel(step, ...) or use "
            "@pardist.data_parallel(...) as a decorator."
        )
    nums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in nums):
        raise TypeError(
            f"pardist.data_parallel({getattr(fn, '__name__', 'fn')}): donate_argnums="
            f"{donate_argnums!r}; give positions of the step's arguments, e.g. (0, 2)."
        )
    if getattr(fn, "_torchdynamo_orig_callable", None) is not None:
        # data_parallel(torch.compile(step)): compile the step with its collectives.
        fn, compile = fn._torchdynamo_orig_callable, compile or True
    if in_specs is not None and not isinstance(in_specs, (tuple, list)):
        raise TypeError(
            "pardist.data_parallel: in_specs must be a tuple with one spec tree "
            f"per positional argument, got a {type(in_specs).__name__}."
        )
    name = getattr(fn, "__name__", "fn")
    if deterministic is not None and (
        isinstance(deterministic, bool) or not isinstance(deterministic, int) or deterministic < 1
    ):
        raise ValueError(
            f"pardist.data_parallel({name}): deterministic={deterministic!r}; give the number "
            "of row groups G, an int that every world size you will run at divides (e.g. 12 "
            "for 1, 2, 3, 4 and 6 ranks)."
        )
    if deterministic and (compile or compression is not None):
        raise ValueError(
            f"pardist.data_parallel({name}): deterministic={deterministic} runs eagerly and in "
            "full precision; it cannot be combined with "
            f"{'compile' if compile else 'compression'}. Drop one of them."
        )
    if compression not in _COMPRESSION:
        raise ValueError(
            f"pardist.data_parallel({getattr(fn, '__name__', 'fn')}): compression="
            f"{compression!r}; use None, 'bf16' or 'fp16'."
        )
    exact = dict(compression=_COMPRESSION[compression], deterministic=deterministic or 0)
    return _DataParallelStep(fn, **{**options, "compile": compile, **exact})
