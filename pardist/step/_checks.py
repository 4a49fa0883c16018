"""What a step checks of its inputs and outputs, beyond their specs' fit.

On a checked call (the first, and every call under ``PARDIST_DEBUG=1``): every rank
passes inputs of the same layout, replicated inputs and outputs are the same on every
rank of the axes they are replicated over (compared by fingerprint). On every typed
call: JAX's static check that no output varies over an axis its out_spec replicates.
The messages are the step's own (``data_parallel`` words them for data axes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pardist.collectives import _vma
from pardist.runtime import _mesh, _tree
from pardist.step import _replication, _specs
from pardist.step._specs import P

__all__ = ["check_inputs", "check_outputs", "typed_outputs"]


def check_inputs(step, args: tuple, specs: list[P], mesh: _mesh.Mesh, axes) -> None:
    """Every rank passes the same specs and block shapes; replicated inputs agree."""
    named = _tree.leaves_with_paths(args, "args")
    lists = frozenset(i for i, a in enumerate(args) if type(a) is list)
    problem = _replication.layout_mismatch(named, specs, mesh, axes, lists)
    if problem:
        raise ValueError(
            f"{step.where}: the ranks disagree on the layout of their inputs: {problem}. "
            "Every rank must call the step with the same in_specs, and a tensor split "
            "over a non-data axis must have the same block shape on every rank (exact "
            "blocks: a dim split over an axis of size n is 1/n of the global dim; "
            "pardist.local_block cuts them)."
        )
    for over, group in _replication.replicated_groups(named, specs, mesh, step.axis_names):
        problem = _replication.mismatch(group, mesh.group(over))
        if problem:
            seeded = _replication.seeds_differ(mesh.group(over))  # every rank is here
            raise ValueError(step.replicated_input_error(problem, over, axes, len(args), seeded))


def check_outputs(step, out: Any, mesh: _mesh.Mesh, axes, typed_problem) -> None:
    """out_specs fit the outputs; outputs are not typed, nor found, varying where replicated."""
    named = _tree.leaves_with_paths(out, "output")
    flat = step.flat_out_specs(out)
    for (path, leaf), spec in zip(named, flat):
        _specs.check_fits(
            spec, leaf, path, mesh, where=step.where, spec_path=f"the out_spec of {path}"
        )
    if typed_problem:
        raise ValueError(typed_problem)
    for over, group in _replication.replicated_groups(named, flat, mesh, step.axis_names):
        problem = _replication.mismatch(group, mesh.group(over))
        if problem:
            raise ValueError(step.replicated_output_error(problem, over, axes))


def typed_outputs(step, out: Any, state: _vma.Tracking, axes) -> str | None:
    """JAX's static check: an output varying over an axis its out_spec replicates.

    By type, on every call, over every axis (data axes too): a value computed from a
    batch shard varies over the data axes until a collective (``pmean``, ``psum``,
    ``all_gather(..., invariant=True)``) or ``pardist.grad``'s mean makes it invariant.
    """
    flat = _tree.tree_flatten(out)
    tags, get = state.tags, state.get
    for i, (leaf, spec) in enumerate(zip(flat[0], step.flat_out_specs(out, flat))):
        if id(leaf) not in tags:
            continue  # untagged: it varies over nothing (one dict lookup)
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor):
            extra = _vma.value_axes(get(leaf)) - spec.vma
            if extra:
                path = _tree.leaves_with_paths(out, "output")[i][0]
                over = state.ordered(extra)
                return step.replicated_output_error(
                    f"{path} varies over {over} (it is computed from values split over "
                    f"{'it' if len(over) == 1 else 'them'})",
                    over,
                    axes,
                )
    return None
