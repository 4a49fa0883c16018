"""``accumulate='list'``: micro-batches of their own shapes, as plain torch's accumulation loop.

Each rank holds a list of micro-batches, each padded to its own longest row, the last
shorter, and (where a loader ran out) fewer on one rank than on another. pardist must
give what plain torch's loop gives on the same micro-batches (float64, one process,
``loss.backward()`` per micro-batch with its weight), for every weighing:

- ``'tokens'``: the sum of every micro-batch's per-token losses over their global count;
- ``'ranks'``: per rank the mean of its micro-batches' losses, then the mean over ranks
  (DDP with ``no_sync`` and ``loss / k``, Accelerate's loop);
- ``'rows'``: every row of every micro-batch counts once.

Everything is float64 on both sides, so the bound is float64 rounding (``numerics``);
weighing one micro-batch wrongly is off by percents.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64
from torch import nn

import pardist

V, T = 11, 9
# Per rank: each micro-batch's rows' lengths (padded to its own longest). Rank 1 of 2 has
# one micro-batch fewer (its loader ran out); at 3 ranks, rank 2 has one of a single row.
LENGTHS = {
    1: [[[9, 4, 2], [5, 5, 1, 3], [2, 6]]],
    2: [[[9, 4, 2], [5, 5, 1, 3], [2, 6]], [[3, 7, 7, 2], [8]]],
    3: [[[9, 4, 2], [5, 5, 1, 3]], [[3, 7], [2, 6], [8, 1, 1]], [[4]]],
}


class CausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix, self.out = nn.Embedding(V, 12), nn.Linear(12, 12), nn.Linear(12, V)

    def forward(self, ids):
        h = self.emb(ids).cumsum(1) / torch.arange(1, ids.shape[1] + 1)[:, None]
        return self.out(torch.tanh(self.mix(h)))


def micro_batch(lengths: list[int], seed: int) -> dict:
    """Right-padded rows (pad 0), as long as the longest; labels -100 where nothing is next."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, V, (len(lengths), width), generator=g)
    length = torch.tensor(lengths)
    ids[torch.arange(width)[None] >= length[:, None]] = 0
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = torch.where(torch.arange(1, width)[None] < length[:, None], ids[:, 1:], -100)
    return {"input_ids": ids, "labels": labels, "attention_mask": (ids != 0).long()}


def rank_batches(world: int, rank: int) -> list[dict]:
    return [micro_batch(lens, 100 * rank + j) for j, lens in enumerate(LENGTHS[world][rank])]


def token_sum(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def reference(world: int, mean: str):
    """Plain torch, one process, the same micro-batches: (loss, gradients)."""
    net = CausalLM().double()
    everyone = [rank_batches(world, r) for r in range(world)]
    tokens = sum(int((b["labels"] != -100).sum()) for bs in everyone for b in bs)
    rows = sum(len(b["input_ids"]) for bs in everyone for b in bs)
    total = 0.0
    for batches in everyone:
        for b in batches:
            logits = net(b["input_ids"])
            if mean == "tokens":
                loss = token_sum(logits, b["labels"]) / tokens
            elif mean == "ranks":  # each rank's mean of its micro-batches, then of the ranks
                loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten())
                loss = loss / len(batches) / world
            else:  # rows: each row's mean over its tokens, every row of the update once
                per_row = F.cross_entropy(logits.transpose(1, 2), b["labels"], reduction="none")
                counts = (b["labels"] != -100).sum(1).clamp(min=1)
                loss = (per_row.sum(1) / counts).sum() / rows
            loss.backward()
            total += loss.item()
    return total, {k: p.grad for k, p in net.named_parameters()}


def _as_tree(loss: float, grads: dict) -> dict:
    return {"loss": torch.tensor(loss, dtype=torch.float64), **grads}


def loss_for(apply, mean: str):
    def f(params, batch):
        logits = apply(params, {}, batch["input_ids"])[0]
        if mean == "tokens":
            return token_sum(logits, batch["labels"]), (batch["labels"] != -100).sum()
        if mean == "ranks":
            return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        per_row = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
        return (per_row.sum(1) / (batch["labels"] != -100).sum(1).clamp(min=1)).mean()

    return f


def on_ranks(mean: str, in_step: bool = True):
    from pardist.transport import _reducer

    finished = []
    finish = _reducer.Reducer.finish
    _reducer.Reducer.finish = lambda self: finished.append(1) or finish(self)
    try:
        apply, params, _ = pardist.functional(CausalLM().double())
        batches = rank_batches(pardist.world_size(), pardist.rank())
        vg = pardist.value_and_grad(loss_for(apply, mean), mean=mean, accumulate="list")
        if not in_step:
            return vg(params, batches)
        value, grads = pardist.data_parallel(vg)(params, batches)
        return value, grads, len(finished)
    finally:
        _reducer.Reducer.finish = finish


@pytest.mark.parametrize("mean", ["tokens", "ranks", "rows"])
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_a_list_of_micro_batches_equals_torchs_loop(run, nprocs, mean):
    want_loss, want = reference(nprocs, mean)
    for value, grads, reductions in run(nprocs, on_ranks, mean):
        assert_close64({"loss": value, **grads}, _as_tree(want_loss, want))
        assert reductions == 1  # the buckets are reduced once for the whole update


@pytest.mark.parametrize("mean", ["tokens", "ranks", "rows"])
def test_outside_a_step_the_same(mean):
    want_loss, want = reference(1, mean)
    value, grads = on_ranks(mean, in_step=False)
    assert_close64({"loss": value, **grads}, _as_tree(want_loss, want))


def test_weighing_micro_batches_equally_would_be_wrong():
    """What the reference tells apart: the mean of the micro-batches' token means is not the
    mean over their tokens (so the tests above can fail)."""
    _, tokens = reference(2, "tokens")
    _, ranks = reference(2, "ranks")
    assert (
        max(((tokens[k] - ranks[k]).abs().max() / tokens[k].abs().max()).item() for k in tokens)
        > 1e-2
    )


class Batch(collections.UserDict):
    """A Hugging Face-like batch: a UserDict, not a dict."""


def _mapping_micro_batches():
    apply, params, _ = pardist.functional(CausalLM().double())
    batches = [Batch(b) for b in rank_batches(2, pardist.rank())]
    vg = pardist.value_and_grad(loss_for(apply, "tokens"), mean="tokens", accumulate="list")
    return pardist.data_parallel(vg)(params, batches)


def test_micro_batches_that_are_mappings(run):
    want_loss, want = reference(2, "tokens")
    for value, grads in run(2, _mapping_micro_batches):
        assert_close64({"loss": value, **grads}, _as_tree(want_loss, want))


def _carried_buffers(sync_bn: bool, uneven: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double()
    apply, params, buffers = pardist.functional(model, sync_bn=sync_bn)
    g = torch.Generator().manual_seed(pardist.rank())
    k = 3 - (uneven and pardist.rank() == 1)
    batches = [(torch.randn(4 + j, 3, generator=g, dtype=torch.float64),) for j in range(k)]

    def f(p, b, batch):
        out, b = apply(p, b, batch[0])
        return out.square().mean(), b

    vg = pardist.value_and_grad(f, has_aux=True, accumulate="list", carry=1)
    try:
        (loss, buffers), grads = pardist.data_parallel(vg)(params, buffers, batches)
    except ValueError as e:
        return str(e)
    return float(loss), grads, buffers


@pytest.mark.parametrize(
    "sync_bn, names", [(True, "pardist.psum / pmean"), (False, "running statistics")]
)
def test_uneven_counts_with_the_ranks_in_the_loss_raise_on_every_rank(run, sync_bn, names):
    """Batch norm pairs the ranks in every micro-batch: cross-replica statistics by a
    collective, per-rank ones by averaging the buffers (whose counts would then differ).
    With different counts every rank raises at the first micro-batch, naming both."""
    for message in run(2, _carried_buffers, sync_bn, True):
        assert (
            "the ranks run different numbers of micro-batches in this update (from 2 to 3"
            in message
        )
        assert names in message and "LayerNorm or GroupNorm" in message
    first, second = run(2, _carried_buffers, sync_bn, False)  # the same counts: both work
    assert all(torch.equal(first[1][k], second[1][k]) for k in first[1])
    assert first[2]["1.num_batches_tracked"].item() == 3


def _one_rank_has_none():
    apply, params, _ = pardist.functional(CausalLM().double())
    vg = pardist.data_parallel(
        pardist.value_and_grad(loss_for(apply, "tokens"), mean="tokens", accumulate="list")
    )
    vg(params, rank_batches(2, pardist.rank()))  # (the first call also compares layouts)
    batches = rank_batches(2, 0)[: pardist.rank() * 2]  # rank 0's loader ran out: no batch
    try:
        vg(params, batches)
    except ValueError as e:
        return str(e)


def test_a_rank_without_micro_batches_stops_every_rank(run):
    here, there = run(2, _one_rank_has_none)
    assert "empty list of micro-batches on this rank" in here
    assert "empty list of micro-batches on another rank" in there


def test_clear_errors():
    apply, params, _ = pardist.functional(CausalLM().double())
    f = loss_for(apply, "ranks")
    vg = pardist.value_and_grad(f, accumulate="list")
    batch = micro_batch([3, 2], 0)
    with pytest.raises(ValueError, match=r"args\[1\], which holds the batch, is a dict"):
        vg(params, batch)
    with pytest.raises(ValueError, match="empty list of micro-batches on this rank"):
        vg(params, [])
    two = pardist.value_and_grad(lambda p, a, b: f(p, a), accumulate="list", batch_argnums=(1, 2))
    with pytest.raises(
        ValueError, match=r"different numbers of them \(args\[1\] has 2, args\[2\] has 1"
    ):
        two(params, [batch, batch], [batch])
    with pytest.raises(
        ValueError, match="give a number of micro-batches to split the batch into, or 'list'"
    ):
        pardist.grad(f, accumulate="lists")
    with pytest.raises(ValueError, match="mean='rows' weighs micro-batch 0 by its rows"):
        rows = pardist.grad(lambda p, b: f(p, b), accumulate="list", mean="rows")
        rows(params, [{"input_ids": batch["input_ids"], "labels": batch["labels"][:1]}])


def test_a_compiled_step_says_it_runs_a_list_eagerly(world1):
    apply, params, _ = pardist.functional(CausalLM().double())
    vg = pardist.value_and_grad(loss_for(apply, "ranks"), accumulate="list")
    with pytest.warns(UserWarning, match="accumulate='list' runs micro-batches of other shapes"):
        value, grads = pardist.data_parallel(vg, compile=True)(params, rank_batches(1, 0))
    want_loss, want = reference(1, "ranks")
    assert_close64(_as_tree(value.item(), grads), _as_tree(want_loss, want))
