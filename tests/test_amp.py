"""Mixed precision: bf16 autocast in a step, fp16 loss scaling with one verdict on all ranks."""

from __future__ import annotations

import helpers
import torch
import torch.nn.functional as F

import pardist


def test_loss_scale_follows_grad_scaler_rule():
    scaler = pardist.amp.dynamic_loss_scale(init_scale=1024.0, growth_interval=2)
    state = scaler.init()
    scales = []
    for finite in [True, True, False, True, False, True, True, True]:
        state = scaler.adjust(state, finite)
        scales.append(float(state.scale))
    assert scales == [1024, 2048, 1024, 1024, 512, 512, 1024, 1024]
    grads, finite = scaler.unscale({"w": torch.tensor([1024.0, -2048.0])}, scaler.init())
    assert finite and grads["w"].tolist() == [1.0, -2.0]
    _, finite = scaler.unscale({"w": torch.tensor([float("nan")])}, scaler.init())
    assert not finite


def test_a_disabled_loss_scale_changes_nothing():
    scaler = pardist.amp.dynamic_loss_scale(enabled=False)
    state = scaler.init()
    loss, grads = torch.tensor(3.0), {"w": torch.tensor([float("inf"), 2.0])}
    assert scaler.scale(loss, state) is loss
    assert scaler.unscale(grads, state) == (grads, True)  # as GradScaler(enabled=False) steps
    assert scaler.adjust(state, False) is state and float(state.scale) == 1.0


def _fp16_training(poison_step: int):
    apply, params, _ = pardist.functional(helpers.mlp())
    opt = pardist.optim.sgd(0.1, momentum=0.9)
    scaler = pardist.amp.dynamic_loss_scale(init_scale=2.0**10)

    def loss_fn(p, x, y):
        with pardist.amp.autocast("fp16"):
            logits = apply(p, {}, x)[0]
        return F.cross_entropy(logits.float(), y)

    @pardist.data_parallel()
    def step(params, opt_state, ls, batch):
        grads = pardist.grad(lambda p, b: scaler.scale(loss_fn(p, *b), ls))(params, batch)
        grads, finite = scaler.unscale(grads, ls)
        if finite:
            params, opt_state = opt.update(grads, opt_state, params)
        return params, opt_state, scaler.adjust(ls, finite)

    state, ls = opt.init(params), scaler.init()
    r, history = pardist.rank(), []
    for s in range(4):
        x, y = helpers.global_batch(s, "mlp")
        x, y = helpers.shard(x, r, 2), helpers.shard(y, r, 2)
        if s == poison_step and r == 1:
            x = x.clone()
            x[0, 0] = float("inf")  # only rank 1 sees the overflow
        params, state, ls = step(params, state, ls, (x, y))
        history.append((float(ls.scale), int(state.count)))
    return history, params


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(run):
    results = run(2, _fp16_training, 2)
    (h0, p0), (h1, p1) = results
    assert h0 == h1 == [(1024.0, 1), (1024.0, 2), (512.0, 2), (512.0, 3)]
    assert all(torch.equal(p0[k], p1[k]) for k in p0)


def _local_verdict():
    # Gradients that were never reduced (torch.func.grad): only rank 1's overflow.
    scaler = pardist.amp.dynamic_loss_scale()
    bad = float("inf") if pardist.rank() == 1 else 1.0
    step = pardist.data_parallel(
        lambda g, b: scaler.unscale(g, scaler.init())[1],
        in_specs=(pardist.P("gpu"), pardist.P("gpu")),
    )
    return step({"w": torch.tensor([bad])}, torch.ones(1))


def test_the_verdict_is_agreed_even_for_unreduced_gradients(run):
    assert run(2, _local_verdict) == [False, False]


def _bf16(autocast: bool):
    """The step's gradients with and without bf16 autocast, and torch's own on each rank's
    rows, computed here (the same kernels on the same shapes in the same process)."""
    apply, params, _ = pardist.functional(helpers.mlp())
    x, y = helpers.global_batch(0, "mlp")
    shards = [(helpers.shard(x, r, 2), helpers.shard(y, r, 2)) for r in range(2)]

    def loss_fn(p, x, y):
        with pardist.amp.autocast("bf16" if autocast else "fp32"):
            return F.cross_entropy(apply(p, {}, x)[0].float(), y)

    step = pardist.data_parallel(lambda p, batch: pardist.grad(loss_fn)(p, *batch))
    grads = step(params, shards[pardist.rank()])
    model, theirs = helpers.mlp(), []
    for xs, ys in shards:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(xs).float(), ys)
        loss.backward()
        theirs.append({k: p.grad.clone() for k, p in model.named_parameters()})
    return grads, theirs


def test_bf16_autocast_in_a_step_gives_torchs_autocast_gradients_in_fp32(run):
    full = run(2, _bf16, False)
    for (grads, theirs), (fp32, _) in zip(run(2, _bf16, True), full):
        for k in grads:
            assert grads[k].dtype == torch.float32  # fp32 master weights and gradients
            assert not torch.equal(grads[k], fp32[k])  # bf16 arithmetic ran
            # No tolerance for bf16 is needed: each rank's gradient is torch's autocast
            # gradient on its rows (the same kernels on the same inputs, here in this
            # process), and their mean is rounded once in float32: 2^-24 of it at most.
            want = (theirs[0][k] + theirs[1][k]) / 2
            err = (grads[k] - want).abs()
            assert (err <= 2**-24 * want.abs()).all(), (k, float(err.max()))
