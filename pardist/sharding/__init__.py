"""FSDP (ZeRO-3): parameters stored as flat shards over an axis, gathered per module.

``pardist.fsdp(params)``, the units gathered together, their gathers and the
reduce-scatter of their gradients, eagerly (``_apply``) and in a compiled step's graph
(``_traced``: :class:`Local` is a shard as a compiled step's ``pardist.grad`` gives it to
the loss). May import ``pardist.runtime``, ``pardist.transport``, ``pardist.compile`` and
``pardist.collectives``.
"""

from pardist.sharding._fsdp import fsdp
from pardist.sharding._traced import Local

__all__ = ["Local", "fsdp"]
