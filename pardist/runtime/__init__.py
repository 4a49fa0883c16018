"""The bottom layer: the process group, meshes, the step context, trees, failures.

Holds who this process is (``_process``), named meshes over DeviceMesh, the running
step's context, pytree helpers, gradient layouts, seeding, logging and pardist's
warnings and errors. Imports nothing else of pardist. Public names are re-exported
by ``pardist``; the names below are what the packages above may use (the modules
``_tree``, ``_process``, ``_mesh``... are imported whole as namespaces).
"""

# First: an unsupported torch is refused in one line, before pardist touches its internals.
from pardist.runtime import _compat
from pardist.runtime._compat import *  # noqa: F403 (its __all__: what torch offers, version-proofed)
from pardist.runtime._context import (
    CallState,
    Ids,
    StepContext,
    collective_starts,
    compiled_plan,
    current_mode,
    current_step,
    debug_enabled,
    donating,
    entered,
    holds,
    is_donated,
    shard_group,
    sharded_over,
)
from pardist.runtime._faults import StepMismatch
from pardist.runtime._integrity import (
    MARKER,
    CheckpointError,
    cause,
    checksums,
    claim_folder,
    commit,
    committed_steps,
    described,
    save_error,
    verify,
)
from pardist.runtime._layout import (
    ShardsGradients,
    dense_strides,
    is_dense,
    laid_out_like,
    same_layout,
)
from pardist.runtime._lockstep import Lockstep
from pardist.runtime._mesh import Mesh, current_mesh, distributed, init
from pardist.runtime._modes import (
    ALONE,
    EAGER,
    Alone,
    Compiled,
    CompiledLoss,
    Deterministic,
    Eager,
    Mode,
)
from pardist.runtime._process import (
    GroupRef,
    device,
    is_initialized,
    is_main,
    local_rank,
    rank,
    shutdown,
    world_size,
)
from pardist.runtime._progress import get_logger, print0, progress
from pardist.runtime._rank0first import rank0_first
from pardist.runtime._rng import rng_count, set_rng_count
from pardist.runtime._seed import rank_seed, seed_everything, seed_worker
from pardist.runtime._signature import Signature
from pardist.runtime._warnings import (
    DuplicateBatchWarning,
    GradientSumWarning,
    NonFiniteLossWarning,
    RankLostWarning,
)

__all__ = [
    *_compat.__all__,
    "ALONE",
    "EAGER",
    "MARKER",
    "Alone",
    "CallState",
    "CheckpointError",
    "Compiled",
    "CompiledLoss",
    "Deterministic",
    "DuplicateBatchWarning",
    "GradientSumWarning",
    "Eager",
    "GroupRef",
    "Ids",
    "Lockstep",
    "Mesh",
    "Mode",
    "NonFiniteLossWarning",
    "RankLostWarning",
    "ShardsGradients",
    "Signature",
    "StepContext",
    "StepMismatch",
    "cause",
    "checksums",
    "claim_folder",
    "collective_starts",
    "commit",
    "committed_steps",
    "described",
    "compiled_plan",
    "current_mesh",
    "current_mode",
    "current_step",
    "debug_enabled",
    "dense_strides",
    "device",
    "distributed",
    "donating",
    "entered",
    "get_logger",
    "holds",
    "init",
    "is_dense",
    "is_donated",
    "is_initialized",
    "is_main",
    "laid_out_like",
    "local_rank",
    "print0",
    "progress",
    "rank",
    "rank0_first",
    "rank_seed",
    "rng_count",
    "same_layout",
    "save_error",
    "seed_everything",
    "seed_worker",
    "set_rng_count",
    "shard_group",
    "sharded_over",
    "shutdown",
    "verify",
    "world_size",
]
