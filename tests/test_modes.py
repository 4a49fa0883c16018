"""The modes under test: every way a step runs, on one model, against one process.

Shaped like optax's ``_OPTIMIZERS_UNDER_TEST``: one row per way of running a step
(eager, a compiled step, the deterministic mode, micro-batches, a ZeRO-sharded
optimizer state, FSDP parameters, activation checkpointing), each the change a
user makes to the same training loop. Every row must give, at 2 ranks, what plain
torch gives in one process on the concatenated batch (float64 on both sides,
compared to float64 rounding: numerics.py), with every rank holding the same bits.
Where analysis says the bits themselves must match, they are compared with
``torch.equal``: activation checkpointing re-runs the same kernels on the same
inputs (so it is eager's bits), and the deterministic mode sums in a fixed order
of row groups (so it is its own bits at 1 and 2 ranks). A new mode is a new row.
One process runs ALONE (eager with nothing to reduce), which must give forced
EAGER's bits there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

import pardist
from pardist import optim

F64 = torch.float64
STEPS = 3


@dataclasses.dataclass(frozen=True)
class Mode:
    """What a user changes in the loop below to run their step this way."""

    step: dict = dataclasses.field(default_factory=dict)  # data_parallel's options
    grad: dict = dataclasses.field(default_factory=dict)  # value_and_grad's options
    optimizer: Callable = lambda opt: opt  # noqa: E731
    params: Callable = lambda p: p  # noqa: E731
    remat: str | None = None  # functional(model, remat=...)


MODES_UNDER_TEST = {
    "eager": Mode(),
    "compiled": Mode(step={"compile": True}),
    "deterministic": Mode(step={"deterministic": 4}),
    "accumulate": Mode(grad={"accumulate": 2}),
    "zero": Mode(optimizer=optim.sharded),
    "fsdp": Mode(params=pardist.fsdp),
    "remat": Mode(remat="nothing_saveable"),
}


class Block(nn.Module):
    """A residual block; the model stacks three (what activation checkpointing looks for)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = (
            nn.LayerNorm(width),
            nn.Linear(width, 32),
            nn.Linear(32, width),
        )

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def model() -> nn.Module:
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Block(16) for _ in range(3)])
    return nn.Sequential(nn.Linear(8, 16), blocks, nn.Tanh(), nn.Linear(16, 4)).to(F64)


def batch(step: int):
    g = torch.Generator().manual_seed(40 + step)
    return torch.randn(16, 8, generator=g, dtype=F64), torch.randint(0, 4, (16,), generator=g)


def one_process():
    """Plain torch on the whole batch: the reference every mode must equal."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), 0.1, momentum=0.9, weight_decay=1e-3)
    losses = []
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return {k: v.detach() for k, v in net.named_parameters()}, torch.stack(losses)


def train(name: str):
    """Params and losses after STEPS steps run ``name``'s way at this world size."""
    mode = MODES_UNDER_TEST[name]
    torch._dynamo.reset()
    apply, params, buffers = pardist.functional(model(), remat=mode.remat)
    opt = mode.optimizer(optim.sgd(0.1, momentum=0.9, weight_decay=1e-3))
    params = mode.params(params)
    state = opt.init(params)

    def loss_fn(p, x, y):
        return F.cross_entropy(apply(p, buffers, x)[0], y)

    @pardist.data_parallel(**mode.step)
    def step(p, s, xy):
        loss, g = pardist.value_and_grad(loss_fn, **mode.grad)(p, *xy)
        p, s = opt.update(g, s, p)
        return p, s, pardist.pmean(loss.detach(), "gpu")

    rank, world = pardist.rank(), pardist.world_size()
    losses = []
    for s in range(STEPS):
        x, y = batch(s)
        params, state, loss = step(params, state, (x.chunk(world)[rank], y.chunk(world)[rank]))
        losses.append(loss)
    shapes = dict(model().named_parameters())  # FSDP keeps flat shards: view them back
    if mode.params is pardist.fsdp:
        params = {k: v.full_tensor().view(shapes[k].shape) for k, v in params.items()}
    return params, torch.stack(losses)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(MODES_UNDER_TEST))
def test_every_mode_equals_one_process(run, name):
    want_params, want_losses = one_process()
    results = run(2, train, name, timeout=600)  # (a compiled step: minutes when loaded)
    for params, losses in results:
        assert_close64(params, want_params, f"{name}: parameters")
        assert_close64(losses, want_losses, f"{name}: losses")
    for k in want_params:  # every rank holds the same bits
        assert torch.equal(results[0][0][k], results[1][0][k]), (name, k)


def test_activation_checkpointing_gives_eagers_bits(run):
    eager, remat = zip(*run(2, lambda: (train("eager"), train("remat"))))
    for (p_e, l_e), (p_r, l_r) in zip(eager, remat):
        assert all(torch.equal(p_r[k], p_e[k]) for k in p_e)
        assert torch.equal(l_r, l_e)


def test_the_deterministic_mode_gives_its_bits_at_1_and_2_ranks(run):
    (one,) = run(1, train, "deterministic")
    for params, losses in run(2, train, "deterministic"):
        assert all(torch.equal(params[k], one[0][k]) for k in one[0])
        assert torch.equal(losses, one[1])


def alone_or_eager(force_eager: bool):
    """A one-process step with batch norm (per-rank statistics), dropout and AdamW, run
    as pardist picks (ALONE) or forced EAGER; what it gives and which path each took."""
    from pardist.gradients import _bucketed
    from pardist.step import _shard_map

    taken = {"compute": 0, "compute_local": 0}
    kept = {name: getattr(_bucketed, name) for name in taken}

    def counted(name):
        def path(*args):
            taken[name] += 1
            return kept[name](*args)

        return path

    try:
        for name in taken:
            setattr(_bucketed, name, counted(name))
        _shard_map.ALONE = pardist.runtime.EAGER if force_eager else pardist.runtime.ALONE
        return _train_alone(), taken
    finally:
        for name, fn in kept.items():
            setattr(_bucketed, name, fn)
        _shard_map.ALONE = pardist.runtime.ALONE


def _train_alone():
    pardist.seed_everything(0)  # dropout's streams from the same count in both runs
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 4))
    apply, params, buffers = pardist.functional(net.to(F64), sync_bn=False)
    opt = optim.adamw(1e-2)
    modes = []

    def loss_fn(p, b, x, y):
        out, b = apply(p, b, x)
        return F.cross_entropy(out, y), b

    @pardist.data_parallel(donate_argnums=(0, 1, 2))
    def step(p, b, s, xy):
        modes.append(pardist.runtime.current_mode().name)
        (loss, b), g = pardist.value_and_grad(loss_fn, has_aux=True)(p, b, *xy)
        p, s = opt.update(g, s, p)
        return p, b, s, loss

    state, losses = (params, buffers, opt.init(params)), []
    for s in range(STEPS):
        *state, loss = step(*state, batch(s))
        losses.append(loss)
    x, y, nan = *batch(0), float("nan")
    with pytest.warns(pardist.NonFiniteLossWarning, match="loss"):
        step(*tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, state), (x * nan, y))
    return tree_leaves((state, losses)), modes


def test_one_process_runs_alone_with_eagers_bits(run):
    """One process runs ALONE (eager with nothing to reduce: autograd's gradient as it
    is, no batch placed, no reducer) and gives forced EAGER's bits, loss check included."""
    ((got, modes), taken), ((want, eager_modes), eager_taken) = (
        run(1, alone_or_eager, force)[0] for force in (False, True)
    )
    assert modes == ["alone"] * (STEPS + 1) and eager_modes == ["eager"] * (STEPS + 1)
    assert taken == {"compute": 0, "compute_local": STEPS + 1}
    assert eager_taken == {"compute": STEPS + 1, "compute_local": 0}
    assert len(got) == len(want) > 10
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is b is None) or torch.equal(a, b), (i, a, b)
