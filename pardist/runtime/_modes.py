"""How a step runs: one object per way of running, chosen once per call, with its rules.

JAX gives each operation one rule per kind of trace (``jax/_src/shard_map.py``
registers ``process_shard_map`` on ``EvalTrace``, ``BatchTrace``, ``JVPTrace`` and
``JaxprTrace``). pardist does the same with the ways a data-parallel step runs:
the running step's context holds one :class:`Mode`, and each package that
implements an operation registers that operation's rule on the modes it supports,
where the operation lives::

    collectives/_collectives.py   psum, pmean, pmax, all_gather, pvary, axis_index,
                                  axis_size, blockwise (all_to_all, psum_scatter)
    gradients/_grad.py            grad: the gradient's path and its mean over the step
    nn/_functional.py             batch_stats: batch-norm statistics left to average
    sharding/_traced.py           fsdp_layout, fsdp_pad, fsdp_trim: pardist.fsdp's shards
                                  as a compiled step takes and returns them

Code that runs an operation calls ``current_mode().run(op, ...)``, which calls the
rule with the mode first, and never asks which mode it is in. A mode inherits its
parent's rules unless it registers its own (the deterministic mode is eager but for
the gradient and the statistics).
Outside any step the mode is :data:`EAGER` (to ``pardist.grad``, :data:`ALONE`). A
new way of running is one subclass here and its rules beside the operations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pardist.runtime import _compat

__all__ = [
    "ALONE",
    "EAGER",
    "Alone",
    "Compiled",
    "CompiledLoss",
    "Deterministic",
    "Eager",
    "Mode",
]


class Mode:
    """One way a step runs. ``rules``: operation name -> ``rule(mode, *args)``."""

    name = "mode"
    alone = False  # one process: nothing is reduced and no value varies (see Alone)
    rules: dict[str, Callable] = {}
    _own: frozenset = frozenset()  # the operations this class registered itself

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.rules, cls._own = dict(cls.rules), frozenset()

    @classmethod
    def register(cls, op: str) -> Callable[[Callable], Callable]:
        """Decorator: ``fn`` is ``op``'s rule in this mode and in the modes below it
        that have no rule of their own for ``op``."""

        def put(fn: Callable) -> Callable:
            cls._own = cls._own | {op}
            for mode in [cls, *_descendants(cls)]:
                if mode is cls or op not in mode._own:
                    mode.rules[op] = fn
            return fn

        return put

    def run(self, op: str, *args: Any) -> Any:
        """``op``'s rule in this mode, called with the mode and ``args``."""
        return self.rules[op](self, *args)

    def __repr__(self) -> str:
        return f"pardist mode {self.name!r}"


def _descendants(cls: type) -> list[type]:
    return [d for sub in cls.__subclasses__() for d in (sub, *_descendants(sub))]


class Eager(Mode):
    """Op by op: autograd's backward, gradients reduced in buckets as it produces them."""

    name = "eager"
    groups = 0  # row groups of the deterministic mode (0: not deterministic)
    plan = None
    counts_tokens = True  # pardist.grad(mean='tokens') is supported


class Alone(Eager):
    """Eager on one process (every mesh axis of size one): nothing is reduced and no
    value varies, so a plain ``pardist.grad`` call (one pass, ranks weighed equally) is
    autograd's gradient as it is outside any step, with no batch to place and no
    reduction to choose; the same numbers by fewer steps. Its rules are eager's. A step
    takes it where it would run eagerly on a mesh of one."""

    name = "alone"
    alone = True


class Deterministic(Eager):
    """``data_parallel(step, deterministic=G)``: G row groups summed in a fixed order."""

    name = "deterministic"

    def __init__(self, groups: int):
        self.groups = groups


class CompiledLoss(Eager):
    """``compile=True`` where the whole step cannot be one graph (activation checkpoints,
    ``pardist.fsdp`` shards, a list of micro-batches, an operation dynamo cannot trace in
    the step): the step runs eagerly and ``pardist.grad`` differentiates its loss compiled
    (``compile(f)``: torch.compile with graph breaks allowed, AOTAutograd's forward and
    backward, checkpointed blocks recomputed there). Its other rules are eager's."""

    name = "compiled_loss"
    # Collectives run as they do eagerly, out of the loss's graphs: dynamo breaks the
    # graph at each (torch.compiler.disable, made on first use: dynamo is loaded then).
    BREAKS = frozenset(
        {"psum", "pmean", "pmax", "all_gather", "blockwise", "pvary", "broadcast", "axis_index"}
    )
    _disabled: dict = {}

    def __init__(self, compile: Callable[[Callable], Callable]):  # noqa: A002
        self.compile = compile
        # Made here, eagerly: made while dynamo traces (torch 2.11), the wrapper was traced
        # through, and the collective's shared-memory wait with it.
        for op in self.BREAKS - self._disabled.keys():
            if op in self.rules:
                self._disabled[op] = _compat.torch.compiler.disable(self.rules[op])

    def run(self, op: str, *args: Any) -> Any:
        rule = self.rules[op]
        if op in self.BREAKS and _compat.tracing():
            rule = self._disabled.get(op, rule)
        return rule(self, *args)


class Compiled(Mode):
    """``data_parallel(step, compile=True)``: the step is traced into one graph; ``plan``
    holds its static facts (axes, sizes, buckets)."""

    name = "compiled"
    groups = 0
    counts_tokens = True

    def __init__(self, plan: Any):
        self.plan = plan


EAGER = Eager()
ALONE = Alone()
