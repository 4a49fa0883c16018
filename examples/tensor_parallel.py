"""Train a small transformer with tensor and data parallelism on a 2-D mesh ('data' x 'model').

    python examples/tensor_parallel.py                                  # one process
    torchrun --standalone --nproc_per_node=4 examples/tensor_parallel.py  # 2 x 2 mesh

Every rank runs this script and holds its *block* of every weight: attention
heads, the MLP's hidden units and the vocabulary are split over 'model'
(Megatron's layout, written as specs: P(None, 'model') is a column block,
P('model', None) a row block); embeddings and norms are replicated. The batch is
split over 'data'. The step is ordinary per-rank code with three psums over
'model'; pardist works out the backward, inserting the psums Megatron writes by
hand (the gradient of a replicated value used by a split one). With 4 processes
the losses are those of one process on the same global batches.

The task: continue token sequences made by x[t + 1] = (5 * x[t] + 3) mod 32.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import pardist
from pardist import P

VOCAB, DIM, HEADS, LAYERS, LENGTH = 32, 32, 4, 2, 16


def init_params(g: torch.Generator) -> tuple[dict, dict]:
    """The full model (the same on every rank, from one seed) and each weight's spec."""

    def w(*shape):
        return torch.randn(*shape, generator=g) / shape[0] ** 0.5

    cols, rows = P(None, "model"), P("model", None)
    params = {"embed": torch.randn(VOCAB, DIM, generator=g), "pos": w(LENGTH, DIM) / 4}
    specs = {"embed": P(), "pos": P()}
    for i in range(LAYERS):
        params[f"{i}"] = {
            "ln1": torch.ones(DIM),
            "q": w(DIM, DIM),  # columns: 'model' rank m computes heads of block m
            "k": w(DIM, DIM),
            "v": w(DIM, DIM),
            "o": w(DIM, DIM),  # rows: each rank's heads' share of the projection
            "ln2": torch.ones(DIM),
            "w1": w(DIM, 4 * DIM),
            "b1": torch.zeros(4 * DIM),
            "w2": w(4 * DIM, DIM),
            "b2": torch.zeros(DIM),  # added after the psum: replicated
        }
        specs[f"{i}"] = {"ln1": P(), "q": cols, "k": cols, "v": cols, "o": rows}
        specs[f"{i}"] |= {"ln2": P(), "w1": cols, "b1": P("model"), "w2": rows, "b2": P()}
    params["ln_f"], params["head"] = torch.ones(DIM), w(DIM, VOCAB)
    specs["ln_f"], specs["head"] = P(), cols  # the logits are split over the vocabulary
    return params, specs


def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (DIM,), weight)


def block(p: dict, x: torch.Tensor) -> torch.Tensor:
    b, t, _ = x.shape
    h = norm(x, p["ln1"])
    q, k, v = ((h @ p[n]).view(b, t, -1, DIM // HEADS).transpose(1, 2) for n in "qkv")
    heads = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # this rank's heads
    x = x + pardist.psum(heads.transpose(1, 2).reshape(b, t, -1) @ p["o"], "model")
    h = F.gelu(norm(x, p["ln2"]) @ p["w1"] + p["b1"])  # this rank's hidden units
    return x + pardist.psum(h @ p["w2"], "model") + p["b2"]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over a vocabulary split over 'model', without gathering the logits."""
    part = logits.shape[-1]
    # axis_index varies over 'model' (as JAX's): so does every value computed from it.
    local = targets - pardist.axis_index("model") * part
    mine = (local >= 0) & (local < part)
    top = pardist.pmax(logits.max(-1).values.detach(), "model")
    z = logits - top[..., None]
    total = pardist.psum(z.exp().sum(-1), "model")
    picked = pardist.psum(z.gather(-1, local.clamp(0, part - 1)[..., None])[..., 0] * mine, "model")
    return (total.log() - picked).mean()


def loss_fn(params: dict, tokens: torch.Tensor) -> torch.Tensor:
    x = params["embed"][tokens[:, :-1]] + params["pos"][: tokens.shape[1] - 1]
    for i in range(LAYERS):
        x = block(params[f"{i}"], x)
    return cross_entropy(norm(x, params["ln_f"]) @ params["head"], tokens[:, 1:])


def batch(step: int, size: int) -> torch.Tensor:
    """A global batch of sequences, the same on every rank (each keeps its 'data' block)."""
    g = torch.Generator().manual_seed(step)
    tokens = [torch.randint(0, VOCAB, (size,), generator=g)]
    for _ in range(LENGTH):
        tokens.append((5 * tokens[-1] + 3) % VOCAB)
    return torch.stack(tokens, 1)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--bs", type=int, default=32, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--model", type=int, default=2, help="size of the 'model' axis")
    args = parser.parse_args(argv)

    pardist.init()
    world = pardist.world_size()
    model = args.model if world % args.model == 0 else 1
    mesh = pardist.Mesh({"data": -1, "model": model})
    full, specs = init_params(torch.Generator().manual_seed(0))
    with mesh:
        params = pardist.local_block(full, specs)  # this rank's blocks
    opt = pardist.optim.adamw(args.lr, weight_decay=0.0)
    opt_state = opt.init(params)
    opt_specs = pardist.state_specs(opt_state, params, specs)

    @pardist.data_parallel(
        axis="data",
        mesh=mesh,
        in_specs=(specs, opt_specs, P("data")),
        out_specs=(specs, opt_specs, P()),
        donate_argnums=(0, 1),
    )
    def train_step(params, opt_state, tokens):
        loss, grads = pardist.value_and_grad(loss_fn)(params, tokens)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, opt_state, loss

    data_size, data_index = mesh.size("data"), mesh.index("data")
    losses = []
    for step in range(args.steps):
        tokens = batch(step, args.bs).chunk(data_size)[data_index]
        params, opt_state, loss = train_step(params, opt_state, tokens)
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            pardist.print0(f"step {step:3d}  loss {losses[-1]:.4f}")
    pardist.print0(f"final: loss={losses[-1]:.4f} mesh={mesh.shape} ranks={world}")
    return losses


if __name__ == "__main__":
    main()
