"""FSDP (ZeRO-3): parameters stored as flat shards over an axis, gathered per module.

``pardist.fsdp(params)``, the units gathered together, their gathers and the
reduce-scatter of their gradients. May import ``pardist.runtime``,
``pardist.transport``, ``pardist.compile`` and ``pardist.collectives``.
"""

from pardist.sharding._fsdp import fsdp

__all__ = ["fsdp"]
