"""What pardist's Python costs per step: dispatch-bound models against plain torch and DDP.

    python benchmarks/overhead.py                    # world size 1 and 2, the three models
    python benchmarks/overhead.py --ranks 1 --compiled

On a GPU kernels are asynchronous, so a small or medium model's step costs what its
Python costs. The same regime shows on a CPU with a model whose compute is negligible:
``deep`` is 31 ``Linear(16, 16)`` layers at batch 8, ``deep_bn`` the same with
``BatchNorm1d`` after each (122 parameter tensors), ``wide`` a compute-bound MLP
(4 x ``Linear(1024, 1024)`` at batch 256). Each runs, interleaved step by step in one
process group, as:

    torch         the module, torch.optim.AdamW(fused=True), zero_grad / backward / step
    floor         (world size 1) the least a functional step does in Python: parameters
                  installed in the module, autograd.grad, the fused AdamW kernel; no
                  checks, no purity. What pardist costs above it is its own
    ddp           the same inside DistributedDataParallel (world size 2+)
    pardist       the README's step: value_and_grad(has_aux) + optim.adamw, donated
    compiled      the same step with compile=True (with --compiled)
    pardist_local_bn  (BN model, 2+ ranks) sync_bn=False: per-rank statistics, what DDP
                  on CPU does (SyncBatchNorm is CUDA only); pardist/DDP compares this

and reports the median ms per step of the slowest rank, the ratio to plain torch, and
pardist's cost over plain torch in microseconds per parameter tensor. One thread per
rank. Prints a Markdown table and writes benchmarks/results/overhead.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import pardist

sys.path.insert(0, os.path.dirname(__file__))
from vs_ddp import interleaved_ms  # noqa: E402  (the same interleaving as vs_ddp)


def deep(bn: bool) -> nn.Module:
    layers = []
    for _ in range(31):
        layers += [nn.Linear(16, 16)] + ([nn.BatchNorm1d(16)] if bn else []) + [nn.ReLU()]
    return nn.Sequential(*layers)


# name: (model, input features, per-rank batch)
MODELS = {
    "deep": (lambda: deep(False), 16, 8),
    "deep_bn": (lambda: deep(True), 16, 8),
    "wide": (lambda: nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]), 1024, 256),
}


def variants(name: str, compiled: bool) -> dict:
    make, features, batch = MODELS[name]
    g = torch.Generator().manual_seed(pardist.rank())
    device = pardist.device()
    x = torch.randn(batch, features, generator=g).to(device)
    y = torch.randn(batch, features, generator=g).to(device)
    out = {}

    def torch_step(net):
        opt = torch.optim.AdamW(net.parameters(), 1e-3, fused=True)

        def step():
            opt.zero_grad(set_to_none=True)
            F.mse_loss(net(x), y).backward()
            opt.step()

        return step

    torch.manual_seed(0)
    out["torch"] = torch_step(make().to(device))
    if pardist.world_size() == 1:
        torch.manual_seed(0)
        out["floor"] = floor_step(make().to(device), x, y)
    if pardist.world_size() > 1:
        torch.manual_seed(0)
        out["ddp"] = torch_step(nn.parallel.DistributedDataParallel(make().to(device)))
    for kind in ("pardist", "compiled") if compiled else ("pardist",):
        torch.manual_seed(0)
        out[kind] = pardist_step(make(), x, y, compile=kind == "compiled")
    if name.endswith("_bn") and pardist.world_size() > 1:
        # DDP on CPU has no SyncBatchNorm (CUDA only): per-rank statistics, as pardist's
        # sync_bn=False, are its like-for-like.
        torch.manual_seed(0)
        out["pardist_local_bn"] = pardist_step(make(), x, y, compile=False, sync_bn=False)
    return out


def floor_step(net: nn.Module, x, y):
    """The least a step with parameters in and out does, in Python: tensors installed in
    the module, ``autograd.grad`` on detached leaves, the fused AdamW kernel. No checks,
    no purity (buffers are updated in place), no tree of state: one rank's floor."""
    params = dict(net.named_parameters())
    places = [(net.get_submodule(k.rpartition(".")[0]), k.rpartition(".")[2], k) for k in params]
    params = {k: p.detach().clone() for k, p in params.items()}
    state = [[torch.zeros_like(p) for p in params.values()] for _ in range(2)]
    count = [0]

    def step():
        leaves = [p.detach().requires_grad_() for p in params.values()]
        for (module, attr, _), leaf in zip(places, leaves):
            module._parameters[attr] = leaf
        grads = torch.autograd.grad(F.mse_loss(net(x), y), leaves)
        count[0] += 1
        steps = [torch.full((), float(count[0]), device=x.device)] * len(leaves)
        p = list(params.values())
        torch._fused_adamw_(p, list(grads), *state, [], steps, lr=1e-3, beta1=0.9,
                            beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
                            maximize=False)  # fmt: skip

    return step


def pardist_step(net: nn.Module, x, y, loss=F.mse_loss, sync_bn: bool = True, **options):
    """The README's step: value_and_grad with the buffers as aux, AdamW, donated;
    ``options`` (compile, deterministic) go to ``data_parallel``."""
    apply, params, buffers = pardist.functional(net, sync_bn=sync_bn)
    opt = pardist.optim.adamw(1e-3)
    state = {"all": (params, buffers, opt.init(params))}

    def loss_fn(params, buffers, x, y):
        out, buffers = apply(params, buffers, x)
        return loss(out, y), buffers

    @pardist.data_parallel(donate_argnums=(0, 1, 2), **options)
    def step(params, buffers, opt_state, batch):
        (loss, buffers), grads = pardist.value_and_grad(loss_fn, has_aux=True)(
            params, buffers, *batch
        )
        params, opt_state = opt.update(grads, opt_state, params)
        return params, buffers, opt_state

    def run():
        state["all"] = step(*state["all"], (x, y))

    return run


def worker(names: list[str], steps: int, warmup: int, compiled: bool) -> dict:
    torch.set_num_threads(1)
    return {name: interleaved_ms(variants(name, compiled), steps, warmup) for name in names}


def tensors(name: str) -> int:
    return len(list(MODELS[name][0]().parameters()))


def table(rows: list[dict]) -> str:
    order = ("torch", "floor", "ddp", "pardist", "pardist_local_bn", "compiled")
    keys = [k for k in order if any(k in r for r in rows)]
    head = "| model | ranks | " + " | ".join(f"{k} ms" for k in keys)
    head += " | pardist/torch | pardist/floor | pardist/DDP | pardist - torch, us per tensor |"
    lines = [head, "|" + "---|" * (len(keys) + 6)]
    for r in rows:
        cells = " | ".join(f"{r[k]:.2f}" if k in r else "-" for k in keys)
        like = r.get("pardist_local_bn", r["pardist"])  # DDP's semantics: per-rank BN
        ddp = f"{like / r['ddp']:.2f}" if "ddp" in r else "-"
        floor = f"{r['pardist'] / r['floor']:.2f}" if "floor" in r else "-"
        per = 1e3 * (r["pardist"] - r["torch"]) / tensors(r["model"])
        lines.append(
            f"| {r['model']} | {r['ranks']} | {cells} | {r['pardist'] / r['torch']:.2f} | {floor} "
            f"| {ddp} | {per:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--compiled", action="store_true", help="also compile=True")
    parser.add_argument("--name", default="overhead")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    rows = []
    for ranks in args.ranks:
        got = pardist.spawn(worker, ranks, args.models, args.steps, args.warmup, args.compiled)
        rows += [{"model": m, "ranks": ranks, **got[m]} for m in args.models]
    print(table(rows))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(table(rows) + "\n")
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({"device": str(pardist.device()), "rows": rows, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
