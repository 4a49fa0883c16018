"""N ranks equal one process for every argument's gradient, collectives in the loss or not.

Inside a step, ``pardist.grad`` is the gradient of the loss averaged over the data axes:
a replicated argument gets the mean of the ranks' gradients, a sharded one its rows of
one process's gradient on the global batch. Each loss below means the same on every
world size (the global batch's mean squared error, written per rank, as a ``pmean``, as
a global sum over the global count, over gathered predictions, or after normalising
with the global batch's statistics), so each must give, at 1, 2 and 4 ranks, on both
transports, eagerly and compiled, one process's gradient with respect to the weights,
to the batch, and to both at once. Float64 on both sides (numerics.py).
"""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close64

import pardist
from pardist import P

F64 = torch.float64
ROWS = 8  # the global batch


def _sq(w, x, y):
    return (x @ w - y) ** 2


def _normalised(x, mean, var):
    return (x - mean) / (var + 1e-3).sqrt()


LOSSES = {
    "per_rank_mean": lambda w, x, y: _sq(w, x, y).mean(),
    "pmean": lambda w, x, y: pardist.pmean(_sq(w, x, y).mean(), "gpu"),
    "sum_over_count": lambda w, x, y: (
        pardist.psum(_sq(w, x, y).sum(), "gpu") / pardist.psum((y == y).sum().to(F64), "gpu")
    ),
    "gathered_invariant": lambda w, x, y: _sq(
        w,
        pardist.all_gather(x, "gpu", invariant=True),
        pardist.all_gather(y, "gpu", invariant=True),
    ).mean(),
    "gathered_varying": lambda w, x, y: (
        (pardist.all_gather(x @ w, "gpu") - pardist.all_gather(y, "gpu")) ** 2
    ).mean(),
    "global_statistics": lambda w, x, y: _sq(
        w,
        _normalised(
            x,
            pardist.psum(x.sum(0), "gpu") / pardist.psum(len(x), "gpu"),
            pardist.psum((x - pardist.psum(x.sum(0), "gpu") / pardist.psum(len(x), "gpu"))
                         .pow(2).sum(0), "gpu") / pardist.psum(len(x), "gpu"),
        ),
        y,
    ).mean(),
}  # fmt: skip


def _reference(name: str, w, x, y):
    """One process on the whole batch: every loss above is this batch's mean."""
    if name == "global_statistics":
        x = _normalised(x, x.mean(0), x.var(0, unbiased=False))
    return _sq(w, x, y).mean()


def data():
    g = torch.Generator().manual_seed(11)
    return (
        torch.randn(3, generator=g, dtype=F64),
        torch.randn(ROWS, 3, generator=g, dtype=F64),
        torch.randn(ROWS, generator=g, dtype=F64),
    )


def _on_ranks(names: list[str], compile: bool) -> dict:  # noqa: A002
    w, x, y = data()
    r, n = pardist.rank(), pardist.world_size()
    x, y = x.chunk(n)[r], y.chunk(n)[r]
    out = {}
    for name in names:
        f = LOSSES[name]
        for argnums, specs in [(0, P()), (1, P("gpu")), ((0, 1), (P(), P("gpu")))]:
            step = pardist.data_parallel(
                lambda w, x, y: pardist.value_and_grad(f, argnums)(w, x, y),  # noqa: B023
                in_specs=(P(), P("gpu"), P("gpu")),
                out_specs=(P(), specs),
                compile={"backend": "aot_eager"} if compile else False,
            )
            out[name, argnums] = step(w, x, y)
    return out


def _check(results: list[dict], names: list[str]) -> None:
    w, x, y = data()
    n = len(results)
    for name in names:
        value = _reference(name, w, x, y)
        gw, gx = torch.func.grad(lambda w, x: _reference(name, w, x, y), (0, 1))(w, x)  # noqa: B023
        for r, got in enumerate(results):
            rows = gx.chunk(n)[r]
            assert_close64(got[name, 0], (value, gw), f"{name} at {n}: w")
            assert_close64(got[name, 1], (value, rows), f"{name} at {n}: x")
            assert_close64(got[name, (0, 1)], (value, (gw, rows)), f"{name} at {n}: both")


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_every_arguments_gradient_equals_one_process(run, ranks):
    _check(run(ranks, _on_ranks, list(LOSSES), False), list(LOSSES))


def test_over_gloo_too(run):
    _check(run(2, _on_ranks, list(LOSSES), False, env={"PARDIST_SHM": "0"}), list(LOSSES))


def test_compiled_steps_too(run):
    names = ["per_rank_mean", "pmean", "sum_over_count", "gathered_invariant"]
    _check(run(2, _on_ranks, names, True), names)


def _options(option: str) -> dict:
    """The batch's and the weights' gradients under accumulate, mean='rows' (uneven shards),
    mean='tokens' and the deterministic mode, on this rank."""
    w, x, y = data()
    r, n = pardist.rank(), pardist.world_size()
    cut = [0, 3, ROWS] if option == "rows" else [i * ROWS // n for i in range(n + 1)]
    x, y = x[cut[r] : cut[r + 1]], y[cut[r] : cut[r + 1]]
    grad, step_options = {}, {}
    f = LOSSES["per_rank_mean"]
    if option == "accumulate":
        grad = {"accumulate": 2}
    elif option == "rows":
        grad = {"mean": "rows"}
    elif option == "tokens":
        grad = {"mean": "tokens"}
        f = lambda w, x, y: (_sq(w, x, y).sum(), len(y))  # noqa: E731
    elif option == "deterministic":
        step_options = {"deterministic": 4}
    step = pardist.data_parallel(
        lambda w, x, y: pardist.value_and_grad(f, (0, 1), **grad)(w, x, y),
        in_specs=(P(), P("gpu"), P("gpu")),
        out_specs=(P(), (P(), P("gpu"))),
        **step_options,
    )
    return step(w, x, y), cut[r : r + 2]


@pytest.mark.parametrize("option", ["accumulate", "rows", "tokens", "deterministic"])
def test_every_way_of_weighing_gives_the_batch_one_process_gradient(run, option):
    w, x, y = data()
    value = _reference("per_rank_mean", w, x, y)
    gw, gx = torch.func.grad(lambda w, x: _reference("per_rank_mean", w, x, y), (0, 1))(w, x)
    for got, (start, stop) in run(2, _options, option):
        assert_close64(got, (value, (gw, gx[start:stop])), option)
