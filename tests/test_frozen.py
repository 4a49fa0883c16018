"""Frozen parameters (requires_grad=False) get no gradient and no update, as in plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import pardist
from pardist import optim

STEPS = 3


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    net[0].requires_grad_(False)  # a frozen body, fine-tuned head (fastai's fine_tune)
    net[2].weight.requires_grad_(False)
    return net


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(24, 8, generator=g), torch.randint(0, 4, (24,), generator=g)


def plain_torch() -> dict:
    """One process, torch.optim.SGD with weight decay over all parameters."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _full(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.full_tensor().reshape(like.shape) if isinstance(t, DTensor) else t


def train(mode: str) -> tuple[dict, dict, list]:
    net = model()
    initial = {k: v.detach().clone() for k, v in net.state_dict().items()}
    apply, params, buffers = pardist.functional(net)
    base = optim.sgd(0.1, momentum=0.9, weight_decay=1e-2)
    opt = optim.sharded(base) if mode == "zero" else base
    if mode == "fsdp":
        params = pardist.fsdp(params)
    state = opt.init(params)

    def loss(p, b, x, y):
        return F.cross_entropy(apply(p, b, x)[0], y)

    @pardist.data_parallel(compile=mode.startswith("compiled"))
    def step(p, s, b, xy):
        g = pardist.grad(loss)(p, b, *xy)
        p, s = opt.update(g, s, p)
        return p, s, sorted(g)

    rank, world = pardist.rank(), pardist.world_size()
    for s in range(STEPS):
        x, y = batch(s)
        params, state, names = step(
            params, state, buffers, (x.chunk(world)[rank], y.chunk(world)[rank])
        )
    if mode.startswith("compiled"):  # one graph for the whole step, not an eager fallback
        assert step.compiled.fallback is None and step.compiled.calls == STEPS
    full = {k: _full(v, initial[k]) for k, v in params.items()}
    net.load_state_dict({**full, **buffers}, strict=True)  # export still works
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, initial, names


# compiled: at 2 ranks, the whole step in one graph, its gradients summed over shared memory
# (compiled_gloo: over torch's functional collectives, PARDIST_SHM=0)
CASES = [(n, mode) for mode in ("plain", "zero", "fsdp") for n in (1, 2)]
CASES += [(2, "compiled"), (2, "compiled_gloo")]


@pytest.mark.parametrize("nprocs, mode", CASES)
def test_frozen_parameters_stay_frozen(run, nprocs, mode):
    reference = plain_torch()
    env = {"PARDIST_SHM": "0"} if mode == "compiled_gloo" else None
    for ours, initial, names in run(nprocs, train, mode, env=env):
        assert names == ["2.bias", "4.bias", "4.weight"]  # no gradient for the frozen ones
        for k in ("0.weight", "0.bias", "2.weight"):
            assert torch.equal(ours[k], initial[k]), k  # bit-identical, weight decay included
            assert torch.equal(reference[k], initial[k]), k
        for k in ("2.bias", "4.weight", "4.bias"):
            assert not torch.equal(ours[k], initial[k]), k
            torch.testing.assert_close(ours[k], reference[k], rtol=1e-5, atol=1e-6)


def test_functional_keeps_frozen_parameters_with_the_buffers():
    net = model()
    apply, params, buffers = pardist.functional(net)
    assert set(params) == {"2.bias", "4.weight", "4.bias"}
    assert set(buffers) == {"0.weight", "0.bias", "2.weight"}
    x = torch.randn(5, 8)
    out, new_buffers = apply(params, buffers, x)
    torch.testing.assert_close(out, net(x), rtol=0, atol=0)
    assert set(new_buffers) == set(buffers)


def backbone_model() -> nn.Module:
    """A frozen batch-norm backbone in eval mode (its statistics kept) and a trained head."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh()), nn.Linear(16, 4)
    )
    net[0][1].running_mean.uniform_(-1, 1)  # statistics as if pretrained: not 0 and 1
    net[0][1].running_var.uniform_(0.5, 2)
    net[0].requires_grad_(False).eval()
    return net.double()  # float64: the ranks' sums in another order differ by ~1e-16


def train_with_eval_backbone() -> tuple[dict, dict]:
    net = backbone_model()
    apply, params, buffers = pardist.functional(net)
    opt = optim.sgd(0.1, momentum=0.9)
    state = opt.init(params)

    def loss(p, b, x, y):
        out, b = apply(p, b, x)
        return F.cross_entropy(out, y), b

    @pardist.data_parallel
    def step(p, s, b, xy):
        g, b = pardist.grad(loss, has_aux=True)(p, b, *xy)
        p, s = opt.update(g, s, p)
        return p, s, b

    rank, world = pardist.rank(), pardist.world_size()
    for s in range(STEPS):
        x, y = batch(s)
        x = x.double()
        params, state, buffers = step(
            params, state, buffers, (x.chunk(world)[rank], y.chunk(world)[rank])
        )
        apply(params, buffers, x, train=False)  # an evaluation between steps
    return params, buffers


def test_a_backbone_in_eval_mode_stays_in_eval_mode(run):
    # Plain torch: the backbone in eval mode normalises with its running statistics and
    # keeps them; only the head trains.
    net = backbone_model()
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        F.cross_entropy(net(x.double()), y).backward()
        opt.step()
    for params, buffers in run(2, train_with_eval_backbone):
        for k in ("0.1.running_mean", "0.1.running_var", "0.1.num_batches_tracked", "0.0.weight"):
            assert torch.equal(buffers[k], initial[k]), k  # never updated, bit for bit
        for k in ("1.weight", "1.bias"):
            # float64 sums of 24 rows of terms below 10 in another order: below 1e-13
            torch.testing.assert_close(params[k], net.state_dict()[k], rtol=0, atol=1e-12)


def test_a_model_given_in_eval_mode_trains_every_module():
    # from_pretrained returns models in eval mode: apply(train=True) trains all of them.
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval()
    apply, params, buffers = pardist.functional(net, device=None)
    _, trained = apply(params, buffers, torch.randn(6, 3))
    assert trained["1.num_batches_tracked"] == 1
    _, evaluated = apply(params, buffers, torch.randn(6, 3), train=False)
    assert evaluated["1.num_batches_tracked"] == 0
