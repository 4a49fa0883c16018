"""Optimizers and gradient transformations as pure ``init`` / ``update`` pairs (optax's shape).

``opt = pardist.optim.adamw(lr)``; ``state = opt.init(params)``;
``params, state = opt.update(grads, state, params)``. May import ``pardist.runtime``,
``pardist.transport``, ``pardist.compile``, ``pardist.collectives`` and ``pardist.sharding``.
"""

from pardist.optim._adamw import AdamWState, adam, adamw
from pardist.optim._base import GradientTransformation, Optimizer, chain
from pardist.optim._groups import current_lr, masked, multi_transform, step_count
from pardist.optim._schedules import (
    constant,
    cosine_decay,
    flat_cos,
    linear_warmup,
    one_cycle,
    piecewise_constant,
    warmup_cosine,
)
from pardist.optim._sgd import SGDState, sgd
from pardist.optim._sharded import ShardedState, sharded
from pardist.optim._torch import from_torch, prepared, state_from_torch, state_to_torch
from pardist.optim._transforms import clip_by_global_norm, clip_by_value, global_norm

__all__ = [
    "AdamWState",
    "GradientTransformation",
    "Optimizer",
    "SGDState",
    "ShardedState",
    "adam",
    "adamw",
    "chain",
    "clip_by_global_norm",
    "clip_by_value",
    "current_lr",
    "constant",
    "cosine_decay",
    "flat_cos",
    "from_torch",
    "global_norm",
    "linear_warmup",
    "masked",
    "multi_transform",
    "one_cycle",
    "piecewise_constant",
    "sgd",
    "sharded",
    "prepared",
    "state_from_torch",
    "state_to_torch",
    "step_count",
    "warmup_cosine",
]
