"""data_parallel: equivalence with one process and with torch DDP, replicas, specs, donation."""

from __future__ import annotations

import warnings

import helpers
import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64

import pardist
from pardist import P

F64 = torch.float64  # comparisons of training runs are in float64: see numerics.py


def reference(model, opt_name, **kw):
    """One process on the concatenated global batch (world size 1, in the test process)."""
    return helpers.train_pardist(model, opt_name, whole_batch=True, dtype=F64, **kw)


@pytest.mark.parametrize("nprocs", [2, 3, 4])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_mlp_equals_one_process_and_ddp(run, world1, nprocs, opt_name):
    params1, _, losses1, _ = reference("mlp", opt_name)
    results = run(nprocs, helpers.train_pardist, "mlp", opt_name, dtype=F64)
    ddp = run(nprocs, helpers.train_ddp, "mlp", opt_name, dtype=F64)
    for params, _, losses, _ in results:
        assert_close64(params, params1, "one process")
        assert_close64(params, ddp[0], "DDP")
        # value_and_grad returns the global-batch loss, identical on every rank
        assert_close64(losses, losses1, "losses")


@pytest.mark.parametrize("nprocs", [2, 3])
def test_batchnorm_convnet_with_sync_bn_equals_one_process(run, world1, nprocs):
    params1, buffers1, _, _ = reference("convnet", "sgd")
    for params, buffers, _, _ in run(nprocs, helpers.train_pardist, "convnet", "sgd", dtype=F64):
        assert_close64(params, params1, "parameters")
        # running statistics too: they came from the global batch
        assert_close64(buffers, buffers1, "buffers")


def test_batchnorm_without_sync_equals_ddp_and_buffers_agree(run):
    ours = run(2, helpers.train_pardist, "convnet", "sgd", sync_bn=False, dtype=F64)
    ddp = run(2, helpers.train_ddp, "convnet", "sgd", dtype=F64)
    assert_close64(ours[0][0], ddp[0], "DDP")
    for k in ours[0][1]:  # per-shard statistics, averaged so every replica keeps the same
        assert torch.equal(ours[0][1][k], ours[1][1][k])


@pytest.mark.parametrize("nprocs", [2, 3])
def test_replicas_bit_identical_after_every_step(run, nprocs):
    results = run(nprocs, helpers.train_pardist, "convnet", "adamw", steps=3)
    for prints in zip(*(r[3] for r in results)):
        for other in prints[1:]:
            for k in prints[0]:
                assert torch.equal(prints[0][k], other[k]), k


def _tensors(tree):
    return [t for t in pardist.runtime._tree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _check_unmutated(donate: bool):
    apply, params, buffers = pardist.functional(helpers.convnet())
    opt = pardist.optim.adamw(1e-2)
    state = opt.init(params)
    x, y = helpers.global_batch(0, "convnet", 8)
    before = [t.clone() for t in _tensors((params, buffers, state, x, y))]

    def loss_fn(p, b, x, y):
        out, nb = apply(p, b, x)
        return F.cross_entropy(out, y), nb

    def step(params, buffers, state, batch):
        (loss, nb), g = pardist.value_and_grad(loss_fn, has_aux=True)(params, buffers, *batch)
        params, state = opt.update(g, state, params)
        return params, nb, state

    dp = pardist.data_parallel(step, donate_argnums=(0, 2) if donate else ())
    out = dp(params, buffers, state, (x, y))
    after = _tensors((params, buffers, state, x, y))
    changed = [not torch.equal(a, b) for a, b in zip(before, after)]
    aliased = all(a is b for a, b in zip(_tensors(out[0]), _tensors(params)))
    # Written in place, the update hands back the given trees (no containers rebuilt).
    trees = [
        out[0] is params,
        out[2].exp_avg is state.exp_avg,
        out[2].exp_avg_sq is state.exp_avg_sq,
    ]
    return changed, aliased, [len(_tensors(t)) for t in (params, buffers, state)], trees


def test_inputs_unmutated_without_donation(run):
    for changed, aliased, _, trees in run(2, _check_unmutated, False):
        assert not any(changed)
        assert not aliased and not any(trees)


def test_donation_updates_in_place(run):
    for changed, aliased, (n_params, n_buffers, _), trees in run(2, _check_unmutated, True):
        assert aliased and all(trees)  # the donated tensors (and trees), updated in place
        assert any(changed[:n_params])
        assert not any(changed[n_params : n_params + n_buffers])  # buffers were not donated


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_donation_gives_the_same_numbers(run, opt):
    plain = run(2, helpers.train_pardist, "mlp", opt)
    donated = run(2, helpers.train_pardist, "mlp", opt, donate=True)
    for k in plain[0][0]:
        assert torch.equal(plain[0][0][k], donated[0][0][k])


def _sgd_trees(momentum: float):
    """Whether a donated SGD step hands back the given trees (its second step: torch
    makes the momentum buffers on the first)."""
    params = {"w": torch.ones(4, 3), "b": torch.zeros(4)}
    opt = pardist.optim.sgd(0.1, momentum=momentum)
    x = torch.ones(2, 3)

    @pardist.data_parallel(donate_argnums=(0, 1))
    def step(p, s, x):
        g = pardist.grad(lambda p, x: (x @ p["w"].T + p["b"]).square().mean())(p, x)
        return opt.update(g, s, p)

    params, state = step(params, opt.init(params), x)
    new, new_state = step(params, state, x)
    return new is params, new_state.momentum_buffer is state.momentum_buffer


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_donated_sgd_hands_back_the_given_trees(run, momentum):
    for trees in run(2, _sgd_trees, momentum):
        assert trees == (True, True)


def _donated_reuse():
    @pardist.data_parallel(donate_argnums=0)
    def step(w, batch):
        return w - 0.1 * pardist.grad(lambda w, b: (b @ w).square().mean())(w, batch)

    w = torch.ones(3)
    new = step(w, torch.ones(2, 3))
    step(new, torch.ones(2, 3))  # fine: the value the call returned
    try:
        step(w, torch.ones(2, 3))
    except ValueError as e:
        msg = str(e)
    # The step remembers a donated tensor only while it lives: a dead one's address,
    # reused by a new tensor, must not send every later call down the slow check.
    v = torch.ones(3)
    for _ in range(50):
        v = step(v, torch.ones(2, 3))
    return msg, len(step._consumed)


def test_donated_argument_reused_is_an_error(run):
    for msg, remembered in run(2, _donated_reuse):
        assert "args[0] was donated" in msg and "Pass the value that call returned" in msg
        assert remembered <= 2  # w (alive, still consumed) and at most one in flight


def _forgot_mean():
    @pardist.data_parallel(axis="gpu")
    def step(w, batch):
        g = torch.func.grad(lambda w, b: (b @ w).square().mean())(w, batch)
        return {"w": w - 0.1 * g}

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(pardist.rank()), dtype=F64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = step(torch.ones(3, dtype=F64), x)
        step(torch.ones(3, dtype=F64), x)  # (said once per step)
    return out["w"], [str(w.message) for w in caught if w.category is pardist.GradientSumWarning]


def test_torch_func_grad_in_a_step_is_jaxs_sum_over_ranks_and_says_so(run):
    # torch.func.grad of a per-rank loss is JAX's grad inside shard_map: the replicated
    # input's gradient is the sum of the ranks' gradients (not pardist.grad's mean).
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(r), dtype=F64) for r in (0, 1)]
    w = torch.ones(3, dtype=F64)
    total = sum(torch.func.grad(lambda w: (x @ w).square().mean())(w) for x in xs)  # noqa: B023
    for new_w, messages in run(2, _forgot_mean):
        assert_close64(new_w, w - 0.1 * total, "w")
        assert len(messages) == 1, messages
        assert "sum over the 2 ranks" in messages[0] and "pardist.grad" in messages[0]


def _per_rank_output(debug_calls: int):
    step = pardist.data_parallel(lambda w, b: b.sum())
    errors = 0
    for i in range(debug_calls):
        try:
            step(torch.ones(1), torch.full((2,), float(pardist.rank() + i)))
        except ValueError:
            errors += 1
    return errors


def _equal_by_value_varying_by_type(calls: int):
    # Equal on every rank at the first call, not at the second: the type says from the start.
    step = pardist.data_parallel(lambda w, b: pardist.all_gather(b, "gpu").sum() * w)
    errors = []
    for i in range(calls):
        try:
            step(torch.ones(()), torch.full((2,), float(i * pardist.rank())))
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_outputs_are_checked_by_type_on_every_call(run):
    # A per-rank output under P() is refused on every call, debug mode or not (by its type).
    assert run(2, _per_rank_output, 3) == [3, 3]
    assert run(2, _per_rank_output, 3, env={"PARDIST_DEBUG": "1"}) == [3, 3]
    for errors in run(2, _equal_by_value_varying_by_type, 2):
        assert len(errors) == 2
        assert "varies over ('gpu',)" in errors[0] and "pmean" in errors[0]


def _sharded_output_spec():
    step = pardist.data_parallel(lambda w, b: (w * 2, b * w), out_specs=(P(), P("gpu")))
    w2, local = step(torch.ones(2), torch.full((3, 2), float(pardist.rank())))
    return w2.tolist(), local[0].tolist()


def test_out_specs_mark_per_rank_outputs(run):
    assert run(2, _sharded_output_spec) == [([2.0, 2.0], [0.0, 0.0]), ([2.0, 2.0], [1.0, 1.0])]


def _explicit_in_specs():
    # dim 1 of x is sharded; w is replicated; the batch's per-rank columns give a
    # gradient of the mean over ranks.
    def step(w, x):
        return pardist.grad(lambda w, x: (x * w).sum())(w, x)

    dp = pardist.data_parallel(step, in_specs=(P(), P(None, "gpu")))
    x = torch.full((2, 1), float(pardist.rank() + 1))
    return dp(torch.ones(2, 1), x).flatten().tolist()


def test_explicit_in_specs(run):
    # local grads are [r+1, r+1]; their mean over 2 ranks is 1.5
    assert run(2, _explicit_in_specs) == [[1.5, 1.5]] * 2


def _replicated_shape_differs():
    step = pardist.data_parallel(lambda p, b: p["w"].sum())
    try:
        step({"w": torch.ones(3 + pardist.rank())}, torch.ones(2))
    except ValueError as e:
        return str(e)


def test_replicated_input_shape_differs(run):
    for msg in run(2, _replicated_shape_differs):
        assert (
            "args[0]['w'] is shape (3,) (float32) on rank 0 but shape (4,) (float32) on rank 1"
            in msg
        )


def _replicated_values_differ(seed_per_rank: bool):
    if seed_per_rank:  # DDP scripts seed each rank (seed + rank): DDP's wrap copies rank 0's
        torch.manual_seed(pardist.rank())
        w = torch.randn(3)
    else:  # the same seed, but a rank draws once more before the model
        torch.manual_seed(0)
        w = torch.randn(3 + pardist.rank())[-3:]
    step = pardist.data_parallel(lambda p, b: p)
    try:
        step({"w": w}, torch.ones(2))
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("seed_per_rank", [True, False])
def test_replicated_input_values_differ(run, seed_per_rank):
    for msg in run(2, _replicated_values_differ, seed_per_rank):
        assert "args[0]['w'] differs between rank 0 and rank 1" in msg
        seeded = "The ranks were seeded differently (torch.initial_seed() differs)"
        if seed_per_rank:  # broadcast first, as DDP's wrap does
            assert seeded in msg and "params = pardist.broadcast(params)" in msg
            assert msg.index("broadcast") < msg.index("seed every rank alike")
        else:
            assert seeded not in msg
            assert "pardist.seed_everything(0)" in msg and "pardist.broadcast(tree)" in msg


def test_spec_errors(world1):
    step = pardist.data_parallel(lambda p, b: p, in_specs=(P(), {"x": P("gpu")}))
    with pytest.raises(ValueError, match=r"in_specs\[1\] does not fit args\[1\].*lacks \['y'\]"):
        step(torch.ones(1), {"y": torch.ones(2)})
    step = pardist.data_parallel(lambda p, b: p, in_specs=(P(), P("gpu", None, None)))
    with pytest.raises(
        ValueError,
        match=r"in_spec of args\[1\] is P\('gpu', None, None\).*"
        r"shape \(4, 2\), only 2 dims",
    ):
        step(torch.ones(1), torch.ones(4, 2))
    step = pardist.data_parallel(lambda p, b: p)
    with pytest.raises(TypeError, match=r"args\[1\]\['lr'\] is a float .*not a tensor"):
        step(torch.ones(1), {"lr": 0.1})
    with pytest.raises(ValueError, match="one spec tree per positional argument; got 1 for 2"):
        pardist.data_parallel(lambda p, b: p, in_specs=(P(),))(torch.ones(1), torch.ones(1))


def test_axis_not_in_mesh(world1):
    step = pardist.data_parallel(lambda p, b: p, axis="tpu")
    with pytest.raises(
        ValueError, match=r"axis 'tpu' is not in the mesh \(axes: 'gpu' of size 1\)"
    ):
        step(torch.ones(1), torch.ones(1))


def test_decorator_forms_keep_the_signature(world1):
    import inspect

    @pardist.data_parallel(axis="gpu")
    def step(params, opt_state, batch):
        """Doc."""
        return params

    assert list(inspect.signature(step).parameters) == ["params", "opt_state", "batch"]
    assert step.__doc__ == "Doc." and step.__name__ == "step"
    with pytest.raises(TypeError, match="data_parallel\\(axis='gpu'\\)"):
        pardist.data_parallel("gpu")


def _tuple_axes(flat: bool):
    mesh = pardist.Mesh({"node": 2, "gpu": 2})
    axis = "all" if flat else ("node", "gpu")
    if flat:
        mesh = pardist.Mesh({"all": 4})
    x, y = helpers.global_batch(0, "mlp", dtype=F64)
    apply, params, _ = pardist.functional(helpers.mlp().double())

    @pardist.data_parallel(axis=axis, mesh=mesh)
    def step(params, batch):
        return pardist.grad(lambda p, x, y: F.cross_entropy(apply(p, {}, x)[0], y))(params, *batch)

    r = pardist.rank()
    return step(params, (helpers.shard(x, r, 4), helpers.shard(y, r, 4)))


def test_hierarchical_axes_equal_flat_reduction(run):
    hier = run(4, _tuple_axes, False)
    flat = run(4, _tuple_axes, True)
    assert_close64(hier[0], flat[0], "hierarchical against flat")
    for k in hier[0]:
        assert all(torch.equal(h[k], hier[0][k]) for h in hier)


def test_overlapped_reduction_gives_the_same_numbers(run):
    # Through gloo (no shared memory), buckets launched during the backward or after it
    # are the same all-reduces of the same buckets: bit-identical results.
    env = {"PARDIST_SHM": "0"}
    on = run(2, helpers.train_pardist, "convnet", "adamw", overlap=True, env=env)
    off = run(2, helpers.train_pardist, "convnet", "adamw", overlap=False, env=env)
    for k in on[0][0]:
        assert torch.equal(on[0][0][k], off[0][0][k])


def _batch_in_the_middle(state):
    opt = pardist.optim.sgd(0.1)

    @pardist.data_parallel()
    def step(params, batch, opt_state):
        grads = pardist.grad(lambda p, b: (b @ p["w"]).square().mean())(params, batch)
        return opt.update(grads, opt_state, params)

    params = {"w": torch.ones(3)}
    batch = torch.randn(4, 3, generator=torch.Generator().manual_seed(pardist.rank()))
    try:
        step(params, batch, opt.init(params) if state == "optimizer" else {"m": torch.zeros(3)})
    except (TypeError, ValueError) as e:
        return str(e)


@pytest.mark.parametrize("state", ["optimizer", "tensor"])
def test_the_batch_in_another_position_is_explained(run, state):
    # sgd's state holds a 0-d count, which P('gpu') cannot split; a state of vectors can
    # be split, and the batch, taken as replicated, then differs between the ranks.
    first = "args[2].count" if state == "optimizer" else "args[1] differs between rank 0 and"
    for msg in run(2, _batch_in_the_middle, state):
        assert first in msg
        assert (
            "No in_specs were given, so the last positional argument, args[2] ('opt_state'), "
            "is taken to be the batch (split along dim 0 over 'gpu')"
        ) in msg
        assert "in_specs=(P(), P('gpu'), P()) for args[1] ('batch')" in msg
