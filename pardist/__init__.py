"""pardist: data-parallel training on PyTorch, written the way JAX people write it.

A training step is a pure function of parameter trees;
``pardist.data_parallel(step, axis='gpu')`` runs it on every rank's shard of the
batch and ``pardist.grad`` averages the gradients, with explicit sharding specs
instead of wrapped modules.
"""

# First: an unsupported torch is refused in one line, before pardist touches its internals.
from pardist.runtime import _compat  # noqa: F401  # isort: skip

# isort: split
from pardist import amp, checkpoint, data, optim
from pardist.collectives._broadcast import broadcast
from pardist.collectives._collectives import (
    all_gather,
    axis_index,
    axis_size,
    pmax,
    pmean,
    psum,
    pvary,
)
from pardist.collectives._exchange import all_to_all, psum_scatter
from pardist.data._gather import gather, gather_object
from pardist.gradients._grad import grad, value_and_grad
from pardist.launch._spawn import SpawnError, spawn
from pardist.nn._convert import CrossReplicaBatchNorm, convert_batchnorm
from pardist.nn._export import state_dict
from pardist.nn._functional import functional
from pardist.nn._remat import Remat, remat
from pardist.runtime._mesh import Mesh, distributed, init
from pardist.runtime._process import (
    device,
    is_initialized,
    is_main,
    local_rank,
    rank,
    rank0_first,
    shutdown,
    world_size,
)
from pardist.runtime._progress import get_logger, print0, progress
from pardist.runtime._rng import rng_count, set_rng_count
from pardist.runtime._seed import rank_seed, seed_everything, seed_worker
from pardist.runtime._warnings import DuplicateBatchWarning, NonFiniteLossWarning
from pardist.sharding._fsdp import fsdp
from pardist.step._data_parallel import data_parallel
from pardist.step._diloco import DiLoCo, DiLoCoState, diloco, local_sgd
from pardist.step._shard_map import shard_map
from pardist.step._specs import P, local_block, specs, state_specs

__version__ = "0.1.0"

__all__ = [
    "CrossReplicaBatchNorm",
    "DiLoCo",
    "DiLoCoState",
    "DuplicateBatchWarning",
    "Mesh",
    "NonFiniteLossWarning",
    "P",
    "Remat",
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
    "diloco",
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
    "local_sgd",
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
    "remat",
    "rng_count",
    "seed_everything",
    "seed_worker",
    "set_rng_count",
    "shard_map",
    "shutdown",
    "spawn",
    "specs",
    "state_dict",
    "state_specs",
    "value_and_grad",
    "world_size",
]
