"""``data_parallel``: run a pure step on every rank's shard of the batch.

No module is wrapped and no hook is installed: the step is an ordinary function
of parameter trees. ``data_parallel`` reads the specs (which inputs are shards of
a global batch, which are replicated), checks on the first call (and under
``PARDIST_DEBUG=1``) that replicated values really agree across ranks, and runs
the step inside a context that ``pardist.grad``, the optimizers and batch norm
read: the mesh, the axis, what was donated, and the persistent gradient buckets.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pardist import _collectives, _compiled, _mesh, _replication, _specs, _tree
from pardist._context import StepContext, debug_enabled, entered
from pardist._specs import P
from pardist.optim._sharded import ShardedState

__all__ = ["data_parallel"]

_COMPRESSION = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    torch.bfloat16: torch.bfloat16,
    torch.float16: torch.float16,
}


class _Step:
    """The function ``data_parallel`` returns; holds what persists between calls."""

    def __init__(
        self,
        fn: Callable,
        axis,
        in_specs,
        out_specs,
        mesh,
        donate_argnums,
        compression,
        overlap,
        bucket_mb,
        compile=False,
    ):
        functools.update_wrapper(self, fn)
        self.fn, self.axis, self.mesh = fn, axis, mesh
        self.in_specs, self.out_specs = in_specs, out_specs
        self.donate_argnums = (
            (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        )
        if compression not in _COMPRESSION:
            raise ValueError(
                f"{self.where}: compression={compression!r}; use None, 'bf16' or 'fp16'."
            )
        self.compression = _COMPRESSION[compression]
        self.overlap, self.bucket_mb = overlap, bucket_mb
        self.reducers: dict = {}
        self.calls = 0
        self._specs_cache: dict = {}
        self._consumed: dict[int, weakref.ref] = {}  # donated leaves that are now invalid
        self.compiled = _compiled.compiled_step(compile, self.where)

    @property
    def where(self) -> str:
        return f"pardist.data_parallel({getattr(self.fn, '__name__', 'fn')})"

    def _leaf_specs(self, args: tuple, treedef, mesh: _mesh.Mesh, axes: tuple[str, ...]):
        """Per leaf: its spec; which leaves are sharded, donated; sharded-state signatures."""
        key = (treedef, id(mesh))
        if key not in self._specs_cache:
            specs = self.in_specs
            if specs is None:  # the step(params, opt_state, batch) convention
                specs = tuple(P() for _ in args[:-1]) + (P(axes if len(axes) > 1 else axes[0]),)
            elif not isinstance(specs, (tuple, list)) or len(specs) != len(args):
                raise ValueError(
                    f"{self.where}: in_specs must be a tuple with one spec tree per positional "
                    f"argument; got {_count(specs)} for {len(args)} arguments."
                )
            flat = _specs.flat_specs(
                tuple(specs), args, where=self.where, specs_name="in_specs", tree_name="args"
            )
            for (path, leaf), spec in zip(_tree.leaves_with_paths(args, "args"), flat):
                _specs.check_fits(
                    spec, leaf, path, mesh, where=self.where, spec_path=f"the in_spec of {path}"
                )
            # A sharded optimizer state over this axis: its parameters' gradients are
            # reduce-scattered (its signature is static, part of the tree structure).
            nodes = _tree.tree_flatten(args, is_leaf=lambda x: isinstance(x, ShardedState))[0]
            scatter = frozenset(
                n.signature for n in nodes if isinstance(n, ShardedState) and n.axis == axes
            )
            sharded = [i for i, s in enumerate(flat) if set(s.axes) & set(axes)]
            children = (
                treedef.children() if hasattr(treedef, "children") else treedef.children_specs
            )  # torch < 2.9
            counts = [child.num_leaves for child in children]
            starts = [sum(counts[:i]) for i in range(len(counts))]
            donated = [
                j for i in self.donate_argnums for j in range(starts[i], starts[i] + counts[i])
            ]
            self._specs_cache[key] = flat, sharded, donated, scatter
        return self._specs_cache[key]

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # torch.compile(data_parallel(step))
            return _compiled.outer_compile(self, args, kwargs)
        mesh = self.mesh or _mesh.current_mesh(self.where.removeprefix("pardist."))
        axes = mesh.axes(self.axis, self.where.removeprefix("pardist."))
        leaves, treedef = _tree.tree_flatten(args)
        specs, sharded, donated_idx, scatter = self._leaf_specs(args, treedef, mesh, axes)
        if self._consumed:
            self._check_not_consumed(leaves, args)
        check = self.calls == 0 or debug_enabled()
        group = mesh.group(axes) if check else None
        if check:
            named = _tree.leaves_with_paths(args, "args")
            problem = _replication.mismatch(_replicated(named, specs, axes), group)
            if problem:
                raise ValueError(
                    f"{self.where}: replicated inputs must be identical on every rank of "
                    f"axis {self.axis!r}, but {problem}. Build them the same way on every rank "
                    "(seed before creating the model: pardist.seed_everything(0)), or copy "
                    "rank 0's values with pardist.broadcast(tree); if the input is a per-rank "
                    "shard, give it a sharded spec such as P('gpu') in in_specs."
                )
        donated = {id(leaves[i]) for i in donated_idx if isinstance(leaves[i], torch.Tensor)}
        out = _compiled.EAGER
        if self.compiled is not None:
            out = self.compiled(self, args, kwargs, mesh, axes, sharded, donated_idx, scatter)
        if out is _compiled.EAGER:
            out = self._run_eager(args, kwargs, mesh, axes, leaves, sharded, donated, scatter)
        self.calls += 1
        if check:
            self._check_outputs(out, mesh, axes, group)
        if donated:
            kept = {id(x) for x in _tree.tree_leaves(out)}
            for x in leaves:
                if id(x) in donated and id(x) not in kept:
                    self._consumed[id(x)] = weakref.ref(x)
        return out

    def _run_eager(self, args, kwargs, mesh, axes, leaves, sharded, donated, scatter):
        ctx = StepContext(
            name=self.where,
            mesh=mesh,
            axis=axes,
            size=mesh.size(axes),
            varying={id(leaves[i]) for i in sharded}
            | {id(x) for x in leaves if isinstance(x, DTensor)},
            scatter=scatter,
            donated=donated,
            reducers=self.reducers,
            compression=self.compression,
            overlap=self.overlap,
            bucket_bytes=int(self.bucket_mb * 2**20),
        )
        with entered(ctx):
            out = self.fn(*args, **kwargs)
            if ctx.pending_means:  # statistics no gradient computation carried
                means = _collectives.pmean(ctx.pending_means, axes)
                for t, mean in zip(ctx.pending_means, means):
                    t.copy_(mean)
        return out

    def _check_not_consumed(self, leaves: list, args: tuple) -> None:
        def consumed(leaf: Any) -> bool:
            ref = self._consumed.get(id(leaf))
            return ref is not None and ref() is leaf

        if not any(consumed(leaf) for leaf in leaves):
            self._consumed = {k: r for k, r in self._consumed.items() if r() is not None}
            return
        for path, leaf in _tree.leaves_with_paths(args, "args"):
            if consumed(leaf):
                raise ValueError(
                    f"{self.where}: {path} was donated to an earlier call "
                    f"(donate_argnums={self.donate_argnums}) and may have been overwritten. "
                    "Pass the value that call returned instead (params, opt_state = "
                    "step(params, opt_state, batch)), or drop it from donate_argnums."
                )

    def _check_outputs(self, out: Any, mesh: _mesh.Mesh, axes: tuple[str, ...], group) -> None:
        specs = self.out_specs
        named = _tree.leaves_with_paths(out, "output")
        flat = (
            _specs.flat_specs(
                specs, out, where=self.where, specs_name="out_specs", tree_name="output"
            )
            if specs is not None
            else [P()] * len(named)
        )
        for (path, leaf), spec in zip(named, flat):
            _specs.check_fits(
                spec, leaf, path, mesh, where=self.where, spec_path=f"the out_spec of {path}"
            )
        problem = _replication.mismatch(_replicated(named, flat, axes), group)
        if problem:
            axis = self.axis if isinstance(self.axis, str) else tuple(self.axis)
            raise ValueError(
                f"{self.where}: {problem}, but out_specs says it is replicated (P()). "
                f"If it holds gradients from torch.func.grad, use pardist.grad, which "
                f"averages them over {axis!r}; if it is a per-rank value (a local loss), "
                f"reduce it with pardist.pmean(x, {axis!r}) or give it a sharded out_spec "
                f"such as P({axis!r})."
            )


def _count(specs: Any) -> str:
    return str(len(specs)) if isinstance(specs, (tuple, list)) else f"a {type(specs).__name__}"


def _replicated(named: list, specs: list, axes: tuple[str, ...]) -> list:
    """The (path, leaf) pairs meant to be identical on every rank of ``axes``."""
    return [
        (p, x)
        for (p, x), s in zip(named, specs)
        if not set(s.axes) & set(axes) and not isinstance(x, DTensor)
    ]


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
            split over 'gpu'. Keyword arguments are always replicated.
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
            on tensor values) runs eagerly after one warning naming the reason.

    Returns:
        A function with ``fn``'s signature.

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
    options = dict(
        axis=axis,
        in_specs=in_specs,
        out_specs=out_specs,
        mesh=mesh,
        donate_argnums=donate_argnums,
        compression=compression,
        overlap=overlap,
        bucket_mb=bucket_mb,
        compile=compile,
    )
    if fn is None:
        return lambda f: data_parallel(f, **options)
    if isinstance(fn, str):
        raise TypeError(
            "pardist.data_parallel: the first argument is the step function; "
            f"write data_parallel(axis={fn!r}) to use it as a decorator."
        )
    if getattr(fn, "_torchdynamo_orig_callable", None) is not None:
        # data_parallel(torch.compile(step)): compile the step with its collectives.
        fn, options["compile"] = fn._torchdynamo_orig_callable, compile or True
    if in_specs is not None and not isinstance(in_specs, (tuple, list)):
        raise TypeError(
            "pardist.data_parallel: in_specs must be a tuple with one spec tree "
            f"per positional argument, got a {type(in_specs).__name__}."
        )
    return _Step(fn, **options)
