"""What a step remembers between calls never runs on a call it was not made for.

The step caches its specs per tree structure (interned TreeSpecs, runtime/_flat.py)
and functional's batch-norm interception per model. Each change of signature here
(tree structure, dtype, batch size, donation) is followed by a call whose numbers
are compared with plain torch computing the same thing.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

import pardist
from pardist.runtime import _flat

Pair = collections.namedtuple("Pair", "a b")
TREES = [
    None,
    3,
    "leaf",
    {},
    [],
    (),
    {"w": torch.ones(2), "b": torch.zeros(1)},
    {"b": torch.zeros(1), "w": torch.ones(2)},  # the same keys in another order
    {"a": None, "b": (1, [2, 3.0])},
    [Pair(1, {"x": 2}), ()],
    collections.OrderedDict(a=1, b=[2]),
    collections.defaultdict(list, a=[1]),
    torch.return_types.max((torch.ones(1), torch.zeros(1))),
    ({"x": torch.ones(1)}, [torch.ones(1), {"y": (torch.ones(1),)}]),
]


@pytest.mark.parametrize("tree", TREES, ids=range(len(TREES)))
def test_fast_flattening_is_torchs(tree):
    leaves, spec = pytree.tree_flatten(tree)
    for _ in range(2):  # the second time from the cache
        fast, fast_spec = _flat.tree_flatten(tree)
        assert fast_spec == spec and len(fast) == len(leaves)
        assert all(a is b for a, b in zip(fast, leaves))
        back = _flat.tree_unflatten(fast, fast_spec)
        assert type(back) is type(tree) and pytree.tree_flatten(back)[1] == spec


def test_trees_of_other_structures_never_share_a_spec():
    trees = [{"a": 1, "b": 2}, {"b": 2, "a": 1}, {"a": 1, "b": (2,)}, [1, 2], (1, 2), Pair(1, 2)]
    specs = [_flat.tree_flatten(t)[1] for t in trees]
    assert all(specs[i] != specs[j] for i in range(len(specs)) for j in range(i))


def _reference(w, x, y, steps):
    """Plain torch: SGD on a linear least-squares loss."""
    w = w.clone().requires_grad_()
    for _ in range(steps):
        (g,) = torch.autograd.grad(F.mse_loss(x @ w, y), w)
        w = (w - 0.1 * g).detach().requires_grad_()
    return w.detach()


def _signatures():
    step = pardist.data_parallel(
        lambda p, batch: {
            k: v - 0.1 * g for (k, v), g in zip(p.items(), pardist.grad(loss)(p, *batch).values())
        }
    )
    results = []
    g = torch.Generator().manual_seed(0)
    for dtype, rows, keys in [
        (torch.float32, 8, ("w",)),
        (torch.float64, 8, ("w",)),  # a changed dtype
        (torch.float64, 6, ("w",)),  # a changed batch size
        (torch.float64, 6, ("w", "v")),  # a changed tree structure
        (torch.float32, 8, ("w",)),  # back to the first
    ]:
        x = torch.randn(rows, 3, generator=g, dtype=dtype)
        y = torch.randn(rows, 1, generator=g, dtype=dtype)
        w0 = torch.randn(3, 1, generator=g, dtype=dtype)
        p = {k: w0 * (i + 1) for i, k in enumerate(keys)}
        r, n = pardist.rank(), rows // pardist.world_size()
        got = step(p, (x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]))
        results.append((got, {k: _reference(v, x, y, 1) for k, v in p.items()}, dtype))
    return results


def loss(p, x, y):
    return sum(F.mse_loss(x @ w, y) for w in p.values())


def test_a_changed_signature_gives_the_numbers_of_plain_torch(run):
    for results in run(2, _signatures):
        for got, want, dtype in results:
            assert got.keys() == want.keys()
            for k in want:
                assert got[k].dtype == dtype
                torch.testing.assert_close(got[k], want[k])


def _donation():
    opt = pardist.optim.sgd(0.1)

    def step(p, s, batch):
        grads = pardist.grad(loss)(p, *batch)
        return opt.update(grads, s, p)

    plain = pardist.data_parallel(step)
    donated = pardist.data_parallel(step, donate_argnums=(0, 1))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)
    r = pardist.rank()
    batch = (x[4 * r : 4 * r + 4], y[4 * r : 4 * r + 4])
    w = torch.randn(3, 1, generator=g)
    kept = {"w": w.clone()}
    p1, s1 = plain(kept, opt.init(kept), batch)
    assert torch.equal(kept["w"], w)  # not donated: untouched
    mine = {"w": w.clone()}
    p2, s2 = donated(mine, opt.init(mine), batch)
    p3, s3 = donated(p2, s2, batch)  # the donated tensors, donated again
    return p1["w"], p3["w"], _reference(w, x, y, 1), _reference(w, x, y, 2)


def test_a_newly_donated_argument_gives_the_numbers_of_plain_torch(run):
    for once, twice, want_once, want_twice in run(2, _donation):
        torch.testing.assert_close(once, want_once)
        torch.testing.assert_close(twice, want_twice)
