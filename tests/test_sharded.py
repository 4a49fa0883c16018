"""optim.sharded (ZeRO-1/2): equal to the unsharded optimizer, 1/N of the state, reshardable."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close64
from torch.distributed.tensor import DTensor

import pardist
from pardist import P, optim

STEPS = 8
F64 = torch.float64  # both sides compute in float64, compared up to its rounding (numerics.py)


def params():
    # sizes that do not divide by 2, 3 or 4
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(37, 11, generator=g, dtype=F64) / 6,
        "b1": torch.randn(11, generator=g, dtype=F64) / 6,
        "w2": torch.randn(11, 5, generator=g, dtype=F64) / 3,
        "b2": torch.zeros(5, dtype=F64),
        "s": torch.ones(1, dtype=F64),
    }


def loss(p, x, y):
    h = torch.tanh(x @ p["w1"] + p["b1"])
    return torch.nn.functional.cross_entropy((h @ p["w2"] + p["b2"]) * p["s"], y)


def batch(step, rank, world):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(24, 37, generator=g, dtype=F64), torch.randint(0, 5, (24,), generator=g)
    return x.chunk(world)[rank], y.chunk(world)[rank]


OPTIMIZERS = {
    "adamw": lambda: optim.adamw(1e-2),
    "sgd": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "clip+adamw": lambda: optim.chain(optim.clip_by_global_norm(0.1), optim.adamw(1e-2)),
}


def train(name: str, shard: bool, donate: bool = False, steps: int = STEPS, start=None):
    base = OPTIMIZERS[name]()
    opt = optim.sharded(base) if shard else base
    p = params() if start is None else start[0]
    state = opt.init(p) if start is None else start[1]

    @pardist.data_parallel(donate_argnums=(0, 1) if donate else ())
    def step(p, state, b):
        g = pardist.grad(loss)(p, *b)
        kinds = {type(v).__name__ for v in g.values()}
        p, state = opt.update(g, state, p)
        return p, state, kinds

    kinds = set()
    for s in range(steps):
        p, state, k = step(p, state, batch(s, pardist.rank(), pardist.world_size()))
        kinds |= k
    return p, state, kinds


def _compare(name, donate):
    reference, _, plain = train(name, shard=False)
    ours, state, kinds = train(name, shard=True, donate=donate)
    local = sum(
        t.to_local().numel()
        for t in pardist.runtime._tree.tree_leaves(state)
        if isinstance(t, DTensor)
    )
    return reference, ours, kinds, plain, local


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_equals_the_unsharded_optimizer(run, nprocs, name):
    for reference, ours, kinds, plain, _ in run(nprocs, _compare, name, nprocs % 2 == 0):
        assert_close64(ours, reference, "parameters")
        # ZeRO-2: inside the step, pardist.grad reduce-scattered into DTensor shards
        assert kinds == ({"DTensor"} if nprocs > 1 else {"Tensor"}) and plain == {"Tensor"}


def _memory():
    big = {"w": torch.randn(1001, 97), "b": torch.randn(97), "v": torch.randn(333, 3)}
    state = optim.sharded(optim.adamw(1e-3)).init(big)
    mine = sum(
        t.to_local().numel() * t.element_size()
        for t in pardist.runtime._tree.tree_leaves(state)
        if isinstance(t, DTensor)
    )
    total = 2 * sum(t.numel() * t.element_size() for t in big.values())  # exp_avg, exp_avg_sq
    return mine, total, pardist.specs(state.inner.exp_avg), pardist.specs(state.inner.count)


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_state_memory_per_rank_is_a_1_over_n_share(run, nprocs):
    results = run(nprocs, _memory)
    for mine, total, spec, count_spec in results:
        assert mine <= total / nprocs * 1.05, (mine, total / nprocs)
        assert spec == {"w": P("gpu"), "b": P("gpu"), "v": P("gpu")} and count_spec == P()
    assert sum(m for m, *_ in results) == results[0][1]  # the shards cover it exactly


def _zero1_from_full_gradients():
    # Outside a step (or with gradients computed elsewhere): full gradients work too.
    p, base = params(), optim.adamw(1e-2)
    opt = optim.sharded(base)
    s1, s2, p1, p2 = opt.init(p), base.init(p), p, p
    for s in range(3):
        x, y = batch(s, 0, 1)
        g = torch.func.grad(loss)(p1, x, y)
        p1, s1 = opt.update(g, s1, p1)
        p2, s2 = base.update(torch.func.grad(loss)(p2, x, y), s2, p2)
    return p1, p2


def test_full_gradients_are_sharded_by_the_optimizer(run):
    for p1, p2 in run(2, _zero1_from_full_gradients):
        assert_close64(p1, p2, "parameters")


def _save(path):
    p, state, _ = train("adamw", shard=True, steps=3)
    pardist.checkpoint.save(path, {"params": p, "state": state})


def _resume(path, steps):
    like_p = params()
    like = {"params": like_p, "state": optim.sharded(optim.adamw(1e-2)).init(like_p)}
    loaded = pardist.checkpoint.load(path, like)
    p, _, _ = train("adamw", shard=True, steps=steps, start=(loaded["params"], loaded["state"]))
    return p


@pytest.mark.parametrize("load_at", [1, 3])
def test_checkpoint_reshards_to_another_world_size(run, tmp_path, load_at):
    path = str(tmp_path / "ckpt")
    run(2, _save, path)  # 3 steps at 2 ranks, state sharded in halves
    resumed = run(load_at, _resume, path, 2)  # resharded, then 2 more steps
    # Reference: the same 3 + 2 steps with the unsharded optimizer and no checkpoint.
    start = run(2, _plain, 3)[0]
    expected = run(load_at, _continue, start, 2)[0]
    assert_close64(resumed[0], expected, "parameters")


def _plain(steps):
    p, state, _ = train("adamw", shard=False, steps=steps)
    return p, state


def _continue(start, steps):
    return train("adamw", shard=False, steps=steps, start=start)[0]


def test_errors(world1):
    opt = optim.sharded(optim.adamw(1e-3), axis="tpu")
    with pytest.raises(ValueError, match=r"axis 'tpu' is not in the mesh"):
        opt.init({"w": torch.ones(3)})
    opt = optim.sharded(optim.adamw(1e-3))
    with pytest.raises(TypeError, match=r"params\['step'\] has dtype torch.int64"):
        opt.init({"w": torch.ones(3), "step": torch.tensor(3)})
    state = opt.init({"w": torch.ones(3)})
    with pytest.raises(ValueError, match=r"grads\['w'\] has shape \(2,\); expected the full"):
        opt.update({"w": torch.ones(2)}, state, {"w": torch.ones(3)})
    with pytest.raises(ValueError, match=r"the state was made for parameters"):
        opt.update({"w": torch.ones(4)}, state, {"w": torch.ones(4)})
