"""Ranks one call of a step apart: an error at once, never wrong numbers or a wait to the timeout.

The pattern that makes them: one rank raises inside a step, the user catches it to skip
the batch, and goes on while the others wait in a collective of that call. Before, the
calls paired one step apart (rank 0's step 4 equal to rank 1's step 3, training on) or
waited in different collectives until the timeout.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pardist

MODES = {"per-rank batch norm": (False, None), "sync batch norm": (True, None),
         "deterministic": (True, 2)}  # fmt: skip
TIMEOUT = "60"  # a wait to the timeout would show as a CollectiveTimeout


def _catch_and_continue(sync_bn: bool, deterministic):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    apply, params, buffers = pardist.functional(net, sync_bn=sync_bn)

    def loss(p, b, x):
        out, b = apply(p, b, x)
        return out.mean(), b

    @pardist.data_parallel(deterministic=deterministic)
    def step(p, b, x):
        if x[0, 0] > 100:  # a bad batch, on rank 1 only
            raise ValueError("bad batch")
        (value, b), _ = pardist.value_and_grad(loss, has_aux=True)(p, b, x)
        return value, b

    seen = []
    for s in range(5):
        x = torch.randn(4, 3) + pardist.rank()
        if s == 2 and pardist.rank() == 1:
            x[0, 0] = 1000.0
        try:
            _, buffers = step(params, buffers, x)
            seen.append("ok")
        except Exception as e:  # noqa: BLE001 - the skip-a-bad-batch pattern
            seen.append(type(e).__name__)
    return seen


@pytest.mark.parametrize("mode", list(MODES))
def test_a_rank_that_skips_a_call_stops_every_rank_at_once(run, mode):
    # (ranks found out of step stay so: a group of their own, not reused by other tests)
    env = {"PARDIST_TIMEOUT": TIMEOUT, "OUT_OF_STEP": mode}
    for rank, seen in enumerate(run(2, _catch_and_continue, *MODES[mode], env=env)):
        assert seen[:2] == ["ok", "ok"], seen
        if rank == 1:
            assert seen[2] == "ValueError", seen
        # never a later call that completes (calls one apart), nor a wait to the timeout
        assert all(e == "StepMismatch" for e in seen[3:]), seen
        assert seen[2] in ("StepMismatch", "ValueError"), seen


def test_over_gloo_it_stops_too(run):
    # gloo: every collective's header carries the call (tests/test_desync.py: every case)
    env = {"PARDIST_SHM": "0", "PARDIST_TIMEOUT": TIMEOUT, "OUT_OF_STEP": "gloo"}
    for rank, seen in enumerate(run(2, _catch_and_continue, False, None, env=env)):
        assert seen[2] == ("ValueError" if rank == 1 else "StepMismatch"), seen
        assert seen[3:] == ["StepMismatch"] * 2, seen


def _skip_together():
    torch.manual_seed(0)
    apply, params, buffers = pardist.functional(nn.Linear(3, 1))

    @pardist.data_parallel
    def step(p, x):
        return pardist.grad(lambda p, x: apply(p, buffers, x)[0].mean())(p, x)

    done = 0
    for s in range(4):
        x = torch.randn(4, 3)
        if s == 2 and pardist.rank() == 1:
            x[0, 0] = float("nan")
        # decided on every rank together, before the step: docs/faults.md's recipe
        bad = pardist.psum(torch.tensor(float(not torch.isfinite(x).all())), "gpu") > 0
        if bad:
            continue
        step(params, x)
        done += 1
    return done


def test_skipping_on_every_rank_together_keeps_them_in_step(run):
    assert run(2, _skip_together) == [3, 3]


def _two_steps_of_one_function():
    # A benchmark's pattern: the same function made into two steps (two models), called in
    # turn. Rank 1 is slow between them: rank 0 waits in the second step's call 2 while
    # rank 1 shows it has left the first step's call 2. Two steps, not ranks out of step.
    import time

    def train(p, x):
        return pardist.grad(lambda p: (x @ p).square().mean())(p)

    steps = [pardist.data_parallel(train), pardist.data_parallel(train)]
    done = 0
    for _ in range(3):
        for step in steps:
            step(torch.ones(3), torch.ones(4, 3))
            done += 1
            if pardist.rank() == 1:
                time.sleep(0.3)  # rank 0 is then in the next step's collective, waiting
    return done


def test_two_steps_of_one_function_in_turn_are_not_out_of_step(run):
    assert run(2, _two_steps_of_one_function, env={"PARDIST_TIMEOUT": TIMEOUT}) == [6, 6]
