"""The deterministic mode: the same bits at world size 1, 2, 3 and 4.

``data_parallel(step, deterministic=12)`` on an MLP with dropout, a conv net with
batch norm and a small transformer, trained for a few steps with SGD-momentum
and with AdamW, on both transports: the parameters, optimizer state, buffers
and losses are ``torch.equal`` at every world size, and every rank holds the
same bits. Bad input (a G the world size does not divide, a batch G does not
divide, unequal shards) is an error naming the numbers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64
from torch import nn

import pardist

G = 12
TRANSPORTS = {"shm": None, "gloo": {"PARDIST_SHM": "0"}}


class Tiny(nn.Module):
    """A one-block transformer classifier over token ids, with dropout."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.block(self.embed(x)).mean(1))


def model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.25), nn.Linear(32, 32), nn.Tanh(),
            nn.Linear(32, 5),
        )  # fmt: skip
    if kind == "bn":
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5), nn.BatchNorm1d(5),
        )  # fmt: skip
    if kind == "odd":  # numels 130, 13, 91, 7, 35, 5: no shard a multiple of a vector width
        return nn.Sequential(nn.Linear(10, 13), nn.Tanh(), nn.Linear(13, 7), nn.Tanh(),
                             nn.Linear(7, 5))  # fmt: skip
    if kind == "wide":  # 69,893 parameters: sums split over the ranks (collectives._fold)
        return nn.Sequential(nn.Linear(10, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 5))  # fmt: skip
    return Tiny()


def batches(kind: str, steps: int, rows: int = 24, dtype=torch.float32) -> list:
    g = torch.Generator().manual_seed(1)
    if kind in ("mlp", "wide", "odd"):
        xs = [torch.randn(rows, 10, generator=g, dtype=dtype) for _ in range(steps)]
    elif kind == "bn":
        xs = [torch.randn(rows, 3, 8, 8, generator=g, dtype=dtype) * 2 + 0.5 for _ in range(steps)]
    else:
        xs = [torch.randint(0, 40, (rows, 6), generator=g) for _ in range(steps)]
    return [(x, torch.randint(0, 5, (rows,), generator=g)) for x in xs]


def train(
    kind: str,
    optimizer: str,
    steps: int = 3,
    groups: int = G,
    dtype=torch.float32,
    fsdp=False,
    zero=False,
):
    """On every rank: ``steps`` deterministic steps on this rank's slice of each batch
    (with ``fsdp``, on ``pardist.fsdp`` shards; with ``zero``, the optimizer's state
    sharded by ``optim.sharded``: either returned whole)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels at every world size
    try:
        pardist.seed_everything(0)
        pardist.set_rng_count(0)  # a fresh run (these worker processes ran other tests)
        apply, params, buffers = pardist.functional(model(kind).to(dtype))
        params = pardist.fsdp(params) if fsdp else params
        opt = (
            pardist.optim.sgd(0.05, momentum=0.9)
            if optimizer == "sgd"
            else pardist.optim.adamw(3e-3, weight_decay=0.01)
        )
        opt = pardist.optim.sharded(opt) if zero else opt
        opt_state = opt.init(params)

        def loss_fn(p, b, x, y):
            out, b = apply(p, b, x)
            return F.cross_entropy(out, y), b

        @pardist.data_parallel(deterministic=groups)
        def step(p, b, s, batch):
            (loss, b), g = pardist.value_and_grad(loss_fn, has_aux=True)(p, b, *batch)
            p, s = opt.update(g, s, p)
            return p, b, s, loss

        r, n = pardist.rank(), pardist.world_size()
        losses = []
        for x, y in batches(kind, steps, dtype=dtype):
            rows = len(x) // n
            mine = (x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows])
            params, buffers, opt_state, loss = step(params, buffers, opt_state, mine)
            losses.append(loss)
        if fsdp or zero:  # the shards, whole (every rank calls full_tensor: a collective)
            whole = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
            params, opt_state = torch.utils._pytree.tree_map(whole, (params, opt_state))
        return params, buffers, opt_state, losses
    finally:
        torch.set_num_threads(threads)


def assert_equal(a, b, what: str) -> None:
    la, _ = torch.utils._pytree.tree_flatten(a)
    lb, _ = torch.utils._pytree.tree_flatten(b)
    assert len(la) == len(lb), what
    for i, (x, y) in enumerate(zip(la, lb)):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"{what}: leaf {i} differs by {(x - y).abs().max()}"
        else:
            assert x == y, what


@pytest.mark.parametrize("kind", ["mlp", "bn", "transformer", "wide"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_bit_identical_at_world_sizes_1_to_4(run, kind, optimizer):
    one = run(1, train, kind, optimizer)[0]
    for n in (2, 3, 4):
        results = run(n, train, kind, optimizer)
        for r, result in enumerate(results):
            assert_equal(result, one, f"{kind}/{optimizer} at {n} ranks, rank {r}")
    # it trains: every parameter moved
    start = dict(model(kind).named_parameters())
    assert all(not torch.equal(p, start[k]) for k, p in one[0].items())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fsdp_shards_of_any_length_have_the_whole_tensors_bits(run, optimizer, dtype):
    """pardist.fsdp cuts each parameter where torch.chunk does (13 elements: 7 + 6, 5 + 5 +
    3, 4 + 4 + 4 + 1), and torch's fused kernels take the last numel % W elements of a
    tensor in a scalar tail that rounds otherwise than the SIMD lanes (W: the CPU's vector
    width). The update is the whole tensor's, element for element, at every world size."""
    one = run(1, train, "odd", optimizer, dtype=dtype, fsdp=True)[0]
    for n in (2, 3, 4):
        for r, result in enumerate(run(n, train, "odd", optimizer, dtype=dtype, fsdp=True)):
            assert_equal(result, one, f"fsdp {optimizer} {dtype} at {n} ranks, rank {r}")


@pytest.mark.parametrize(
    ("optimizer", "dtype"),
    [("sgd", torch.float64), ("adamw", torch.float32)],  # (both kernels, both widths)
    ids=["sgd-float64", "adamw-float32"],
)
def test_zero_shards_of_any_length_have_the_whole_tensors_bits(run, optimizer, dtype):
    """optim.sharded (ZeRO) updates each rank's flat slice of every parameter and state
    tensor, cut where shard_range cuts it: as for pardist.fsdp, each element takes the
    SIMD lane or scalar tail it takes in the whole tensor, so the parameters are one plain
    process's and the state that of optim.sharded at one rank, at every world size."""
    plain = run(1, train, "odd", optimizer, dtype=dtype)[0]
    one = run(1, train, "odd", optimizer, dtype=dtype, zero=True)[0]
    assert_equal(one[0], plain[0], f"zero {optimizer} {dtype} at 1 rank: the parameters")
    for n in (2, 3, 4):
        for r, result in enumerate(run(n, train, "odd", optimizer, dtype=dtype, zero=True)):
            assert_equal(result, one, f"zero {optimizer} {dtype} at {n} ranks, rank {r}")


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("kind", ["bn", "wide"])
def test_both_transports(run, transport, kind):
    one = run(1, train, kind, "adamw")[0]
    for n in (2, 3):
        for result in run(n, train, kind, "adamw", env=TRANSPORTS[transport]):
            assert_equal(result, one, f"{kind}/adamw on {transport} at {n} ranks")


def test_close_to_plain_torch(run):
    """The deterministic mode computes the same function as one plain torch process
    (both in float64, compared up to its rounding: numerics.py)."""
    params, buffers, _, losses = run(2, train, "bn", "sgd", 1, dtype=torch.float64)[0]
    net = model("bn").double()
    x, y = batches("bn", 1, dtype=torch.float64)[0]
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= 0.05 * p.grad
    assert_close64(losses[0], loss.detach(), "loss")
    assert_close64(params, {k: p.detach() for k, p in net.named_parameters()}, "parameters")
    assert_close64(buffers, dict(net.named_buffers()), "buffers")


def _bad(groups: int, rows: int):
    apply, params, buffers = pardist.functional(nn.Linear(4, 2))

    @pardist.data_parallel(deterministic=groups)
    def step(p, batch):
        return pardist.grad(lambda p, x: apply(p, buffers, x)[0].sum())(p, batch)

    try:
        step(params, torch.ones(rows, 4))
    except ValueError as e:
        return str(e)
    return None


def _unequal():
    apply, params, buffers = pardist.functional(nn.Linear(4, 2))

    @pardist.data_parallel(deterministic=2)
    def step(p, batch):
        return pardist.grad(lambda p, x: apply(p, buffers, x)[0].sum())(p, batch)

    try:
        step(params, torch.randn(4 if pardist.rank() == 0 else 2, 4))
    except ValueError as e:
        return str(e)
    return None


def test_bad_groups_and_rows_name_the_numbers(run):
    message = run(3, _bad, 8, 4)[0]
    assert "deterministic=8" in message and "3 ranks" in message and "deterministic=24" in message
    message = run(2, _bad, 4, 3)[0]
    assert "6 at 2 ranks" in message and "multiple of 4" in message
    message = run(2, _unequal)[0]
    assert "rank 0: 4, rank 1: 2" in message and "split_batches=True" in message
    with pytest.raises(ValueError, match="row groups"):
        pardist.data_parallel(lambda p, b: p, deterministic=0)
    with pytest.raises(ValueError, match="compile"):
        pardist.data_parallel(lambda p, b: p, deterministic=4, compile=True)


def test_a_non_finite_loss_is_reported_as_in_the_default_mode(world1):
    @pardist.data_parallel(deterministic=2)
    def step(w, x):
        return pardist.value_and_grad(lambda w, x: (x @ w).log().mean())(w, x)

    with pytest.warns(pardist.NonFiniteLossWarning, match="loss is not finite on 1 of 1"):
        value, _ = step(torch.ones(3), -torch.ones(4, 3))
    assert value.isnan()


class _Fails(nn.Module):
    """Raises on the row group whose first value is marked, after the others met at a BN."""

    def forward(self, x):
        if x[0, 0] > 100:
            raise ZeroDivisionError("group with the marked row")
        return x


def test_an_error_in_one_group_is_raised_and_the_next_step_runs(world1):
    torch.manual_seed(0)
    net = nn.Sequential(_Fails(), nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).double()
    apply, params, buffers = pardist.functional(net)

    @pardist.data_parallel(deterministic=4)
    def step(p, x):
        return pardist.value_and_grad(lambda p, x: apply(p, buffers, x)[0].mean())(p, x)

    x = torch.randn(8, 3, dtype=torch.float64)
    marked = x.clone()
    marked[4, 0] = 1000.0  # the first row of group 2: groups 0 and 1 wait at the batch norm
    with pytest.raises(ZeroDivisionError, match="marked row"):
        step(params, marked)
    value, grads = step(params, x)  # the kept threads are free again
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).double()
    want = ref(x).mean()
    assert_close64(value, want.detach(), "value")  # float64, up to its rounding


def _after_a_nan_step():
    # F1: a NaN step's batch-norm statistics are NaN in every group; they were once
    # joined (NaN never equals NaN) into a (16,)-> (2*16,) buffer that crashed the next step.
    torch.manual_seed(0)
    apply, params, buffers = pardist.functional(nn.Sequential(nn.Linear(3, 16), nn.BatchNorm1d(16)))

    @pardist.data_parallel(deterministic=4)
    def step(p, b, x):
        loss = lambda p, b, x: (lambda out: (out[0].pow(2).mean(), out[1]))(apply(p, b, x))
        return pardist.value_and_grad(loss, has_aux=True)(p, b, x)[0][1]

    x = torch.randn(8, 3).chunk(pardist.world_size())[pardist.rank()]
    nan = step(params, buffers, torch.full_like(x, float("nan")))
    after = step(params, nan, x)  # runs: the buffers kept their shapes
    return {k: v.shape for k, v in nan.items()}, {k: v.shape for k, v in after.items()}


def test_a_nan_step_keeps_the_shapes_of_the_buffers(run):
    for nan, after in run(2, _after_a_nan_step):
        assert nan == after == {"1.running_mean": (16,), "1.running_var": (16,),
                                "1.num_batches_tracked": ()}  # fmt: skip


def _equal_valued_aux():
    # F2: outputs equal in every group (a constant per row, the same scalar per group)
    # were returned once, so their shape depended on their values.
    P = pardist.P

    @pardist.data_parallel(deterministic=4, out_specs=(P(), P("gpu"), P("gpu")))
    def step(w, x):
        f = lambda w, x: ((x @ w).sum(), (torch.zeros(len(x)), w.sum() * 0))
        g, (rows, scalars) = pardist.grad(f, has_aux=True)(w, x)
        return g, rows, scalars

    x = torch.ones(8, 3).chunk(pardist.world_size())[pardist.rank()]
    _, rows, scalars = step(torch.ones(3), x)
    return rows.shape, scalars.shape, pardist.world_size()


@pytest.mark.parametrize("nprocs", [1, 2])
def test_aux_shapes_follow_the_layout_not_the_values(run, nprocs):
    for rows, scalars, world in run(nprocs, _equal_valued_aux):
        # this rank's block: each of its rows; one scalar per row group (4 in all)
        assert rows == (8 // world,) and scalars == (4 // world,)


class _OwnRows(nn.Module):
    """A buffer that follows each call's own rows: no one value for all the row groups."""

    def __init__(self):
        super().__init__()
        self.register_buffer("last", torch.zeros(3))

    def forward(self, x):
        self.last.copy_(x.mean(0))
        return x


def test_state_the_groups_disagree_on_is_an_error(world1):
    apply, params, buffers = pardist.functional(nn.Sequential(_OwnRows(), nn.Linear(3, 1)))

    @pardist.data_parallel(deterministic=2)
    def step(p, b, x):
        loss = lambda p, b, x: (lambda out: (out[0].mean(), out[1]))(apply(p, b, x))
        return pardist.grad(loss, has_aux=True)(p, b, x)

    with pytest.raises(
        ValueError, match=r"row groups 0 and 1 returned different values for aux\['0.last'\]"
    ):
        step(params, buffers, torch.randn(4, 3))
