"""Lose a rank, keep training: ``--keep-going`` ends ``torch.equal`` to the run that lost none.

Every run is ``tests/scripts/keep_going.py``: ``deterministic=12``, float64, dropout,
AdamW, 12 steps fed by ``pardist.data.shard(split_batches=True)``. A rank kills itself
(SIGKILL from a timer thread, so the signal lands anywhere in a call of the step: the
forward, the backward, the gradient reduction, the optimizer) or stops itself (SIGSTOP);
the survivors must end with the parameters, the optimizer state and the losses of the
uninterrupted 3-rank run, bit for bit, after the same 12 steps. Runs are bounded by
PARDIST_TIMEOUT, the launcher's timeout and pytest-timeout; the recovery itself by
nothing but its events (the launcher's word, the new group's start).
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_leaves

import pardist

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import keep_going  # noqa: E402

ENV = {"PARDIST_TIMEOUT": "60"}


def _same(got: dict, want: dict) -> bool:
    a = tree_leaves((got["params"], got["state"]))
    b = tree_leaves((want["params"], want["state"]))
    tensors = all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )
    # evaluated by the survivors and gathered; other world sizes cut other batch shapes,
    # whose float64 kernels round differently (a few ulps of outputs near 1)
    preds = torch.allclose(got["preds"], want["preds"], rtol=1e-12, atol=1e-14)
    return tensors and preds and got["losses"] == want["losses"] and got["calls"] == want["calls"]


def _spawn(kills: dict, shm: str, keep: bool = True, world: int = 3, **train) -> dict:
    """``keep_going.train(kills, **train)`` at ``world`` ranks (``keep``: --keep-going)."""
    return pardist.spawn(
        functools.partial(keep_going.train, **train),
        world,
        kills,
        env={**ENV, "PARDIST_SHM": shm},
        timeout=300,
        keep_going=keep,
    )


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    want = pardist.spawn(keep_going.train, 3, {}, env=ENV, timeout=300)
    alone = pardist.spawn(keep_going.train, 1, {}, env=ENV, timeout=300)
    assert _same(alone, want)  # the deterministic mode: one process's bits at 3 ranks
    return want


def _plans(seed: int, trials: int) -> list[dict]:
    """Random kills: a rank, a call, how far into it; a third of them a second failure
    later (down to one rank); the first rank among the victims."""
    rng = random.Random(seed)
    plans = [{0: (rng.randrange(11), rng.random())}]  # the first rank
    while len(plans) < trials:  # calls 0 to 10 of 12: the kill lands before the run ends
        victim, call = rng.randrange(3), rng.randrange(11)
        kills = {victim: (call, rng.random())}
        if rng.random() < 1 / 3:
            other = rng.choice([r for r in range(3) if r != victim])
            kills[other] = (rng.randrange(call, 11), rng.random())
        plans.append(kills)
    return plans


@pytest.mark.timeout(900)
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_random_kills_end_bit_identical_to_the_uninterrupted_run(uninterrupted, shm):
    for kills in _plans(int(shm), 20):
        got = _spawn(kills, shm)
        assert got["world"] == 3 - len(kills), kills
        named = sum(line.count("killed by SIGKILL") for line in got["said"])
        assert named == len(kills), got["said"]  # (two at once: one line names both)
        assert f"going on with {got['world']} rank(s)" in got["said"][-1], got["said"]
        assert _same(got, uninterrupted), (kills, got["losses"], uninterrupted["losses"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_a_rank_that_finished_a_pass_meets_the_others_still_in_its_last_call(uninterrupted, shm):
    """A kill at the very end of a pass's last call: a survivor that the last collective's
    message reached has finished the call and is already in the next pass's start check
    (a collective outside the step) while another is still inside the call. The one still
    inside takes the call's result from it, then meets it at that check (was: the two
    regrouped into different collectives, and one timed out after 60 s)."""
    rng = random.Random(7 + int(shm))
    for _ in range(8):  # calls 3 and 7 end passes 1 and 2 (4 calls a pass)
        kills = {rng.randrange(3): (rng.choice([3, 7]), rng.uniform(0.8, 1.0))}
        got = _spawn(kills, shm)
        assert got["world"] == 2, kills
        assert _same(got, uninterrupted), (kills, got["losses"], uninterrupted["losses"])


def test_the_survivors_plan_where_each_is_behind_past_or_too_far_apart():
    """step._survivor.plan, the decision every survivor makes alike from every rank's
    (step, calls finished, inside the step, outside where): checked case by case, since
    a kill lands in each of them only now and then."""
    from pardist.step._survivor import plan

    inside, check = (1, 7, True, None), (1, 8, False, "check")
    assert plan([check, inside]) == (0, {1}, set())  # finished, in the next pass's check
    assert plan([(1, 8, True, None), inside, inside]) == (0, {1, 2}, set())  # in call 8
    assert plan([check, (1, 8, True, None)]) == (None, set(), {0})  # one past the check
    assert plan([check, check]) == (None, set(), set())  # both redo the check
    assert plan([None, None]) == (None, set(), set())  # no step called yet
    for apart in (
        [(1, 9, True, None), inside],  # two calls apart
        [(1, 8, False, "pardist.checkpoint.save"), (1, 8, True, None)],  # past a save
        [(1, 7, False, "check"), (1, 8, True, None)],  # outside, behind
    ):
        with pytest.raises(RuntimeError, match="too far apart"):
            plan(apart)


def _launch(tmp_path: Path, *argv: str, shm: str = "1", timeout: float = 300, restarts=0):
    out = tmp_path / "out.pt"
    cmd = [sys.executable, "-m", "pardist.launch", "--nproc", "3", "--keep-going"]
    cmd += ["--max-restarts", str(restarts)] if restarts else []
    done = subprocess.run(
        [*cmd, str(SCRIPTS / "keep_going.py"), str(out), *argv],
        env={**os.environ, **ENV, "PARDIST_SHM": shm},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done, (torch.load(out, weights_only=False) if out.exists() else None)


@pytest.mark.timeout(400)
def test_the_launcher_goes_on_without_rank_0(uninterrupted, tmp_path):
    # Separate interpreters, each with its own hash seed (as torchrun's), the store in the
    # launcher: the first rank's death leaves a run whose new main rank saves.
    done, got = _launch(tmp_path, "0:5:0.5")
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("pardist.launch --keep-going: finished with 2 of 3 ranks"), last
    assert "lost rank 0 killed by SIGKILL" in last, last
    assert "saved by launch rank 1" in done.stdout, done.stdout
    assert "RankLostWarning: pardist (--keep-going): lost rank(s) [0]" in done.stderr
    assert got["world"] == 2 and _same(got, uninterrupted)


def _checkpoints(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("pardist.run"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_lost_in_a_checkpoint_save_is_saved_again_by_the_survivors(
    uninterrupted, tmp_path, victim
):
    # The signal lands in the save after 4 calls (or, where it has not fired by its end,
    # just before the next call): the survivors save again without the lost rank.
    ckpt = tmp_path / "ckpt"
    plan = f"{victim}:4s:{random.Random(victim).random() / 2}"
    done, got = _launch(tmp_path, plan, "--ckpt", str(ckpt), timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    assert got["world"] == 2 and _same(got, uninterrupted)
    assert _checkpoints(ckpt) == ["10", "2", "4", "6", "8"]  # no half-written one left
    saved = pardist.checkpoint.load(ckpt / "4", dict(calls=0, losses=""))
    assert saved["calls"] == 4 and json.loads(saved["losses"]) == uninterrupted["losses"][:4]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", ["0:2", "2:4", "1:4s"])
def test_a_replacement_joins_at_the_next_save_with_the_state_from_a_peer(
    uninterrupted, tmp_path, plan
):
    # --max-restarts 1 under --keep-going: the launcher starts a replacement at once; the
    # survivors take it in at their next save (every 2 calls) and send it their state.
    # A kill in call 2 lands there or, at the latest, before call 3 (the replacement
    # joins at the save after 4 calls, between two passes); in call 4, at the save after
    # 6 (part-way through a pass); "4s": in the save after 4 calls (or before call 4),
    # which the survivors make again.
    ckpt, victim = tmp_path / "ckpt", int(plan[0])
    plan += f":{random.Random(plan).random() / 2}"
    done, got = _launch(tmp_path, plan, "--ckpt", str(ckpt), restarts=1, timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    said = f"lost rank {victim} killed by SIGKILL (replaced by launch rank 3, which joined)"
    assert said in done.stderr
    joined = re.findall(r"joined the run at step (\d+) \(the state from rank 0\)", done.stdout)
    assert joined == (["6"] if plan.startswith("2:4") else ["4"]) or plan[2:4] == "4s", joined
    assert got["world"] == 3 and got["shrunk"] in ([], [2], [3], [4], [5])
    assert _same(got, uninterrupted)
    for rank in range(3):  # every rank, the replacement's too, ends with the same bits
        assert _same(torch.load(tmp_path / f"out.pt.{rank}", weights_only=False), uninterrupted)
    assert _checkpoints(ckpt) == ["10", "2", "4", "6", "8"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shm, plan", [("1", "2:4"), ("0", "0:3")], ids=["shared-memory", "gloo"])
def test_a_replacement_joins_at_the_next_step_boundary_it_is_ready_for(
    uninterrupted, tmp_path, shm, plan
):
    # No checkpoint at all: pardist.checkpoint.offer after every call. The replacement
    # joins at the first offer after its pardist.init signed in: the one after the call
    # redone over the survivors (where it was quick to start) or the next, where the
    # script waits for it (the event); part-way through a pass, a kill of rank 0 on gloo.
    victim = int(plan[0])
    plan += f":{random.Random(plan).random() / 2}"
    done, got = _launch(tmp_path, plan, "--offer", shm=shm, restarts=1, timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    said = f"lost rank {victim} killed by SIGKILL (replaced by launch rank 3, which joined)"
    assert said in done.stderr
    assert len(got["shrunk"]) == 1, got["shrunk"]
    joined = re.findall(r"joined the run at step (\d+) \(the state from rank 0\)", done.stdout)
    assert joined in ([str(got["shrunk"][0] + 1)], [str(got["shrunk"][0] + 2)]), joined
    assert got["world"] == 3 and _same(got, uninterrupted)
    for rank in range(3):  # every rank, the replacement's too, ends with the same bits
        assert _same(torch.load(tmp_path / f"out.pt.{rank}", weights_only=False), uninterrupted)


def test_offer_looks_at_nothing_without_replacements_and_refuses_code(monkeypatch):
    from pardist.checkpoint import _resume
    from pardist.runtime import _rejoin, _survive

    code = {"step": 1, "where": Path("runs")}  # a leaf that only code rebuilds
    monkeypatch.setitem(_resume._looked, "at", False)
    pardist.checkpoint.offer(code, step=1)  # not under --keep-going --max-restarts
    monkeypatch.setenv(_survive.ENV, "1")
    pardist.checkpoint.offer(code, step=1)  # --keep-going without replacements
    monkeypatch.setenv(_rejoin.BUDGET, "1")
    with pytest.raises(TypeError, match=r"pardist.checkpoint.offer: tree\['where'\] is a \w*Path"):
        pardist.checkpoint.offer(code, step=1)
    assert code == {"step": 1, "where": Path("runs")}  # (nothing of it was touched)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_a_stopped_rank_is_fenced_off_and_the_others_go_on(uninterrupted, tmp_path, shm):
    done, got = _launch(tmp_path, "1:6:0.3", "--stop", shm=shm)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "lost rank 1 stopped (SIGSTOP) for 3 s, then killed by the launcher" in last, last
    assert got["world"] == 2 and _same(got, uninterrupted)


@pytest.mark.timeout(300)
def test_without_keep_going_a_lost_rank_still_stops_the_run(tmp_path):
    cmd = [sys.executable, "-m", "pardist.launch", "--nproc", "2"]
    done = subprocess.run(
        [*cmd, str(SCRIPTS / "keep_going.py"), str(tmp_path / "out.pt"), "1:3:0.5"],
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode != 0
    assert "rank 1 (local rank 1" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out.pt").exists()


def _hand_made_shards():
    me = int(os.environ["RANK"])

    @pardist.data_parallel(deterministic=6)
    def step(w, batch):
        return w - 0.1 * pardist.grad(lambda w, b: (b @ w).square().mean())(w, batch)

    w = torch.ones(3, dtype=torch.float64)
    for call in range(4):
        if me == 2 and call == 2:
            os.kill(os.getpid(), 9)
        rows = torch.arange(6 * 3, dtype=torch.float64).view(6, 3)
        w = step(w, rows[2 * me : 2 * me + 2])
    return w


@pytest.mark.timeout(300)
def test_a_batch_that_no_loader_made_is_a_clear_error():
    with pytest.raises(pardist.SpawnError, match="did not come from a pardist.data.shard"):
        pardist.spawn(_hand_made_shards, 3, env=ENV, timeout=200, keep_going=True)


@pytest.mark.timeout(300)
def test_the_launcher_refuses_keep_going_across_machines():
    cmd = [sys.executable, "-m", "pardist.launch", "--nnodes", "2", "--keep-going", "x.py"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--keep-going runs on one machine" in done.stderr


def _sharded_state(which: str):
    params = {"w": torch.ones(6)}
    if which == "zero":
        pardist.optim.sharded(pardist.optim.adamw(0.1))
    else:
        pardist.fsdp(params)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", ["zero", "fsdp"])
def test_sharded_state_is_refused_at_once_under_keep_going(which):
    # A lost rank's shards would be gone with it: said when the state is made, not at a loss.
    with pytest.raises(pardist.SpawnError, match="--keep-going needs replicated state"):
        pardist.spawn(_sharded_state, 2, which, env=ENV, timeout=200, keep_going=True)
    pardist.spawn(_sharded_state, 2, which, env=ENV, timeout=200)  # without: as before


@pytest.mark.timeout(600)
@pytest.mark.parametrize("victim, compiled", [(0, False), (2, False)])
def test_the_default_mode_equals_a_run_at_the_survivors_size_from_that_step(victim, compiled):
    # Killed a tenth into call 5: the survivors redo call 5 at 2 ranks, or, where the
    # victim had already given all it had to call 5, call 6. The reference: that many
    # calls at 3 ranks, then a new 2-rank run resumed from there (its loader's position
    # and random streams restored). Survivors 0, 1 or 1, 2 are ranks 0 and 1 of the new
    # group, as in the reference; the same world size, the same kernels and the same
    # reduction order give the same bits, so torch.equal is the bound.
    # Compiled: the step is compiled again once for the survivors' size (dynamo reset);
    # compared with the eager runs (a compiled step has the eager step's numbers).
    got = _spawn({victim: (5, 0.1)}, "1", groups=None, compile=compiled)
    assert got["world"] == 2 and got["shrunk"] in ([5], [6]), got["shrunk"]
    head = _spawn({}, "1", keep=False, groups=None, until=got["shrunk"][0])
    tail = _spawn({}, "1", keep=False, world=2, groups=None, start=head)
    want = dict(tail, losses=head["losses"] + tail["losses"])
    if not compiled:
        assert _same(got, want), (got["losses"], want["losses"])
        return
    # Inductor reassociates float64 sums: a few ulps (2.2e-16 each) a step, which 12 AdamW
    # steps at lr 1e-2 keep far below 1e-9; a wrong row, mask or step moves them by 1e-3.
    assert not [w for w in got["warned"] if "compile=True" in w], got["warned"]  # no fallback
    close = functools.partial(torch.allclose, rtol=1e-9, atol=1e-12)
    leaves = zip(tree_leaves(got["params"]), tree_leaves(want["params"]), strict=True)
    assert all(close(a, b) for a, b in leaves)
    assert close(torch.tensor(got["losses"]), torch.tensor(want["losses"]))
    assert close(got["preds"], want["preds"])
