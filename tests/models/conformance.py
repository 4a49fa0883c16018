"""Training a zoo model three ways, and measuring how far apart the results are.

``on_ranks`` runs on every rank of a group: pardist's defaults (``functional``
with cross-replica batch norm, ``data_parallel``, ``value_and_grad``,
``optim.sgd(momentum=0.9)`` / ``optim.adamw``), each rank on its shard.
``one_process`` is the independent reference: the plain module in one process on
the whole batch, with ``torch.optim.SGD`` / ``torch.optim.AdamW``. Both take the
same steps from the same initial parameters.
"""

from __future__ import annotations

import math

import torch
import zoo

import pardist

STEPS = 3
SGD = dict(lr=0.005, momentum=0.9)
ADAMW = dict(lr=1e-3, weight_decay=1e-2, eps=1e-6)


def on_ranks(name: str, deterministic: int | None = None) -> dict:
    """pardist on this rank's shards: first-step loss and gradients, then parameters,
    buffers and losses after STEPS steps of each optimizer (``deterministic``: G row
    groups, the deterministic mode)."""
    if deterministic:
        pardist.set_rng_count(0)  # a fresh run's dropout (the processes are reused)
    model = zoo.build(name)
    kind = zoo.MODELS[name].kind
    apply, params0, buffers0 = pardist.functional(model)
    rank, world = pardist.rank(), pardist.world_size()

    def loss_fn(params, buffers, b):
        out, new_buffers = zoo.forward(lambda *a, **k: apply(params, buffers, *a, **k), kind, b)
        return zoo.loss_of(out, kind, b), new_buffers

    def make_step(opt):
        @pardist.data_parallel(deterministic=deterministic)
        def step(params, buffers, state, b):
            (loss, new_buffers), grads = pardist.value_and_grad(loss_fn, has_aux=True)(
                params, buffers, b
            )
            params, state = opt.update(grads, state, params)
            return params, new_buffers, state, loss, grads

        return step

    result = {"keys": sorted(params0)}
    optimizers = {"sgd": pardist.optim.sgd(**SGD), "adamw": pardist.optim.adamw(**ADAMW)}
    for opt_name, opt in optimizers.items():
        step = make_step(opt)
        params, buffers, state = params0, buffers0, opt.init(params0)
        losses = []
        for s in range(STEPS):
            b = zoo.shard(zoo.batch(name, s), rank, world)
            params, buffers, state, loss, grads = step(params, buffers, state, b)
            losses.append(float(loss))
            if s == 0 and opt_name == "sgd":
                result["grads"] = {k: g.clone() for k, g in grads.items()}
                result["layout"] = [k for k in grads if grads[k].stride() != params0[k].stride()]
        result[opt_name] = {
            "params": {k: v.clone() for k, v in params.items()},
            "buffers": {k: v.clone() for k, v in buffers.items()},
            "losses": losses,
        }
    return result


def _reversed(b: dict, channels_last: bool) -> dict:
    """The batch with its rows in reverse order (the same loss, summed in another order)."""
    out = {k: v.flip(0) for k, v in b.items()}
    if channels_last:
        out = {
            k: v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v
            for k, v in out.items()
        }
    return out


def one_process(
    name: str,
    threads: int | None = None,
    dtype=torch.float32,
    rows_reversed: bool = False,
    nudged: bool = False,
) -> dict:
    """The plain module on the whole batch with torch.optim, in this process.

    ``rows_reversed`` feeds each batch's rows in reverse order: mathematically the
    same step, but every sum over the batch is taken in another order, as
    splitting the batch between ranks does.
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        kind = zoo.MODELS[name].kind
        result = {}
        for opt_name in ("sgd", "adamw"):
            model = zoo.build(name, dtype)
            params = dict(model.named_parameters())
            if nudged:
                g = torch.Generator().manual_seed(0)
                with torch.no_grad():
                    for p in params.values():
                        sign = torch.randint(0, 2, p.shape, generator=g).to(p.dtype) * 2 - 1
                        p.mul_(1 + sign * 2.0**-24)
            for p in params.values():  # an unused parameter's gradient is zero, not None
                p.grad = torch.zeros_like(p)
            make = torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW
            opt = make(params.values(), **(SGD if opt_name == "sgd" else ADAMW))
            losses = []
            for s in range(STEPS):
                b = zoo.batch(name, s, dtype)
                if rows_reversed:
                    b = _reversed(b, zoo.MODELS[name].channels_last)
                opt.zero_grad(set_to_none=False)
                loss = zoo.loss_of(zoo.forward(model, kind, b), kind, b)
                loss.backward()
                losses.append(float(loss))
                if s == 0 and opt_name == "sgd":
                    result["grads"] = {k: p.grad.clone() for k, p in params.items()}
                opt.step()
            result[opt_name] = {
                "params": {k: p.detach().clone() for k, p in params.items()},
                "buffers": {k: b.clone() for k, b in model.named_buffers()},
                "losses": losses,
            }
        initial = zoo.build(name, dtype).named_parameters()
        result["initial"] = {k: p.detach().clone() for k, p in initial}
        return result
    finally:
        torch.set_num_threads(before)


def rel_l2(got: dict, want: dict) -> float:
    """The worst per-tensor relative L2 error of ``got`` against ``want``.

    Each tensor's error is measured against its own norm, or against its share of
    the whole tree's norm where that is larger: a gradient that is zero in exact
    arithmetic (a bias before a batch norm) holds only rounding noise, which has
    no relative error of its own to speak of.
    """
    keys = [k for k in want if want[k].is_floating_point()]
    total = math.sqrt(sum(want[k].double().square().sum().item() for k in keys))
    numel = sum(want[k].numel() for k in keys)
    worst = 0.0
    for k in keys:
        w, g = want[k].double(), got[k].double().contiguous()
        share = total * math.sqrt(w.numel() / numel)
        scale = max(w.norm().item(), share, 1e-30)
        worst = max(worst, (g - w).norm().item() / scale)
    return worst


def errors(got: dict, want: dict) -> dict:
    """Every measured error of a pardist run against a reference run."""
    out = {"grads": rel_l2(got["grads"], want["grads"])}
    for opt in ("sgd", "adamw"):
        out[f"{opt} params"] = rel_l2(got[opt]["params"], want[opt]["params"])
        out[f"{opt} buffers"] = rel_l2(got[opt]["buffers"], want[opt]["buffers"])
        out[f"{opt} losses"] = max(
            abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got[opt]["losses"], want[opt]["losses"])
        )
    return out
