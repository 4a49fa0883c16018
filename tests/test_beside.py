"""A compiled step reads its gradients' sums where they were summed, in shared memory.

Between CPU ranks of one host the whole-step graph's update reads each bucket's sum in
the common area (``compile._beside``), as the eager step's update does: no copy. That
memory is the other ranks' too, and the next step rewrites it. So inductor must never
compute into it (no buffer reuse, no in-place kernel), and a sum the graph returns, or
writes into, is copied first. These tests hold the graph to that, against plain torch
in one process (float64).
"""

from __future__ import annotations

import operator

import helpers
import pytest
import torch
import torch.fx
import torch.nn.functional as F
from numerics import assert_close64

import pardist
from pardist.compile import _guard

F64 = torch.float64
LIMIT = 300  # seconds per call: compiling is slow on a loaded machine
STEPS = 3
LR = 0.1


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 40), torch.nn.Tanh(), torch.nn.Linear(40, 6))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g, dtype=F64), torch.randn(8, 6, generator=g, dtype=F64)


def _added(rank: int) -> float:
    return 0.25 * (rank + 1)  # a number of each rank's own, added to its sums in place


def _reference(ranks: int) -> list:
    """Plain torch, one process, the whole batch: each step's new parameters, its mean
    gradients, and the mean over ranks of their sum with each rank's number added."""
    net = _net().to(F64)
    x, y = _batch()
    out = []
    for _ in range(STEPS):
        loss = F.mse_loss(net(x), y)
        g = dict(zip(dict(net.named_parameters()), torch.autograd.grad(loss, net.parameters())))
        with torch.no_grad():
            for name, p in net.named_parameters():
                p -= LR * g[name]
        params = {k: v.detach().clone() for k, v in net.named_parameters()}
        added = [sum((v + _added(r)).sum() for v in g.values()) for r in range(ranks)]
        out.append((params, g, sum(added) / ranks))
    return out


def _compiled_steps(written: bool):
    """Three compiled steps at this rank, each returning its new parameters and either
    its mean gradients or (``written``) the ranks' mean of their sum after adding the
    rank's number to them in place. Every step's results are read after the last step.
    (Inductor fuses this in-place add into the sum's kernel: which writes into the sums'
    memory get a copy is tested below, on graphs.)"""
    torch._dynamo.reset()
    apply, params, buffers = pardist.functional(_net().to(F64))
    add = _added(pardist.rank())

    def step(params, batch):
        x, y = batch
        grads = pardist.grad(lambda p: F.mse_loss(apply(p, buffers, x)[0], y))(params)
        new = {k: p - LR * grads[k] for k, p in params.items()}
        if not written:
            return new, grads
        g = list(grads.values())
        torch._foreach_add_(g, add)
        return new, pardist.pmean(torch.stack([t.sum() for t in g]).sum(), "gpu")

    dp = pardist.data_parallel(step, compile=True)
    rank, world = pardist.rank(), pardist.world_size()
    batch = tuple(helpers.shard(t, rank, world) for t in _batch())
    out = []
    for _ in range(STEPS):
        params, result = dp(params, batch)
        out.append((params, result))
    ran = dp.compiled.fallback is None and dp.compiled.calls == STEPS
    return out, ran, _guard.guard()


@pytest.mark.parametrize("written", [False, True], ids=["returned", "written"])
def test_sums_a_compiled_step_returns_or_writes_are_its_own(run, written):
    want = _reference(2)
    for rank, (out, ran, guarded) in enumerate(run(2, _compiled_steps, written, timeout=LIMIT)):
        assert ran and guarded  # one graph, its update reading the sums in shared memory
        for k, (params, result) in enumerate(out):
            assert_close64(params, want[k][0], f"rank {rank}, step {k}: parameters")
            # Returned sums outlive the next step's; a rank's write is not the other's.
            assert_close64(result, want[k][2 if written else 1], f"rank {rank}, step {k}")


def _graph(use) -> torch.fx.Node:
    """A graph whose wait's sum is sliced and viewed, and the view used by ``use``."""
    graph = torch.fx.Graph()
    ticket = graph.placeholder("ticket")
    wait = graph.call_function(
        torch.ops.pardist.shm_sum_wait.default, (ticket, ticket, 12, torch.float32)
    )
    piece = graph.call_function(torch.ops.aten.slice.Tensor, (wait, 0, 0, 6))
    view = graph.call_function(torch.ops.aten.view.default, (piece, [2, 3]))
    graph.output(use(graph, view))
    return wait


def _call(op, *args):
    return lambda graph, view: graph.call_function(
        op, tuple(view if a is None else a for a in args)
    )


def test_a_sum_is_copied_where_the_graph_returns_or_writes_it():
    import pardist.compile  # noqa: F401  (registers torch.ops.pardist)

    aten = torch.ops.aten
    returned = lambda graph, view: view  # noqa: E731
    split = lambda graph, view: graph.call_function(  # noqa: E731
        operator.getitem, (graph.call_function(aten.split.Tensor, (view, 1)), 0)
    )
    in_place = {
        "foreach": lambda graph, view: graph.call_function(
            aten._foreach_mul_.Scalar, ([view], 2.0)
        ),
        "add_": _call(aten.add_.Tensor, None, None),
        "index_put_": _call(aten.index_put_.default, None, [None], None),
        "python": _call(lambda t: t, None),  # (reinplacing's scatters are Python functions)
    }
    for name, use in {"returned": returned, "split": split, **in_place}.items():
        assert _guard._escapes(_graph(use)), name
    only_read = {
        "mul": _call(aten.mul.Tensor, None, 2.0),
        "sum": _call(aten.sum.default, None),
        "copied into another": lambda graph, view: graph.call_function(
            aten.copy_.default, (graph.placeholder("into"), view)
        ),
    }
    for name, use in only_read.items():
        assert not _guard._escapes(_graph(use)), name
