"""pardist: data-parallel training on PyTorch, written the way JAX people write it.

A training step is a pure function of parameter trees;
``pardist.data_parallel(step, axis='gpu')`` runs it on every rank's shard of the
batch and ``pardist.grad`` averages the gradients, with explicit sharding specs
instead of wrapped modules.
"""

from pardist import amp, checkpoint, data, optim
from pardist._batchnorm import CrossReplicaBatchNorm, convert_batchnorm
from pardist._collectives import (
    all_gather,
    axis_index,
    axis_size,
    broadcast,
    pmax,
    pmean,
    psum,
    pvary,
)
from pardist._data_parallel import data_parallel
from pardist._exchange import all_to_all, psum_scatter
from pardist._fsdp import fsdp
from pardist._functional import functional
from pardist._gather import gather, gather_object
from pardist._grad import grad, value_and_grad
from pardist._mesh import Mesh
from pardist._progress import get_logger, print0, progress
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
from pardist._seed import rank_seed, seed_everything, seed_worker
from pardist._shard_map import shard_map
from pardist._spawn import SpawnError, spawn
from pardist._specs import P, local_block, specs, state_specs
from pardist._warnings import DuplicateBatchWarning, NonFiniteLossWarning

__version__ = "0.1.0"

__all__ = [
    "CrossReplicaBatchNorm",
    "DuplicateBatchWarning",
    "Mesh",
    "NonFiniteLossWarning",
    "P",
    "SpawnError",
    "all_gather",
    "all_to_all",
    "amp",
    "axis_index",
    "axis_size",
    "broadcast",
    "checkpoint",
    "convert_batchnorm",
    "data",
    "data_parallel",
    "device",
    "distributed",
    "fsdp",
    "functional",
    "gather",
    "gather_object",
    "get_logger",
    "grad",
    "init",
    "is_initialized",
    "is_main",
    "local_block",
    "local_rank",
    "optim",
    "pmax",
    "pmean",
    "print0",
    "progress",
    "psum",
    "psum_scatter",
    "pvary",
    "rank",
    "rank0_first",
    "rank_seed",
    "seed_everything",
    "seed_worker",
    "shard_map",
    "shutdown",
    "spawn",
    "specs",
    "state_specs",
    "value_and_grad",
    "world_size",
]
