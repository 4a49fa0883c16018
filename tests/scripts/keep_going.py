"""A small training run that loses ranks on request, for ``--keep-going``'s tests.

    python -m pardist.launch --nproc 3 --keep-going keep_going.py OUT [PLAN] [--stop]
    python -m pardist.launch --nproc 3 --keep-going --max-restarts 1 keep_going.py \
        OUT PLAN --ckpt DIR | --offer

PLAN is ``rank:step:fraction,...`` (a step ``4s``: the save after 4 calls, with
``--ckpt``): that launch rank kills itself (SIGKILL, or stops
itself with ``--stop``) after ``fraction`` of a call's time (the median of its calls so
far) into call ``step`` of the step: a timer thread, so the signal lands anywhere in the
call (forward, backward, the gradient reduction, the optimizer), or, where the thread
has not fired by then, at the start of the next call (a step of 10 or less is always
inside the run). The run is ``deterministic=12`` in float64 with dropout, fed
by ``pardist.data.shard(split_batches=True)``, then evaluated through a sharded loader
and ``pardist.gather``; the new main rank saves the parameters, the optimizer state, the
losses, the predictions, the number of steps and the world size at the end to OUT.
With ``--ckpt DIR`` it resumes from DIR and saves there every 2 calls (a replacement
started by ``--max-restarts`` joins at such a save), and every rank saves its own
result to OUT.<rank>. With ``--offer`` (and no ``--ckpt``) it saves nothing and calls
``pardist.checkpoint.offer`` after every call instead: a replacement joins at the first
one after it is ready, and at the second call after the loss the ranks wait until it is
(the test's event), so that it joins there at the latest.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

import pardist

EPOCHS, ROWS, BATCH = 3, 96, 24  # 4 steps an epoch, 12 in all


def plan(text: str) -> dict[int, tuple]:
    out = {}
    for item in filter(None, text.split(",")):
        rank, step, delay = item.split(":")
        save = step.endswith("s")  # "4s": in the checkpoint save after 4 calls (--ckpt)
        out[int(rank)] = (int(step.removesuffix("s")), float(delay), *(("save",) if save else ()))
    return out


def train(kills: dict, stop: bool = False, **kw) -> dict:
    """The run; ``kills`` maps a launch rank to (call, fraction). Its result holds the
    RankLostWarnings seen (``said``), which are also shown as usual. ``groups``: the
    deterministic mode's G (None: the default mode); ``until``: stop after that many
    calls (the result then holds what a resumed run needs); ``start``: such a result;
    ``compile``: data_parallel's."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = _train(kills, stop, **kw)
    for w in seen:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    lost = [str(w.message) for w in seen if issubclass(w.category, pardist.RankLostWarning)]
    return dict(out, said=lost, warned=[str(w.message) for w in seen])


def _saved(params, state, data, calls: int, losses: list) -> dict:
    """What a checkpoint keeps (``--ckpt``): all that the loop needs to go on."""
    losses, rng = json.dumps(losses), pardist.rng_count()
    return dict(params=params, state=state, data=data, calls=calls, losses=losses, rng=rng)


def _until_ready() -> None:
    """Wait until the replacements on their way have signed in (the launcher's store)."""
    from pardist.runtime import _rejoin, _survive

    store, expected = _survive.state()["store"], _survive.state()["expected"]
    while not all(store.check([_rejoin.ready_key(i)]) for i in expected):
        time.sleep(0.02)


def _train(
    kills: dict, stop: bool, groups=12, until=None, start=None, compile=False, ckpt=None,
    offer=False,
) -> dict:  # fmt: skip
    me = int(os.environ.get("RANK", "0"))
    pardist.seed_everything(0)
    x = torch.randn(ROWS, 5, dtype=torch.float64)
    y = torch.randn(ROWS, 1, dtype=torch.float64)
    data = pardist.data.shard(
        DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True), split_batches=True
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 32), torch.nn.Tanh(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    ).double()
    apply, params, buffers = pardist.functional(model)
    opt = pardist.optim.adamw(1e-2)
    state = opt.init(params)

    def loss_fn(p, b, x, y):
        out, _ = apply(p, b, x)
        return ((out - y) ** 2).mean()

    @pardist.data_parallel(deterministic=groups, compile=compile)
    def step(p, s, batch):
        loss, g = pardist.value_and_grad(loss_fn)(p, buffers, *batch)
        p, s = opt.update(g, s, p)
        return p, s, loss

    calls, losses, took, timer, shrunk, saves = 0, [], [], None, [], []
    if start is not None:  # a run resumed at another world size
        params, state, calls, losses = start["params"], start["state"], start["calls"], []
        data.set_epoch(calls // len(data))
        data.load_state_dict(start["data"])
        pardist.set_rng_count(start["rng"])
    if ckpt is not None or offer:  # a replacement (--max-restarts) joins at a save or offer
        saved = pardist.checkpoint.resume(ckpt, _saved(params, state, data, 0, []))
        params, state, calls = saved["params"], saved["state"], saved["calls"]
        losses = json.loads(saved["losses"])
        pardist.set_rng_count(saved["rng"])
    sig = signal.SIGSTOP if stop else signal.SIGKILL
    for epoch in range(calls // len(data), EPOCHS):
        data.set_epoch(epoch)
        for batch in data:
            if timer is not None and timer.is_alive() and timer.cancel() is None:
                os.kill(os.getpid(), sig)  # not fired within its call: now, between calls
            if me in kills and calls == kills[me][0] and len(kills[me]) == 2:
                call_s = statistics.median(took[1:]) if len(took) > 1 else 0.005
                timer = threading.Timer(kills[me][1] * call_s, os.kill, (os.getpid(), sig))
                timer.start()
            start = time.perf_counter()
            world = pardist.world_size()
            params, state, loss = step(params, state, batch)
            took.append(time.perf_counter() - start)
            if pardist.world_size() != world:
                shrunk.append(calls)  # this call was redone over the survivors
            losses.append(loss.item())
            calls += 1
            if ckpt is not None and calls % 2 == 0 and calls < EPOCHS * len(data):
                kept, started = _saved(params, state, data, calls, losses), time.perf_counter()
                if me in kills and (calls, "save") == kills[me][::2]:  # into this save
                    save_s = statistics.median(saves) if saves else 0.05
                    timer = threading.Timer(kills[me][1] * save_s, os.kill, (os.getpid(), sig))
                    timer.start()
                pardist.checkpoint.save(ckpt, kept, step=calls)
                saves.append(time.perf_counter() - started)
            if offer and calls < EPOCHS * len(data):
                if shrunk and calls == shrunk[0] + 2:
                    _until_ready()
                pardist.checkpoint.offer(_saved(params, state, data, calls, losses), step=calls)
            if calls == until:
                saved = dict(data=data.state_dict(), rng=pardist.rng_count())
                return dict(params=params, state=state, calls=calls, losses=losses, **saved)
    # Evaluation after a loss: a loader of the whole set (not split), gathered in order.
    valid = pardist.data.shard(DataLoader(TensorDataset(x), batch_size=10))
    preds = torch.cat([apply(params, buffers, xb, train=False)[0] for (xb,) in valid])
    preds = pardist.gather(preds, total=ROWS)
    world = pardist.world_size()
    return dict(
        params=params, state=state, calls=calls, world=world, losses=losses, shrunk=shrunk,
        preds=preds,
    )  # fmt: skip


if __name__ == "__main__":
    pardist.init()
    ckpt = sys.argv[sys.argv.index("--ckpt") + 1] if "--ckpt" in sys.argv else None
    offer = "--offer" in sys.argv
    args = [a for a in sys.argv[1:] if a not in ("--stop", "--ckpt", ckpt, "--offer")]
    kills = plan(args[1] if len(args) > 1 else "")
    out = train(kills, stop="--stop" in sys.argv, ckpt=ckpt, offer=offer)
    if pardist.is_main():
        torch.save(out, args[0])
        print(f"saved by launch rank {os.environ.get('RANK', '0')}", flush=True)
    if ckpt is not None or offer:  # every rank's own result, a replacement's included
        torch.save(out, f"{args[0]}.{pardist.rank()}")
    pardist.shutdown()
