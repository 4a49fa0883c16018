"""Tensor parallelism on a 2x2 mesh ('data' x 'model') against one process on the whole batch.

Each model is written once as a function of its parameters, with the model-axis
reduction passed in: ``pardist.psum(., 'model')`` on 4 ranks, the identity in
the reference, which runs plain torch (autograd, torch.optim.SGD) on the full
weights and the concatenated batch. Every step's gradients and parameters must
match, block by block, up to float64 rounding: both sides compute in float64
(numerics.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close64

import pardist
from pardist import P

F64 = torch.float64
STEPS = 3
D, H, HEADS, T = 8, 12, 4, 3


def mlp_params(g: torch.Generator) -> tuple[dict, dict]:
    """A Megatron MLP: layer norm, column-parallel w1 (+ its bias), row-parallel w2."""
    params = {
        "ln": 1 + 0.1 * torch.randn(D, generator=g, dtype=F64),
        "w1": torch.randn(D, H, generator=g, dtype=F64) / D**0.5,
        "b1": 0.1 * torch.randn(H, generator=g, dtype=F64),
        "w2": torch.randn(H, D, generator=g, dtype=F64) / H**0.5,
        "b2": 0.1 * torch.randn(D, generator=g, dtype=F64),  # added after the psum: no psum
    }
    specs = {"ln": P(), "w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
    return params, {**specs, "b2": P()}


def mlp(p: dict, x: torch.Tensor, reduce) -> torch.Tensor:
    h = F.layer_norm(x, (D,), p["ln"])
    return x + reduce(F.gelu(h @ p["w1"] + p["b1"]) @ p["w2"]) + p["b2"]


def attention_params(g: torch.Generator) -> tuple[dict, dict]:
    """Self-attention with its heads split over 'model' (columns of q, k, v; rows of o)."""
    params = {"ln": 1 + 0.1 * torch.randn(D, generator=g, dtype=F64)}
    for name in ("q", "k", "v", "o"):
        params[name] = torch.randn(D, D, generator=g, dtype=F64) / D**0.5
    params["bo"] = 0.1 * torch.randn(D, generator=g, dtype=F64)
    cols = P(None, "model")
    return params, {"ln": P(), "q": cols, "k": cols, "v": cols, "o": P("model", None), "bo": P()}


def attention(p: dict, x: torch.Tensor, reduce) -> torch.Tensor:
    b, t, _ = x.shape
    h = F.layer_norm(x, (D,), p["ln"])
    split = lambda w: (h @ w).view(b, t, -1, D // HEADS).transpose(1, 2)  # noqa: E731
    heads = F.scaled_dot_product_attention(split(p["q"]), split(p["k"]), split(p["v"]))
    return x + reduce(heads.transpose(1, 2).reshape(b, t, -1) @ p["o"]) + p["bo"]


MODELS = {"mlp": (mlp_params, mlp), "attention": (attention_params, attention)}


def data(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return tuple(torch.randn(n, T, D, generator=g, dtype=F64) for _ in range(2))


def block(t: torch.Tensor, spec: P, index: dict) -> torch.Tensor:
    """The block of a full tensor that the rank at ``index`` holds under ``spec``."""
    for dim, axis in enumerate(spec):
        if axis is not None:
            t = t.chunk(2, dim)[index[axis]]
    return t


def reference(model: str) -> list[tuple[dict, dict, float]]:
    """One process, plain torch: (grads, params, loss) after every step."""
    make, forward = MODELS[model]
    params, _ = make(torch.Generator().manual_seed(0))
    params = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    out = []
    for s in range(STEPS):
        x, y = data(s)
        opt.zero_grad()
        loss = (forward(params, x, lambda t: t) - y).square().mean()
        loss.backward()
        grads = {k: v.grad.clone() for k, v in params.items()}
        opt.step()
        out.append((grads, {k: v.detach().clone() for k, v in params.items()}, loss.item()))
    return out


def _train(model: str, loss_mean: bool, accumulate: int):
    """4 ranks: data_parallel over 'data' on a 2x2 mesh, weights split over 'model'."""
    make, forward = MODELS[model]
    mesh = pardist.Mesh({"data": 2, "model": 2})
    full, specs = make(torch.Generator().manual_seed(0))
    with mesh:
        params = pardist.local_block(full, specs)
        opt = pardist.optim.sgd(0.1, momentum=0.9)
        state = opt.init(params)
        state_specs = pardist.state_specs(state, params, specs)

    def loss_fn(p, x, y):
        local = (forward(p, x, lambda t: pardist.psum(t, "model")) - y).square().mean()
        return pardist.pmean(local, "data") if loss_mean else local  # both mean the same

    @pardist.data_parallel(
        axis="data",
        mesh=mesh,
        in_specs=(specs, state_specs, P("data")),
        out_specs=(specs, state_specs, specs, P()),
    )
    def step(p, state, batch):
        loss, grads = pardist.value_and_grad(loss_fn, accumulate=accumulate, batch_argnums=(1, 2))(
            p, *batch
        )
        p, state = opt.update(grads, state, p)
        return p, state, grads, loss

    index = {"data": mesh.index("data"), "model": mesh.index("model")}
    out = []
    for s in range(STEPS):
        x, y = data(s)
        batch = (x.chunk(2)[index["data"]], y.chunk(2)[index["data"]])
        params, state, grads, loss = step(params, state, batch)
        out.append((grads, params, loss.item()))
    return index, out


@pytest.mark.parametrize("model", ["mlp", "attention"])
def test_tensor_parallel_equals_one_process(run, model):
    expected = reference(model)
    specs = MODELS[model][0](torch.Generator().manual_seed(0))[1]
    # A per-rank loss, and one already averaged over 'data' in 2 micro-batches: the same steps.
    for loss_mean, accumulate in ((False, 1), (True, 2)):
        for index, steps in run(4, _train, model, loss_mean, accumulate):
            for s, ((grads, params, loss), (g1, p1, loss1)) in enumerate(zip(steps, expected)):
                where = f"{model} step {s} at {index} ({loss_mean=}, {accumulate=})"
                assert_close64(loss, loss1, f"loss, {where}")
                g1 = {k: block(v, specs[k], index) for k, v in g1.items()}
                assert_close64(grads, g1, f"gradients, {where}")
                p1 = {k: block(v, specs[k], index) for k, v in p1.items()}
                assert_close64(params, p1, f"parameters, {where}")


def _convnet_on_a_2x2_mesh():
    # Replicated over 'model', sharded over 'data': tracked, with cross-replica batch norm.
    import helpers

    mesh = pardist.Mesh({"data": 2, "model": 2})
    apply, params, buffers = pardist.functional(helpers.convnet().double())
    opt = pardist.optim.sgd(0.1, momentum=0.9)
    state = opt.init(params)

    def loss_fn(p, b, x, y):
        out, b = apply(p, b, x)
        return F.cross_entropy(out, y), b

    @pardist.data_parallel(axis="data", mesh=mesh)
    def step(p, b, state, batch):
        (loss, b), grads = pardist.value_and_grad(loss_fn, has_aux=True)(p, b, *batch)
        p, state = opt.update(grads, state, p)
        return p, b, state, loss

    d = mesh.index("data")
    for s in range(STEPS):
        x, y = helpers.global_batch(s, "convnet", dtype=F64)
        params, buffers, state, loss = step(params, buffers, state, (x.chunk(2)[d], y.chunk(2)[d]))
    return params, buffers


def test_batch_norm_in_a_tracked_step_equals_one_process(run):
    import helpers

    net = helpers.convnet().double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for s in range(STEPS):
        x, y = helpers.global_batch(s, "convnet", dtype=F64)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    for params, buffers in run(4, _convnet_on_a_2x2_mesh):
        assert_close64(params, {k: v.detach() for k, v in net.named_parameters()}, "params")
        assert_close64(buffers, dict(net.named_buffers()), "buffers")


def _errors():
    mesh = pardist.Mesh({"i": 2})
    r = pardist.rank()
    messages = {}

    def catch(name, fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            messages[name] = str(e)

    def mapped(f, in_specs, out_specs=None):
        return pardist.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs or P())

    # The ranks disagree on a spec, then on a block shape: both fail at once, on every rank.
    catch("spec", lambda: mapped(lambda x: x.sum(), P("i") if r == 0 else P())(torch.ones(2)))
    catch("block", lambda: mapped(lambda x: x.sum(), P("i"))(torch.ones(2 + r)))
    with mesh:
        catch("local_block", lambda: pardist.local_block({"w": torch.ones(3, 5)}, P(None, "i")))
        catch("scatter", lambda: pardist.psum_scatter({"g": torch.ones(3)}, "i"))
    catch("axis", lambda: mapped(lambda x: x, P("model"))(torch.ones(2)))

    def inplace(c, x):
        def loss(c):
            y = c * 1
            y += x  # y is the same on every rank, x is not, and y needs a gradient
            return y.sum()

        return pardist.grad(loss)(c)

    catch("inplace", lambda: mapped(inplace, (P(), P("i")), P("i"))(torch.ones(2), torch.ones(2)))
    catch("replicated", lambda: mapped(lambda c: c, P())(torch.full((2,), float(r))))

    # An overflow in one rank's block of the gradients: every rank skips the step.
    scaler = pardist.amp.dynamic_loss_scale()
    ls = scaler.init()
    g = torch.full((2,), float("inf") if r == 0 else 1.0)
    messages["finite"] = mapped(lambda g: scaler.unscale(g, ls)[1], P("i"))(g)
    return messages


def test_errors_name_the_path_the_axis_and_the_fix(run):
    for m in run(2, _errors):
        assert "pardist.shard_map(<lambda>): the ranks disagree" in m["spec"]
        assert (
            "args[0] has in_spec P('i') with block shape (2,) on rank 0 but P() on rank 1"
            in (m["spec"])
        )
        assert (
            "args[0] has in_spec P('i') with block shape (2,) on rank 0 but P('i') with "
            in (m["block"])
        )
        assert "block shape (3,) on rank 1" in m["block"] and "exact" in m["block"]
        assert "tree['w'] has shape (3, 5)" in m["local_block"]
        assert "splits dim 1 (size 5) over 'i' of size 2" in m["local_block"]
        assert "Pad dim 1 to a multiple of 2" in m["local_block"]
        assert "tree['g'] has shape (3,); its dim 0 (size 3) does not split" in m["scatter"]
        assert "axis 'model' is not in the mesh (axes: 'i' of size 2)" in m["axis"]
        assert "the in-place add_ writes a value that varies over ('i',)" in m["inplace"]
        assert "x = x + y" in m["inplace"]
        assert "args[0] differs between rank 0 and rank 1" in m["replicated"]
        assert "pardist.broadcast" in m["replicated"]
        assert m["finite"] is False


def test_shard_map_forms(world1):
    @pardist.shard_map(in_specs=(P(), P("gpu")), out_specs=P())
    def total(w, x):
        """Doc."""
        return pardist.psum((x * w).sum(), "gpu")

    assert total.__name__ == "total" and total.__doc__ == "Doc."
    direct = pardist.shard_map(lambda x: x * 2, in_specs=P(), out_specs=P())
    assert direct(torch.ones(2)).tolist() == [2.0, 2.0]
    assert total(torch.tensor(2.0), torch.ones(3)).item() == 6.0
    with pytest.raises(ValueError, match="one spec tree per positional argument; got 1 for 2"):
        pardist.shard_map(lambda a, b: a, in_specs=(P(),), out_specs=P())(torch.ones(1), 1)
    with pytest.raises(TypeError, match=r"shard_map\(f, in_specs=..., out_specs=...\)"):
        pardist.shard_map("gpu", in_specs=P(), out_specs=P())
