"""Gradient accumulation inside a step: the step's batch split, BN buffers carried, one reduction.

The reference is plain torch in one process: a gradient-accumulation loop over the
same global micro-batches (micro-batch j of the global batch is every rank's j-th
slice), with `loss / k` backpropagated k times, as a torch user writes it.
"""

from __future__ import annotations

import helpers
import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64

import pardist
from pardist import P

F64 = torch.float64  # both sides compute in float64, compared up to its rounding (numerics.py)
TRANSPORTS = [pytest.param({}, id="shm"), pytest.param({"PARDIST_SHM": "0"}, id="gloo")]
RANKS, ROWS, K, STEPS = 2, 8, 4, 2  # per-rank rows; micro-batches of 2 rows per rank


def _shards(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = helpers.global_batch(step, "convnet", RANKS * ROWS, dtype=F64)
    return list(zip(x.chunk(RANKS), y.chunk(RANKS)))


def _pardist_accumulating(k: int):
    apply, params, buffers = pardist.functional(helpers.convnet().double())  # sync batch norm
    opt = pardist.optim.sgd(0.1, momentum=0.9)

    def loss_fn(params, buffers, x, y):  # the README's loss: two batch arguments, BN buffers
        logits, buffers = apply(params, buffers, x)
        return F.cross_entropy(logits, y), buffers

    @pardist.data_parallel(donate_argnums=(0, 2))
    def step(params, buffers, opt_state, batch):
        (loss, buffers), grads = pardist.value_and_grad(
            loss_fn, has_aux=True, accumulate=k, carry=1
        )(params, buffers, *batch)
        kept = {name: g.clone() for name, g in grads.items()}
        params, opt_state = opt.update(grads, opt_state, params)
        return params, buffers, opt_state, loss, kept

    state, losses = opt.init(params), []
    for s in range(STEPS):
        params, buffers, state, loss, grads = step(
            params, buffers, state, _shards(s)[pardist.rank()]
        )
        losses.append(float(loss))
    return params, buffers, losses, grads


def _torch_accumulating(k: int):
    """One process, plain torch: k backward passes of loss / k, then one optimizer step."""
    model = helpers.convnet().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for s in range(STEPS):
        shards = _shards(s)
        opt.zero_grad()
        total = 0.0
        for j in range(k):
            x = torch.cat([sx.chunk(k)[j] for sx, _ in shards])
            y = torch.cat([sy.chunk(k)[j] for _, sy in shards])
            loss = F.cross_entropy(model(x), y) / k
            loss.backward()
            total += loss.item()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(total)
    return dict(model.named_parameters()), dict(model.named_buffers()), losses, grads


@pytest.mark.parametrize("env", TRANSPORTS)
def test_accumulation_with_batch_norm_and_two_batch_arguments_equals_one_torch_process(run, env):
    params1, buffers1, losses1, grads1 = _torch_accumulating(K)
    results = run(RANKS, _pardist_accumulating, K, env=env)
    for params, buffers, losses, grads in results:
        assert_close64(grads, grads1, "gradients")
        assert_close64(params, {k: v.detach() for k, v in params1.items()}, "parameters")
        # carried micro-batch to micro-batch: k updates per step
        assert_close64(buffers, buffers1, "buffers")
        assert_close64(losses, losses1, "losses")
    for name in results[0][0]:  # replicas bit-identical
        assert torch.equal(results[0][0][name], results[1][0][name])


def _count_reductions(k: int):
    """Spy on the reducer (the real one runs): when each bucket's reduction starts."""
    from pardist.transport._reducer import Reducer

    torch.manual_seed(0)
    wide = torch.nn.Sequential(  # over the 1 MiB first bucket, then small ones
        torch.nn.Linear(8, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Linear(512, 4)
    )
    apply, params, _ = pardist.functional(wide)
    forwards, launches, original = [0], [], Reducer._launch

    def spy(self, bucket):
        launches.append((forwards[0], len(self.buckets)))
        return original(self, bucket)

    def loss_fn(params, x, y):
        forwards[0] += 1
        return F.cross_entropy(apply(params, {}, x)[0], y)

    # Tiny buckets, so that a per-micro-batch reduction would show in the count.
    step = pardist.data_parallel(
        lambda p, b: pardist.grad(loss_fn, accumulate=k)(p, *b), bucket_mb=2e-4
    )
    x, y = helpers.global_batch(0, "mlp", 16)
    r = pardist.rank()
    Reducer._launch = spy
    try:
        for _ in range(2):
            forwards[0] = 0
            step(params, (x.chunk(2)[r], y.chunk(2)[r]))
    finally:
        Reducer._launch = original
    return launches


@pytest.mark.parametrize("env", TRANSPORTS)
def test_one_reduction_per_step_not_per_micro_batch(run, env):
    for launches in run(2, _count_reductions, 4, env=env):
        buckets = launches[0][1]
        assert buckets > 2  # the test would prove little with one bucket
        assert len(launches) == 2 * buckets  # two steps, each bucket reduced once
        # and only once every micro-batch has added its gradients
        assert all(forwards == 4 for forwards, _ in launches), launches


def loss3(params, t, x, y):
    h = torch.tanh(x @ params["w1"] + t) @ params["w2"]
    return F.cross_entropy(h, y)


W_SHAPES = {"w1": (8, 5), "w2": (5, 4)}


def _data(n=24):
    g = torch.Generator().manual_seed(3)
    params = {k: torch.randn(*shape, generator=g, dtype=F64) for k, shape in W_SHAPES.items()}
    x, y = torch.randn(n, 8, generator=g, dtype=F64), torch.randint(0, 4, (n,), generator=g)
    t = torch.randn(2, 1, 5, generator=g, dtype=F64)  # one per rank
    return params, t, x, y


def _sharded_input_gradients(k: int):
    params, t, x, y = _data()
    r = pardist.rank()
    mine = x.chunk(2)[r], y.chunk(2)[r]
    # x is split into micro-batches (it is the step's batch): its gradient is joined.
    split = pardist.data_parallel(
        lambda p, t, b: pardist.grad(loss3, argnums=(0, 2), accumulate=k)(p, t, *b),
        out_specs=(P(), P("gpu")),
    )
    # t is sharded too (one row per rank), but left whole (batch_argnums): its
    # gradient is summed over the micro-batches.
    whole = pardist.data_parallel(
        lambda p, t, b: pardist.grad(loss3, argnums=(0, 1), accumulate=k, batch_argnums=(2, 3))(
            p, t, *b
        ),
        in_specs=(P(), P("gpu"), P("gpu")),
        out_specs=(P(), P("gpu")),
    )
    return split(params, t[0], mine), whole(params, t[r], mine)


@pytest.mark.parametrize("env", TRANSPORTS)
def test_gradients_of_sharded_inputs_under_accumulation_are_the_global_ones(run, env):
    params, t, x, y = _data()
    rows = [(x.chunk(2)[r], y.chunk(2)[r]) for r in range(2)]

    def global_loss(p, ts, xs):  # the mean of the two ranks' losses
        return (loss3(p, ts[0], xs[0], rows[0][1]) + loss3(p, ts[1], xs[1], rows[1][1])) / 2

    xs = [x_r for x_r, _ in rows]
    gp1, gxs = torch.func.grad(global_loss, argnums=(0, 2))(params, [t[0], t[0]], xs)
    gp2_1, gts = torch.func.grad(global_loss, argnums=(0, 1))(params, [t[0], t[1]], xs)
    for r, ((gp, gx), (gp2, gt)) in enumerate(run(2, _sharded_input_gradients, 3, env=env)):
        # Every argument's gradient is that of the global loss: a sharded input's is its
        # rows' (the micro-batches' joined), a per-rank one's its own; as one process's.
        assert_close64(gx, gxs[r], "x")
        assert_close64(gt, gts[r], "t")
        assert_close64(gp, gp1, "params, x split")
        assert_close64(gp2, gp2_1, "params, t whole")


def _errors():
    apply, params, buffers = pardist.functional(helpers.convnet())
    x, y = helpers.global_batch(pardist.rank(), "convnet", 6)

    def loss_fn(params, buffers, x, y):
        logits, buffers = apply(params, buffers, x)
        return F.cross_entropy(logits, y), buffers

    messages = []

    def attempt(step, *args):
        try:
            step(*args)
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append("no error")

    def make(**options):
        return pardist.data_parallel(
            lambda p, b, batch: pardist.value_and_grad(loss_fn, has_aux=True, **options)(
                p, b, *batch
            )
        )

    attempt(make(accumulate=2), params, buffers, (x, y))  # carry unsaid
    attempt(make(accumulate=4, carry=1), params, buffers, (x, y))  # 6 rows, k=4
    attempt(make(accumulate=2, carry=0), params, buffers, (x, y))  # carry names params
    moved = pardist.data_parallel(  # the batch transformed inside the step
        lambda p, b, batch: pardist.value_and_grad(loss_fn, has_aux=True, accumulate=2, carry=1)(
            p, b, batch[0] * 2, batch[1]
        )
    )
    attempt(moved, params, buffers, (x, y))
    return messages


def test_accumulation_errors_name_the_argument_and_the_fix(run):
    for messages in run(2, _errors):
        unsaid, indivisible, wrong_carry, moved = messages
        assert "aux has the tree, shapes and dtypes of args[1]" in unsaid
        assert "pass carry=1" in unsaid and "carry=None" in unsaid
        assert "accumulate=4 cannot split args[2] of shape (6, 1, 8, 8)" in indivisible
        assert "dim 0 has 6 rows, not a multiple of 4" in indivisible
        assert "divisible by 4 (e.g. 8)" in indivisible
        assert "carry=0 names args[0], which is differentiated" in wrong_carry
        assert "args[2] (shape (6, 1, 8, 8)) was computed inside the step" in moved
        assert "batch_argnums=(2, 3)" in moved


def test_accumulation_outside_a_step_needs_the_batch_named():
    params, t, x, y = _data()
    with pytest.raises(ValueError, match=r"cannot tell which of args\[1, 2, 3\].*batch_argnums"):
        pardist.grad(loss3, accumulate=2)(params, t[0], x, y)
    got = pardist.grad(loss3, accumulate=2, batch_argnums=(2, 3))(params, t[0], x, y)
    assert_close64(got, torch.func.grad(loss3)(params, t[0], x, y), "gradients")
