"""Every rank fed the same batch: a warning on the first call (an error under PARDIST_DEBUG=1).

And the cases where equal batches are no evidence of a mistake, which must stay quiet.
"""

from __future__ import annotations

import warnings

import helpers
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import pardist
from pardist import P


def _first_call(make_batch, in_specs=None, calls: int = 1):
    """Warnings (messages) and errors (messages) from ``calls`` calls of a training step."""
    apply, params, _ = pardist.functional(helpers.mlp())

    def train_step(params, opt_state, batch):
        grads = pardist.grad(lambda p, x, y: F.cross_entropy(apply(p, {}, x)[0], y))(params, *batch)
        return grads, opt_state

    step = pardist.data_parallel(train_step, in_specs=in_specs)
    warned, raised = [], []
    for i in range(calls):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                step(params, {}, make_batch(i))
            except ValueError as e:
                raised.append(str(e))
        warned += [str(w.message) for w in caught if w.category is pardist.DuplicateBatchWarning]
    return warned, raised


def _plain_loader(i):
    """A plain shuffled DataLoader, seeded alike on every rank (the mistake)."""
    torch.manual_seed(0)
    x, y = helpers.global_batch(0, "mlp", 64)
    return next(iter(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)))


def _sharded_loader(i):
    torch.manual_seed(0)
    x, y = helpers.global_batch(0, "mlp", 64)
    return next(iter(pardist.data.shard(DataLoader(TensorDataset(x, y), batch_size=8))))


def test_every_rank_given_the_same_batch_warns_naming_the_argument_and_the_fix(run):
    for warned, raised in run(2, _first_call, _plain_loader, None, 3):
        assert not raised and len(warned) == 1, (warned, raised)  # on the first call only
        message = warned[0]
        assert "every rank received the same batch: args[2] ('batch')" in message
        assert "identical on all 2 ranks" in message
        assert "pardist.data.shard(loader)" in message and "in_specs=(P(), P(), P())" in message
    for warned, raised in run(2, _first_call, _plain_loader, None, 2, env={"PARDIST_DEBUG": "1"}):
        assert not warned and len(raised) == 2  # every call checked, and an error
        assert "every rank received the same batch: args[2] ('batch')" in raised[0]


def _one_row(i):  # one sample per rank, equal by chance
    return torch.ones(1, 8) * 0.5 + torch.arange(8.0), torch.tensor([2])


def _constant(i):  # synthetic data
    return torch.ones(4, 8), torch.zeros(4, dtype=torch.long)


def _same_rows_other_order(i):
    x, y = helpers.global_batch(0, "mlp", 8)
    order = torch.arange(8).roll(pardist.rank())
    return x[order], y[order]


def _one_hot(i):  # each rank its own one-hot rows (rows of equal sums)
    order = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]).roll(pardist.rank() + 1)
    return F.one_hot(order, 8).float(), torch.zeros(8, dtype=torch.long)


def _permutations(i):  # a sorting task: every row a permutation of the same items
    rows = [torch.arange(8.0).roll(k + 3 * pardist.rank()) for k in range(8)]
    return torch.stack(rows), torch.zeros(8, dtype=torch.long)


def _constant_rows(i):  # each row constant, the rows' order mirrored between ranks
    values = [1.0, 2.0, 2.0, 1.0] if pardist.rank() % 2 == 0 else [2.0, 1.0, 1.0, 2.0]
    return torch.tensor(values)[:, None].expand(4, 8), torch.zeros(4, dtype=torch.long)


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("make_batch", [_one_hot, _permutations, _constant_rows])
def test_no_false_alarm_on_distinct_batches_alike_in_their_sums(run, nprocs, make_batch):
    env = {"PARDIST_DEBUG": "1"}  # the strict mode: an error would show
    assert run(nprocs, _first_call, make_batch, None, 1, env=env) == [([], [])] * nprocs


@pytest.mark.parametrize(
    "make_batch, in_specs",
    [
        (_sharded_loader, None),  # the fix
        (_one_row, None),
        (_constant, None),
        (_same_rows_other_order, None),
        (_plain_loader, (P(), P(), P())),  # the same batch, meant: marked replicated
    ],
    ids=["sharded-loader", "one-row-each", "constant", "reordered", "marked-replicated"],
)
def test_no_report_where_equal_batches_prove_nothing(run, make_batch, in_specs):
    env = {"PARDIST_DEBUG": "1"}  # the strict mode: an error would show
    assert run(2, _first_call, make_batch, in_specs, 2, env=env) == [([], [])] * 2


def test_no_report_at_world_size_one(world1):
    with warnings.catch_warnings():
        warnings.simplefilter("error", pardist.DuplicateBatchWarning)
        assert _first_call(_plain_loader) == ([], [])


def _augmented_on_each_rank(i):
    """F5: the same plain loader everywhere, noise added per rank: the labels give it away."""
    torch.manual_seed(0)
    x, y = helpers.global_batch(0, "mlp", 64)
    x, y = next(iter(DataLoader(TensorDataset(x, y), batch_size=48, shuffle=True)))
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(pardist.rank()))
    return x + 0.1 * noise, y  # 48 labels of 4 classes: 96 bits, alike by chance never


def _alike_labels_by_chance(i):
    """Distinct inputs, 8 binary labels that happen to agree: 8 bits prove nothing."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(pardist.rank()))
    return x, torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])


def test_labels_alike_on_every_rank_warn_though_the_inputs_were_augmented(run):
    for warned, raised in run(2, _first_call, _augmented_on_each_rank):
        assert not raised
        assert (
            len(warned) == 1 and "args[2] ('batch') (its args[2][1]; the rest differ)" in warned[0]
        )
    env = {"PARDIST_DEBUG": "1"}
    assert run(2, _first_call, _alike_labels_by_chance, None, 1, env=env) == [([], [])] * 2
