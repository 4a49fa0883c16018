"""What pardist's tracking of varying axes costs: a tensor-parallel step against Megatron by hand.

    python benchmarks/tensor_parallel.py                 # 2 ranks, mesh {'model': 2}
    python benchmarks/tensor_parallel.py --ranks 4 --dim 256 --batch 16

A pre-norm transformer (attention heads and MLP hidden units split over
'model', Megatron's layout) computes its loss and gradients two ways in one
process group, interleaved step by step so that machine noise hits both alike:

    manual   Megatron's collectives placed by hand, as Megatron-LM writes them:
             "f" (identity forward, psum backward) before each split layer, "g"
             (psum forward, identity backward) after it; nothing tracked
    pardist  the same model written with plain pardist.psum inside
             pardist.shard_map, differentiated with pardist.grad: pardist tracks
             which axes each value varies over and inserts the same collectives

Both move the same bytes, so the difference is the tracking itself: a
TorchFunctionMode looking up each operation's operands. The script also
reports that cost per operation (a small addition): plain, inside an empty
TorchFunctionMode (the floor of any such mode), inside pardist's tracker. Every
number is the median over rounds of the slowest rank's milliseconds (or the
median microseconds per operation); the gradients of both ways are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import pardist
from pardist import P
from pardist.collectives import _vma
from pardist.step._tracker import Tracker
from pardist.transport._primitives import PsumInvariant, Pvary


def init(dim: int, layers: int, vocab: int, mesh: pardist.Mesh) -> tuple[dict, dict]:
    """This rank's blocks of the model, and their specs."""
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g) / shape[0] ** 0.5

    cols, rows = P(None, "model"), P("model", None)
    params, specs = {"embed": torch.randn(vocab, dim, generator=g)}, {"embed": P()}
    for i in range(layers):
        params[f"{i}"] = {n: w(dim, dim) for n in "qkvo"}
        params[f"{i}"] |= {"ln1": torch.ones(dim), "ln2": torch.ones(dim)}
        params[f"{i}"] |= {"w1": w(dim, 4 * dim), "w2": w(4 * dim, dim)}
        specs[f"{i}"] = {"q": cols, "k": cols, "v": cols, "o": rows, "w1": cols, "w2": rows}
        specs[f"{i}"] |= {"ln1": P(), "ln2": P()}
    params["head"], specs["head"] = w(dim, vocab), P()
    with mesh:
        return pardist.local_block(params, specs), specs


def loss_fn(p: dict, tokens: torch.Tensor, heads: int, enter, leave) -> torch.Tensor:
    x = p["embed"][tokens]
    b, t, d = x.shape
    for i in range(sum(k.isdigit() for k in p)):
        blk = p[f"{i}"]
        h = enter(F.layer_norm(x, (d,), blk["ln1"]))
        q, k, v = ((h @ blk[n]).view(b, t, heads, -1).transpose(1, 2) for n in "qkv")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        x = x + leave(y.reshape(b, t, -1) @ blk["o"])
        h = enter(F.layer_norm(x, (d,), blk["ln2"]))
        x = x + leave(F.gelu(h @ blk["w1"]) @ blk["w2"])
    return F.cross_entropy((x @ p["head"]).flatten(0, 1), tokens.roll(-1, 1).flatten())


class _Empty(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def per_op_us(rounds: int = 7, n: int = 3000) -> dict[str, float]:
    """Microseconds per small addition: plain, in an empty mode, in pardist's tracker."""
    mesh = pardist.Mesh({"model": pardist.world_size()})
    state = _vma.Tracking(mesh)
    a, b = torch.ones(8), torch.ones(8)
    state.set(a, frozenset({"model"}))
    state.set(b, frozenset({"model"}))

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(n):
            a + b
        return (time.perf_counter() - start) / n * 1e6

    times: dict[str, list[float]] = {"plain": [], "empty mode": [], "tracker": []}
    for _ in range(rounds):
        times["plain"].append(loop())
        with _Empty():
            times["empty mode"].append(loop())
        with _vma.tracking(state), Tracker(state, "benchmark"):
            times["tracker"].append(loop())
    return {k: statistics.median(v) for k, v in times.items()}


def body(args) -> dict:
    torch.set_num_threads(1)
    model = pardist.world_size()
    mesh = pardist.Mesh({"model": model})
    params, specs = init(args.dim, args.layers, args.vocab, mesh)
    heads = args.heads // model
    group = mesh.groups("model")
    reduce = pardist.collectives.reduce_groups

    def manual(p, tokens):
        inputs = [t.detach().requires_grad_() for t in pardist.runtime._tree.tree_leaves(p)]
        q = pardist.runtime._tree.tree_unflatten(inputs, pardist.runtime._tree.tree_flatten(p)[1])
        loss = loss_fn(
            q,
            tokens,
            heads,
            lambda h: Pvary.apply(h, group, reduce),  # Megatron's f
            lambda y: PsumInvariant.apply(y, group, reduce),  # Megatron's g
        )
        return torch.autograd.grad(loss, inputs)

    @pardist.shard_map(mesh=mesh, in_specs=(specs, P()), out_specs=specs)
    def tracked(p, tokens):
        f = lambda p: loss_fn(p, tokens, heads, lambda h: h, lambda y: pardist.psum(y, "model"))  # noqa: E731
        return pardist.grad(f)(p)

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.length), generator=g)
    ways = {"manual": lambda: manual(params, tokens), "pardist": lambda: tracked(params, tokens)}
    first = {name: fn() for name, fn in ways.items()}
    same = all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-5)
        for a, b in zip(first["manual"], pardist.runtime._tree.tree_leaves(first["pardist"]))
    )
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.steps):
        for name, fn in ways.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            times[name].append(elapsed.item() * 1e3)
    return {"ms": {k: statistics.median(v) for k, v in times.items()}, "same": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    result = pardist.spawn(body, args.ranks, args)
    pardist.init()
    ops = per_op_us()
    pardist.shutdown()
    ms = result["ms"]
    print(
        "| ranks | dim | batch x length | manual ms | pardist ms | pardist/manual | grads equal |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {args.ranks} | {args.dim} | {args.batch} x {args.length} | {ms['manual']:.1f} | "
        f"{ms['pardist']:.1f} | {ms['pardist'] / ms['manual']:.2f} | {result['same']} |"
    )
    print()
    print("| us per op: plain | empty TorchFunctionMode | pardist's tracker |")
    print("|---|---|---|")
    print(f"| {ops['plain']:.1f} | {ops['empty mode']:.1f} | {ops['tracker']:.1f} |")


if __name__ == "__main__":
    main()
