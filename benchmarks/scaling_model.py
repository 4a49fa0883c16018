"""A model of pardist's step time: compute, then each collective on its link, overlapped.

The step of one rank (GPU or CPU process) on a per-rank batch, weak scaling (the per-rank
batch is fixed as the world grows). Its parts:

- **compute**: ``flops_per_sample * batch / flops``, a third forward and two thirds
  backward; processes beyond a node's cores share them (CPU ranks only).
- **collectives**: alpha-beta costs, ``alpha`` per message step and ``beta`` bytes/s.
  All-reduce is the better of a ring (``2 (n-1)/n`` of the bytes in ``2 (n-1)`` steps)
  and a tree (twice the bytes in ``2 log2 n`` steps), as NCCL picks; reduce-scatter and
  all-gather are rings (``(n-1)/n`` of the bytes, ``n-1`` steps: NCCL has no tree for
  them, so their latency grows with the world). A collective over ranks of one node runs
  on the ``intra`` link; over several nodes on the ``inter`` link, whose ``beta`` is a
  node's whole bandwidth out (all its NICs), shared by the collectives that cross it at
  once (HSDP's and DiLoCo's: one group per rank of a node).
- **overlap**: gradient buckets (``first_bucket_bytes``, then ``bucket_bytes``, as
  pardist's reducer fills them in the backward) reduce as they fill, one after another;
  what ends after the backward is exposed. ``overlap`` is the fraction of that hiding a
  machine achieves: 1 on GPUs (the collectives run beside the kernels), fitted on CPU
  ranks (where the reduction shares the cores with the backward).

The modes, as pardist runs them (docs/sharding.md):

- ``ddp``: ``data_parallel`` with replicated parameters, bucketed all-reduce in the backward.
- ``zero``: ``optim.sharded``: bucketed reduce-scatter in the backward, the new parameters
  all-gathered after the update (exposed).
- ``fsdp``: per-unit all-gather in the forward and again in the backward, each started
  one unit ahead (hidden behind the unit before, up to ``overlap``); the reduce-scatter
  of each unit waits in the backward.
- ``hsdp``: fsdp within a node; each unit's gradient shard is then all-reduced across
  nodes (exposed, as pardist does it in the backward).
- ``diloco``: ddp within a node; every ``every`` steps each rank of a node all-gathers
  its 1/k of the float32 parameters across the nodes and the node all-gathers the k
  means: exposed, amortised over the steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["Cluster", "Link", "Plan", "Workload", "step_time", "MODES"]

MODES = ("ddp", "zero", "fsdp", "hsdp", "diloco")


@dataclass(frozen=True)
class Link:
    """Seconds per message step (``alpha``) and bytes per second (``beta``)."""

    alpha: float
    beta: float

    def all_reduce(self, nbytes: float, n: int) -> float:
        """The better of a ring (bandwidth-optimal) and a tree (log-latency), as NCCL picks."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        ring = 2 * (n - 1) / n * nbytes / self.beta + 2 * (n - 1) * self.alpha
        tree = 2 * nbytes / self.beta + 2 * math.ceil(math.log2(n)) * self.alpha
        return min(ring, tree)

    def reduce_scatter(self, nbytes: float, n: int) -> float:
        """A ring (NCCL has no tree for it): ``nbytes`` the whole, each rank keeps 1/n."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return (n - 1) / n * nbytes / self.beta + (n - 1) * self.alpha

    all_gather = reduce_scatter  # ``nbytes``: the whole gathered tensor

    def shared(self, ways: int) -> Link:
        """The link as each of ``ways`` collectives that cross it at once sees it."""
        return Link(self.alpha, self.beta / max(1, ways))


@dataclass(frozen=True)
class Cluster:
    name: str
    flops: float  # achieved FLOP/s per rank on this workload's kernels
    per_node: int  # ranks per node
    intra: Link
    inter: Link
    overlap: float = 1.0  # the fraction of the ideal overlap achieved (see above)
    cores: int | None = None  # CPU ranks: a node's cores, shared beyond this many ranks


@dataclass(frozen=True)
class Workload:
    name: str
    params: float
    flops_per_sample: float  # forward and backward
    batch: int  # per rank
    units: int = 8  # FSDP's units
    param_bytes: int = 4


@dataclass(frozen=True)
class Plan:
    mode: str = "ddp"
    grad_bytes: int = 4  # 2: gradients reduced in bf16 (compression=)
    bucket_bytes: int = 25 * 2**20
    first_bucket_bytes: int = 2**20
    every: int = 1  # DiLoCo's H

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"Plan: mode={self.mode!r}; one of {MODES}")


def _buckets(total: float, first: float, rest: float) -> list[float]:
    out, left = [], total
    while left > 0:
        size = min(left, first if not out else rest)
        out.append(size)
        left -= size
    return out


def _hidden(times: list[float], sizes: list[float], backward: float, overlap: float) -> float:
    """Exposed time of bucket collectives started as the backward fills them, in order."""
    total, done, end = sum(sizes), 0.0, 0.0
    for t, size in zip(times, sizes):
        done += size
        end = max(end, backward * done / total) + t
    ideal = max(0.0, end - backward)
    return overlap * ideal + (1 - overlap) * sum(times)


def step_time(w: Workload, c: Cluster, n: int, plan: Plan) -> dict:
    """The step's seconds, its compute, its communication and what of it is exposed."""
    local = min(n, c.per_node)
    nodes = math.ceil(n / c.per_node)
    share = max(1.0, local / c.cores) if c.cores else 1.0
    alone = w.flops_per_sample * w.batch / c.flops
    compute = alone * share
    forward, backward = compute / 3, 2 * compute / 3
    link = c.intra if nodes == 1 else c.inter
    grads, weights = w.params * plan.grad_bytes, w.params * w.param_bytes
    sizes = _buckets(grads, plan.first_bucket_bytes, plan.bucket_bytes)
    mode = plan.mode
    if mode == "diloco":  # the inner steps: data parallelism within a node
        inner = step_time(w, replace(c, per_node=local), local, replace(plan, mode="ddp"))
        # each rank of a node gathers its 1/local of the float32 params across the nodes
        # (all at once, sharing the node's link), then the node gathers the means
        part = c.inter.shared(local).all_gather(4 * w.params / local * nodes, nodes)
        meet = (part + c.intra.all_gather(4 * w.params, local)) / plan.every if nodes > 1 else 0
        comm = inner["comm"] + meet
        exposed = inner["exposed"] + meet
    elif mode in ("ddp", "zero"):
        collective = link.all_reduce if mode == "ddp" else link.reduce_scatter
        times = [collective(s, n) for s in sizes]
        exposed = _hidden(times, sizes, backward, c.overlap)
        comm = sum(times)
        if mode == "zero":
            gather = link.all_gather(weights, n)
            comm, exposed = comm + gather, exposed + gather
    else:  # fsdp, hsdp: gathers and reduce-scatters per unit
        over, ranks = (c.intra, local) if mode == "hsdp" else (link, n)
        gather = over.all_gather(weights / w.units, ranks)
        scatter = over.reduce_scatter(grads / w.units, ranks)
        shard = grads / w.units / ranks  # each rank's, over its own group across the nodes
        across = c.inter.shared(local).all_reduce(shard, nodes) if mode == "hsdp" else 0.0
        f, b = forward / w.units, backward / w.units
        hidden = lambda t, work: max(work, t) * c.overlap + (work + t) * (1 - c.overlap)  # noqa: E731
        run = gather + w.units * hidden(gather, f)  # the first gather waits
        run += w.units * (hidden(gather, b) + scatter + across)
        comm = w.units * (2 * gather + scatter + across)
        exposed = run - compute
    step = compute + exposed
    return {
        "step": step,
        "compute": compute,
        "comm": comm,
        "exposed": exposed,
        "efficiency": alone / step,
    }
