"""Collectives over named mesh axes, with JAX's transposes: psum, all_gather, all_to_all...

Each is differentiable under autograd and torch.func; ``_vma`` tracks which axes a
value varies over. May import ``pardist.runtime``, ``pardist.transport`` and
``pardist.compile``'s traced collectives.
"""

from pardist.collectives._broadcast import broadcast
from pardist.collectives._collectives import (
    all_gather,
    axis_index,
    axis_size,
    needs_grad,
    pmax,
    pmean,
    psum,
    psum_groups,
    pvary,
    reduce_groups,
)
from pardist.collectives._exchange import all_to_all, psum_scatter

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "broadcast",
    "needs_grad",
    "pmax",
    "pmean",
    "psum",
    "psum_groups",
    "psum_scatter",
    "pvary",
    "reduce_groups",
]
