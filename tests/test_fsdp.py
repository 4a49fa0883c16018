"""pardist.fsdp (ZeRO-3): equal to data parallelism and to one process, at 1/N of the memory.

The model has what breaks naive FSDP: an embedding tied to the output layer (used
by the first and the last module), batch norm synchronised over the axis, a
module type with a raw parameter, nested units, and sizes that divide by no
number of ranks. The references are unsharded ``data_parallel`` at the same
ranks and, independently, one plain torch process on the whole batch. The
training compared runs in float64 on every side, compared up to float64
rounding (numerics.py).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64
from torch import nn
from torch.distributed.tensor import DTensor

import pardist
from pardist import P, optim
from pardist.sharding import _units as _fsdp_units

pytestmark = pytest.mark.timeout(180)
STEPS = 4
VOCAB, D, H = 13, 7, 11


class Scale(nn.Module):
    """A module of its own type holding a bare parameter."""

    def __init__(self, n: int):
        super().__init__()
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * self.g


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H, bias=False)  # a bias before batch norm has no gradient
        self.norm = nn.BatchNorm1d(H)
        self.down = nn.Linear(H, D)
        self.scale = Scale(D)

    def forward(self, x):
        return x + self.scale(self.down(torch.tanh(self.norm(self.up(x)))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(D, VOCAB)
        self.head.weight = self.embed.weight  # tied: the first and the last module

    def forward(self, ids):
        return self.head(self.blocks(self.embed(ids)))


def batch(step: int, rank: int = 0, world: int = 1):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (24,), generator=g)
    y = torch.randint(0, VOCAB, (24,), generator=g)
    return ids.chunk(world)[rank], y.chunk(world)[rank]


OPTIMIZERS = {
    "sgd": (lambda: optim.sgd(0.1, momentum=0.9), lambda p: torch.optim.SGD(p, 0.1, 0.9)),
    "adamw": (lambda: optim.adamw(1e-2), lambda p: torch.optim.AdamW(p, 1e-2)),
}


def full(params: dict) -> dict:
    """Full parameters from FSDP shards (every rank gets the same)."""
    shapes = dict(Net().named_parameters())
    return {
        k: v.full_tensor().view(shapes[k].shape) if isinstance(v, DTensor) else v
        for k, v in params.items()
    }


def train(
    opt_name: str,
    shard: bool,
    *,
    donate=False,
    units="auto",
    steps=STEPS,
    sharded=False,
    accumulate=1,
    mesh=None,
    axis="gpu",
    fsdp_axis="gpu",
    start=None,
    first=0,
    compile=False,  # noqa: A002
):
    """Train Net; return (full params, buffers, losses, gradient kinds, specs, raw state)."""
    apply, params, buffers = pardist.functional(Net().double(), fsdp_units=units)
    if shard:
        params = pardist.fsdp(params, fsdp_axis, mesh=mesh)
    opt = OPTIMIZERS[opt_name][0]()
    opt = optim.sharded(opt, fsdp_axis, mesh=mesh) if sharded else opt
    state = opt.init(params)
    if start is not None:
        params, buffers, state = start

    def loss_fn(p, b, ids, y):
        logits, b = apply(p, b, ids)
        return F.cross_entropy(logits, y), b

    @pardist.data_parallel(
        axis=axis, mesh=mesh, donate_argnums=(0, 2) if donate else (), compile=compile
    )
    def step(p, b, s, data):
        grad_fn = pardist.value_and_grad(
            loss_fn, has_aux=True, accumulate=accumulate, batch_argnums=(2, 3), carry=1
        )
        (loss, b), g = grad_fn(p, b, *data)  # carry=1: the buffers go micro-batch to micro-batch
        kinds = {type(x).__name__ for x in g.values()}
        p, s = opt.update(g, s, p)
        return p, b, s, loss, kinds

    kinds, losses = set(), []
    for s in range(first, first + steps):
        params, buffers, state, loss, k = step(
            params, buffers, state, batch(s, pardist.rank(), pardist.world_size())
        )
        kinds |= k
        losses.append(float(loss))
    specs = pardist.specs(params)

    @pardist.data_parallel(axis=axis, mesh=mesh, in_specs=(P(), P(), P()), compile=compile)
    def evaluate(p, b, ids):  # the same whole batch on every rank, without gradients
        with torch.no_grad():
            return apply(p, b, ids, train=False)[0]

    logits = evaluate(params, buffers, batch(0)[0])
    return full(params), buffers, losses, kinds, specs, (params, buffers, state), logits


def one_process(opt_name: str):
    net = Net().double()
    opt = OPTIMIZERS[opt_name][1](net.parameters())
    for s in range(STEPS):
        ids, y = batch(s)
        opt.zero_grad()
        F.cross_entropy(net(ids), y).backward()
        opt.step()
    return {k: v.detach() for k, v in net.named_parameters()}, dict(net.named_buffers())


def _compare(opt_name, donate, units):
    dp = train(opt_name, shard=False)
    ours = train(opt_name, shard=True, donate=donate, units=units)
    return dp[:5] + dp[6:], ours[:5] + ours[6:]


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert_close64(a, b, "parameters")


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_equals_data_parallel_and_one_process(run, nprocs, opt_name):
    reference, ref_buffers = one_process(opt_name)
    results = run(nprocs, _compare, opt_name, nprocs % 2 == 0, "auto")
    net = Net().double()
    net.load_state_dict({**reference, **ref_buffers}, strict=False)  # head.weight is tied
    evaluated = net.eval()(batch(0)[0])
    for (dp, _, dp_losses, dp_kinds, _, dp_logits), ours in results:
        params, buffers, losses, kinds, specs, logits = ours
        assert_close64(logits, dp_logits, "evaluation")
        assert_close64(logits, evaluated, "evaluation against one process")
        _close(params, dp)  # unsharded data_parallel at the same ranks
        _close(params, reference)  # one plain torch process on the whole batch
        assert_close64(buffers, ref_buffers, "buffers")  # sync batch norm's running statistics
        assert_close64(losses, dp_losses, "losses")
        # pardist.grad returned shards, and the params stayed shards over 'gpu'
        assert kinds == {"DTensor"} and dp_kinds == {"Tensor"}
        assert set(specs.values()) == {P("gpu")}
    first = results[0][1][0]
    for _, (params, *_) in results[1:]:  # every rank gathers the same parameters
        assert all(torch.equal(params[k], first[k]) for k in first)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _peak(shard: bool, width: int = 1024, depth: int = 8):
    """Per rank: the resident high-water mark of AdamW steps above the resident set before.

    VmHWM counts private and shared memory this process touched; glibc is told to map
    every allocation over 1 MiB on its own (mallopt), so freed tensors leave the resident
    set at once. A tiny model's step first sets up what every model shares (DTensor).
    """
    import ctypes
    import gc

    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD

    def steps(width, depth, n):
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])
        apply, params, _ = pardist.functional(net, fsdp_units=[nn.Linear])
        del net
        params = pardist.fsdp(params) if shard else params
        opt = optim.adamw(1e-3)
        state = opt.init(params)
        x = torch.randn(4, width)

        @pardist.data_parallel(donate_argnums=(0, 1))
        def step(p, s, x):
            g = pardist.grad(lambda p, x: apply(p, {}, x)[0].square().mean())(p, x)
            return opt.update(g, s, p)

        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        for _ in range(n):
            params, state = step(params, state, x)
        return params

    steps(16, 2, 2)
    gc.collect()
    base = _status("VmRSS")
    steps(width, depth, 3)
    return _status("VmHWM") - base


def test_peak_memory_per_rank_is_a_1_over_n_share(run):
    # AdamW: parameters, gradients and two state tensors; 8 units of 4 MiB each.
    width, depth = 1024, 8
    replicated = 4 * width * width * depth * 4
    unit = width * width * 4
    env = {"PARDIST_TEST_ISOLATED": "memory"}  # fresh processes: nothing else in their heap
    ours = run(2, _peak, True, env=env)
    dp = run(2, _peak, False, env=env)
    # 1/N + 5%, plus the largest unit gathered and its full gradient (both transient),
    # the reduce-scatter's shared piece (one unit here) and 4 MiB for the rest.
    bound = replicated / 2 * 1.05 + 3 * unit + 4 * 2**20
    print(
        f"peak MiB per rank: fsdp {[p / 2**20 for p in ours]}, dp {[p / 2**20 for p in dp]}, "
        f"bound {bound / 2**20:.1f}, replicated {replicated / 2**20:.0f}"
    )
    assert max(ours) <= bound
    assert min(dp) >= replicated  # the measure sees the replicated state


def _through_the_backend():
    return train("adamw", False)[0], train("adamw", True, donate=True)[0]


def _donated_in_place():
    apply, params, buffers = pardist.functional(Net())
    params = pardist.fsdp(params)
    opt = optim.adamw(1e-2)
    state = opt.init(params)
    before = {k: (id(v), v.to_local().data_ptr()) for k, v in params.items()}

    @pardist.data_parallel(donate_argnums=(0, 2))
    def step(p, b, s, data):
        g = pardist.grad(lambda p, b, ids, y: F.cross_entropy(apply(p, b, ids)[0], y))(p, b, *data)
        return opt.update(g, s, p)

    params, _ = step(params, buffers, state, batch(0, pardist.rank(), pardist.world_size()))
    return before, {k: (id(v), v.to_local().data_ptr()) for k, v in params.items()}


def test_donated_shards_are_updated_in_place(run):
    for before, after in run(2, _donated_in_place):
        assert before == after  # the same DTensors, their local shards written in place


def test_equals_data_parallel_through_the_backend_with_prefetch(run):
    # PARDIST_SHM=0: gathers through gloo, the next unit's started while one computes
    for dp, ours in run(2, _through_the_backend, env={"PARDIST_SHM": "0"}):
        _close(ours, dp)


def _units(model: nn.Module, policy) -> dict[str, list[str]]:
    names = [n for n, _ in model.named_parameters()]
    units, _ = _fsdp_units.choose(model, names, policy, "test")
    return {u.name: u.params for u in units}


def test_units_follow_modules_and_tied_weights_go_to_the_unit_holding_every_user():
    auto = _units(Net(), "auto")
    # the embedding is also the output layer: it goes to the root, gathered throughout
    assert auto[""] == ["embed.weight"]
    assert auto["blocks.0.down"] == ["blocks.0.down.weight", "blocks.0.down.bias"]
    assert auto["head"] == ["head.bias"] and "embed" not in auto
    assert set(_units(Net(), [Block])) == {"", "blocks.0", "blocks.1"}
    assert _units(Net(), None) == {"": [n for n, _ in Net().named_parameters()]}
    # a module holding most of its parameters itself is not split (its forward uses the
    # rest directly: MultiheadAttention and out_proj.weight)
    layer = nn.TransformerEncoderLayer(16, 2, 64, batch_first=True)
    assert "self_attn" in _units(layer, "auto") and "self_attn.out_proj" not in _units(
        layer, "auto"
    )
    with pytest.raises(TypeError, match=r"fsdp_units must be 'auto', None, module paths"):
        _units(Net(), [3])


def _grads():
    apply, params, buffers = pardist.functional(Net().double())
    shards = pardist.fsdp(params)

    def loss_fn(p, b, ids, y):
        return F.cross_entropy(apply(p, b, ids)[0], y)

    @pardist.data_parallel()
    def both(p, b, data, *, q):  # shards as a keyword argument: not among the step's inputs
        return pardist.grad(loss_fn)(p, b, *data), pardist.grad(loss_fn)(q, b, *data)

    mean, ours = both(params, buffers, batch(0, pardist.rank(), pardist.world_size()), q=shards)
    return mean, {k: (v.to_local(), v.full_tensor()) for k, v in ours.items()}


def test_grad_returns_this_ranks_shard_of_the_mean_gradient(run):
    for rank, (mean, ours) in enumerate(run(3, _grads)):
        for k, (local, whole) in ours.items():
            flat = mean[k].reshape(-1)
            chunk = -(-flat.numel() // 3)
            assert_close64(local, flat[rank * chunk : (rank + 1) * chunk], f"{k}'s shard")
            assert_close64(whole, flat, k)


def _accumulate():
    return train("sgd", False, accumulate=2)[0], train("sgd", True, accumulate=2)[0]


def test_accumulation_equals_data_parallel(run):
    # One reduce-scatter per micro-batch (as FSDP2): the gradients stay 1/N in memory.
    for dp, ours in run(2, _accumulate):
        _close(ours, dp)


def one_process_micro(k: int, world: int = 2):
    """Plain torch, one process, SGD: each step's batch as ``k`` micro-batches, the j-th
    holding every rank's j-th part of its shard (as ``accumulate=k`` splits them), each
    loss over its rows divided by ``k``; batch norm's statistics per micro-batch."""
    net = Net().double()
    opt = torch.optim.SGD(net.parameters(), 0.1, 0.9)
    for s in range(STEPS):
        shards = [batch(s, r, world) for r in range(world)]
        opt.zero_grad()
        for j in range(k):
            ids = torch.cat([i.chunk(k)[j] for i, _ in shards])
            y = torch.cat([t.chunk(k)[j] for _, t in shards])
            (F.cross_entropy(net(ids), y) / k).backward()
        opt.step()
    evaluated = net.eval()(batch(0)[0]).detach()
    return {k: v.detach() for k, v in net.named_parameters()}, dict(net.named_buffers()), evaluated


def _compiled(accumulate: int, hsdp: bool):
    kw = {"mesh": pardist.Mesh({"node": 2, "gpu": 2}), "axis": ("node", "gpu")} if hsdp else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = train("sgd", True, compile=True, accumulate=accumulate, donate=True, **kw)
    said = [str(w.message) for w in caught if "compile=True" in str(w.message)]
    return out[0], out[1], out[6], said


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "nprocs, shm, accumulate",
    [(2, "1", 2), (2, "0", 1), (4, "1", 1)],
    ids=["shared-memory-micro-batches", "gloo", "hybrid-4-ranks"],
)
def test_compiled_step_gathers_and_reduce_scatters_in_its_graph(run, nprocs, shm, accumulate):
    """compile=True with pardist.fsdp parameters: one graph (no fallback's warning) whose
    per-unit all-gathers and reduce-scatters give one process's numbers. The chunks are of
    uneven lengths (7, 11, 13 x 7 over 2 ranks), batch norm syncs in the same graph, and
    the 4-rank run shards over 'gpu' and replicates over 'node' (HSDP)."""
    hsdp = nprocs == 4
    reference, ref_buffers, evaluated = one_process_micro(accumulate, nprocs)
    results = run(nprocs, _compiled, accumulate, hsdp, env={"PARDIST_SHM": shm}, timeout=560)
    for params, buffers, logits, said in results:
        assert said == []
        _close(params, reference)
        assert_close64(buffers, ref_buffers, "buffers")
        assert_close64(logits, evaluated, "evaluation")


def _with_sharded_optimizer():
    ours = train("adamw", True, sharded=True, donate=True)
    return ours[0], ours[5][2].inner.exp_avg["embed.weight"].to_local().shape


def test_optim_sharded_over_the_same_axis_takes_the_shards(run):
    reference, _ = one_process("adamw")
    results = run(2, _with_sharded_optimizer)
    for params, _ in results:
        _close(params, reference)
    # the state is sharded like the parameters: 91 -> 46 + 45
    assert [tuple(shape) for _, shape in results] == [(46,), (45,)]


def _save(path):
    params, buffers, state = train("adamw", True, steps=2)[5]
    pardist.checkpoint.save(path, {"params": params, "buffers": buffers, "state": state})


def _resume(path):
    apply, params, buffers = pardist.functional(Net().double())
    params = pardist.fsdp(params)
    like = {"params": params, "buffers": buffers, "state": optim.adamw(1e-2).init(params)}
    loaded = pardist.checkpoint.load(path, like)
    start = (loaded["params"], loaded["buffers"], loaded["state"])
    return train("adamw", True, steps=STEPS - 2, first=2, start=start)[0]


@pytest.mark.parametrize("load_at", [1, 3])
def test_checkpoint_saves_shards_and_reshards_them(run, tmp_path, load_at):
    path = str(tmp_path / "ckpt")
    run(2, _save, path)  # two steps at 2 ranks: halves
    reference, _ = one_process("adamw")
    for params in run(load_at, _resume, path):  # resharded to 1 or 3, then two more steps
        _close(params, reference)


def _hsdp():
    mesh = pardist.Mesh({"node": 2, "gpu": 2})
    out = train("sgd", True, mesh=mesh, axis=("node", "gpu"), fsdp_axis="gpu", donate=True)
    return out[0], out[5][0]["embed.weight"].to_local().numel(), pardist.specs(out[5][0])


def test_hybrid_shards_within_a_node_and_replicates_across_nodes(run):
    reference, _ = one_process("sgd")
    results = run(4, _hsdp)
    for rank, (params, local, specs) in enumerate(results):
        _close(params, reference)
        assert local == (46 if rank % 2 == 0 else 45)  # split over 'gpu' (2), not all 4
        assert set(specs.values()) == {P("gpu")}


class Attention(nn.Module):
    """nn.MultiheadAttention uses out_proj.weight in its own forward, never calling out_proj."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, ids):
        x = self.embed(ids.view(-1, 3))
        y, _ = self.attn(x, x, x, need_weights=False)
        return self.head(x + y).flatten(0, 1)


def _attention(units):
    apply, params, _ = pardist.functional(Attention().double(), fsdp_units=units)
    out = []
    for shard in (False, True):
        p = pardist.fsdp(params) if shard else params
        opt = optim.sgd(0.5)
        s = opt.init(p)

        def loss_fn(p, ids, y):
            return F.cross_entropy(apply(p, {}, ids)[0], y)

        @pardist.data_parallel()
        def step(p, s, data, opt=opt, loss_fn=loss_fn):
            return opt.update(pardist.grad(loss_fn)(p, *data), s, p)

        for i in range(3):
            ids, y = batch(i, pardist.rank(), pardist.world_size())
            p, s = step(p, s, (ids, y.view(-1, 3)[:, 0].repeat_interleave(3)))
        shapes = dict(Attention().named_parameters())
        out.append({k: v.full_tensor().view(shapes[k].shape) if shard else v for k, v in p.items()})
    return out


@pytest.mark.parametrize("units", ["auto", ["attn", "attn.out_proj", "head"]])
def test_a_module_using_another_units_parameter_gets_it_gathered(run, units):
    for dp, ours in run(2, _attention, units):
        _close(ours, dp)


def test_errors_name_the_parameter_its_shape_the_axis_and_the_fix(world1):
    apply, params, buffers = pardist.functional(Net())
    shards = pardist.fsdp(params)
    ids, y = batch(0)
    stored = r"\['embed.weight'\] \(shape \(13, 7\)\) is stored by pardist.fsdp as flat shards "
    with pytest.raises(RuntimeError, match=r"params" + stored + r"over axis 'gpu'.*inside "):
        apply(shards, buffers, ids)  # outside a step

    def decayed(p, b, ids, y):  # weight decay written by hand: uses the shards themselves
        penalty = sum(v.square().sum() for v in p.values())
        return F.cross_entropy(apply(p, b, ids)[0], y) + 1e-4 * penalty

    with pytest.raises(RuntimeError, match=r"args\[0\]" + stored + r".*outside functional's"):
        pardist.data_parallel(lambda p, b, d: pardist.grad(decayed)(p, b, *d))(
            shards, buffers, (ids, y)
        )
    with pytest.raises(RuntimeError, match=r"under torch.func transforms"):
        pardist.data_parallel(
            lambda p, b, d: torch.func.grad(lambda p: apply(p, b, d[0])[0].sum())(p)
        )(shards, buffers, (ids, y))
    with pytest.raises(ValueError, match=r"axis 'tpu' is not in the mesh"):
        pardist.fsdp(params, "tpu")
    with pytest.raises(TypeError, match=r"params\['n'\] has dtype torch.int64"):
        pardist.fsdp({"n": torch.tensor([1])})
    with pytest.raises(ValueError, match=r"params\['embed.weight'\] is already a DTensor"):
        pardist.fsdp(shards)
    with pytest.raises(ValueError, match=r"fsdp_units names 'block', which is not a submodule"):
        step = pardist.data_parallel(lambda p, b, d: apply2(p, b, d[0]))
        apply2, _, _ = pardist.functional(Net(), fsdp_units=["block"])
        step(shards, buffers, (ids, y))
    wrong = dict(shards, **{"head.bias": pardist.fsdp({"w": torch.ones(3)})["w"]})
    with pytest.raises(ValueError, match=r"params\['head.bias'\] is a DTensor of shape \(3,\).*"):
        pardist.data_parallel(lambda p, b, d: apply(p, b, d[0]))(wrong, buffers, (ids, y))
    mesh = pardist.Mesh({"a": 1, "b": 1})
    other = pardist.fsdp(params, "a", mesh=mesh)
    with pytest.raises(ValueError, match=r"shards over \('a',\), but .* data parallel over"):
        pardist.data_parallel(lambda p, b, d: apply(p, b, d[0]), axis="b", mesh=mesh)(
            other, buffers, (ids, y)
        )


def _unsupported() -> list[str]:
    apply, params, buffers = pardist.functional(Net())
    ids, y = batch(0, pardist.rank(), 2)
    messages = []

    def loss_fn(p, b, ids, y):
        return F.cross_entropy(apply(p, b, ids)[0], y)

    try:  # a row-weighted mean: the reduce-scatter would weigh every rank alike
        pardist.data_parallel(lambda p, b, d: pardist.grad(loss_fn, mean="rows")(p, b, *d))(
            pardist.fsdp(params), buffers, (ids, y)
        )
    except ValueError as e:
        messages.append(str(e))
    mesh = pardist.Mesh({"data": 1, "model": 2})
    try:  # a model axis beyond the step's: the gathers are not typed for it
        pardist.data_parallel(
            lambda p, b, d: pardist.grad(loss_fn)(p, b, *d), axis="data", mesh=mesh
        )(pardist.fsdp(params, "data", mesh=mesh), buffers, batch(0))  # the same on both
    except RuntimeError as e:
        messages.append(str(e))
    return messages


def test_unsupported_combinations_raise_instead_of_a_wrong_number(run):
    for messages in run(2, _unsupported):
        assert len(messages) == 2, messages
        assert "mean='rows' is not supported with pardist.fsdp parameters" in messages[0]
        assert "model axes ['model'] are not supported yet" in messages[1]


def test_optimizer_errors_for_mixed_shards_and_full_tensors(world1):
    _, params, _ = pardist.functional(Net())
    shards = pardist.fsdp(params)
    opt = optim.adamw(1e-2)
    with pytest.raises(ValueError, match=r"opt_state.exp_avg\['embed.weight'\] has shape \(13,"):
        opt.update(shards, opt.init(params), shards)  # state made for the full params
    with pytest.raises(ValueError, match=r"grads\['embed.weight'\] is a Tensor but its param"):
        opt.update(dict(shards, **{"embed.weight": torch.zeros(91)}), opt.init(shards), shards)
    zero = optim.sharded(optim.adamw(1e-2))
    with pytest.raises(ValueError, match=r"the state was made for parameters.*pardist.fsdp"):
        zero.update(shards, zero.init(params), shards)
    mesh = pardist.Mesh({"node": 1, "gpu": 1})
    with pytest.raises(ValueError, match=r"over \('node', 'gpu'\): params\['embed.weight'\] "):
        optim.sharded(optim.adamw(1e-2), ("node", "gpu"), mesh=mesh).init(
            pardist.fsdp(params, "gpu", mesh=mesh)
        )


class Diverging(Net):
    """Runs its blocks in another order on rank 1: data-dependent control flow gone wrong."""

    def forward(self, ids):
        blocks = list(self.blocks)[:: -1 if pardist.rank() == 1 else 1]
        x = self.embed(ids)
        for block in blocks:
            x = block(x)
        return self.head(x)


def _diverge(kind: str):
    units = None if kind == "units" and pardist.rank() == 1 else [Block]
    apply, params, buffers = pardist.functional(
        Diverging() if kind == "order" else Net(), fsdp_units=units
    )
    shards = pardist.fsdp(params)
    if kind == "params" and pardist.rank() == 1:  # one rank kept a parameter replicated
        shards["head.bias"] = params["head.bias"]
    step = pardist.data_parallel(lambda p, b, d: apply(p, b, d[0])[0])
    try:
        step(shards, buffers, batch(0, pardist.rank(), 2))
    except (RuntimeError, ValueError) as e:  # raised on both ranks alike: the group lives on
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "kind, shm, message",
    [
        ("units", "1", r"the FSDP units differ between group rank 0 and group rank 1"),
        ("params", "1", r"replicated inputs must be identical .* leaves on rank 0 but"),
        ("order", "1", r"gathered different units \(rank 0: 'blocks.0', rank 1: 'blocks.1'"),
        ("order", "0", r"gathered different units \(rank 0: 'blocks.0', rank 1: 'blocks.1'"),
    ],
)
def test_ranks_that_disagree_fail_fast_naming_the_difference(run, kind, shm, message):
    env = {"PARDIST_SHM": "0"} if shm == "0" else None
    for error in run(2, _diverge, kind, env=env):  # every rank raises: nothing hangs
        assert re.search(message, error), error
