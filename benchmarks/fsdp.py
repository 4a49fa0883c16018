"""FSDP (ZeRO-3) against data parallelism, ZeRO-2 and torch FSDP2: peak memory and step time.

    python benchmarks/fsdp.py                       # 2 ranks, the 25M MLP and a 50M transformer
    python benchmarks/fsdp.py --models mlp25m --steps 10

Four variants train the same model with AdamW (state = 2x the parameters):

    dp      pardist.data_parallel + pardist.optim.adamw, params and state donated
    zero2   the same with pardist.optim.sharded(adamw): state and gradients sharded
    fsdp    pardist.fsdp(params): parameters, gradients and state sharded (ZeRO-3)
    fsdp2   torch FSDP2: fully_shard on every layer (block) and the root + torch.optim.AdamW

Step time: all four run in one process group, one step each per round (noise hits
them alike), median over rounds of the slowest rank's time. Peak memory: each
variant alone in a fresh process group; per rank, the high-water mark of the
resident set (VmHWM, which counts shared memory this process touched) during the
steps, minus the resident set before the model was built. The mark is reset
(/proc/self/clear_refs) after setup, so building the full model on every rank
before sharding it (which all four do) is not counted; glibc is told to serve
every allocation over 1 MiB with its own mapping (mallopt), so freed tensors leave
the resident set at once instead of staying in malloc's heap. What is measured is
everything the step holds at its worst moment: parameters, gradients, optimizer
state, activations, communication buffers.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from vs_ddp import MODELS as MLPS
from vs_ddp import interleaved_ms

import pardist


class GPT(nn.Module):
    """A GPT-2-shaped decoder: tied input/output embedding, pre-norm blocks (torch's layers)."""

    def __init__(self, vocab=16384, d=512, layers=14, heads=8, ctx=64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, 0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        for block in self.h:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.ln(x)).flatten(0, 1)


def gpt_data(batch: int, seq: int, vocab: int = 16384):
    g = torch.Generator().manual_seed(pardist.rank())  # each rank its own tokens
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:].reshape(-1)


def mlp_data(name: str):
    _, shape, batch = MLPS[name]
    g = torch.Generator().manual_seed(pardist.rank())
    return torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)


# name: (model factory, per-rank batch, blocks to shard separately in FSDP2)
MODELS = {
    "mlp25m": (MLPS["mlp25m"][0], lambda: mlp_data("mlp25m"), lambda m: list(m)[::2]),
    "gpt50m": (GPT, lambda: gpt_data(1, 64), lambda m: list(m.h)),
}
# One step of this first sets up what every later model shares (DTensor's machinery,
# gloo's buffers), so that the memory measured is the model's.
WARMUP = (
    lambda: GPT(vocab=64, d=16, layers=2, heads=2, ctx=8),
    lambda: gpt_data(2, 8, vocab=64),
    lambda m: list(m.h),
)


def make(variant: str, name: str):
    """A step function for one variant (its own model and state) and its data."""
    factory, data, blocks = WARMUP if name == "warmup" else MODELS[name]
    x, y = data()
    torch.manual_seed(0)
    module = factory()
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(pardist.device().type, (dist.get_world_size(),))
        net = module
        for block in blocks(net):
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

        def torch_step():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            opt.step()

        return torch_step
    apply, params, buffers = pardist.functional(module)
    del module
    if variant == "fsdp":
        params = pardist.fsdp(params)
    opt = pardist.optim.adamw(1e-4)
    opt = pardist.optim.sharded(opt) if variant == "zero2" else opt
    state = {"all": (params, opt.init(params))}
    del params

    def loss_fn(params, x, y):
        return F.cross_entropy(apply(params, {}, x)[0], y)

    def train_step(params, opt_state, batch):
        grads = pardist.grad(loss_fn)(params, *batch)
        return opt.update(grads, opt_state, params)

    step = pardist.data_parallel(train_step, donate_argnums=(0, 1))

    def run():
        state["all"] = step(*state["all"], (x, y))

    return run


VARIANTS = ["dp", "zero2", "fsdp", "fsdp2"]


def timing(names, steps, warmup):
    torch.set_num_threads(1)
    out = {}
    for name in names:
        out[name] = interleaved_ms({v: make(v, name) for v in VARIANTS}, steps, warmup)
    return out


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def memory(variant: str, name: str, steps: int) -> dict:
    """Peak and resting resident bytes of one variant's steps, above the process's baseline."""
    torch.set_num_threads(1)
    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: big allocations are their own mappings
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD: give the heap's free top back at once
    make(variant, "warmup")()
    gc.collect()
    base = _status("VmRSS")
    fn = make(variant, name)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the present resident set
    for _ in range(steps):
        fn()
    peak, rest = _status("VmHWM") - base, _status("VmRSS") - base
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (peak, rest))
    return {"peak": max(p for p, _ in everyone), "rest": max(r for _, r in everyone)}


def replicated_bytes(name: str) -> int:
    """Parameters + gradients + AdamW's two state tensors, unsharded."""
    module = MODELS[name][0]()
    return 4 * sum(p.numel() * p.element_size() for p in module.parameters())


def table(rows: list[dict], ranks: int) -> str:
    lines = [
        "| model | params | ranks | replicated P+G+S MB | peak MB/rank: dp / ZeRO-2 / FSDP / "
        "FSDP2 | ms/step: dp / ZeRO-2 / FSDP / FSDP2 | FSDP/dp time | FSDP/FSDP2 time |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        mb = {v: r["memory"][v]["peak"] / 2**20 for v in VARIANTS}
        ms = r["ms"]
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.1f}M | {ranks} | {r['replicated'] / 2**20:.0f} "
            f"| {' / '.join(f'{mb[v]:.0f}' for v in VARIANTS)} "
            f"| {' / '.join(f'{ms[v]:.0f}' for v in VARIANTS)} "
            f"| {ms['fsdp'] / ms['dp']:.2f} | {ms['fsdp'] / ms['fsdp2']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    ms = pardist.spawn(timing, args.ranks, args.models, args.steps, args.warmup)
    rows = []
    for name in args.models:
        mem = {v: pardist.spawn(memory, args.ranks, v, name, args.memory_steps) for v in VARIANTS}
        module = MODELS[name][0]()
        rows.append(
            {
                "model": name,
                "params": sum(p.numel() for p in module.parameters()),
                "replicated": replicated_bytes(name),
                "ms": ms[name],
                "memory": mem,
            }
        )
    print(table(rows, args.ranks))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fsdp.md"), "w") as f:
        f.write(table(rows, args.ranks) + "\n")
    with open(os.path.join(args.out, "fsdp.json"), "w") as f:
        json.dump({"ranks": args.ranks, "rows": rows, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
