"""data_parallel(step, compile=True): one graph per step, the eager step's numbers, replicas equal.

Compiling is slow on two cores, so the models are tiny, each compiled step serves
several assertions, inductor compiles with one thread, and most cases use the
``aot_eager`` backend (dynamo and AOT autograd, the same graph, without inductor's
code generation); the MLP cases, one with batch norm, run the default backend,
inductor, end to end.
"""

from __future__ import annotations

import collections
import random
import warnings

import helpers
import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

import pardist
from pardist import optim

F64 = torch.float64  # compiled, eager and the references compute in float64 (numerics.py)
LIMIT = 300  # seconds per call: compiling is slow on a loaded machine


def _fresh_dynamo() -> None:
    """A fresh dynamo cache (the kept-alive test ranks compiled the same step code for
    other models in earlier tests), and inductor compiling with one thread."""
    torch._dynamo.reset()
    torch._inductor.config.compile_threads = 1


class _Counter:
    """A backend that keeps every graph it compiled (dynamo's restarts are not graphs)."""

    def __init__(self, backend: str):
        _fresh_dynamo()
        self.backend, self.graphs = backend, []

    def __call__(self, gm, example_inputs):
        compiled = torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)
        self.graphs.append(gm)
        return compiled


def _collectives_in(graphs) -> collections.Counter:
    """The collective operators a compiled graph holds (so they are in it, not around it)."""
    names = collections.Counter()
    for module in (m for gm in graphs for m in gm.modules() if hasattr(m, "graph")):
        for node in module.graph.nodes:
            name = str(node.target)
            if name.startswith(("pardist.", "_c10d_functional.")):
                names[name.split(".")[1]] += 1  # shm_all_reduce, all_reduce, wait_tensor, ...
    return names


def _train_both(model: str, opt_name: str, backend: str, sync_bn: bool = True, donate: bool = True):
    counter = _Counter(backend)
    train = dict(steps=3, donate=donate, sync_bn=sync_bn, dtype=F64)
    eager = helpers.train_pardist(model, opt_name, **train)
    compiled = helpers.train_pardist(model, opt_name, **train, compile={"backend": counter})
    return eager, compiled, len(counter.graphs), _collectives_in(counter.graphs)


def _assert_equal_numbers(eager, compiled, reference=None):
    params, buffers, losses, _ = compiled
    assert_close64(params, eager[0], "parameters")
    if reference is not None:
        assert_close64(params, reference[0], "parameters against the reference")
    assert_close64(buffers, eager[1], "buffers")
    assert_close64(losses, eager[2], "losses")


def _assert_replicas_identical(results):
    for prints in zip(*(compiled[3] for _, compiled, _, _ in results)):
        for other in prints[1:]:
            for k in prints[0]:
                assert torch.equal(prints[0][k], other[k]), k


# The MLPs run the default path (inductor); the BN conv net runs aot_eager, whose
# graph is the same one inductor would get. The BN models use SGD: a bias that feeds
# batch norm has a gradient of rounding noise, which AdamW would amplify. The BN MLP
# under inductor: before torch 2.15 inductor computes batch norm's two sums straight
# into the buffer of their cat (for sync batch norm's all-reduce) and reuses that
# buffer once the cat is read, so the gradient mean must not write over the sums
# (it did, 0.0025 off, where the update's new parameters got fresh buffers: no donation).
CASES = [
    ("mlp", "adamw", "inductor", True),
    ("bn_mlp", "sgd", "inductor", False),
    ("convnet", "sgd", "aot_eager", True),
]


@pytest.mark.parametrize("model,opt_name,backend,donate", CASES)
def test_step_compiles_to_one_graph_with_the_eager_numbers(
    run, world1, model, opt_name, backend, donate
):
    reference = helpers.train_pardist(model, opt_name, steps=3, whole_batch=True, dtype=F64)
    results = run(2, _train_both, model, opt_name, backend, True, donate, timeout=LIMIT)
    for *_, graphs, collectives in results:
        assert graphs == 1  # one graph, and the second and third calls did not recompile
        # The gradient mean (a sum per bucket) and sync batch norm's statistics (a
        # psum per layer in the forward, another in the backward) are graph nodes.
        assert collectives["shm_sum_start"] == collectives["shm_sum_wait"] >= 1
        assert collectives["shm_all_reduce"] >= (0 if model == "mlp" else 4)
    _assert_replicas_identical(results)
    # (float64: a compiled AdamW's bias corrections are computed in float64 too; in
    # float32 they were 1.3e-5 off, 6e-6 of an update a step)
    for eager, compiled, _, _ in results:
        _assert_equal_numbers(eager, compiled, reference)


def _loss_compiled(sync_bn: bool):
    _fresh_dynamo()
    train = dict(steps=3, donate=True, sync_bn=sync_bn, dtype=F64)
    eager = helpers.train_pardist("convnet", "sgd", **train)
    compiled = helpers.train_pardist("convnet", "sgd", **train, compile_loss={"dynamic": False})
    # Per-rank batch norm is DDP's (no SyncBatchNorm on CPU): DDP is the reference there.
    ddp = None if sync_bn else helpers.train_ddp("convnet", "sgd", steps=3, dtype=F64)
    return eager, compiled, ddp


def _wide_net() -> torch.nn.Module:
    torch.manual_seed(0)  # 565,600 float64 parameters: a 4.5 MB bucket, past the shared region
    return torch.nn.Sequential(torch.nn.Linear(8, 700), torch.nn.Tanh(), torch.nn.Linear(700, 800))


def _wide_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=g, dtype=F64), torch.randn(6, 800, generator=g, dtype=F64)


def _wide_stepper(compile):  # noqa: A002
    """The wide net's loss and mean gradients on this rank's rows: a step to call."""
    _fresh_dynamo()
    apply, params, buffers = pardist.functional(_wide_net().to(F64))

    def step(params, batch):
        x, y = batch
        return pardist.value_and_grad(lambda p: F.mse_loss(apply(p, buffers, x)[0], y))(params)

    step = pardist.data_parallel(step, compile=compile)
    rank, world = pardist.rank(), pardist.world_size()
    batch = tuple(helpers.shard(t, rank, world) for t in _wide_batch())
    return lambda: step(params, batch)


def _wide_step(compile):  # noqa: A002
    """The wide net's loss and mean gradients on this rank's rows, one step."""
    return _wide_stepper(compile)()


def _wide_grads():
    counter = _Counter("aot_eager")
    return _wide_step({"backend": counter}), _collectives_in(counter.graphs)


def _wide_overlap():
    """The wide net compiled by inductor over functional collectives: with pardist's
    overlap scheduling (the order of inductor's scheduled kernels recorded: C a
    collective, W a wait, M a matrix product), without it, and eagerly."""
    from torch._inductor import comms

    from pardist.compile import _backend as _step

    order: list[str] = []

    def record(nodes):
        kinds = [(comms.contains_collective, "C"), (comms.contains_wait, "W")]
        kinds.append((comms.contains_gemm_like, "M"))
        order.extend(next((k for test, k in kinds if test(n)), ".") for n in nodes)
        return nodes

    default = _step.overlap_options
    passes = default()["reorder_for_compute_comm_overlap_passes"]
    recorded = {**default(), "reorder_for_compute_comm_overlap_passes": [*passes, record]}
    _step.overlap_options = lambda: recorded
    try:  # (no cache: the recording pass is no key a cache can pickle)
        with torch._inductor.config.patch(fx_graph_cache=False):
            overlapped = _wide_step(True)
    finally:
        _step.overlap_options = default
    in_order = _wide_step({"options": {"reorder_for_compute_comm_overlap": False}})
    return "".join(order), overlapped, in_order, _wide_step(False)


def test_a_large_bucket_is_divided_into_shared_memory_inside_the_graph(run):
    # One micro-batch at 3 ranks: the graph's bucket operator divides each gradient by
    # the rank count as it writes it into shared memory (the arena, past 4 MB).
    net = _wide_net().to(F64)
    x, y = _wide_batch()
    loss = F.mse_loss(net(x), y)  # one process, the whole batch: the reference
    want = dict(zip(dict(net.named_parameters()), torch.autograd.grad(loss, net.parameters())))
    for (value, grads), collectives in run(3, _wide_grads, timeout=LIMIT):
        assert collectives["shm_sum_start"] == collectives["shm_sum_wait"] >= 1
        assert_close64(grads, want, "gradients")
        assert_close64(float(value), float(loss), "loss")


def test_buckets_over_gloo_overlap_the_backward_with_the_same_bits(run):
    """Over torch's functional collectives (gloo here, nccl on GPUs) the graph issues its
    first bucket's all-reduce while the backward still has matrix products to run and
    waits for it after them, as DDP's hooks overlap; the order of the kernels changes,
    not their arithmetic."""
    net = _wide_net().to(F64)
    x, y = _wide_batch()
    loss = F.mse_loss(net(x), y)  # one process, the whole batch: the reference
    want = dict(zip(dict(net.named_parameters()), torch.autograd.grad(loss, net.parameters())))
    env = {"PARDIST_SHM": "0"}
    for order, overlapped, in_order, eager in run(2, _wide_overlap, env=env, timeout=LIMIT):
        # Two buckets (the last layer's 4.5 MB, then the first layer's); the first is
        # issued after the last layer's weight gradient, with two products still to run.
        assert order.count("C") == 2 and order.count("W") == 2, order
        assert "M" in order[order.index("C") : order.index("W")], order
        for k in want:
            assert torch.equal(overlapped[1][k], in_order[1][k]), k
        assert torch.equal(overlapped[0], in_order[0])
        assert_close64(overlapped[1], eager[1], "gradients against the eager step")
        assert_close64(overlapped[1], want, "gradients against one process")


def _profiled_order(compile) -> tuple[str, tuple, tuple]:  # noqa: A002
    """The wide net's step, compiled; its second call profiled: the main thread's order of
    bucket starts (S), matrix products (M) and waits (W), and both calls' results."""
    step = _wide_stepper(compile)
    first = step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        again = step()
    kinds = {"pardist.shm_sum_start": "S", "pardist.shm_sum_wait": "W"}  # (named by pardist)
    kinds.update({"aten::mm": "M", "aten::addmm": "M"})
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    return "".join(kinds[e.name] for e in events if e.name in kinds), first, again


def _wide_beside():
    """The wide net compiled by inductor over shared memory: by default; without
    inductor's memory pass, which also moves kernels; without that and pardist's pass
    that issues the starts early; and eagerly."""
    alone = {"reorder_for_peak_memory": False}
    in_order = {**alone, "post_grad_custom_post_pass": None}
    variants = (True, {"options": alone}, {"options": in_order})
    return [_profiled_order(compile) for compile in variants], _wide_step(False)


def test_shared_memory_buckets_are_summed_beside_the_backward_with_the_same_bits(run):
    """Between CPU ranks of one host the graph starts its first bucket's sum (on the
    rank's helper thread) while the backward still has matrix products to run, and
    waits for it after them; the sums are the synchronous transport's, bit for bit."""
    net = _wide_net().to(F64)
    x, y = _wide_batch()
    loss = F.mse_loss(net(x), y)  # one process, the whole batch: the reference
    want = dict(zip(dict(net.named_parameters()), torch.autograd.grad(loss, net.parameters())))
    env = {"PARDIST_SHM_HELPER": "1"}  # (this machine's two cores are the ranks' own)
    for compiled, eager in run(2, _wide_beside, env=env, timeout=LIMIT):
        # Two buckets (the last layer's 4.5 MB, then the first layer's): both started
        # before either is waited for, the first with two products still to run (but
        # in the graph as traced, where the last layer's weight gradient comes last).
        for order, _, _ in compiled:
            assert order.count("S") == 2 and order.count("W") == 2, order
            assert order.rindex("S") < order.index("W"), order
        default, alone, in_order = (order for order, _, _ in compiled)
        assert alone.index("S") == 3 and in_order.index("S") == 5, (alone, in_order)
        assert "M" in default[default.index("S") : default.index("W")], default
        _, (value, grads), _ = compiled[0]
        for _, *calls in compiled:  # the same bits, whatever the order, call after call
            for v, g in calls:
                assert torch.equal(v, value) and all(torch.equal(g[k], grads[k]) for k in want)
        assert_close64(grads, eager[1], "gradients against the eager step")
        assert_close64(grads, want, "gradients against one process")


def _two_grads(compile):  # noqa: A002
    """Two pardist.grad calls in one step (a GAN's two players), two buckets each."""
    _fresh_dynamo()
    g = torch.Generator().manual_seed(2)
    shapes = {"w": (700, 700), "b": (700,)}  # 3.9 MB and 5.6 kB: two buckets
    params = {
        p: {k: torch.randn(*s, generator=g, dtype=F64) for k, s in shapes.items()}
        for p in ("g", "d")
    }
    x = helpers.shard(torch.randn(6, 700, generator=g, dtype=F64), pardist.rank(), 2)

    @pardist.data_parallel(compile=compile)
    def step(params, x):
        first = pardist.grad(lambda p: (x @ p["w"] + p["b"]).tanh().sum())(params["g"])
        second = pardist.grad(lambda p: (x @ p["w"] - p["b"]).pow(2).mean())(params["d"])
        return first, second

    return step(params, x)


def _two_grads_both():
    alone = {"options": {"reorder_for_peak_memory": False}}  # pardist's order as it is
    return _two_grads(alone), _two_grads(False)


def test_two_gradient_means_in_one_step_keep_their_own_sums(run):
    """Each mean's buckets have shared memory of their own: the second's start, which
    runs before the first's waits, must not overwrite sums the first has yet to read."""
    env = {"PARDIST_SHM_HELPER": "1"}  # (the worker group of the test above)
    for *compiled, eager in run(2, _two_grads_both, env=env, timeout=LIMIT):
        for grads in compiled:
            for mine, want, name in zip(grads, eager, ("first", "second")):
                assert_close64(mine, want, f"the {name} gradients against the eager step")


def _tied_loss(p, x, z):
    """``p + q``: autograd hands both parameters one gradient tensor (this rank's z[0])."""
    return (x @ p["w"]).pow(2).mean() + ((p["p"] + p["q"]) * z[0]).sum()


def _untied_loss(p, x, z):
    """The same gradients, bit for bit, in two tensors."""
    return (x @ p["w"]).pow(2).mean() + (p["p"] * z[0]).sum() + (p["q"] * z[0]).sum()


def _tied_params() -> dict:
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (600, 600), "p": (400, 500), "q": (400, 500)}  # 2.9, 1.6, 1.6 MB
    return {k: torch.randn(*s, generator=g, dtype=F64) for k, s in shapes.items()}


def _tied_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 600, generator=g, dtype=F64), torch.randn(6, 500, generator=g, dtype=F64)


def _tied_grads(loss, compile=True):  # noqa: A002
    _fresh_dynamo()
    step = pardist.data_parallel(lambda p, b: pardist.grad(loss)(p, *b), compile=compile)
    rank, world = pardist.rank(), pardist.world_size()
    return step(_tied_params(), tuple(helpers.shard(t, rank, world) for t in _tied_batch()))


def _tied_and_untied():
    return _tied_grads(_tied_loss), _tied_grads(_untied_loss), _tied_grads(_tied_loss, False)


def test_two_parameters_given_one_gradient_are_each_reduced_once(run):
    """The graph writes each sum back over its gradient. Where two parameters share one
    gradient tensor (here in different buckets), a sum written before the other is read
    would be averaged twice: at 3 ranks, a rounding off the same gradients held apart."""
    x, z = _tied_batch()
    want = torch.func.grad(lambda p: (x @ p["w"]).pow(2).mean())(_tied_params())
    want["p"] = want["q"] = z[::2].mean(0).expand(400, 500)  # the ranks' z[0], averaged
    for tied, untied, eager in run(3, _tied_and_untied, timeout=LIMIT):
        for k in tied:
            assert torch.equal(tied[k], untied[k]), k
        assert_close64(tied, eager, "gradients against the eager step")
        assert_close64(tied, want, "gradients against one process")


@pytest.mark.parametrize("sync_bn", [True, False], ids=["sync_bn", "per_rank_bn"])
def test_a_compiled_loss_in_an_eager_step_has_the_eager_numbers(run, world1, sync_bn):
    """The other way to compile (docs/compile.md): pardist.grad(torch.compile(loss_fn)),
    forward and backward in AOTAutograd's graphs, the gradient mean and update eager.
    With cross-replica batch norm the graph breaks at each norm (its collectives)."""
    reference = helpers.train_pardist("convnet", "sgd", steps=3, whole_batch=True, dtype=F64)
    results = run(2, _loss_compiled, sync_bn, timeout=LIMIT)
    for eager, compiled, ddp in results:
        _assert_equal_numbers(eager, compiled, reference if sync_bn else (ddp,))
    _assert_replicas_identical([(eager, compiled, None, None) for eager, compiled, _ in results])


def test_gloo_transport_three_ranks_and_per_shard_batch_norm(run):
    """Without shared memory, torch's functional collectives over gloo are in the graph."""
    env = {"PARDIST_SHM": "0"}
    results = run(3, _train_both, "convnet", "sgd", "aot_eager", False, env=env, timeout=LIMIT)
    ddp = run(3, helpers.train_ddp, "convnet", "sgd", steps=3, dtype=F64, env=env, timeout=LIMIT)
    for eager, compiled, graphs, collectives in results:
        assert graphs == 1
        assert {"all_reduce", "wait_tensor"} <= set(collectives)
        # sync_bn=False: per-shard statistics, averaged in the graph like the eager step
        _assert_equal_numbers(eager, compiled)
        assert_close64(compiled[0], ddp[0], "parameters against DDP")
    _assert_replicas_identical(results)


def _zero_optimizer():
    schedule = lambda count: 0.1 / (1 + count)  # noqa: E731
    sgd = optim.sgd(schedule, momentum=0.9, dampening=0.1, weight_decay=1e-3)
    return optim.chain(optim.clip_by_global_norm(1.0), sgd)


def _transformer_zero(compile, steps: int = 3):
    """A transformer block with a sharded optimizer (ZeRO-2), 2 micro-batches, donation,
    a learning-rate schedule, clipping and SGD's dampened first step."""
    apply, params, _ = pardist.functional(helpers.transformer().double())
    opt = optim.sharded(_zero_optimizer())
    state = opt.init(params)

    def loss_fn(p, x, y):
        return F.cross_entropy(apply(p, {}, x)[0], y)

    def step(p, state, batch):
        loss, g = pardist.value_and_grad(loss_fn, accumulate=2, batch_argnums=(1, 2))(p, *batch)
        kinds = {type(v).__name__ for v in g.values()}
        p, state = opt.update(g, state, p)
        return p, state, loss, kinds

    counter = _Counter("aot_eager")
    dp = pardist.data_parallel(
        step, donate_argnums=(0, 1), compile={"backend": counter} if compile else False
    )
    losses, kinds, prints = [], set(), []
    for s in range(steps):
        x, y = helpers.global_batch(s, "transformer", dtype=F64)
        x, y = helpers.shard(x, pardist.rank(), 2), helpers.shard(y, pardist.rank(), 2)
        params, state, loss, k = dp(params, state, (x, y))
        losses.append(float(loss))
        kinds |= k
        prints.append({k: v.clone() for k, v in params.items()})
    held = [
        t.to_local().numel()
        for t in pardist.runtime._tree.tree_leaves(state.inner)
        if isinstance(t, DTensor)
    ]
    return params, losses, kinds, prints, len(counter.graphs), _collectives_in(counter.graphs), held


def _one_process(steps: int = 3):
    """The same training, unsharded, in one process on the whole batch."""
    apply, params, _ = pardist.functional(helpers.transformer().double())
    opt = _zero_optimizer()
    state = opt.init(params)
    for s in range(steps):
        x, y = helpers.global_batch(s, "transformer", dtype=F64)
        g = pardist.grad(lambda p, x, y: F.cross_entropy(apply(p, {}, x)[0], y))(params, x, y)
        params, state = opt.update(g, state, params)
    return params


def test_transformer_block_with_sharded_optimizer_and_accumulation(run, world1):
    reference = _one_process()
    eager = run(2, _transformer_zero, False, timeout=LIMIT)
    compiled = run(2, _transformer_zero, True, timeout=LIMIT)
    for (p_e, l_e, *_), (p_c, l_c, kinds, _, graphs, collectives, held) in zip(eager, compiled):
        assert graphs == 1
        assert kinds == {"DTensor"}  # gradients reduce-scattered into shards (ZeRO-2)
        assert {"shm_reduce_scatter", "shm_all_gather"} <= set(collectives)
        assert sum(held) <= sum(v.numel() for v in p_c.values()) // 2 + 64  # half, padded
        assert_close64(p_c, p_e, "compiled against eager")
        assert_close64(p_c, reference, "compiled against one process")
        assert_close64(l_c, l_e, "losses")
    for a, b in zip(compiled[0][3], compiled[1][3]):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def _collectives_step(compile):
    def loss_fn(w, x):
        z = x @ w
        everyone = pardist.all_gather(z, "gpu", dim=1)  # differentiable
        top = pardist.pmax(z.detach().abs().amax(), "gpu")
        peaks = pardist.pmax(z.tanh(), "gpu")  # differentiable: its cotangent to the max
        shared = pardist.all_gather(z.sin(), "gpu", dim=0, invariant=True)  # my block back
        sums = pardist.psum({"a": z.sum(), "b": z.square().sum()}, "gpu")
        index, size = pardist.axis_index("gpu"), pardist.axis_size("gpu")
        mean = pardist.pmean(z.mean() * (index + 1) / size, "gpu")
        terms = 1e-3 * sums["a"] + 1e-4 * sums["b"] + mean + 1e-2 * peaks.sum()
        terms = terms + 1e-2 * shared.square().mean()
        return everyone.square().mean() / top + terms

    def step(w, x):
        value, g = pardist.value_and_grad(loss_fn)(w, x)
        return w - 0.1 * g, value

    counter = _Counter("aot_eager")
    dp = pardist.data_parallel(step, compile={"backend": counter} if compile else False)
    g = torch.Generator().manual_seed(pardist.rank())
    w, x = (
        torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=F64),
        torch.randn(6, 4, generator=g, dtype=F64),
    )
    values = []
    for _ in range(3):
        w, value = dp(w, x)
        values.append(value)
    return w, values, len(counter.graphs)


def test_collectives_inside_a_compiled_step(run):
    env = {"PARDIST_SHM": "0"}  # the gloo group of the test above: functional collectives
    eager = run(3, _collectives_step, False, env=env, timeout=LIMIT)
    compiled = run(3, _collectives_step, True, env=env, timeout=LIMIT)
    for (w_e, v_e, _), (w_c, v_c, graphs) in zip(eager, compiled):
        assert graphs == 1  # compiled, not fallen back to the eager step
        assert_close64(w_c, w_e, "weights")
        assert_close64(v_c, v_e, "values")
    assert torch.equal(compiled[0][0], compiled[1][0]) and torch.equal(
        compiled[0][0], compiled[2][0]
    )


def _uncompilable(kind: str, compile):
    def step(w, x):
        value, g = pardist.value_and_grad(lambda w, x: (x @ w).square().mean())(w, x)
        if kind == "branch" and value > 0.5:  # Python control flow on a tensor's value
            g = g * 2
        if kind == "one_rank" and pardist.rank() == 0:  # only rank 0 cannot trace
            torch._dynamo.graph_break()
        return w - 0.1 * g, value

    dp = pardist.data_parallel(step, compile={"backend": "aot_eager"} if compile else False)
    w, x = torch.ones(4, 3), torch.randn(6, 4, generator=torch.Generator().manual_seed(9))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            w, _ = dp(w, x * (1 + pardist.rank()))
    return w, [str(c.message) for c in caught if "pardist" in str(c.message)]


@pytest.mark.parametrize("kind", ["branch", "one_rank"])
def test_uncompilable_step_falls_back_once_with_the_reason(run, kind):
    eager = run(2, _uncompilable, kind, False, timeout=LIMIT)
    compiled = run(2, _uncompilable, kind, True, timeout=LIMIT)
    for (w_e, _), (w_c, messages) in zip(eager, compiled):
        assert torch.equal(w_c, w_e)  # the eager step ran: exactly its numbers
        assert len(messages) == 1, messages
        assert "could not make the whole step one graph" in messages[0]
        assert "runs eagerly with its loss compiled" in messages[0]
    reasons = [messages[0] for _, messages in compiled]
    if kind == "branch":
        assert all("Data-dependent branching" in r and "value > 0.5" in r for r in reasons)
        assert all("Keep Python control flow off tensor values" in r for r in reasons)
    else:
        assert not any("control flow" in r for r in reasons)  # a graph break is no branch
    if kind == "branch":
        pass
    else:  # rank 1 could compile, but follows rank 0 so that collectives never mix
        assert "graph_break" in reasons[0] and "on rank 0" in reasons[1]


def _spellings():
    def step(w, x):
        return w - 0.1 * pardist.grad(lambda w, x: (x @ w).square().mean())(w, x)

    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(pardist.rank()), dtype=F64)
    wrapped = pardist.data_parallel(step)
    outer = torch.compile(wrapped)  # torch.compile around the step
    inner = pardist.data_parallel(torch.compile(step))  # the step compiled first
    eager = pardist.data_parallel(step)
    w = torch.ones(4, 3, dtype=F64)
    got = [f(f(w, x), x) for f in (eager, outer, inner)]
    compiled = [wrapped.compiled, inner.compiled]
    return got, [c is not None and c.fallback is None and c.calls == 2 for c in compiled]


def test_torch_compile_spellings_compile_the_whole_step(run):
    for (eager, outer, inner), flags in run(2, _spellings, timeout=LIMIT):
        assert flags == [True, True]
        assert_close64(outer, eager, "torch.compile(data_parallel(step))")
        assert_close64(inner, eager, "data_parallel(torch.compile(step))")


def _eager_only(compile):
    """A step compile=True runs eagerly (a model axis of size 2), and one it compiles since
    round 5 (mean='rows', uneven shards over two axes): float64 both.

    At 4 ranks, on the 2x2 mesh test_shard_map uses: a mesh's axes label its groups
    (for error messages) in the kept-alive process group of that size.
    """
    out = {}
    mesh = pardist.Mesh({"data": 2, "model": 2})
    for kind, axis, mean in [("model", "data", "ranks"), ("rows", ("data", "model"), "rows")]:

        def step(w, x, mean=mean):
            loss = lambda w, x: (x @ w).square().mean()  # noqa: E731
            value, g = pardist.value_and_grad(loss, mean=mean)(w, x)
            return w - 0.1 * g, value

        dp = pardist.data_parallel(
            step, axis, mesh=mesh, compile={"backend": "aot_eager"} if compile else False
        )
        shard = mesh.index(axis)  # the same batch on the ranks of 'model' for kind 'model'
        rows = 6 if kind == "model" else 6 + 2 * shard  # uneven shards for 'rows'
        g = torch.Generator().manual_seed(9 + shard)
        w, x = torch.ones(4, 3, dtype=F64), torch.randn(rows, 4, generator=g, dtype=F64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                w, value = dp(w, x)
        out[kind] = w, value, [str(c.message) for c in caught if "compile=True" in str(c.message)]
    return out


def test_steps_beyond_the_compiled_path_run_eagerly_with_one_warning(run):
    eager = run(4, _eager_only, False, timeout=LIMIT)
    compiled = run(4, _eager_only, True, timeout=LIMIT)
    for e, c in zip(eager, compiled):
        (w_e, v_e, _), (w_c, v_c, messages) = e["model"], c["model"]
        assert torch.equal(w_c, w_e) and torch.equal(v_c, v_e)  # the eager step ran
        assert len(messages) == 1 and "'model': 2" in messages[0], messages
        assert "runs eagerly instead" in messages[0]  # (no loss compiled: tracked axes)
        (w_e, v_e, _), (w_c, v_c, messages) = e["rows"], c["rows"]
        assert messages == []  # one graph, the rows weighed in it
        assert_close64((w_c, v_c), (w_e, v_e), "mean='rows' compiled")


def _cast(t, dtype):
    return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _varying_shapes(schedule: list):
    """A BN MLP (SGD momentum), eager and compiled side by side, fed batches of changing
    size and dtype. Each stretch of one dtype starts both from the eager step's state, so
    that it is computed alike on both; returns, eager then compiled, each stretch's end:
    (the parameters' dtypes, the parameters in float64), and the warnings and graphs."""
    counter = _Counter("aot_eager")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )
    apply, params, buffers = pardist.functional(model)
    opt = optim.sgd(0.1, momentum=0.9)

    def step(p, b, s, batch):
        def loss_fn(p, b, x, y):
            out, b = apply(p, b, x)
            return F.mse_loss(out, y), b

        (loss, b), g = pardist.value_and_grad(loss_fn, has_aux=True)(p, b, *batch)
        p, s = opt.update(g, s, p)
        return p, b, s, loss

    steps = {
        "eager": pardist.data_parallel(step),
        "compiled": pardist.data_parallel(step, compile={"backend": counter}),
    }
    state = {name: (params, buffers, opt.init(params)) for name in steps}
    ends = {name: [] for name in steps}
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i, (rows, dtype) in enumerate(schedule):  # rows per rank
            x = torch.randn(2, rows, 4, generator=g)[pardist.rank()]
            y = x.sum(1, keepdim=True)
            if i == 0 or schedule[i - 1][1] != dtype:  # a new stretch: both from eager's
                start = tuple(tree_map(lambda t, d=dtype: _cast(t, d), t) for t in state["eager"])
                state = {name: start for name in steps}
            for name, dp in steps.items():
                p, b, s, _ = dp(*state[name], (x.to(dtype), y.to(dtype)))
                state[name] = p, b, s
            if i + 1 == len(schedule) or schedule[i + 1][1] != dtype:  # the stretch's end
                for name in steps:
                    p = state[name][0]
                    ends[name].append(
                        ({t.dtype for t in p.values()}, tree_map(lambda t: _cast(t, F64), p))
                    )
    caught = [str(w.message) for w in seen if "pardist" in str(w.message)]
    return ends["eager"], ends["compiled"], caught, len(counter.graphs)


def test_compiled_step_never_crashes_on_fifty_batch_sizes(run):
    sizes = list(range(1, 51))  # rows per rank, one row per rank included
    random.Random(0).shuffle(sizes)
    for eager, compiled, warned, graphs in run(
        2, _varying_shapes, [(n, F64) for n in sizes], timeout=LIMIT * 3
    ):
        assert not warned, warned  # one dynamic graph serves them: no fallback
        assert graphs <= 4, graphs  # the first size, the dynamic graph, one row per rank
        (dtypes, eager), (compiled_dtypes, compiled) = eager[0], compiled[0]
        assert dtypes == compiled_dtypes == {F64}
        assert_close64(compiled, eager, "parameters")  # float64 throughout


def test_compiled_step_follows_dtype_changes(run):
    f32, f64 = torch.float32, torch.float64
    schedule = [(4, f64), (4, f64), (4, f32), (4, f32), (4, f64), (4, f64)]
    for eager, compiled, warned, graphs in run(2, _varying_shapes, schedule, timeout=LIMIT):
        assert not warned, warned
        assert graphs == 2, graphs  # one per dtype; back to float64 reuses the first
        # Each stretch started alike on both: its parameters have the stretch's dtype, and
        # the float64 stretches (the first graph, and the same graph again after the
        # float32 one) give the eager numbers up to float64 rounding. float32 training
        # has no bound from analysis: that stretch is checked for its dtype (which graph ran).
        assert [d for d, _ in eager] == [d for d, _ in compiled] == [{f64}, {f32}, {f64}]
        for i in (0, 2):
            assert_close64(compiled[i][1], eager[i][1], f"stretch {i}'s parameters")
