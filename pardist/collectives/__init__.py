"""Collectives over named mesh axes, with JAX's transposes: psum, all_gather, ppermute...

Each is differentiable under autograd and torch.func (forward and reverse mode);
``_vma`` types which axes a value varies over. May import ``pardist.runtime``,
``pardist.transport`` and ``pardist.compile``'s traced collectives.
"""

from pardist.collectives._broadcast import broadcast
from pardist.collectives._collectives import (
    AxisIndex,
    axis_index,
    axis_size,
    lift,
    needs_grad,
    pmax,
    pmean,
    pmin,
    psum,
    psum_groups,
    pvary,
    reduce_groups,
    varying_axes,
)
from pardist.collectives._exchange import all_gather, all_to_all, ppermute, psum_scatter

__all__ = [
    "AxisIndex",
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "broadcast",
    "lift",
    "needs_grad",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_groups",
    "psum_scatter",
    "pvary",
    "reduce_groups",
    "varying_axes",
]
