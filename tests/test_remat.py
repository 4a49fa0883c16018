"""Activation checkpointing in every mode of a step: the gradients of the model without it.

A checkpointed block keeps only its inputs and is run again in the backward, with the
same kernels on the same inputs, so every mode must give the bits it gives without
checkpointing (the deterministic-mode and loss-compiled ones included), dropout
drawing the same mask again. The model checkpoints itself in each of torch's ways
(non-reentrant, reentrant, ``checkpoint_sequential``), or pardist does
(``functional(model, remat=...)``). The bytes the forward keeps show that the
recomputation really happens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from torch import nn

import pardist
from pardist import optim

WAYS = ["nonreentrant", "reentrant", "sequential", "remat"]


class Block(nn.Module):
    def __init__(self, norm: str):
        super().__init__()
        self.norm = nn.BatchNorm1d(16) if norm == "batch" else nn.LayerNorm(16)
        self.up, self.down, self.drop = nn.Linear(16, 32), nn.Linear(32, 16), nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(self.down(torch.relu(self.up(self.norm(x)))))


class Net(nn.Module):
    """Four blocks, checkpointed the way ``way`` says (None: not at all)."""

    def __init__(self, way: str | None = None, norm: str = "layer"):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.Sequential(*[Block(norm) for _ in range(4)])
        self.way = way

    def forward(self, x):
        x = self.inp(x)
        if self.way in (None, "remat"):
            x = self.blocks(x)
        elif self.way == "sequential":
            x = ckpt.checkpoint_sequential(self.blocks, 2, x, use_reentrant=False)
        else:
            for block in self.blocks:
                x = ckpt.checkpoint(block, x, use_reentrant=self.way == "reentrant")
        return self.head(x)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(24, 8, generator=g), torch.randint(0, 4, (24,), generator=g)


def train(way: str | None, mode: str, norm: str = "layer", steps: int = 3):
    """Params, buffers and losses after ``steps`` SGD steps in ``mode`` at this world size."""
    pardist.set_rng_count(0)  # the same dropout masks for every way
    torch._dynamo.reset()
    net = Net(way, norm)
    apply, params, buffers = pardist.functional(
        net, remat="nothing_saveable" if way == "remat" else None
    )
    base = optim.sgd(0.1, momentum=0.9)
    opt = optim.sharded(base) if mode == "zero" else base
    if mode == "fsdp":
        params = pardist.fsdp(params)
    state = opt.init(params)

    def loss_fn(p, b, x, y):
        out, b = apply(p, b, x)
        return F.cross_entropy(out, y), b

    if mode == "compiled loss":
        loss_fn = torch.compile(loss_fn, dynamic=False)
    k = 2 if mode == "accumulate" else 1
    vg = pardist.value_and_grad(
        loss_fn, has_aux=True, accumulate=k, **({"carry": 1} if k > 1 else {})
    )
    options = {"deterministic": 4} if mode == "deterministic" else {}

    @pardist.data_parallel(**options)
    def step(p, s, b, xy):
        (loss, b), g = vg(p, b, *xy)
        p, s = opt.update(g, s, p)
        return p, s, b, loss

    rank, world = pardist.rank(), pardist.world_size()
    losses = []
    for s in range(steps):
        x, y = batch(s)
        params, state, buffers, loss = step(
            params, state, buffers, (x.chunk(world)[rank], y.chunk(world)[rank])
        )
        losses.append(float(loss))
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in params.items()}
    return full, buffers, losses


def each_way(mode: str, norm: str = "layer") -> dict:
    """Per way: whether params, buffers and losses equal the un-checkpointed run's bits."""
    ref = train(None, mode, norm)
    out = {}
    for way in WAYS:
        got = train(way, mode, norm)
        out[way] = [
            all(torch.equal(got[0][k], ref[0][k]) for k in ref[0]),
            all(torch.equal(got[1][k], ref[1][k]) for k in ref[1]),
            got[2] == ref[2],
        ]
    return out


@pytest.mark.parametrize("mode", ["eager", "accumulate", "zero", "fsdp", "deterministic"])
def test_checkpointed_models_train_bit_for_bit_as_without(run, mode):
    for result in run(2, each_way, mode):
        assert result == {way: [True, True, True] for way in WAYS}, result


@pytest.mark.parametrize("mode", ["eager", "zero", "fsdp"])
def test_batch_norm_in_a_checkpointed_block_updates_its_statistics_once(run, mode):
    # The recomputation runs under cross-replica batch norm again (the same global
    # statistics), and updates copies of the running statistics, not the real ones.
    for result in run(2, each_way, mode, "batch"):
        assert result == {way: [True, True, True] for way in WAYS}, result


def _loss_compiled():
    ref = train(None, "compiled loss")
    return {way: train(way, "compiled loss") for way in ("reentrant", "remat")}, ref


@pytest.mark.timeout(900)
def test_a_compiled_loss_recomputes_with_the_eager_numbers(run):
    # AOTAutograd partitions the joint graph at the checkpoints (a compiled recomputation);
    # its dropout is functionalised, so the masks replay too.
    for got, ref in run(2, _loss_compiled, timeout=600):  # (inductor: minutes when loaded)
        for way, (params, _, losses) in got.items():
            assert all(torch.equal(params[k], ref[0][k]) for k in ref[0]), way
            assert losses == ref[2], way


def _whole_step_compiled():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = Net("nonreentrant")
        apply, params, buffers = pardist.functional(net)

        @pardist.data_parallel(compile=True)
        def step(p, b, xy):
            return pardist.grad(lambda p: F.cross_entropy(apply(p, b, xy[0])[0], xy[1]))(p)

        x, y = batch(0)
        rank, world = pardist.rank(), pardist.world_size()
        grads = step(params, buffers, (x.chunk(world)[rank], y.chunk(world)[rank]))
    return grads, [str(w.message) for w in caught]


def test_a_whole_step_graph_runs_a_checkpointing_model_eagerly_and_says_why(run):
    # torch.func (which the whole-step graph traces) cannot run checkpoints: the step runs
    # eagerly, with one warning naming the loss-only way to compile.
    for grads, messages in run(2, _whole_step_compiled):
        assert any("pardist.grad(torch.compile(loss_fn))" in m for m in messages), messages
        assert all(torch.isfinite(g).all() for g in grads.values())


def _plain_torch(way: str | None):
    net = Net(way)
    net.blocks.apply(lambda m: setattr(m, "p", 0.0) if isinstance(m, nn.Dropout) else None)
    x, y = batch(0)
    F.cross_entropy(net(x), y).backward()
    return {k: p.grad for k, p in net.named_parameters()}


@pytest.mark.parametrize("way", WAYS)
def test_outside_a_step_pardist_grad_equals_plain_torch_checkpointing(way):
    # Plain torch's own backward through its own checkpoints; pardist.grad outside a step
    # (autograd's backward, not torch.func's, which cannot run saved-tensor hooks).
    want = _plain_torch(None if way == "remat" else way)
    net = Net(way)
    net.blocks.apply(lambda m: setattr(m, "p", 0.0) if isinstance(m, nn.Dropout) else None)
    apply, params, buffers = pardist.functional(
        net, remat="nothing_saveable" if way == "remat" else None, device=None
    )
    x, y = batch(0)
    got = pardist.grad(lambda p: F.cross_entropy(apply(p, buffers, x)[0], y))(params)
    assert {k: torch.equal(got[k], want[k]) for k in want} == {k: True for k in want}


def _saved_bytes(apply, params, buffers, x) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        p = {k: v.detach().requires_grad_() for k, v in params.items()}
        apply(p, buffers, x)[0].sum()
    kept = {t.untyped_storage().data_ptr() for t in p.values()}
    return sum(n for ptr, n in seen.items() if ptr not in kept)


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_remat_keeps_fewer_activations_and_the_same_gradients(policy):
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    plain = pardist.functional(Net(), device=None)
    kept = pardist.functional(Net(), remat=policy, device=None)
    full, little = _saved_bytes(*plain, x), _saved_bytes(*kept, x)
    # nothing_saveable keeps each block's input only; dots_saveable adds the matmul outputs
    assert little < (0.3 if policy == "nothing_saveable" else 0.8) * full, (little, full)
    torch.manual_seed(1)
    want = pardist.grad(lambda p: F.cross_entropy(plain[0](p, plain[2], x)[0], y))(plain[1])
    torch.manual_seed(1)
    got = pardist.grad(lambda p: F.cross_entropy(kept[0](p, kept[2], x)[0], y))(kept[1])
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_every_other_block_is_recomputed_with_remat_every_2():
    apply, params, buffers = pardist.functional(Net(), remat=pardist.Remat(every=2), device=None)
    x = torch.randn(64, 8)
    none = _saved_bytes(*pardist.functional(Net(), device=None), x)
    every = _saved_bytes(*pardist.functional(Net(), remat="nothing_saveable", device=None), x)
    half = _saved_bytes(apply, params, buffers, x)
    assert every < half < none, (every, half, none)


def test_an_unknown_policy_lists_the_policies():
    with pytest.raises(ValueError, match="dots_saveable.*everything_saveable.*nothing_saveable"):
        pardist.remat(torch.sin, policy="dots")
    with pytest.raises(ValueError, match="remat blocks names 'nope'"):
        pardist.functional(Net(), remat=pardist.Remat(blocks=["nope"]))
    with pytest.raises(ValueError, match="found no list of alike blocks"):
        pardist.functional(nn.Linear(2, 2), remat="nothing_saveable")


def test_remat_of_a_function_that_changes_its_argument_is_an_error():
    def bump(x, count):
        count.add_(1)  # a buffer changed in place: the recomputation would do it again
        return x * 2

    with pytest.raises(RuntimeError, match=r"changed its argument args\[1\]"):
        pardist.remat(bump)(torch.ones(2, requires_grad=True), torch.zeros(()))


def test_remat_of_a_function_returning_an_opaque_object_is_an_error():
    class Box:
        def __init__(self, t):
            self.t = t

    with pytest.raises(TypeError, match=r"returned a Box at output"):
        pardist.remat(lambda x: Box(x * 2))(torch.ones(2, requires_grad=True))


def _deterministic_batch_norm():
    try:
        train("nonreentrant", "deterministic", "batch", steps=1)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return str(e)
    return "no error"


def test_batch_norm_recomputed_in_the_deterministic_mode_is_a_clear_error(run):
    for message in run(2, _deterministic_batch_norm):
        assert "cannot be recomputed in the deterministic mode" in message, message


def test_checkpointing_under_a_torch_func_transform_names_the_way_out():
    apply, params, buffers = pardist.functional(Net("nonreentrant"), device=None)
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"torch.func transforms.*pardist.grad outside"):
        torch.func.grad(lambda p: apply(p, buffers, x)[0].sum())(params)
