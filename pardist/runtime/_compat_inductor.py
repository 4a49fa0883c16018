"""The seam's second file: inductor's hooks that compiled steps use (pardist.runtime._compat).

Each names a private part of ``torch._inductor`` (or torch's wrapper around it), says
since which torch it is used as here, and degrades where a torch lacks it.
"""

from __future__ import annotations

import sys

import torch

__all__ = [
    "TorchCompileInductorWrapper",
    "inductor_graph_pass",
    "inductor_layout_opt",
    "inductor_lowering",
    "inductor_overlap_passes",
    "never_a_frame",
]

# torch._TorchCompileInductorWrapper: the backend torch.compile builds for inductor from
# (mode, options, dynamic), so compile=True accepts torch.compile's arguments; since 2.0.
TorchCompileInductorWrapper = torch._TorchCompileInductorWrapper


def inductor_overlap_passes(names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` that this torch's inductor has as compute/communication overlap
    passes: torch._inductor.comms, named in ``reorder_for_compute_comm_overlap_passes``
    (sink_waits, raise_comms, reorder_compute_for_overlap since 2.2). Imported when a
    step compiles, not with pardist."""
    from torch._inductor import comms

    return [n for n in names if callable(getattr(comms, n, None))]


def inductor_graph_pass(fn, files: tuple[str, ...]):
    """``fn`` (a function of an FX graph) as inductor's ``post_grad_custom_pre_pass`` or
    ``post_grad_custom_post_pass``:
    wrapped in torch._inductor.custom_graph_pass.CustomGraphPass (since 2.5) with a uuid
    hashed from ``files`` (its source), so that compiled graphs stay cacheable; the bare
    function where this torch lacks the class (inductor then compiles without its cache).
    Imported when a step compiles, not with pardist."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
    except ImportError:
        return fn

    class _Pass(CustomGraphPass):
        def __call__(self, graph) -> None:
            fn(graph)

        def uuid(self) -> bytes:
            return get_hash_for_files(files)

    return _Pass()


def inductor_lowering(op, then) -> bool:
    """Have inductor lower the custom operator ``op`` as it lowers any (its fallback
    kernel), then ``then(out, clone, graph)``: that kernel's output, inductor's lowering
    of ``aten.clone`` and the graph being lowered (``V.graph``), returning what the
    graph reads. False where this torch lacks the hooks (``register_lowering``)."""
    try:
        from torch._inductor import lowering
        from torch._inductor.virtualized import V
    except ImportError:
        return False
    clone = lowering.lowerings.get(torch.ops.aten.clone.default)
    if clone is None or not hasattr(lowering, "register_lowering"):
        return False
    fallback = lowering.fallback_handler(op, add_to_fallback_set=False)

    def lower(*args, **kwargs):
        return then(fallback(*args, **kwargs), clone, V.graph)

    lowering.register_lowering(op, type_promotion_kind=None)(lower)
    return True


def inductor_layout_opt(gm: torch.fx.GraphModule) -> bool:
    """Whether inductor will run this (inference) graph's convolutions channels_last:
    torch._inductor.graph.GraphLowering.decide_layout_opt, a staticmethod since 2.1
    (always where oneDNN runs every convolution, by heuristics on GPUs). False where
    this torch lacks it or it cannot decide. Imported when a step compiles."""
    try:
        from torch._inductor.graph import GraphLowering

        return bool(GraphLowering.decide_layout_opt(gm, is_inference=True))
    except Exception:  # noqa: BLE001 - no answer: leave the graph as traced
        return False


_never_frames: set = set()


def never_a_frame(fn) -> None:
    """Never let dynamo compile ``fn`` as a frame of its own (it still traces it inline).

    A TorchFunctionMode's ``__torch_function__`` runs for every torch call; where a
    compiled function graph-breaks (torch 2.11 at a reentrant checkpoint), dynamo caught
    each of those calls as a new frame, compiled it (a one-op graph per argument count,
    with inductor's rounding) and, past its recompile limit, ran the rest eagerly: a
    compiled loss then gave other numbers than without the checkpoint. A skipped frame
    runs as plain Python, and so does what it calls. torch._dynamo's
    ``set_code_exec_strategy`` (``skip_code`` with the callees skipped too), as used since
    2.6; only once dynamo is imported (a process that never compiles never imports it).
    """
    code = fn.__code__
    if code in _never_frames or "torch._dynamo" not in sys.modules:
        return
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # another torch: its frames as dynamo decides
        _never_frames.add(code)
        return
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    _never_frames.add(code)


def reset_dynamo() -> None:
    """Forget every frame dynamo compiled (a step compiled again for a new world size)."""
    import torch._dynamo

    torch._dynamo.reset()
