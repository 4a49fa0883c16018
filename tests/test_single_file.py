"""Single-file checkpoints: every pardist state through ``torch.save`` and
``torch.load(weights_only=True)`` (torch's default since 2.6), with no private API.

A DDP script saves one file on rank 0 and every rank loads it. Here a run at 2 ranks
saves its params, a chained optimizer's state (clipping, parameter groups, AdamW and
SGD), the loss scale and the loader's position part-way through an epoch; the file is
loaded at 3 ranks and at 1, and training ends as one process that never stopped (float64,
compared within float64 rounding: ``numerics``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, TensorDataset

import pardist
from pardist import optim

STEPS = 8  # 2 epochs of 4 global batches of 12 rows


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    apply, params, _ = pardist.functional(model)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 4, generator=g, dtype=torch.float64), torch.arange(48) % 3)
    loader = pardist.data.shard(
        DataLoader(data, batch_size=12, shuffle=True), split_batches=True, device=None
    )
    groups = {
        "w": optim.adamw(optim.warmup_cosine(0.05, 2, STEPS)),
        "b": optim.sgd(0.1, momentum=0.9),
    }
    opt = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.multi_transform(groups, lambda path, p: "w" if p.ndim > 1 else "b"),
    )
    scaler = pardist.amp.dynamic_loss_scale(init_scale=2.0**4, growth_interval=3)

    @pardist.data_parallel(donate_argnums=(0, 1))
    def step(params, opt_state, scale, batch):
        def loss(p, x, y):
            return scaler.scale(F.cross_entropy(apply(p, {}, x)[0], y), scale)

        grads = pardist.grad(loss)(params, *batch)
        grads, finite = scaler.unscale(grads, scale)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, opt_state, scaler.adjust(scale, finite)

    return params, opt.init(params), scaler.init(), loader, step


def _train(load: str | None, save: str | None, stop: int | None):
    params, opt_state, scale, loader, step = _setup()
    done = 0
    if load is not None:  # every rank reads rank 0's file
        saved = torch.load(load, weights_only=True)
        params, opt_state, scale = saved["params"], saved["opt_state"], saved["scale"]
        loader.load_state_dict(saved["loader"])
        done = saved["step"]
    for epoch in range(done // len(loader), STEPS // len(loader)):
        loader.set_epoch(epoch)
        for batch in loader:
            params, opt_state, scale = step(params, opt_state, scale, batch)
            done += 1
            if done == stop:
                if pardist.rank() == 0:
                    state = dict(params=params, opt_state=opt_state, scale=scale, step=done)
                    torch.save({**state, "loader": loader.state_dict()}, save)
                return None
    return params, opt_state, scale


@pytest.mark.parametrize("stop, resume_at", [(6, 3), (3, 1)])
def test_saved_on_rank0_at_two_ranks_loaded_at_another_world_size(run, tmp_path, stop, resume_at):
    path = str(tmp_path / "ckpt.pt")
    run(2, _train, None, path, stop)
    finals = run(resume_at, _train, path, None, None)
    [(want_params, want_state, want_scale)] = run(1, _train, None, None, None)  # never stopped
    for params, opt_state, scale in finals:
        assert_close64(params, want_params, f"resumed at {resume_at} ranks")
        assert (
            type(opt_state[1]["w"]) is optim.AdamWState and type(scale).__name__ == "LossScaleState"
        )
        assert_close64(opt_state, want_state, "optimizer state")
        assert all(map(torch.equal, scale, want_scale))  # powers of two: exact


def test_every_state_loads_with_weights_only(tmp_path):
    params = {"w": torch.ones(2, 2), "b": torch.zeros(2)}
    groups = {"a": optim.adam(0.1, amsgrad=True), "s": optim.sgd(0.1)}
    states = {
        "chain": optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(0.1)).init(params),
        "groups": optim.multi_transform(groups, lambda path, p: "a" if p.ndim > 1 else "s").init(
            params
        ),
        "masked": optim.masked(optim.sgd(0.1, momentum=0.9), {"w": True, "b": False}).init(params),
        "scale": pardist.amp.dynamic_loss_scale().init(),
        "loader": pardist.data.shard(DataLoader(list(range(10)), batch_size=2)).state_dict(),
        "diloco": pardist.diloco(lambda p, s, x: (p, s, x), every=2).init(params, ()),
        "rng": pardist.rng_count(),
    }
    path = tmp_path / "all.pt"
    torch.save(states, path)
    back = torch.load(path, weights_only=True)
    assert {k: type(v) for k, v in back.items()} == {k: type(v) for k, v in states.items()}
    assert type(back["diloco"]).__name__ == "DiLoCoState"
    flat, spec = tree_flatten(back)
    want, want_spec = tree_flatten(states)
    assert spec == want_spec  # every NamedTuple, dict and None where it was
    for a, b in zip(flat, want):
        assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b
