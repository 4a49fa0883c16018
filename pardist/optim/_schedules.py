"""Learning-rate schedules: functions from the step count to a value.

Pass one as ``lr`` to any pardist optimizer. Each is a plain function of an
``int``, so it can be printed, plotted and tested.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = [
    "constant",
    "cosine_decay",
    "flat_cos",
    "linear_warmup",
    "one_cycle",
    "piecewise_constant",
]

Schedule = Callable[[int], float]


def constant(value: float) -> Schedule:
    return lambda count: value


def _cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2 * (math.cos(math.pi * pct) + 1)


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine from ``init_value`` down to ``alpha * init_value`` over ``decay_steps``."""

    def schedule(count: int) -> float:
        return _cos(init_value, alpha * init_value, min(count, decay_steps) / decay_steps)

    return schedule


def linear_warmup(schedule: Schedule | float, warmup_steps: int, start: float = 0.0) -> Schedule:
    """Ramp linearly from ``start`` to ``schedule`` over ``warmup_steps``, then follow it."""
    after = schedule if callable(schedule) else constant(schedule)

    def warm(count: int) -> float:
        if count >= warmup_steps:
            return after(count - warmup_steps)
        return start + (after(0) - start) * count / warmup_steps

    return warm


def one_cycle(
    total_steps: int,
    max_lr: float,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    """The one-cycle policy, equal to ``torch.optim.lr_scheduler.OneCycleLR`` (cosine).

    Rises from ``max_lr / div_factor`` to ``max_lr`` over the first ``pct_start``
    of the steps, then anneals to ``max_lr / div_factor / final_div_factor``
    (fastai's ``fit_one_cycle``, with fastai's ``pct_start=0.25, final_div_factor=1e5``).

    Example:
        >>> from pardist.optim import one_cycle
        >>> lr = one_cycle(100, 1.0)
        >>> round(lr(0), 4), round(lr(29), 4), lr(99) < 1e-5
        (0.04, 1.0, True)
    """
    initial = max_lr / div_factor
    final = initial / final_div_factor
    peak = float(pct_start * total_steps) - 1

    def schedule(count: int) -> float:
        if count <= peak:
            return _cos(initial, max_lr, count / peak if peak > 0 else 1.0)
        return _cos(max_lr, final, (count - peak) / (total_steps - 1 - peak))

    return schedule


def flat_cos(
    total_steps: int, lr: float, pct_start: float = 0.75, div_final: float = 1e5
) -> Schedule:
    """fastai's ``fit_flat_cos``: flat at ``lr``, then cosine down to ``lr / div_final``."""
    flat = int(total_steps * pct_start)

    def schedule(count: int) -> float:
        if count < flat:
            return lr
        return _cos(lr, lr / div_final, (count - flat) / max(total_steps - flat, 1))

    return schedule


def piecewise_constant(boundaries: Sequence[int], values: Sequence[float]) -> Schedule:
    """``values[i]`` from ``boundaries[i-1]`` on (torch's ``MultiStepLR`` shape)."""
    if len(values) != len(boundaries) + 1:
        raise ValueError("pardist.optim.piecewise_constant: give one more value than boundaries.")

    def schedule(count: int) -> float:
        return values[sum(count >= b for b in boundaries)]

    return schedule
