"""The step: ``shard_map`` and ``data_parallel``, partition specs, varying-axes tracking.

Runs a pure function on every rank's blocks and checks what crosses its edge
(specs, replicated values, duplicate batches). May import every package below it:
runtime, transport, compile, collectives, sharding, gradients, nn, data (not optim: a
sharded state says itself how its gradients arrive, runtime._layout.ShardsGradients).
"""

from pardist.step._data_parallel import data_parallel
from pardist.step._diloco import DiLoCo, DiLoCoState, diloco, local_sgd
from pardist.step._shard_map import shard_map
from pardist.step._specs import P, local_block, specs, state_specs

__all__ = [
    "DiLoCo",
    "DiLoCoState",
    "P",
    "data_parallel",
    "diloco",
    "local_block",
    "local_sgd",
    "shard_map",
    "specs",
    "state_specs",
]
