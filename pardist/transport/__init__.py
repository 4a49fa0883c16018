"""Moving bytes between ranks: shared memory on one host, the backend's collectives.

Shared-memory segments and futexes, collective primitives as autograd Functions,
and the bucketed gradient reducers (all-reduce and reduce-scatter, DDP's buckets).
May import ``pardist.runtime`` only. The names below are its interface.
"""

from pardist.transport._agree import agree, header, name_step
from pardist.transport._buckets import assign
from pardist.transport._primitives import (
    TRACED,
    AllGather,
    AllGatherInvariant,
    AllToAll,
    Pbroadcast,
    Pmax,
    Ppermute,
    Psum,
    PsumInvariant,
    PsumScatter,
    Pvary,
)
from pardist.transport._reducer import Reducer
from pardist.transport._scatter import (
    ParamGather,
    ScatterReducer,
    all_gather_into,
    flat_layout,
    reduce_scatter_into,
    shard_range,
    signature,
    unpack_column,
)
from pardist.transport._shm import ALIGN, SharedMemoryGroup
from pardist.transport._stepmark import mark_step

__all__ = [
    "ALIGN",
    "TRACED",
    "AllGather",
    "AllGatherInvariant",
    "AllToAll",
    "ParamGather",
    "Pbroadcast",
    "Pmax",
    "Ppermute",
    "Psum",
    "PsumInvariant",
    "PsumScatter",
    "Pvary",
    "Reducer",
    "ScatterReducer",
    "SharedMemoryGroup",
    "agree",
    "all_gather_into",
    "assign",
    "flat_layout",
    "header",
    "mark_step",
    "name_step",
    "reduce_scatter_into",
    "shard_range",
    "signature",
    "unpack_column",
]
