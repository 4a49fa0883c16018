"""The backend of a compiled step: the user's compiler, plus what every rank must agree on.

torch.compile calls it with each graph dynamo made of a step. It adds pardist's inductor
passes (one layout for a conv net's activations, shared-memory sums issued beside the
backward, the sums read where they lie), refuses a graph it cannot hold (activation
checkpoints), and on a step's first call has the ranks agree whether every one of them
compiled: a rank that could not makes every rank run the step eagerly, so that compiled
and eager collectives never meet.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pardist import transport
from pardist.compile import _beside, _guard, _layout
from pardist.runtime import (
    TorchCompileInductorWrapper,
    _compat,
    checkpoint_op,
    inductor_overlap_passes,
)

__all__ = ["Backend", "Refused", "agree", "overlap_options", "reason"]


def overlap_options() -> dict:
    """Inductor's scheduling for a graph whose gradient buckets are async collectives.

    Where the graph reduces over torch's functional collectives (nccl, or gloo without
    shared memory), each bucket's all-reduce is issued as soon as the backward has
    produced its gradients, the backward's remaining kernels are ordered to run while
    it travels (``raise_comms``, ``reorder_compute_for_overlap``), and its wait moves to
    where the update first reads the sums (``sink_waits``): the overlap torch's DDP
    gets from its hooks. These passes run after inductor has fused its kernels, so
    they change the order of the same kernels, never their arithmetic. Graphs without
    such collectives (shared memory's operators, one rank) are left as they were.
    A pass this torch does not have is left out; the user's ``options`` win.
    """
    passes = inductor_overlap_passes(("sink_waits", "raise_comms", "reorder_compute_for_overlap"))
    if not passes:
        return {}
    return {
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": passes,
    }


def reason(e: BaseException) -> str:
    """The first informative line of a compilation error."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    head = lines[0] if lines else type(e).__name__
    cause = e.__cause__ or e.__context__
    if isinstance(e, _compat.dynamo.exc.BackendCompilerFailed) and cause is not None:
        return reason(cause)
    for line in lines:  # an error the step raised while traced: dynamo names it here
        if "raised exception " in line:
            return line.split("raised exception ", 1)[1][:500]
    explanation = [line[:240] for line in lines[1:4] if line.startswith("Explanation:")]
    # The user's line that dynamo stopped at: its last 'File "...", line N' and the code.
    at = [i for i, line in enumerate(lines) if line.startswith('File "') and ", line " in line]
    code = lines[at[-1] : at[-1] + 2] if at else [x for x in lines[1:4] if "line " in x]
    return f"{type(e).__name__}: " + " ".join([head, *explanation, *code])[:700]


class Refused(RuntimeError):
    """Another rank could not compile the step: every rank runs it eagerly."""


class Backend:
    """The user's backend, plus the ranks' agreement on the first compilation."""

    def __init__(self, backend: Any, mode: Any, options: Any, dynamic: Any):
        if backend == "inductor":
            # A conv net's activations in one layout (_layout); shared-memory sums
            # issued as the backward makes their gradients (_beside).
            early = {"post_grad_custom_pre_pass": _layout.one_layout()}
            early["post_grad_custom_post_pass"] = _beside.issue_early()
            self.in_place = _guard.guard()  # the update reads the sums in shared memory
            self.inner = TorchCompileInductorWrapper(mode, {**early, **(options or {})}, dynamic)
            # The same compiler, scheduling a graph's async collectives beside its backward.
            overlap = {**early, **overlap_options(), **(options or {})}
            self.overlapping = TorchCompileInductorWrapper(mode, overlap, dynamic)
        else:
            lookup = _compat.dynamo.lookup_backend
            self.inner = lookup(backend) if isinstance(backend, str) else backend
            self.overlapping = self.inner
            self.in_place = False  # the sums copied out of shared memory (copy_out)
        self.agreeing = False  # during a step's first call
        self.verdict: str | None = None  # set once the ranks have agreed
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        self.graphs += 1
        try:
            _no_checkpoints(gm)
            if not self.in_place:
                _guard.copy_out(gm)
            inner = self.overlapping if _async_collectives(gm) else self.inner
            compiled, problem = inner(gm, example_inputs), None
        except _compat.dynamo.exc.RestartAnalysis:
            raise  # dynamo traces again and calls back: nothing to agree on yet
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
            compiled, problem, error = None, reason(e), e
        if self.agreeing:
            self.verdict = agree(problem)
            if self.verdict:
                raise Refused(self.verdict)
        if problem:
            raise error
        return compiled


def _async_collectives(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph issues torch's functional collectives (which run beside it)."""
    return any("_c10d_functional." in str(n.target) for n in gm.graph.nodes)


def _no_checkpoints(gm: torch.fx.GraphModule) -> None:
    """Refuse a graph holding activation checkpoints, saying how to compile it instead.

    The whole-step graph differentiates with torch.func, which cannot run the saved-
    tensor hooks a checkpoint is made of (dynamo records one as ``checkpoint_op``)."""
    if checkpoint_op is not None and any(n.target is checkpoint_op for n in gm.graph.nodes):
        raise RuntimeError(
            "the model checkpoints activations (torch.utils.checkpoint, Hugging Face's "
            "gradient checkpointing, pardist.remat), which the whole-step graph cannot "
            "hold: it differentiates with torch.func, which runs no saved-tensor hooks. "
            "To compile a model that checkpoints, compile its loss in an eager step: "
            "pardist.grad(torch.compile(loss_fn))"
        )


def agree(problem: str | None) -> str:
    """Every rank's verdict on compiling: '' if all could, else the first problem."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem or ""
    verdicts: list = [None] * dist.get_world_size()
    transport.agree("pardist.compile's verdict on compiling", dist.group.WORLD)
    dist.all_gather_object(verdicts, problem)
    for rank, v in enumerate(verdicts):
        if v:
            return v if v == problem else f"on rank {rank}: {v}"
    return ""
