"""pardist.state_dict: trained params of every kind back into the original module, strict."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pardist
from pardist import optim


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight (GPT-2's lm_head)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Tied()


def _batches():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 10, (8,), generator=g) for _ in range(3)]


def _reference() -> dict:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    for tokens in _batches():
        opt.zero_grad()
        F.cross_entropy(model(tokens), (tokens + 1) % 10).backward()
        opt.step()
    return model.state_dict()


def _trained(kind: str, rank0_only: bool):
    apply, params, buffers = pardist.functional(_model())
    opt = optim.sharded(optim.sgd(0.1)) if kind == "zero" else optim.sgd(0.1)
    if kind == "fsdp":
        params = pardist.fsdp(params)

    @pardist.data_parallel
    def step(p, b, s, tokens):
        def loss(p, b, tokens):
            out, b = apply(p, b, tokens)
            return F.cross_entropy(out, (tokens + 1) % 10), b

        grads, b = pardist.grad(loss, has_aux=True)(p, b, tokens)
        p, s = opt.update(grads, s, p)
        return p, b, s

    state = opt.init(params)
    r, n = pardist.rank(), 8 // pardist.world_size()
    for tokens in _batches():
        params, buffers, state = step(params, buffers, state, tokens[r * n : (r + 1) * n])
    out = pardist.state_dict(params, buffers, _model(), rank0_only=rank0_only)
    fresh = _model()
    if out:
        fresh.load_state_dict(out, strict=True)
    return out, {k: v.clone() for k, v in fresh.state_dict().items()}


@pytest.mark.parametrize("kind", ["replicated", "zero", "fsdp"])
def test_trained_params_load_strictly_into_the_module(run, kind):
    want = _reference()
    for out, loaded in run(2, _trained, kind, False):
        assert list(out) == list(want)  # the module's keys, in its order, ties included
        assert out["head.weight"].data_ptr() == out["embed.weight"].data_ptr()
        for k, v in want.items():
            torch.testing.assert_close(loaded[k], v, rtol=1e-5, atol=1e-6)


def test_rank0_only_returns_nothing_elsewhere(run):
    results = run(2, _trained, "fsdp", True)
    assert list(results[0][0]) == list(_reference()) and results[1][0] == {}


def test_a_key_the_params_lack_is_named(world1):
    apply, params, buffers = pardist.functional(nn.Linear(2, 1))
    with pytest.raises(KeyError, match="'bias'"):
        pardist.state_dict({"weight": params["weight"]}, buffers, nn.Linear(2, 1))


class _WithPositions(nn.Module):
    """BERT's pattern: a non-persistent buffer (in named_buffers, not in state_dict)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 3)
        self.register_buffer("position_ids", torch.arange(6)[None], persistent=False)

    def forward(self, x):
        return self.emb(self.position_ids[:, : x.shape[1]]) + x


def test_non_persistent_buffers_are_left_out_as_torch_leaves_them(world1):
    model = _WithPositions()
    apply, params, buffers = pardist.functional(model)
    assert "position_ids" in buffers  # apply needs it
    out = pardist.state_dict(params, buffers, model)
    assert list(out) == list(model.state_dict())  # ['emb.weight']
    fresh = _WithPositions()
    fresh.load_state_dict(out, strict=True)
    assert torch.equal(fresh.emb.weight, params["emb.weight"])


def test_the_wrong_module_is_named_as_such(world1):
    apply, params, buffers = pardist.functional(_WithPositions())
    other = nn.Module()
    other.emb = nn.Embedding(6, 3)  # the same weights, but no position_ids of its own
    with pytest.raises(KeyError, match=r"\['position_ids'\] are not keys.*module the params came"):
        pardist.state_dict(params, buffers, other)
