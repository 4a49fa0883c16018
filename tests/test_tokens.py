"""``mean='tokens'``: the gradient of the loss over the global count of tokens, as one process.

A causal language model on right-padded rows whose lengths differ per rank and per
micro-batch (one rank has no token at all) must train as one process on the whole
padded batch with ``ignore_index``. Everything runs in float64, ours and the
reference, so the only difference is the order of float64 sums: each gradient
entry adds at most a few hundred terms of size below 10, whose rounding is below
1e-12, while weighing the ranks or micro-batches by anything but their tokens is
off by percents.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pardist

V, T, ROWS = 13, 8, 12
TOL = 1e-10


class CausalLM(nn.Module):
    """Each position sees the mean of the embeddings up to it (a causal prefix average)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix, self.out = nn.Embedding(V, 16), nn.Linear(16, 16), nn.Linear(16, V)

    def forward(self, ids):
        h = self.emb(ids).cumsum(1) / torch.arange(1, ids.shape[1] + 1)[:, None]
        return self.out(torch.tanh(self.mix(h)))


def batch(lengths: list[int]):
    """Right-padded rows (pad id 0) and their next-token labels, -100 where nothing is next."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, V, (ROWS, T), generator=g)
    length = torch.tensor(lengths)
    ids[torch.arange(T)[None] >= length[:, None]] = 0
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = torch.where(torch.arange(1, T)[None] < length[:, None], ids[:, 1:], -100)
    return ids, labels


# Rows of length 1 have nothing to predict: at 3 ranks, rank 1 (rows 4-7) has no token at
# all; at 2 ranks x 2 micro-batches, rank 0's second micro-batch has one label.
LENGTHS = [8, 3, 5, 2, 1, 1, 1, 1, 7, 4, 6, 2]


def reference(lengths: list[int]):
    net = CausalLM().double()
    ids, labels = batch(lengths)
    loss = F.cross_entropy(net(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    return loss.item(), {k: p.grad for k, p in net.named_parameters()}


def loss_fn(apply):
    def f(params, ids, labels):
        logits = apply(params, {}, ids)[0]
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return total, (labels != -100).sum()

    return f


def on_ranks(lengths: list[int], accumulate: int):
    apply, params, _ = pardist.functional(CausalLM().double())
    ids, labels = batch(lengths)
    rank, n = pardist.rank(), ROWS // pardist.world_size()
    mine = slice(rank * n, (rank + 1) * n)
    vg = pardist.value_and_grad(loss_fn(apply), mean="tokens", accumulate=accumulate)
    step = pardist.data_parallel(lambda p, b: vg(p, *b))
    try:
        value, grads = step(params, (ids[mine], labels[mine]))
    except ValueError as e:
        return str(e)
    return float(value), grads


@pytest.mark.parametrize("nprocs", [1, 2, 3])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_token_weighted_mean_equals_one_process(run, nprocs, accumulate):
    want_loss, want = reference(LENGTHS)
    for value, grads in run(nprocs, on_ranks, LENGTHS, accumulate):
        assert value == pytest.approx(want_loss, rel=TOL)
        for k in want:
            err = (grads[k] - want[k]).abs().max().item()
            assert err <= TOL * want[k].abs().max().item(), (k, err)


def test_the_mean_over_rows_is_not_the_mean_over_tokens(run):
    # The same data weighed by rows: off by percents (so the test above can fail).
    apply, params, _ = pardist.functional(CausalLM().double())
    ids, labels = batch(LENGTHS)
    _, want = reference(LENGTHS)

    def rows(p, ids, labels):
        return F.cross_entropy(apply(p, {}, ids)[0].flatten(0, 1), labels.flatten())

    got = pardist.grad(rows, accumulate=2, batch_argnums=(1, 2))(params, ids, labels)
    assert max((got[k] - want[k]).abs().max() / want[k].abs().max() for k in want) > 1e-3


def test_outside_a_step_the_same(world1):
    apply, params, _ = pardist.functional(CausalLM().double())
    ids, labels = batch(LENGTHS)
    want_loss, want = reference(LENGTHS)
    vg = pardist.value_and_grad(loss_fn(apply), mean="tokens", accumulate=3, batch_argnums=(1, 2))
    value, grads = vg(params, ids, labels)
    assert float(value) == pytest.approx(want_loss, rel=TOL)
    assert all((grads[k] - want[k]).abs().max() <= TOL * want[k].abs().max() for k in want)


def test_no_token_in_the_whole_step_is_a_clear_error(run):
    for message in run(2, on_ranks, [1] * ROWS, 2):
        assert "no rank had a token in this step" in message, message


def test_a_count_of_the_wrong_kind_names_the_fix():
    apply, params, _ = pardist.functional(CausalLM(), device=None)
    ids, labels = batch(LENGTHS)

    def on_meta(p, ids, labels):
        total, count = loss_fn(apply)(p, ids, labels)
        return total, count.to("meta")

    with pytest.raises(ValueError, match="the token count is on meta and the loss on cpu"):
        pardist.grad(on_meta, mean="tokens")(params, ids, labels)
    with pytest.raises(ValueError, match=r"f returns \(sum of the per-token losses, number"):
        pardist.grad(lambda p: loss_fn(apply)(p, ids, labels)[0], mean="tokens")(params)
    with pytest.raises(ValueError, match="the token count has shape"):
        pardist.grad(lambda p: (loss_fn(apply)(p, ids, labels)[0], labels), mean="tokens")(params)
    with pytest.raises(ValueError, match="'tokens' \\(f returns"):
        pardist.grad(lambda p: p, mean="token")
