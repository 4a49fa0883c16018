"""``shard_map``: a pure function run on every rank's local blocks, as in JAX.

Every rank calls the mapped function with its own *local block* of each input
(SPMD: nothing is sliced for you, as with ``torchrun``); ``in_specs`` say how
those blocks make up the global values. ``P(None, 'model')`` says dim 1 is
split over axis 'model' (each rank of 'model' holds one block); an axis a spec
does not name is one the value is replicated over, and it must be the same on
every rank of it. ``out_specs`` say the same of the results.

Inside, pardist types every value by the mesh axes it varies over (``_vma``,
``_tracker``), as JAX's ``check_vma=True``, so collectives get JAX's transposes:
``psum`` of a value varying over 'model' is invariant over it, and its backward is
the identity. One process has nothing to type and types nothing.

``pardist.data_parallel`` is this same step with its ``axis`` declared as data
axes: ``pardist.grad`` inside it differentiates the loss averaged over them, with
the replicated inputs' gradients averaged in buckets (see ``_data_parallel``). The
rules are the same under either combinator.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pardist.collectives import _collectives, _vma
from pardist.compile import _step
from pardist.runtime import (
    ALONE,
    EAGER,
    Deterministic,
    Ids,
    ShardsGradients,
    StepContext,
    _faults,
    _mesh,
    _process,
    _rng,
    _survive,
    _tree,
    debug_enabled,
    entered,
    tracing,
)
from pardist.step import _checks, _devices, _handshake, _specs, _survivor
from pardist.step._donation import Consumed
from pardist.step._specs import P
from pardist.step._tracker import Tracker

__all__ = ["Step", "shard_map"]


class Step:
    """The function ``shard_map`` returns; holds what persists between calls.

    ``data_parallel`` subclasses it: data axes, default specs, its messages.
    """

    kind = "shard_map"

    def __init__(
        self,
        fn: Callable,
        *,
        mesh: _mesh.Mesh | None,
        in_specs: Any,
        out_specs: Any,
        donate_argnums=(),
        axis: str | tuple[str, ...] = (),
        compression: torch.dtype | None = None,
        overlap: bool = True,
        bucket_mb: float = 25.0,
        compile: bool | dict = False,  # noqa: A002 - torch.compile's word
        deterministic: int = 0,
        check_vma: bool = True,
        axis_names: frozenset | None = None,
    ):
        functools.update_wrapper(self, fn)
        self.mode = Deterministic(deterministic) if deterministic else EAGER  # when eager
        self.fn, self.axis, self.mesh = fn, axis, mesh
        self.in_specs, self.out_specs = in_specs, out_specs
        self.donate_argnums = (
            (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        )
        self.compression, self.overlap, self.bucket_mb = compression, overlap, bucket_mb
        self.reducers: dict = {}
        self.calls = 0
        self.entered = 0  # calls begun, finished or not (see _handshake)
        self.key = None  # for the marks of its calls (see _handshake), at its first call
        self._groups: dict = {}
        self._specs_cache: dict = {}
        self.keep_going = _survive.enabled()  # (read once: the environment is the launcher's)
        if self.keep_going:  # a failed call is redone from its inputs (step._survivor)
            self.donate_argnums = ()
            _survivor.track(self)  # (its caches follow a new group, lost rank or joined)
        self._last = None
        self._consumed = Consumed(self.where, self.donate_argnums)  # donated, not returned
        self.compile_option = compile
        self.compiled = _step.compiled_step(compile, self.where)
        self.check_vma, self.axis_names = check_vma, axis_names
        # Typing (see _types_needed): the input structures whose call was typed and the
        # output structures checked (each held: a spec's id is then never another's, and
        # every rank, running the same program, finds the same ones), and whether the step
        # needs typing on every call.
        self._typed = _Seen()
        self._checked_outputs = _Seen()
        self._always_typed = False

    @property
    def where(self) -> str:
        return f"pardist.{self.kind}({getattr(self.fn, '__name__', 'fn')})"

    # What data_parallel changes.
    def data_axes(self, mesh: _mesh.Mesh) -> tuple[str, ...]:
        """The axes ``pardist.grad`` averages replicated inputs' gradients over: none here."""
        return ()

    def full_specs(self, args: tuple, axes: tuple[str, ...]) -> tuple:
        """One spec tree per positional argument."""
        specs = self.in_specs
        if isinstance(specs, P) or specs is None:
            return (specs,) * len(args)  # one spec for every argument: a prefix of args
        if not isinstance(specs, (tuple, list)) or len(specs) != len(args):
            raise ValueError(
                f"{self.where}: in_specs must be a tuple with one spec tree per positional "
                f"argument; got {_count(specs)} for {len(args)} arguments."
            )
        return tuple(specs)

    def misfit(self, error: Exception, path: str, leaf: Any, nargs: int, axes) -> Exception:
        """The error for an input its in_spec does not fit."""
        return error

    def check_batches(self, named: list, specs: list, sharded: list, mesh, axes) -> None:
        """Checks of the data shards on a checked call (data_parallel's: not all the same)."""

    def replicated_input_error(
        self, problem: str, over: tuple, axes: tuple, nargs: int, seeded: bool = False
    ) -> str:
        return (
            f"{self.where}: inputs whose in_specs split no dim over {over} are replicated over "
            f"them and must be identical on every rank of them, but {problem}. Build them the "
            "same way on every rank (seed first: pardist.seed_everything(0)), copy one rank's "
            f"with pardist.broadcast(tree, {over!r}), or, if an input is a per-rank block, name "
            "the axis in its in_spec."
        )

    def replicated_output_error(self, problem: str, over: tuple, axes: tuple) -> str:
        return (
            f"{self.where}: {problem}, but out_specs replicate it over {over}. Reduce it "
            f"with pardist.psum or pardist.pmean over {over!r}, gather it with "
            "pardist.all_gather(x, axis, invariant=True), or name the axis in its out_spec "
            "(P(axis) splits dim 0 over it)."
        )

    # The step itself.
    def _leaf_specs(self, args: tuple, treedef, mesh: _mesh.Mesh, axes: tuple[str, ...]):
        """Per leaf: its spec and axes; which are data shards, donated; sharded-state ids."""
        key = (id(treedef), id(mesh))  # specs are interned by structure (runtime._flat)
        hit = self._specs_cache.get(key)
        if hit is not None and hit[0] is treedef:
            return hit[1]
        flat = _specs.flat_specs(
            self.full_specs(args, axes),
            args,
            where=self.where,
            specs_name="in_specs",
            tree_name="args",
        )
        for (path, leaf), spec in zip(_tree.leaves_with_paths(args, "args"), flat):
            try:
                _specs.check_fits(
                    spec, leaf, path, mesh, where=self.where, spec_path=f"the in_spec of {path}"
                )
            except (TypeError, ValueError) as e:
                raise self.misfit(e, path, leaf, len(args), axes) from None
        # A state sharded over the data axes (pardist.optim.sharded's) asks for its
        # parameters' gradients reduce-scattered (its signature is in the tree structure).
        nodes = _tree.tree_flatten(args, is_leaf=lambda x: isinstance(x, ShardsGradients))[0]
        scatter = frozenset(
            n.signature for n in nodes if isinstance(n, ShardsGradients) and n.axis == axes
        )
        sharded = [i for i, s in enumerate(flat) if set(s.axes) & set(axes)]
        children = (
            treedef.children() if hasattr(treedef, "children") else treedef.children_specs
        )  # torch < 2.9
        counts = [child.num_leaves for child in children]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        outside = [i for i in self.donate_argnums if not -len(counts) <= i < len(counts)]
        if outside:
            raise ValueError(
                f"{self.where}: donate_argnums={self.donate_argnums} names argument(s) "
                f"{outside}, but the step was called with {len(counts)} positional "
                f"argument(s) (0 to {len(counts) - 1}). Donate the positions of the "
                "arguments whose memory the step may reuse (the params and optimizer state)."
            )
        donated = [
            j
            for i in sorted({i % len(counts) for i in self.donate_argnums})
            for j in range(starts[i], starts[i] + counts[i])
        ]
        self._specs_cache[key] = treedef, (flat, sharded, donated, scatter)
        return flat, sharded, donated, scatter

    def __call__(self, *args, **kwargs):
        if tracing():  # torch.compile(data_parallel(step))
            return _step.outer_compile(self, args, kwargs)
        short = self.where.removeprefix("pardist.")
        mesh = self.mesh or _mesh.current_mesh(short)
        axes = self.data_axes(mesh)
        self.entered += 1
        ref = self._groups.get((id(mesh), axes), 0)
        if ref == 0:  # the process group over the data axes, where there is one (by name:
            # a step kept past shutdown must not keep the group's threads alive)
            ref = _process.GroupRef(mesh.group(axes)) if axes and mesh.size(axes) > 1 else None
            self._groups[(id(mesh), axes)] = ref
        if ref is None:
            return self._call(mesh, axes, args, kwargs)
        if self.keep_going:
            _survivor.called(self)  # (what the survivors of a loss compare)
        if self.key is None:
            self.key = _handshake.key(self.where, self.fn)
            if self.keep_going:  # a replacement's first call: the survivors' next one
                self.entered, self.calls = _survivor.adopt(self.key, self.entered, self.calls)
        group, count = ref.get(), _rng.rng_count()
        try:
            # A peer lost inside the call, in pardist's words whichever collective saw it
            # (FSDP's reduce-scatter over gloo: "Connection reset by peer").
            with _handshake.stepping(group, self.key, self.entered, self.where):
                with _faults.collective_errors(self.where, group):
                    out = self._call(mesh, axes, args, kwargs)
        except _faults.KEEP_GOING_ON as error:
            if not self.keep_going:
                raise
            del group  # the old group must go (its sockets closed) when the survivors leave
            return _survivor.survive(self, error, args, kwargs, count)  # (--keep-going)
        if self.keep_going:
            self._last = out  # what a survivor behind would need (step._survivor)
            _survivor.note(self)
        return out

    def _call(self, mesh, axes, args: tuple, kwargs: dict):
        leaves, treedef = _tree.tree_flatten(args)
        specs, sharded, donated_idx, scatter = self._leaf_specs(args, treedef, mesh, axes)
        ids = list(map(id, leaves))  # once: the sets below are of ids
        if self._consumed:
            self._consumed.check(leaves, ids, args)
        check = self.calls == 0 or debug_enabled()
        if check:
            _devices.check(args, self.where)  # a batch on another device than the params
            _checks.check_inputs(self, args, specs, mesh, axes)
            self.check_batches(_tree.leaves_with_paths(args, "args"), specs, sharded, mesh, axes)
        donated = set(map(ids.__getitem__, donated_idx))  # (ids of non-tensors: unused)
        out, typed_problem, typed = _step.EAGER, None, True
        structure = (treedef, mesh)  # (specs are interned by structure: runtime._flat)
        with _rng.stream(_rng.rank_index(mesh, axes)):  # dropout: per rank and step
            if self.compiled is not None:
                out = self.compiled(self, args, kwargs, mesh, axes, sharded, donated_idx, scatter)
            if out is _step.EAGER:
                out, typed_problem, typed = self._run_eager(
                    args, kwargs, mesh, axes, leaves, ids, specs, sharded, donated, scatter,
                    structure,
                )  # fmt: skip
        self.calls += 1
        if not check and not typed:  # an output structure no typed call saw
            out_spec = _tree.tree_flatten(out)[1]
            if out_spec not in self._checked_outputs:
                self._checked_outputs.add(out_spec)
                check = True  # by values, this once
        if check:
            _checks.check_outputs(self, out, mesh, axes, typed_problem)
        elif typed_problem:
            raise ValueError(typed_problem)
        if donated:
            self._consumed.mark(out, leaves, ids, donated)
        return out

    def _run_eager(
        self, args, kwargs, mesh, axes, leaves, ids, specs, sharded, donated, scatter, structure
    ):
        """(the step's output, the static check's problem or None, whether it was typed),
        run eagerly."""
        varying = set(map(ids.__getitem__, sharded))
        if _tree.any_instance(leaves, DTensor):  # pardist.fsdp shards vary over their axis
            varying |= {id(x) for x in leaves if isinstance(x, DTensor)}
        # Every value is typed by the axes it varies over wherever an axis has more than one
        # rank (unless check_vma=False); on one process an eager step runs ALONE: nothing
        # to reduce and nothing to type.
        live = {a for a, n in mesh.shape.items() if n > 1}
        ctx = StepContext(
            name=self.where,
            mesh=mesh,
            axis=axes,
            size=mesh.size(axes) if axes else 1,
            varying=varying,
            inputs=Ids(ids),
            scatter=scatter,
            donated=donated,
            reducers=self.reducers,
            compression=self.compression,
            overlap=self.overlap,
            bucket_bytes=int(self.bucket_mb * 2**20),
            mode=self._eager_mode(live),
        )
        if self.axis_names is not None:
            _check_manual(self, specs, mesh)
        state = None
        if live and self.check_vma and self._types_needed(live, axes, structure):
            state = _vma.Tracking(mesh, axes, self.axis_names)
        typed_problem = None
        with entered(ctx), _vma.tracking(state), self._tracker(state, leaves, specs):
            out = self.fn(*args, **kwargs)
            if ctx.call.pending_means:  # statistics no gradient computation carried
                means = _collectives.pmean(ctx.call.pending_means, axes)
                with _vma.paused():
                    for t, mean in zip(ctx.call.pending_means, means):
                        t.copy_(mean)
                _vma.invariant(ctx.call.pending_means)
            if state is not None:
                typed_problem = _checks.typed_outputs(self, out, state, axes)
        if state is not None and typed_problem is None:  # (a refused call: typed again)
            self._typed.add(structure)
            self._checked_outputs.add(_tree.tree_flatten(out)[1])
        if state is not None:
            self._always_typed = self._always_typed or state.outside_grads
        return out, typed_problem, state is not None

    def _types_needed(self, live: set, axes: tuple, structure) -> bool:
        """Whether this call types its values, as JAX types a program: once per structure
        of the inputs (the types and the static check of the outputs are those of the
        program, not of the numbers), on every call under ``PARDIST_DEBUG=1``, and on every
        call of a step that needs the types for its numbers: one with axes beyond its data
        axes (tensor parallelism), or that differentiates outside ``pardist.grad``
        (``torch.func.grad``, ``.backward()``: JAX's typed transposes). Elsewhere every
        value counts as varying over the data axes (each collective's result lifted back
        at once): for ``pardist.grad``'s gradient of the loss averaged over the data axes
        that is the typed numbers (docs/semantics.md), and it costs nothing per operation.
        Every rank decides alike (the same program, the same structures)."""
        return (
            self._always_typed
            or bool(live - set(axes))
            or structure not in self._typed
            or debug_enabled()
        )

    def _eager_mode(self, live: set):
        """The mode the step runs in eagerly: a compiled step's fallback (its loss compiled),
        the deterministic mode, or eager (ALONE on one process, where nothing reduces)."""
        fallback = self.compiled.eager_mode if self.compiled is not None else None
        if fallback is not None and self.mode is EAGER:
            return fallback
        return self.mode if live or self.mode is not EAGER else ALONE

    def flat_out_specs(self, out: Any, flat: tuple | None = None) -> list[P]:
        """One spec per output leaf (cached by the output's structure, an interned spec:
        runtime._flat). ``flat``: ``out`` flattened already."""
        leaves, treedef = flat if flat is not None else _tree.tree_flatten(out)
        key = ("out", id(treedef))
        hit = self._specs_cache.get(key)
        if hit is not None and hit[0] is treedef:
            return hit[1]
        specs = (
            [P()] * len(leaves)
            if self.out_specs is None
            else _specs.flat_specs(
                self.out_specs, out, where=self.where, specs_name="out_specs", tree_name="output"
            )
        )
        self._specs_cache[key] = (treedef, specs)
        return specs

    def _tracker(self, state: _vma.Tracking | None, leaves: list, specs: list):
        """What tracks varying axes through the step (nothing where none can differ):
        the sharded inputs typed by their specs (the others vary over nothing)."""
        if state is None:
            return contextlib.nullcontext()
        for leaf, spec in zip(leaves, specs):
            if isinstance(leaf, DTensor):
                state.set(leaf, frozenset(_specs.specs(leaf).axes))
            elif spec.vma and isinstance(leaf, torch.Tensor):
                state.set(leaf, spec.vma)
        return Tracker(state, self.where)


class _Seen:
    """Structures (TreeSpecs, or tuples of them and a mesh) seen, by identity, each held.

    Interned specs (runtime._flat) are found again; a spec made afresh at every call (a
    node type only torch's pytree flattens) never is, so such a call is always typed (and
    checked), alike on every rank. Held at most ``LIMIT``: past it, nothing is found."""

    LIMIT = 64

    def __init__(self):
        self._held: dict[tuple, object] = {}

    @staticmethod
    def _key(item) -> tuple:
        return tuple(map(id, item)) if isinstance(item, tuple) else (id(item),)

    def __contains__(self, item) -> bool:
        held = self._held.get(self._key(item))
        if held is None:
            return False
        return all(a is b for a, b in zip(held, item)) if isinstance(item, tuple) else held is item

    def add(self, item) -> None:
        if len(self._held) < self.LIMIT:
            self._held[self._key(item)] = item


def _check_manual(step: Step, specs: list, mesh) -> None:
    """``axis_names``: the specs name no axis of the mesh outside them."""
    for spec in specs:
        extra = set(spec.axes) - set(step.axis_names)
        if extra:
            raise ValueError(
                f"{step.where}: an in_spec names {sorted(extra)}, but axis_names="
                f"{sorted(step.axis_names)} makes only those axes manual here. Name the axis in "
                "axis_names, or leave it out of the spec."
            )


def _count(specs: Any) -> str:
    return str(len(specs)) if isinstance(specs, (tuple, list)) else f"a {type(specs).__name__}"


def shard_map(
    f: Callable | None = None,
    /,
    *,
    mesh: _mesh.Mesh | None = None,
    in_specs: Any,
    out_specs: Any,
    donate_argnums: int | tuple[int, ...] = (),
    check_vma: bool = True,
    axis_names=None,
):
    """Run ``f`` on every rank's local blocks; ``in_specs`` and ``out_specs`` say how they split.

    JAX's ``shard_map`` in SPMD form: each rank calls the result with its own
    block of every input (``P(None, 'model')``: this rank's columns of a matrix
    split over 'model'; ``P()``: the whole value, the same on every rank of
    every axis). Inside, collectives over mesh axes (:func:`pardist.psum`,
    :func:`pardist.all_gather`, :func:`pardist.psum_scatter`, ...) have JAX's
    transposes, because pardist tracks which axes each value varies over.

    :func:`pardist.grad` inside a ``shard_map`` is JAX's ``grad`` inside one:
    the gradient of the loss as seen on this rank, where a replicated input's
    gradient sums the contributions of every rank it is used on; a loss that
    varies over an axis counts as its sum over that axis, so ``psum`` or
    ``pmean`` it first to say which. For batches split over an axis whose
    gradients should be averaged in buckets, use :func:`pardist.data_parallel`,
    which is ``shard_map`` with that axis declared as its data axis.

    Args:
        f: the function. Also usable as a decorator: ``@shard_map(in_specs=..., out_specs=...)``.
        mesh: the mesh; default: the innermost ``with mesh:``, else ``init``'s.
        in_specs: one spec tree per positional argument (each a prefix of its
            argument), or one ``P`` for all of them. Keyword arguments are replicated.
        out_specs: a spec tree (prefix) for the output. An output replicated
            over an axis must not vary over it: checked from the tracked axes on
            every call, and by comparing values on the first call (and every
            call under ``PARDIST_DEBUG=1``).
        donate_argnums: arguments the caller gives up, as for :func:`pardist.data_parallel`.
        check_vma: JAX's flag. True (default): every value is typed by the axes it varies
            over, collectives transpose by those types, and out_specs are checked by
            them. False: nothing is typed; every value counts as varying, so ``psum``'s
            transpose is ``psum`` (JAX's ``check_vma=False``), and out_specs are checked
            by values on the first call only.
        axis_names: the mesh axes ``f`` is manual over (default: all). Specs and
            collectives may name only these; values are typed over these only.

    Returns:
        A function with ``f``'s signature.

    Example:
        >>> import pardist, torch
        >>> from pardist import P
        >>> _ = pardist.init()
        >>> @pardist.shard_map(in_specs=(P(), P('gpu')), out_specs=P())
        ... def total(w, x):
        ...     return pardist.psum((x * w).sum(), 'gpu')
        >>> total(torch.tensor(2.), torch.ones(3))
        tensor(6.)
        >>> pardist.shutdown()
    """
    options = dict(
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        donate_argnums=donate_argnums,
        check_vma=check_vma,
        axis_names=axis_names,
    )
    if f is None:
        return lambda f: shard_map(f, **options)
    if not callable(f):
        raise TypeError(
            f"pardist.shard_map: the first argument is the function to map, got a "
            f"{type(f).__name__}; write shard_map(f, in_specs=..., out_specs=...) or use it as "
            "a decorator: @shard_map(in_specs=..., out_specs=...)."
        )
    if axis_names is not None:
        options["axis_names"] = frozenset(
            (axis_names,) if isinstance(axis_names, str) else axis_names
        )
    return Step(f, **options)
