"""pardist: data-parallel training on PyTorch, written the way JAX people write it.

A training step is a pure function of parameter trees;
``pardist.data_parallel(step, axis='gpu')`` runs it on every rank's shard of the
batch and ``pardist.grad`` averages the gradients, with explicit sharding specs
instead of wrapped modules.
"""

# First: an unsupported torch is refused in one line, before pardist touches its internals
# (the runtime package imports its compatibility seam before anything else).
from pardist import runtime  # noqa: F401  # isort: skip

# isort: split
from pardist import amp, checkpoint, data, optim
from pardist.collectives import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    broadcast,
    pmax,
    pmean,
    pmin,
    ppermute,
    psum,
    psum_scatter,
    pvary,
    varying_axes,
)
from pardist.data import gather, gather_object
from pardist.gradients import grad, value_and_grad
from pardist.launch import SpawnError, spawn
from pardist.nn import (
    CrossReplicaBatchNorm,
    Remat,
    convert_batchnorm,
    functional,
    remat,
    state_dict,
    unwrapped,
)
from pardist.runtime import (
    DuplicateBatchWarning,
    GradientSumWarning,
    Mesh,
    NonFiniteLossWarning,
    RankLostWarning,
    device,
    distributed,
    get_logger,
    init,
    is_initialized,
    is_main,
    local_rank,
    print0,
    progress,
    rank,
    rank0_first,
    rank_seed,
    rng_count,
    seed_everything,
    seed_worker,
    set_rng_count,
    shutdown,
    world_size,
)
from pardist.sharding import fsdp
from pardist.step import (
    DiLoCo,
    DiLoCoState,
    P,
    data_parallel,
    diloco,
    local_block,
    local_sgd,
    shard_map,
    specs,
    state_specs,
)

__version__ = "0.1.0"

__all__ = [
    "CrossReplicaBatchNorm",
    "DiLoCo",
    "DiLoCoState",
    "DuplicateBatchWarning",
    "GradientSumWarning",
    "Mesh",
    "NonFiniteLossWarning",
    "P",
    "RankLostWarning",
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
    "pmin",
    "ppermute",
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
    "unwrapped",
    "state_specs",
    "value_and_grad",
    "varying_axes",
    "world_size",
]
