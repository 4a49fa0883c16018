"""A rank one call ahead: StepMismatch on every rank within seconds, on both transports.

The pattern: one rank raises inside call 3 of a step, the user catches it to skip the
batch, and goes on while the other waits in a collective of call 3: batch norm's
statistics, the deterministic mode's, one after the gradient, or (outside the step)
``gather_object`` and ``checkpoint.save``. Over gloo this paired the next call's
check with the other rank's batch-norm sum ("from call 4 to call 2100323387") and the
other rank waited the whole timeout. The collective timeout is left at its default
(600 s): only a loud error in seconds passes within the test's bound.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import pardist
from pardist.launch._spawn import Workers

BAD_CALL = 3
CASES = ["sync batch norm", "deterministic", "after the gradient", "gather_object", "save"]


def _skip_a_bad_batch(case: str, folder: str):
    torch.manual_seed(0)
    sync_bn = case in ("sync batch norm", "deterministic")  # (the deterministic mode needs it)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    apply, params, buffers = pardist.functional(net, sync_bn=sync_bn)

    def loss(p, b, x):
        out, b = apply(p, b, x)
        return out.mean(), b

    @pardist.data_parallel(deterministic=4 if case == "deterministic" else None)
    def step(p, b, x):
        if x[0, 0] > 100 and case != "after the gradient":  # a bad batch, on rank 1 only
            raise ValueError("bad batch")
        (value, b), grads = pardist.value_and_grad(loss, has_aux=True)(p, b, x)
        if x[0, 0] > 100:
            raise ValueError("bad batch, found after the gradient")
        return pardist.pmean(value.detach(), "gpu"), b, grads

    def attempt(fn, *args):
        try:
            fn(*args)
            return "ok"
        except Exception as e:  # noqa: BLE001 - the skip-a-bad-batch pattern
            if type(e).__name__ != "ValueError":
                messages.append(str(e))
            return type(e).__name__

    def after(s):  # outside the step, whether or not it raised
        if case == "gather_object":
            pardist.gather_object(s)
        elif case == "save":
            pardist.checkpoint.save(folder, {"p": params}, step=s)

    seen, afterwards, messages = [], [], []
    for s in range(1, 6):
        x = torch.randn(4, 3) + pardist.rank()
        if s == BAD_CALL and pardist.rank() == 1:
            x[0, 0] = 1000.0
        seen.append(attempt(step, params, buffers, x))
        afterwards.append(attempt(after, s))
    return seen, afterwards, messages


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["shared memory", "gloo"])
@pytest.mark.parametrize("case", CASES)
def test_a_rank_one_call_ahead_stops_every_rank_in_seconds(tmp_path, case, transport):
    env = {"PARDIST_TIMEOUT": "600", "PARDIST_SHM": "0" if transport == "gloo" else "1"}
    # (a group found out of step stays so: a group of its own, closed after)
    with Workers(2, env=env, timeout=200) as workers:
        results = workers.run(_skip_a_bad_batch, case, str(tmp_path), timeout=200)
    for rank, (seen, afterwards, messages) in enumerate(results):
        assert seen[: BAD_CALL - 1] == ["ok"] * (BAD_CALL - 1), (rank, seen)
        assert seen[BAD_CALL - 1] == ("ValueError" if rank == 1 else "StepMismatch"), seen
        # never a later call that completes, nor a wait to the timeout (CollectiveTimeout)
        assert set(seen[BAD_CALL:]) == {"StepMismatch"}, (rank, seen, messages)
        # outside the step: in step with each other again (the header pairs), or the
        # rank that went on learns there, at its gather_object or save
        assert afterwards[: BAD_CALL - 1] == ["ok"] * (BAD_CALL - 1), afterwards
        assert set(afterwards) <= {"ok", "StepMismatch"}, (rank, afterwards, messages)
        first = messages[0]
        # the calls named are the real ones: the bad call, and the rank that went on
        numbers = {int(n) for n in re.findall(r"call (\d+)", first)}
        assert BAD_CALL in numbers and numbers <= {BAD_CALL, BAD_CALL + 1}, first
        assert "2100323387" not in first
