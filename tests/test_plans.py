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
        assert [id(x) for x in _flat.tree_leaves(tree)] == [id(x) for x in leaves]
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


def _optimizer_signatures():
    """(name, params, grads per step) in the order one optimizer object sees them."""
    g = torch.Generator().manual_seed(2)

    def case(name, shapes, dtypes, transposed=False):
        params = {k: torch.randn(s, generator=g, dtype=d) for (k, s), d in zip(shapes, dtypes)}
        steps = []
        for _ in range(3):
            grads = {k: torch.randn(p.shape, generator=g, dtype=p.dtype) for k, p in params.items()}
            if transposed:  # the same values in another memory order: re-laid out
                grads["w"] = grads["w"].t().contiguous().t()
            steps.append(grads)
        return name, params, steps

    shapes = [("w", (5, 3)), ("b", (3,))]
    f32, f64 = torch.float32, torch.float64
    return [
        case("float32", shapes, [f32, f32]),
        case("non-contiguous gradients", shapes, [f32, f32], transposed=True),
        case("float64", shapes, [f64, f64]),
        case("two dtypes", shapes, [f64, f32]),
        case("another shape", [("w", (7, 2)), ("b", (2,))], [f32, f32]),
        case("float32 again", shapes, [f32, f32]),
    ]


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (lambda: pardist.optim.adamw(0.01), lambda p: torch.optim.AdamW(p, 0.01)),
        (lambda: pardist.optim.adam(0.01), lambda p: torch.optim.Adam(p, 0.01)),
        (
            lambda: pardist.optim.sgd(0.1, momentum=0.9),
            lambda p: torch.optim.SGD(p, 0.1, momentum=0.9),
        ),
    ],
    ids=["adamw", "adam", "sgd"],
)
def test_one_optimizer_across_signatures_gives_torchs_numbers(ours, theirs):
    """An optimizer remembers its checks for one signature of its tensors (Checked):
    each new signature, re-laid-out gradients and mixed dtypes included, gets torch's."""
    opt = ours()
    for name, params, steps in _optimizer_signatures():
        p, state = params, opt.init(params)
        ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
        torch_opt = theirs(list(ref.values()))
        for grads in steps:
            p, state = opt.update(grads, state, p)
            for k, t in ref.items():
                t.grad = grads[k].clone()
            torch_opt.step()
            for k in ref:
                assert p[k].dtype == ref[k].dtype, name
                torch.testing.assert_close(p[k], ref[k].detach(), msg=name)


def test_the_checks_run_once_per_signature(monkeypatch):
    """The fast path is taken: a repeated signature skips the checks, a new one runs them."""
    from pardist.optim import _base

    calls = []
    real = _base.aligned
    monkeypatch.setattr(_base, "aligned", lambda *a: calls.append(1) or real(*a))
    opt = pardist.optim.adamw(0.01)
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    state = opt.init(params)
    for _ in range(3):
        params, state = opt.update(grads, state, params)
    assert len(calls) == 1
    params, state = opt.update({**grads, "w": torch.ones(3, 4).t()}, state, params)
    assert len(calls) == 2  # non-contiguous: checked (and re-laid out) again
    doubled = {k: v.double() for k, v in params.items()}
    grads64 = {k: v.double() for k, v in grads.items()}
    state64 = opt.init(doubled)
    doubled, state64 = opt.update(grads64, state64, doubled)
    assert len(calls) == 3
    for _ in range(3):  # one optimizer for two groups in turn: both signatures kept
        params, state = opt.update(grads, state, params)
        doubled, state64 = opt.update(grads64, state64, doubled)
    assert len(calls) == 3


def test_an_optimizer_whose_signatures_keep_changing_stops_remembering(monkeypatch):
    from pardist.optim import _base

    calls = []
    real = _base.aligned
    monkeypatch.setattr(_base, "aligned", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(_base.Checked, "MAKE", 2)
    opt = pardist.optim.sgd(0.1)
    for n in (2, 3, 4, 4, 4):  # a new shape each call, then the third one again
        params = {"w": torch.ones(n)}
        opt.update({"w": torch.ones(n)}, opt.init(params), params)
    assert len(calls) == 5  # the third signature was not kept: checked every call
    params = {"w": torch.ones(2)}
    opt.update({"w": torch.ones(2)}, opt.init(params), params)
    assert len(calls) == 5  # the first is still known


def test_a_signature_matches_only_tensors_alike_in_all_the_checks_read(monkeypatch):
    from pardist.runtime._signature import Signature

    made = [torch.randn(4, 3), torch.zeros(3, dtype=torch.float64)]
    sig = Signature(made)
    assert sig.matches(made) and sig.matches([torch.ones(4, 3), torch.ones(3).double()])
    others = {
        "dtype": [made[0].half(), made[1]],
        "shape": [torch.randn(3, 4), made[1]],
        "strides": [torch.randn(3, 4).t(), made[1]],
        "requires_grad": [made[0].clone().requires_grad_(), made[1]],
        "device": [made[0].to("meta"), made[1]],
        "a subclass": [made[0], made[1].as_subclass(_Sub)],
        "count": made[:1],
        "order": made[::-1],
    }
    for what, tensors in others.items():
        assert not sig.matches(tensors), what
    monkeypatch.setenv("PARDIST_DEBUG", "1")  # every check on every call
    assert not sig.matches(made)


class _Sub(torch.Tensor):
    pass
