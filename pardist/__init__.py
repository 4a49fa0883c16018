"""pardist: data-parallel training on PyTorch, written the way JAX people write it.

A training step is a pure function of parameter trees;
``pardist.data_parallel(step, axis='gpu')`` runs it on every rank's shard of the
batch and ``pardist.grad`` averages the gradients, with explicit sharding specs
instead of wrapped modules.
"""

from pardist import optim
from pardist._collectives import all_gather, axis_index, axis_size, broadcast, pmax, pmean, psum
from pardist._data_parallel import data_parallel
from pardist._functional import functional
from pardist._batchnorm import CrossReplicaBatchNorm, convert_batchnorm
from pardist._grad import grad, value_and_grad
from pardist._mesh import Mesh
from pardist._spawn import SpawnError, spawn
from pardist._runtime import (
    device,
    distributed,
    init,
    is_initialized,
    is_main,
    local_rank,
    rank,
    rank0_first,
    shutdown,
    world_size,
)
from pardist._specs import P

__version__ = "0.1.0"

__all__ = [
    "CrossReplicaBatchNorm",
    "Mesh",
    "P",
    "SpawnError",
    "all_gather",
    "axis_index",
    "axis_size",
    "broadcast",
    "convert_batchnorm",
    "data_parallel",
    "device",
    "distributed",
    "functional",
    "grad",
    "init",
    "is_initialized",
    "is_main",
    "local_rank",
    "optim",
    "pmax",
    "pmean",
    "psum",
    "rank",
    "rank0_first",
    "shutdown",
    "spawn",
    "value_and_grad",
    "world_size",
]
