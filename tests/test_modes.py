"""Every feature in every mode: a matrix on one model, every cell against one process.

Shaped like optax's ``_OPTIMIZERS_UNDER_TEST``: the columns are the ways a step runs
(eager, ``compile=True``, ``deterministic=4``), the rows the features a training loop
uses (micro-batches, ZeRO, clipping, FSDP, activation checkpointing as the model does it
and as ``pardist.remat`` does it, a token-weighted and a row-weighted loss, fp16's loss
scale with an overflow, alone and over FSDP shards, a list of micro-batches), each the
change a user makes to the same loop. Every cell must give, at 2 ranks, what plain torch
gives in one process on the concatenated batch (float64 on both sides, compared to float64 rounding:
numerics.py), with every rank holding the same bits, or be refused by an error that
says why (``EXPECTED``). A compiled cell also says how much of it compiled: the whole
step as one graph, made once, or (one warning) its loss in an eager step. A new mode
is a column and a new feature a row, not a file. Where analysis says the bits
themselves must match, they are compared with ``torch.equal``: activation checkpointing
re-runs the same kernels on the same inputs (so it is eager's bits), and the
deterministic mode sums in a fixed order of row groups (so it is its own bits at 1 and 2
ranks). One process runs ALONE (eager with nothing to reduce), which must give forced
EAGER's bits there.
"""

from __future__ import annotations

import dataclasses
import warnings
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
class Feature:
    """What a user changes in the loop below to use a feature."""

    grad: dict = dataclasses.field(default_factory=dict)  # value_and_grad's options
    optimizer: Callable = lambda opt: opt  # noqa: E731
    params: Callable = lambda p: p  # noqa: E731
    remat: str | None = None  # functional(model, remat=...)
    checkpoint: bool = False  # the model's blocks call torch.utils.checkpoint themselves
    uneven: bool = False  # rank 0 holds 6 rows of the batch of 16, rank 1 the other 10
    scale: bool = False  # fp16's dynamic loss scale; rank 1's batch of step 1 overflows
    listed: bool = False  # the shard as a list of two micro-batches
    collectives: bool = False  # the global loss written with collectives (JAX's idiom)


FEATURES = {
    "plain": Feature(),
    "accumulate": Feature(grad={"accumulate": 2}),
    "zero": Feature(optimizer=optim.sharded),
    "clip": Feature(optimizer=lambda opt: optim.chain(optim.clip_by_global_norm(0.5), opt)),
    "fsdp": Feature(params=pardist.fsdp),
    "checkpoint": Feature(checkpoint=True),
    "remat": Feature(remat="nothing_saveable"),
    "remat_dots": Feature(remat="dots_saveable"),
    "tokens": Feature(grad={"mean": "tokens"}),
    "rows": Feature(grad={"mean": "rows"}, uneven=True),
    "loss_scale": Feature(scale=True),
    "fsdp_loss_scale": Feature(scale=True, params=pardist.fsdp),  # (the verdict of chunks)
    "list": Feature(grad={"accumulate": "list"}, listed=True),
    "collectives": Feature(collectives=True),
}
MODES = {"eager": {}, "compiled": {"compile": True}, "deterministic": {"deterministic": 4}}

# What each cell gives. "same": one process's numbers (for a compiled step: as one graph,
# compiled once); "loss": the same numbers, the step eager and its loss compiled, after
# one warning naming why the whole step is no one graph; "eager": the same numbers, the
# step eager after one warning naming why; otherwise the refusal's words.
_REFUSED = "the deterministic mode already runs the batch as 4 row groups"
EXPECTED = {
    ("compiled", "checkpoint"): "loss",
    ("compiled", "remat"): "loss",
    ("compiled", "remat_dots"): "loss",
    ("compiled", "list"): "loss",
    ("deterministic", "accumulate"): _REFUSED,
    ("deterministic", "rows"): _REFUSED,
    ("deterministic", "list"): "takes no list of micro-batches (accumulate='list')",
    ("deterministic", "collectives"): "inside the function pardist.grad differentiates in the "
    "deterministic mode",
}
POISONED = 1  # the step whose batch overflows on rank 1 (loss_scale)


class Block(nn.Module):
    """A residual block; the model stacks three (what activation checkpointing looks for)."""

    def __init__(self, width: int, checkpoint: bool = False):
        super().__init__()
        self.norm, self.up, self.down = (
            nn.LayerNorm(width),
            nn.Linear(width, 32),
            nn.Linear(32, width),
        )
        self.checkpoint = checkpoint

    def inner(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))

    def forward(self, x):
        if self.checkpoint:  # as models that checkpoint themselves do
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        return self.inner(x)


def model(checkpoint: bool = False) -> nn.Module:
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Block(16, checkpoint) for _ in range(3)])
    return nn.Sequential(nn.Linear(8, 16), blocks, nn.Tanh(), nn.Linear(16, 4)).to(F64)


def batch(step: int):
    g = torch.Generator().manual_seed(40 + step)
    return torch.randn(16, 8, generator=g, dtype=F64), torch.randint(0, 4, (16,), generator=g)


def one_process(feature: str = "plain"):
    """Plain torch on the whole batch: the reference every cell must equal."""
    f = FEATURES[feature]
    net = model()
    opt = torch.optim.SGD(net.parameters(), 0.1, momentum=0.9, weight_decay=1e-3)
    losses = []
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        if f.scale and s == POISONED:  # the overflow: every rank skips the update
            losses.append(loss.detach())
            continue
        if feature == "clip":
            nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        losses.append(loss.detach())
    return {k: v.detach() for k, v in net.named_parameters()}, torch.stack(losses)


def _shard(x: torch.Tensor, f: Feature) -> torch.Tensor:
    rank, world = pardist.rank(), pardist.world_size()
    if f.uneven and world == 2:
        return x[:6] if rank == 0 else x[6:]
    return x.chunk(world)[rank]


def train(mode: str, feature: str):
    """Params, losses, the warnings of compile=True and the graphs it made, after STEPS
    steps of ``feature`` run ``mode``'s way at this world size (or the refusal's words)."""
    f = FEATURES[feature]
    torch._dynamo.reset()
    apply, params, buffers = pardist.functional(model(f.checkpoint), remat=f.remat)
    opt = f.optimizer(optim.sgd(0.1, momentum=0.9, weight_decay=1e-3))
    params = f.params(params)
    state, scaler = opt.init(params), pardist.amp.dynamic_loss_scale(init_scale=2.0**4)
    tokens = f.grad.get("mean") == "tokens"

    def loss_fn(p, ls, *batch):
        x, y = batch if len(batch) == 2 else batch[0]  # (x, y), or a micro-batch of a list
        out = apply(p, buffers, x)[0]
        if tokens:  # the sum over the batch's rows (one token each), and their count
            return F.cross_entropy(out, y, reduction="sum"), y.new_tensor(len(y)).double()
        if f.collectives:  # the global batch's mean, twice: over every rank's logits
            # (gathered, invariant), and as the global sum over the global count (psum)
            everyone = F.cross_entropy(
                pardist.all_gather(out, "gpu", invariant=True),
                pardist.all_gather(y, "gpu", invariant=True),
            )
            count = pardist.psum((y >= 0).sum().to(out.dtype), "gpu")
            summed = pardist.psum(F.cross_entropy(out, y, reduction="sum"), "gpu") / count
            return (everyone + summed) / 2
        loss = F.cross_entropy(out, y)
        return scaler.scale(loss, ls) if f.scale else loss

    @pardist.data_parallel(**MODES[mode])
    def step(p, s, ls, batch):
        grad = pardist.value_and_grad(loss_fn, **f.grad)
        loss, g = grad(p, ls, batch) if f.listed else grad(p, ls, *batch)
        if f.scale:
            p, s, ls = scaler.step(opt, g, s, p, ls)
            return p, s, ls, pardist.pmean(loss.detach() / ls.scale, "gpu")
        p, s = opt.update(g, s, p)
        return p, s, ls, pardist.pmean(loss.detach(), "gpu")

    losses, ls = [], scaler.init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(STEPS):
            x, y = batch(i)
            x, y = _shard(x, f), _shard(y, f)
            if f.scale and i == POISONED and pardist.rank() == 1:
                x = x.clone()
                x[0, 0] = float("inf")
            if f.listed:  # two micro-batches, as a loader gives them
                mine = [(x[: len(x) // 2], y[: len(y) // 2]), (x[len(x) // 2 :], y[len(y) // 2 :])]
            try:
                params, state, ls, loss = step(params, state, ls, mine if f.listed else (x, y))
            except (ValueError, NotImplementedError) as e:  # a refusal: its words
                return str(e)
            losses.append(loss)
    if f.scale:  # the loss of the skipped step is the scaled one's: compare the others
        losses[POISONED] = torch.tensor(float("nan"), dtype=F64)
    if f.params is pardist.fsdp:  # FSDP keeps flat shards: view them back
        shapes = dict(model().named_parameters())
        params = {k: v.full_tensor().view(shapes[k].shape) for k, v in params.items()}
    said = [str(c.message) for c in caught if "compile=True" in str(c.message)]
    graphs = step.compiled.backend.graphs if step.compiled is not None else 0
    return params, torch.stack(losses), said, graphs


def train_all(mode: str) -> dict:
    return {feature: train(mode, feature) for feature in FEATURES}


_results: dict = {}


def results(run, mode: str) -> list[dict]:
    """Every feature's cells of ``mode`` at 2 ranks (one group call per mode)."""
    if mode not in _results:
        _results[mode] = run(2, train_all, mode, timeout=800)
    return _results[mode]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", list(MODES))
def test_every_feature_in_every_mode_equals_one_process_or_says_why(run, mode):
    """The matrix: each cell gives one process's numbers (float64, within float64 rounding),
    every rank the same bits; a compiled cell says which of it compiled (one graph, made
    once; or the loss, in an eager step, after one warning naming why); a refused cell
    raises the error that says why, on every rank."""
    failures = []
    for feature in FEATURES:
        expected = EXPECTED.get((mode, feature), "same")
        cells = [r[feature] for r in results(run, mode)]
        if expected not in ("same", "loss", "eager"):
            if not all(isinstance(c, str) and expected in c for c in cells):
                failures.append(f"{feature}: expected a refusal naming {expected!r}, got {cells}")
            continue
        if any(isinstance(c, str) for c in cells):
            failures.append(f"{feature}: refused: {cells[0]}")
            continue
        want_params, want_losses = one_process(feature)
        for params, losses, said, graphs in cells:
            try:
                assert_close64(params, want_params, f"{mode}/{feature}: parameters")
                seen = ~torch.isnan(losses)
                assert_close64(losses[seen], want_losses[seen], f"{mode}/{feature}: losses")
            except AssertionError as e:
                failures.append(str(e))
            if mode == "compiled" and expected == "same" and (said or graphs != 1):
                failures.append(f"{feature}: not one graph made once: {graphs} graphs, {said}")
            if (
                mode == "compiled"
                and expected == "loss"
                and not (len(said) == 1 and "runs eagerly with its loss compiled" in said[0])
            ):
                failures.append(f"{feature}: expected its loss compiled, said {said}")
        a, b = cells[0][0], cells[1][0]
        if not all(torch.equal(a[k], b[k]) for k in a):
            failures.append(f"{feature}: the ranks hold different bits")
    assert not failures, "\n".join(failures)


def test_activation_checkpointing_gives_eagers_bits(run):
    for cells in results(run, "eager"):
        plain, remat = cells["plain"], cells["remat"]
        assert all(torch.equal(remat[0][k], plain[0][k]) for k in plain[0])
        assert torch.equal(remat[1], plain[1])


@pytest.mark.parametrize("feature", ["plain", "tokens", "fsdp"])
def test_the_deterministic_mode_gives_its_bits_at_1_2_and_4_ranks(run, feature):
    ((one_params, one_losses, _, _),) = run(1, train, "deterministic", feature)
    four = run(4, train, "deterministic", feature)
    for params, losses, _, _ in [c[feature] for c in results(run, "deterministic")] + four:
        assert all(torch.equal(params[k], one_params[k]) for k in one_params), feature
        assert torch.equal(losses, one_losses), feature


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
