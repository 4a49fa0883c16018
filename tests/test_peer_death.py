"""A rank killed mid-run, ranks started by hand: the survivor raises pardist's error naming
the lost rank, over shared memory as over gloo, with plain and FSDP parameters.

No launcher watches these ranks (each started by hand, its own hash seed), so nothing but
the transport can tell the survivor. Over gloo the killed rank's sockets close: FSDP's
reduce-scatter said ``pair.cc:537 Read error ... Connection reset by peer``, and now the
step says which rank it lost. Over shared memory nothing closes: the survivor waited the
whole collective timeout; now it sees within a second that the peer's process is gone. The
collective timeout here is 300 s and the test waits 200 s at most, so a pass is the
detection, never the timeout.
"""

from __future__ import annotations

import pytest
from helpers import ranks_by_hand

pytestmark = pytest.mark.timeout(400)

SCRIPT = r"""
import os, signal, sys, torch
import pardist
pardist.init()
torch.manual_seed(0)
apply, params, _ = pardist.functional(torch.nn.Linear(8, 4))
params = pardist.fsdp(params) if sys.argv[1] == "fsdp" else params
opt = pardist.optim.sgd(0.1)
state = opt.init(params)

calls = 0

def loss(p, x):
    out = apply(p, {}, x)[0]  # (FSDP: the parameters gathered)
    if calls == 3 and pardist.rank() == 1:  # killed inside the step, mid-forward
        os.kill(os.getpid(), signal.SIGKILL)
    return out.square().mean()

@pardist.data_parallel
def step(p, s, x):
    return opt.update(pardist.grad(loss)(p, x), s, p)

for calls in range(6):
    params, state = step(params, state, torch.randn(4, 8))
print("finished")
"""


@pytest.mark.parametrize("params", ["plain", "fsdp"])
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_the_survivor_names_the_lost_rank(transport, params):
    shm = "0" if transport == "gloo" else "1"
    procs = ranks_by_hand(SCRIPT, [0, 1], 2, params, PARDIST_TIMEOUT="300", PARDIST_SHM=shm)
    survivor, _ = procs[0].communicate(timeout=200)
    procs[1].communicate(timeout=60)
    assert procs[1].returncode == -9
    assert procs[0].returncode not in (0, None) and "finished" not in survivor
    last = survivor.strip().splitlines()[-1]
    assert "CollectiveTimeout" in last, survivor[-3000:]
    if transport == "shm":
        assert "lost rank 1 on rank 0: its process (pid" in last, last
    else:
        assert "lost the connection to another rank" in last and "Rank(s) [1]" in last, last
    assert "Connection reset by peer" not in last.split("(The backend said")[0]


UNEVEN = r"""
import tempfile, torch
import pardist
pardist.init()
w = torch.ones(3)
step = pardist.data_parallel(lambda w, x: w - 0.1 * pardist.grad(lambda w: (x @ w).sum())(w))
for _ in range(2 + pardist.rank()):  # rank 1's loader has one batch more
    w = step(w, torch.ones(2, 3))
pardist.checkpoint.save(tempfile.gettempdir() + "/pardist-uneven", {"w": w})
print("finished")
"""


def test_ranks_that_ran_different_numbers_of_steps_are_named_on_shared_memory():
    """Rank 0's loader ends a batch early and it saves a checkpoint (a gloo collective)
    while rank 1 waits in a shared-memory collective of one more step: on gloo the two
    headers meet and both raise at once; on shared memory both waited the whole timeout.
    Now rank 1 sees, within a tenth of a second, that rank 0 waits over gloo outside any
    step, and raises StepMismatch naming both; its exit ends rank 0's wait."""
    procs = ranks_by_hand(UNEVEN, [0, 1], 2, PARDIST_TIMEOUT="300", PARDIST_SHM="1")
    out = [p.communicate(timeout=200)[0] for p in procs]
    assert all(p.returncode != 0 for p in procs), out
    last = [text.strip().splitlines()[-1] for text in out]
    assert "StepMismatch: pardist: rank 0 waits outside the step, over gloo, in " in last[1], out[1]
    assert "pardist.checkpoint.save" in last[1] and "of call 3" in last[1], last[1]
    assert "CollectiveTimeout" in last[0] and "lost the connection" in last[0], out[0][-3000:]


IN_SAVE = r"""
import os, signal, torch
import pardist
from pardist.runtime import _safe_dcp
pardist.init()
writer = _safe_dcp.writer_class()
plan = writer.prepare_local_plan

def dies(self, *args):  # rank 1 is killed inside DCP's save, after the ranks agreed on it
    if pardist.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return plan(self, *args)

writer.prepare_local_plan = dies
pardist.checkpoint.save(os.environ["FOLDER"], {"w": torch.ones(3)}, step=1)
print("finished")
"""


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_rank_killed_inside_a_checkpoint_save_is_named(tmp_path, transport):
    shm = "0" if transport == "gloo" else "1"
    env = dict(PARDIST_TIMEOUT="300", FOLDER=str(tmp_path), PARDIST_SHM=shm)
    procs = ranks_by_hand(IN_SAVE, [0, 1], 2, **env)
    survivor = procs[0].communicate(timeout=200)[0]
    procs[1].communicate(timeout=60)
    assert procs[1].returncode == -9 and procs[0].returncode != 0, survivor[-3000:]
    last = survivor.strip().splitlines()[-1]
    assert "CollectiveTimeout: pardist.checkpoint.save over" in last, survivor[-3000:]
    assert "lost the connection to another rank" in last and "Rank(s) [1]" in last, last
    assert not list(tmp_path.glob("1")) and pardist_latest(tmp_path) is None


def pardist_latest(folder):
    import pardist

    return pardist.checkpoint.latest(folder)
