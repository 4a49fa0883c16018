"""DiLoCo and local SGD against a plain-torch, one-process reference of the same algorithm.

The reference simulates the replicas in a loop: each has its own torch.optim.AdamW and
takes ``every`` steps on its own rows; then the mean of their parameters (added in
replica order) gives the outer gradient (global - mean) of a torch.optim.SGD with
Nesterov momentum, and every replica restarts from the global parameters. Everything is
float64, so where the arithmetic is not bit for bit the same (torch's AdamW kernels),
what differs is float64 rounding of a few operations on values below 10: under 1e-12.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import pardist

STEPS, LR, OUTER = 7, 1e-2, dict(lr=0.7, momentum=0.9, nesterov=True)
TOL = 1e-12


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def rows(step: int, replica: int, replicas: int):
    """Replica ``replica``'s rows of global batch ``step``: 8 rows per replica."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8 * replicas, 6, dtype=torch.float64, generator=g)
    y = x.sum(1, keepdim=True).sin()
    return x[8 * replica : 8 * replica + 8], y[8 * replica : 8 * replica + 8]


def reference(replicas: int, every: int, outer: bool) -> list[dict]:
    """Plain torch in one process: the replicas simulated in a loop; each one's params."""
    glob = model()
    nets = [model() for _ in range(replicas)]
    inner = [torch.optim.AdamW(n.parameters(), lr=LR) for n in nets]
    outer_opt = torch.optim.SGD(glob.parameters(), **OUTER) if outer else None
    for t in range(STEPS):
        for r, (net, opt) in enumerate(zip(nets, inner)):
            x, y = rows(t, r, replicas)
            opt.zero_grad()
            (net(x) - y).pow(2).mean().backward()
            opt.step()
        if (t + 1) % every == 0:
            with torch.no_grad():
                for name, g in glob.named_parameters():
                    total = nets[0].get_parameter(name).clone()
                    for net in nets[1:]:
                        total.add_(net.get_parameter(name))
                    mean = total / replicas
                    if outer:
                        g.grad = g - mean
                    else:
                        g.copy_(mean)
            if outer:
                outer_opt.step()
            with torch.no_grad():
                for net in nets:
                    for name, p in net.named_parameters():
                        p.copy_(glob.get_parameter(name))
    return [{k: v.detach().clone() for k, v in net.named_parameters()} for net in nets]


def _inner_step(apply, opt):
    def inner(params, opt_state, batch):  # the batch last: data_parallel's default shard
        loss = lambda p, x, y: (apply(p, {}, x)[0] - y).pow(2).mean()
        grads = pardist.grad(loss)(params, *batch)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, opt_state

    return inner


def on_ranks(every: int, outer: bool) -> tuple[dict, dict]:
    """Each rank a replica; its inner step a plain function (no collective)."""
    apply, params, _ = pardist.functional(model())
    opt = pardist.optim.adamw(LR)
    outer_opt = pardist.optim.sgd(**OUTER) if outer else None
    run = pardist.diloco(_inner_step(apply, opt), outer_opt, every=every)
    state = run.init(params, opt.init(params))
    rank, world = pardist.rank(), pardist.world_size()
    for t in range(STEPS):
        (state,) = run.step(state, rows(t, rank, world))
    return state.params, state.anchor


@pytest.mark.parametrize("nprocs", [1, 2, 4])
@pytest.mark.parametrize("every, outer", [(3, True), (2, False), (1, False)])
def test_equals_the_one_process_reference(run, nprocs, every, outer):
    want = reference(nprocs, every, outer)  # each replica's params after 7 steps
    results = run(nprocs, on_ranks, every, outer)
    for (got, _), mine in zip(results, want):
        for k in mine:
            assert (got[k] - mine[k]).abs().max() <= TOL * mine[k].abs().max(), k
    for _, anchor in results[1:]:  # the global params of the last meeting: the same bits
        assert all(torch.equal(anchor[k], results[0][1][k]) for k in anchor)


def on_nodes(gpus: int) -> dict:
    """DiLoCo across 2 'nodes', data parallel within each (deterministic=4)."""
    mesh = pardist.Mesh({"node": 2, "gpu": gpus})
    apply, params, _ = pardist.functional(model())
    opt = pardist.optim.adamw(LR)
    inner = pardist.data_parallel(_inner_step(apply, opt), mesh=mesh.part("gpu"), deterministic=4)
    run = pardist.diloco(inner, pardist.optim.sgd(**OUTER), every=3, axis="node")
    state = run.init(params, opt.init(params))
    node, gpu = mesh.index("node"), mesh.index("gpu")
    with mesh:
        for t in range(STEPS):
            x, y = rows(t, node, 2)
            (state,) = run.step(state, (x.chunk(gpus)[gpu], y.chunk(gpus)[gpu]))
    return state.params


def test_across_nodes_bit_identical_at_any_number_of_gpus_per_node(run):
    # The deterministic mode makes each node's inner steps the same bits whatever its GPU
    # count, and the mean over the nodes adds them in node order: 2 and 4 ranks agree.
    two, four = run(2, on_nodes, 1), run(4, on_nodes, 2)
    for got, same in zip(four, (two[0], two[0], two[1], two[1])):  # ranks of node 0, of 1
        assert all(torch.equal(got[k], same[k]) for k in got)
    want = reference(2, 3, True)  # each node one process on its rows
    for got, node in ((two[0], 0), (two[1], 1)):
        for k in want[node]:
            assert (got[k] - want[node][k]).abs().max() <= TOL * want[node][k].abs().max(), k


def _stop_and_resume(tmp: str) -> tuple[dict, dict]:
    apply, params, _ = pardist.functional(model())
    opt = pardist.optim.adamw(LR)
    run = pardist.diloco(_inner_step(apply, opt), pardist.optim.sgd(**OUTER), every=3)
    start = run.init(params, opt.init(params))
    rank, world = pardist.rank(), pardist.world_size()
    state = start
    for t in range(STEPS):
        (state,) = run.step(state, rows(t, rank, world))
    stopped = start
    for t in range(4):  # stopped one step into an interval of 3, the outer momentum on
        (stopped,) = run.step(stopped, rows(t, rank, world))
    path = pardist.checkpoint.save(tmp, run.saved(stopped), step=4)  # (replicas differ)
    resumed = run.restored(pardist.checkpoint.load(path, run.saved(start)))
    for t in range(4, STEPS):
        (resumed,) = run.step(resumed, rows(t, rank, world))
    return state, resumed


def test_checkpoint_and_resume_are_exact(run, tmp_path):
    for whole, resumed in run(2, _stop_and_resume, str(tmp_path)):
        for a, b in zip(tree_leaves(whole), tree_leaves(resumed)):
            assert a is b is None or torch.equal(a, b)


def test_bad_input_says_what_to_do(world1):
    with pytest.raises(ValueError, match=r"every=0; give the number of inner steps"):
        pardist.diloco(lambda p, s: (p, s), every=0)
    apply, params, _ = pardist.functional(model())
    opt, outer = pardist.optim.adamw(LR), pardist.optim.sgd(**OUTER)
    run = pardist.diloco(_inner_step(apply, opt), outer, every=1)
    state = run.init(params, opt.init(params))
    other = outer.init({k: torch.zeros(3, dtype=torch.float64) for k in params})
    with pytest.raises(ValueError, match=r"state.outer.*made for other parameters"):
        run.step(state._replace(outer=other), rows(0, 0, 1))
    with pytest.raises(NotImplementedError, match=r"params\['0.weight'\] is a pardist.fsdp shard"):
        run.init(pardist.fsdp(params), ())
