"""Models as pure functions: ``pardist.functional(module)`` and cross-replica batch norm.

May import ``pardist.runtime``, ``pardist.collectives`` and ``pardist.sharding``.
"""

from pardist.nn._convert import CrossReplicaBatchNorm, convert_batchnorm
from pardist.nn._export import state_dict, unwrapped
from pardist.nn._functional import functional
from pardist.nn._remat import Remat, remat

__all__ = [
    "CrossReplicaBatchNorm",
    "Remat",
    "convert_batchnorm",
    "functional",
    "remat",
    "state_dict",
    "unwrapped",
]
