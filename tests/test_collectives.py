"""Collectives: values, backward rules that match one process on the global batch, traps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from numerics import assert_close64

import pardist

F64 = torch.float64  # both sides compute in float64, compared up to its rounding (numerics.py)


def _values():
    r = pardist.rank()
    tree = {"a": torch.tensor([1.0, 2.0]) * (r + 1), "b": (torch.tensor(float(r)),)}
    return (
        pardist.psum(tree, "gpu"),
        pardist.pmean(tree, "gpu"),
        pardist.pmax(tree, "gpu"),
        pardist.all_gather(tree["a"], "gpu"),
        pardist.axis_index("gpu"),
        pardist.axis_size("gpu"),
        pardist.broadcast(tree["a"] + 1, src=1),
    )


@pytest.mark.parametrize("n", [2, 3, 4])
def test_values(run, n):
    total = sum(range(1, n + 1))
    for r, (s, m, mx, g, index, size, b) in enumerate(run(n, _values)):
        assert s["a"].tolist() == [total, 2 * total] and s["b"][0] == sum(range(n))
        torch.testing.assert_close(m["a"], torch.tensor([total / n, 2 * total / n]))
        assert mx["a"].tolist() == [n, 2 * n] and mx["b"][0] == n - 1
        assert g.tolist() == [v for k in range(1, n + 1) for v in (k, 2 * k)]
        assert (index, size) == (r, n)
        assert b.tolist() == [3.0, 5.0]  # rank 1's value + 1


# Three losses that need cross-replica values inside the differentiated function.
# Each rank sees its shard; pardist.grad of the parameters must equal the
# gradient one process computes on the whole batch.
def _centered(w, x, sum_fn, count_fn):
    z = x @ w
    mean = sum_fn(z.sum()) / count_fn(torch.tensor(float(len(z))))
    return (z - mean).square().mean()


def _contrastive(w, x, gather_fn):
    z = x @ w
    return -z.mean() + torch.logsumexp(gather_fn(z), 0)


def _peak(w, x, max_fn):
    return max_fn((x @ w).max()) * w.sum()


def _losses(local: bool):
    ident = lambda t: t  # noqa: E731
    ps = (lambda t: pardist.psum(t, "gpu")) if local else ident
    ag = (lambda t: pardist.all_gather(t, "gpu")) if local else ident
    pm = (lambda t: pardist.pmax(t, "gpu")) if local else ident
    return {
        "centered": lambda w, x: _centered(w, x, ps, ps),
        "contrastive": lambda w, x: _contrastive(w, x, ag),
        "peak": lambda w, x: _peak(w, x, pm),
    }


def _batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(3, generator=g, dtype=F64), torch.randn(12, 3, generator=g, dtype=F64)


def _grads_on_shards():
    w, x = _batch()
    mine = x.chunk(pardist.world_size())[pardist.rank()]
    out = {}
    for name, loss in _losses(local=True).items():
        step = pardist.data_parallel(lambda w, x, loss=loss: pardist.value_and_grad(loss)(w, x))
        out[name] = step(w, mine)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_backward_rules_match_one_process(run, n):
    w, x = _batch()
    expected = {name: pardist.value_and_grad(loss)(w, x) for name, loss in _losses(False).items()}
    for per_rank in run(n, _grads_on_shards):
        for name, (value, g) in per_rank.items():
            assert_close64(value, expected[name][0], f"{name}'s value")
            assert_close64(g, expected[name][1], f"{name}'s gradient")


def _under_torch_func():
    # Collectives inside torch.func transforms: grad, vmap and a hessian-vector product.
    x = torch.tensor([1.0, 2.0]) * (pardist.rank() + 1)
    g = torch.func.grad(lambda x: pardist.psum(x.square().sum(), "gpu"))(x)
    v = torch.func.vmap(lambda row: pardist.psum(row, "gpu"))(torch.ones(3, 2))
    gg = torch.func.grad(
        lambda x: torch.func.grad(lambda y: pardist.pmean(y.pow(3).sum(), "gpu"))(x).sum()
    )(x)
    ag = torch.func.vmap(lambda row: pardist.all_gather(row, "gpu"))(torch.ones(3, 2))
    return g, v, gg, ag.shape


def test_collectives_under_torch_func(run):
    for r, (g, v, gg, shape) in enumerate(run(2, _under_torch_func)):
        x = torch.tensor([1.0, 2.0]) * (r + 1)
        # psum's cotangent is summed over ranks: 2 ranks * d(x^2) = 4x
        torch.testing.assert_close(g, 4 * x)
        assert v.tolist() == [[2.0, 2.0]] * 3
        torch.testing.assert_close(gg, 6 * x)  # pmean's backward is pmean: d2(x^3) = 6x
        assert tuple(shape) == (3, 4)


def _traps():
    import torch.distributed.nn.functional as dnf

    x = torch.tensor([1.0, 2.0])
    try:
        torch.func.grad(lambda x: dnf.all_reduce(x).sum())(x)
        raised = None
    except Exception as e:  # noqa: BLE001
        raised = type(e).__name__

    def inplace(x):
        y = x * 1
        dist.all_reduce(y)  # invisible to autograd: the backward skips the reduction
        return y.sum()

    x = x.clone().requires_grad_()
    wrong = torch.autograd.grad(inplace(x), x)[0]
    right = pardist.grad(lambda x: pardist.psum(x, "gpu").sum())(x.detach())
    return raised, wrong, right


def test_torch_collectives_are_traps(run):
    for raised, wrong, right in run(2, _traps):
        # torch's functional collectives lack setup_context: torch.func refuses them
        assert raised is not None
        # an in-place all_reduce silently drops the reduction from the backward
        assert wrong.tolist() == [1.0, 1.0]
        assert right.tolist() == [2.0, 2.0]


def _tuple_axes():
    mesh = pardist.Mesh({"node": 2, "gpu": 2})
    with mesh:
        x = torch.tensor([float(pardist.rank())])
        return (
            pardist.psum(x, ("node", "gpu")).item(),
            pardist.psum(x, "gpu").item(),
            pardist.psum(x, "node").item(),
            pardist.axis_index(("node", "gpu")),
            pardist.axis_index("node"),
            pardist.all_gather(x, ("node", "gpu")).tolist(),
            pardist.all_gather(x, "node").tolist(),
        )


def test_tuple_axes(run):
    got = run(4, _tuple_axes)
    for r, (both, gpu, node, index, node_index, everyone, column) in enumerate(got):
        assert both == 6.0
        assert gpu == {0: 1.0, 1: 1.0, 2: 5.0, 3: 5.0}[r]  # ranks {0,1} and {2,3}
        assert node == {0: 2.0, 1: 4.0, 2: 2.0, 3: 4.0}[r]  # ranks {0,2} and {1,3}
        assert (index, node_index) == (r, r // 2)
        assert everyone == [0.0, 1.0, 2.0, 3.0]
        assert column == ([0.0, 2.0] if r % 2 == 0 else [1.0, 3.0])


def test_errors(world1):
    with pytest.raises(ValueError, match=r"pardist.psum: axis 'tpu' is not in the mesh"):
        pardist.psum(torch.ones(1), "tpu")
    with pytest.raises(TypeError, match=r"pardist.pmean: tree\['lr'\] is a str .*torch.tensor"):
        pardist.pmean({"lr": "0.1"}, "gpu")
    with pytest.raises(
        ValueError,
        match=r"pardist.Mesh: axis sizes \{'node': 2, 'gpu': 2\} "
        r"multiply to 4, but the world size is 1",
    ):
        pardist.Mesh({"node": 2, "gpu": 2})


def test_collectives_before_init():
    assert not pardist.is_initialized()
    with pytest.raises(
        RuntimeError,
        match=r"pardist.psum: the process group is not started. "
        r"Call pardist.init\(\) first",
    ):
        pardist.psum(torch.ones(1), "gpu")


def _scatter_and_exchange():
    r = pardist.rank()
    x = torch.arange(4.0) * (r + 1)
    scattered = pardist.psum_scatter(x, "gpu")
    w = torch.full((2,), float(r + 1))
    g = torch.func.grad(lambda x: (pardist.psum_scatter(x, "gpu") * w).sum())(x)
    z = torch.arange(4.0).view(2, 2) + 10 * r
    exchanged = pardist.all_to_all(z, "gpu", split_dim=0, concat_dim=1)
    back = pardist.all_to_all(exchanged, "gpu", split_dim=1, concat_dim=0)
    gz = torch.func.grad(lambda z: (pardist.all_to_all(z, "gpu", 0, 1) * (r + 1)).sum())(z)
    return scattered, g, exchanged, back, z, gz


@pytest.mark.parametrize("shm", ["1", "0"])
def test_psum_scatter_and_all_to_all(run, shm):
    # Through shared memory and through gloo's reduce_scatter / all_to_all.
    got = run(2, _scatter_and_exchange, env={"PARDIST_SHM": shm} if shm == "0" else None)
    for r, (scattered, g, exchanged, back, z, gz) in enumerate(got):
        assert scattered.tolist() == (torch.arange(4.0) * 3)[2 * r : 2 * r + 2].tolist()
        assert g.tolist() == [1.0, 1.0, 2.0, 2.0]  # its transpose all-gathers the cotangents
        # row r of every rank's z, side by side in rank order; and back again
        assert exchanged.tolist() == [[2.0 * r, 2.0 * r + 1, 2.0 * r + 10, 2.0 * r + 11]]
        assert torch.equal(back, z)
        assert gz.tolist() == [[1.0, 1.0], [2.0, 2.0]]  # row k went to rank k


def _broadcast_mismatch(kind: str):
    r = pardist.rank()
    if kind == "shape":  # a (3,) source into a (5,) receiver used to fill [1, 1, 1, 2, 2]
        tree = {"w": torch.full((3,) if r == 0 else (5,), float(r + 1))}
    else:
        tree = {"w": torch.ones(3, dtype=torch.float32 if r == 0 else torch.float64)}
    try:
        pardist.broadcast(tree)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("env", [None, {"PARDIST_SHM": "0"}], ids=["shm", "gloo"])
@pytest.mark.parametrize("kind", ["shape", "dtype"])
def test_broadcast_refuses_a_tree_of_other_shapes(run, env, kind):
    messages = run(2, _broadcast_mismatch, kind, env=env)
    for msg in messages:  # every rank raises, none is left waiting
        assert msg is not None and "pardist.broadcast" in msg
        assert "tree['w']" in msg and "on index 1" in msg, msg
        assert ("(5,)" in msg and "(3,)" in msg) if kind == "shape" else "float64" in msg
