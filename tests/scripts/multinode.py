"""One node's worker in the two-namespace test: hierarchical axes, HSDP, then digits.

Run by pardist.launch on each of two "nodes" (network namespaces), 2 processes each:
it checks that the 'node' axis of ``Mesh({'node': 2, 'gpu': 2})`` follows the
machines, that a step reduced hierarchically over ('node', 'gpu') equals the
flat reduction, and that FSDP within a node and data parallelism across nodes
(HSDP: ``pardist.fsdp(params, 'gpu')`` in a step over ('node', 'gpu')) trains as
the flat data-parallel step does; then it trains examples/digits.py over the 4 ranks.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import pardist

ROOT = Path(__file__).resolve().parents[2]


def grads(mesh: pardist.Mesh, axis) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    apply, params, _ = pardist.functional(torch.nn.Linear(8, 4))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    r = pardist.rank()

    @pardist.data_parallel(axis=axis, mesh=mesh)
    def step(params, batch):
        loss = lambda p, x, y: F.cross_entropy(apply(p, {}, x)[0], y)  # noqa: E731
        return pardist.grad(loss)(params, *batch)

    return step(params, (x.chunk(4)[r], y.chunk(4)[r]))


def train(mesh: pardist.Mesh, axis, fsdp: bool) -> dict[str, torch.Tensor]:
    """Three SGD steps of a small MLP; full parameters at the end."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    shapes = {k: p.shape for k, p in net.named_parameters()}
    apply, params, _ = pardist.functional(net)
    if fsdp:
        params = pardist.fsdp(params, "gpu", mesh=mesh)
    opt = pardist.optim.sgd(0.1, momentum=0.9)
    state = opt.init(params)

    @pardist.data_parallel(axis=axis, mesh=mesh)
    def step(params, state, batch):
        loss = lambda p, x, y: F.cross_entropy(apply(p, {}, x)[0], y)  # noqa: E731
        return opt.update(pardist.grad(loss)(params, *batch), state, params)

    r = pardist.rank()
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 9, generator=g), torch.randint(0, 5, (16,), generator=g)
        params, state = step(params, state, (x.chunk(4)[r], y.chunk(4)[r]))
    return {k: v.full_tensor().view(shapes[k]) if fsdp else v for k, v in params.items()}


def main() -> None:
    pardist.init()
    hier = pardist.Mesh({"node": 2, "gpu": 2})
    assert hier.index("node") == int(os.environ["GROUP_RANK"]), "the node axis is the machine"
    assert hier.index("gpu") == int(os.environ["LOCAL_RANK"])
    a, b = grads(hier, ("node", "gpu")), grads(pardist.Mesh({"all": 4}), "all")
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-6, worst
    pardist.print0(f"hierarchical ('node', 'gpu') == flat: max difference {worst:.1e}")
    a, b = train(hier, ("node", "gpu"), True), train(pardist.Mesh({"all": 4}), "all", False)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-6, worst
    pardist.print0(f"HSDP (fsdp over 'gpu', data parallel over 'node') == flat: {worst:.1e}")
    sys.argv = ["digits.py", *sys.argv[1:]]
    runpy.run_path(str(ROOT / "examples" / "digits.py"), run_name="__main__")


if __name__ == "__main__":
    main()
