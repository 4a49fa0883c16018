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
    """Ramp linearly from ``start`` to ``schedule(0)`` over ``warmup_steps``, then follow it.

    The inner schedule starts counting after the warm-up: at step ``warmup_steps + n``
    it is ``schedule(n)``. So a cosine inside decays over its own ``decay_steps`` after
    the warm-up; for warm-up and decay within ``total_steps`` in one call, see
    :func:`warmup_cosine`.
    """
    after = schedule if callable(schedule) else constant(schedule)

    def warm(count: int) -> float:
        if count >= warmup_steps:
            return after(count - warmup_steps)
        return start + (after(0) - start) * count / warmup_steps

    return warm


def warmup_cosine(
    peak: float, warmup_steps: int, total_steps: int, start: float = 0.0, end: float = 0.0
) -> Schedule:
    """Linear warm-up from ``start`` to ``peak``, then a cosine down to ``end`` at
    ``total_steps`` (counted from the first step, warm-up included).

    Equal to ``torch.optim.lr_scheduler.LambdaLR`` with the same formula: ``lr(t) =
    start + (peak - start) * t / warmup_steps`` during the warm-up, then ``end + (peak -
    end) * (1 + cos(pi * (t - warmup_steps) / (total_steps - warmup_steps))) / 2``.

    Example:
        >>> import pardist
        >>> s = pardist.optim.warmup_cosine(1.0, warmup_steps=2, total_steps=6)
        >>> [round(s(t), 3) for t in range(7)]
        [0.0, 0.5, 1.0, 0.854, 0.5, 0.146, 0.0]
    """
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(
            f"pardist.optim.warmup_cosine: warmup_steps={warmup_steps} must be at least 0 "
            f"and less than total_steps={total_steps}."
        )

    def schedule(count: int) -> float:
        if count < warmup_steps:
            return start + (peak - start) * count / warmup_steps
        pct = min(count - warmup_steps, total_steps - warmup_steps) / (total_steps - warmup_steps)
        return _cos(peak, end, pct)

    return schedule


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
