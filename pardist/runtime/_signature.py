"""What a cached decision was made for: each tensor's type, dtype, device, shape and strides.

A step's later calls should not re-derive what its first call checked (issue 19,
JAX's cache per abstract signature). The optimizers check, per call, that every
gradient has its parameter's shape, that all are dense, floating and on a device
with a fused kernel: a pass over every tensor for each property. A
:class:`Signature` remembers the tensors those checks passed for and tells, in one
pass in C, whether later tensors are alike in everything the checks read.

The pass is torch's own: dynamo's ``TensorGuards``, the C++ check its compiled
graphs run on their inputs (Python type, dispatch keys, so device and
requires_grad, dtype, device index, sizes, strides). Where this torch has no
usable ``TensorGuards``, or under ``PARDIST_DEBUG=1``, or while dynamo traces,
nothing matches: every call runs every check, as a first call does. A signature
never matches tensors it was not made for; a miss only costs the checks.
"""

from __future__ import annotations

import torch

from pardist.runtime._compat import tensor_guard, tracing
from pardist.runtime._context import debug_enabled

__all__ = ["Signature"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class Signature:
    """The signature of a list of tensors, to compare later lists with, in C."""

    __slots__ = ("_guard", "_n")

    def __init__(self, tensors: list):
        self._n = len(tensors)
        plain = all(type(t) in _PLAIN for t in tensors)  # subclasses: every check runs
        self._guard = tensor_guard(tensors) if plain and not tracing() else None

    @property
    def usable(self) -> bool:
        """Whether it can match anything (a guard was made: plain tensors, a torch with it)."""
        return self._guard is not None

    def matches(self, tensors: list) -> bool:
        """Whether ``tensors`` are alike the ones this was made for, position by position."""
        guard = self._guard
        return (
            guard is not None
            and len(tensors) == self._n
            and not debug_enabled()
            and not tracing()
            and guard.check(*tensors)
        )
