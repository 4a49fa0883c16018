"""pardist's warnings: conditions that are usually mistakes but may be meant.

Each has its own category, so a script can silence one or make it an error
(``warnings.simplefilter('error', pardist.DuplicateBatchWarning)``);
``PARDIST_DEBUG=1`` makes pardist raise instead of warning. A warning points at
the user's line that led to it, not at pardist's internals.
"""

from __future__ import annotations

import sys
import warnings

__all__ = [
    "DuplicateBatchWarning",
    "GradientSumWarning",
    "NonFiniteLossWarning",
    "RankLostWarning",
    "warn",
]


class DuplicateBatchWarning(UserWarning):
    """Every rank of a data-parallel step received the same batch."""


class GradientSumWarning(UserWarning):
    """A gradient taken outside ``pardist.grad`` in a data-parallel step (``torch.func.grad``,
    ``.backward()``) of a per-rank loss: JAX's rule makes it the sum over the ranks."""


class NonFiniteLossWarning(UserWarning):
    """The loss was inf or nan on some rank of a data-parallel step."""


class RankLostWarning(UserWarning):
    """A rank was lost and the survivors went on without it (``--keep-going``)."""


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first caller outside pardist."""
    frame, level = sys._getframe(1), 2  # level 2: warn's caller
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "pardist":
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
