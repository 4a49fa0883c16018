"""functional(module): a pure apply; cross-replica batch norm."""

from __future__ import annotations

import helpers
import pytest
import torch
from numerics import assert_close64
from torch import nn

import pardist
from pardist import CrossReplicaBatchNorm

F64 = torch.float64  # both sides compute in float64, compared up to its rounding (numerics.py)


def test_apply_is_pure_and_matches_the_module():
    net = helpers.convnet()
    reference = helpers.convnet()
    apply, params, buffers = pardist.functional(net)
    x = torch.randn(6, 1, 8, 8)
    saved = {k: v.clone() for k, v in {**params, **buffers}.items()}
    out, new_buffers = apply(params, buffers, x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)  # train mode, like the module
    for k, v in {**params, **buffers}.items():
        assert torch.equal(v, saved[k]), k  # nothing passed in was mutated
    for k, v in reference.named_buffers():
        assert torch.equal(new_buffers[k], v), k  # the running stats the module would have
    assert all(p.device.type != "meta" for p in net.parameters())  # the module is untouched
    reference.eval()
    evaluated, same = apply(params, new_buffers, x, train=False)
    torch.testing.assert_close(evaluated, reference(x), rtol=0, atol=0)
    assert all(torch.equal(same[k], new_buffers[k]) for k in same)


def test_apply_under_vmap_over_stacked_buffers_matches_each_model():
    # Model ensembling (torch.func.stack_module_state's pattern): vmap over stacked
    # params and buffers. apply copies the buffers it is given; under vmap, whose
    # transform has no rule for torch's one-call clone, each is cloned on its own.
    nets = [helpers.convnet().double().eval() for _ in range(3)]
    parts = [pardist.functional(net) for net in nets]
    apply = parts[0][0]
    params = {k: torch.stack([p[k] for _, p, _ in parts]) for k in parts[0][1]}
    buffers = {k: torch.stack([b[k] for _, _, b in parts]) for k in parts[0][2]}
    x = torch.randn(4, 1, 8, 8, dtype=torch.float64)
    out, new = torch.func.vmap(lambda p, b: apply(p, b, x, train=False))(params, buffers)
    for i, net in enumerate(nets):  # vmap batches the convolutions: float64 rounding
        assert_close64(out[i], net(x), f"model {i}")
        assert all(torch.equal(new[k][i], v) for k, v in net.named_buffers())


def test_later_changes_to_the_module_do_not_leak_in():
    net = helpers.mlp()
    apply, params, buffers = pardist.functional(net)
    x = torch.randn(2, 8)
    before, _ = apply(params, buffers, x)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    net.eval()
    after, _ = apply(params, buffers, x)
    assert torch.equal(before, after)


def test_convert_batchnorm_keeps_names_and_state():
    net = helpers.convnet().double()
    state = net.state_dict()
    assert pardist.convert_batchnorm(net) is net
    assert sum(isinstance(m, CrossReplicaBatchNorm) for m in net.modules()) == 2
    assert list(net.state_dict()) == list(state)
    net.load_state_dict(state)
    x = torch.randn(4, 1, 8, 8, dtype=F64)
    assert_close64(net(x), helpers.convnet().double()(x), "outputs")  # same outside a step


def _bn_layer(momentum):
    # a lone BatchNorm1d with momentum=None (cumulative average) and odd shard sizes
    bn = nn.BatchNorm1d(3, momentum=momentum).double()
    apply, params, buffers = pardist.functional(bn)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 3, generator=g, dtype=F64) * 3 + 1
    sizes = [4, 4, 3][: pardist.world_size()] if pardist.world_size() == 3 else None
    mine = x.split(sizes)[pardist.rank()] if sizes else x
    step = pardist.data_parallel(lambda p, b, x: apply(p, b, x), out_specs=(pardist.P("gpu"), None))
    assert isinstance(pardist.convert_batchnorm(nn.BatchNorm1d(3)), CrossReplicaBatchNorm)
    for _ in range(2):
        out, buffers = step(params, buffers, mine)
    return out, buffers


def test_cross_replica_statistics_over_uneven_shards(run, world1):
    out1, buffers1 = _bn_layer(None)
    got = run(3, _bn_layer, None)
    assert_close64(torch.cat([o for o, _ in got]), out1, "outputs")
    for _, buffers in got:
        assert_close64(buffers, buffers1, "buffers")


def _bf16_statistics():
    bn = nn.BatchNorm1d(3)
    apply, params, buffers = pardist.functional(bn)
    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(1)) + 100
    step = pardist.data_parallel(
        lambda p, b, x: apply(p, b, x.to(torch.bfloat16)), out_specs=(pardist.P("gpu"), None)
    )
    out, new = step(params, buffers, x.chunk(2)[pardist.rank()])
    return out.dtype, new["running_var"]


def test_cross_replica_statistics_are_float32_under_bf16(run):
    # Around 100 bf16 keeps steps of 0.5: squared deviations summed in bf16 are far off.
    x = (torch.randn(64, 3, generator=torch.Generator().manual_seed(1)) + 100).to(torch.bfloat16)
    var = x.double().var(0)  # exact but for float64's rounding: the bf16 values are exact
    expected = 0.9 + 0.1 * var  # momentum 0.1 from ones, unbiased variance
    # In float32, a variance of n = 64 values (about their mean, two passes or Welford's)
    # is within (n + 3) 2^-24 var of the exact one; momentum takes a tenth of it, and the
    # running variance (~1) is rounded after 0.9 * 1 and the sum: below 2^-22 more.
    bound = 0.1 * 67 * 2.0**-24 * var + 2.0**-22
    for dtype, running_var in run(2, _bf16_statistics):
        assert dtype == torch.bfloat16 and running_var.dtype == torch.float32
        err = (running_var.double() - expected).abs()
        assert (err <= bound).all(), (err, bound)


class _Counting(nn.Module):
    """Ties a layer's weight to another's, and replaces (not updates) a buffer."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls = self.calls + 1
        return self.b(self.a(x))


def test_tied_weights_replaced_buffers_and_wrong_keys():
    torch.manual_seed(0)
    net = _Counting().double()
    apply, params, buffers = pardist.functional(net)
    assert sorted(params) == ["a.bias", "a.weight", "b.bias"]  # the tied weight once
    x = torch.randn(2, 3, dtype=F64)
    out, new = apply(params, buffers, x)
    torch.testing.assert_close(out, net(x), rtol=0, atol=0)
    assert float(new["calls"]) == 1.0 and float(buffers["calls"]) == 0.0
    # the gradient of the tied weight sums both uses, as in the module
    g = pardist.grad(lambda p: apply(p, buffers, x)[0].sum())(params)
    net.zero_grad()
    net(x).sum().backward()
    assert_close64(g["a.weight"], net.a.weight.grad, "tied weight's gradient")
    with pytest.raises(KeyError, match=r"missing \['b.bias'\]; unexpected \['c'\]"):
        apply({**{k: v for k, v in params.items() if k != "b.bias"}, "c": x}, buffers, x)


def _in_grad(with_grad: bool):
    """The statistics made inside the differentiated function ride with the gradients."""
    import pardist.collectives._collectives as collectives

    bn = nn.BatchNorm1d(3).double()
    apply, params, buffers = pardist.functional(bn, sync_bn=False)
    g = torch.Generator().manual_seed(pardist.rank())
    x = torch.randn(8, 3, generator=g, dtype=F64) + pardist.rank()
    calls = []
    original = collectives.reduce_groups
    collectives.reduce_groups = lambda *a: calls.append(a) or original(*a)
    try:

        @pardist.data_parallel()
        def step(p, b, x):
            if with_grad:
                loss = lambda p, b, x: (lambda o: (o[0].square().mean(), o[1]))(apply(p, b, x))  # noqa: E731
                _, nb = pardist.grad(loss, has_aux=True)(p, b, x)
                return nb
            return apply(p, b, x)[1]

        new = step(params, buffers, x)
    finally:
        collectives.reduce_groups = original
    return new["running_mean"], 0.1 * x.mean(0), len(calls)


def test_per_shard_statistics_are_averaged_without_a_collective_of_their_own(run):
    for with_grad in (True, False):
        results = run(2, _in_grad, with_grad)
        expected = (results[0][1] + results[1][1]) / 2  # the mean of each rank's own
        for running_mean, _, calls in results:
            assert_close64(running_mean, expected, "running mean")
            # with pardist.grad, the buckets carry them; without, one coalesced mean
            assert calls == (0 if with_grad else 1)
