"""benchmarks/scaling_model.py: its arithmetic against closed forms worked out by hand.

The model's numbers are what docs/scaling.md reports; these tests pin the formulas the
document states (alpha-beta collectives, buckets reduced as the backward fills them,
the modes' traffic), so that an edit of the model cannot change them silently.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "benchmarks"))
from scaling_model import Cluster, Link, Plan, Workload, step_time  # noqa: E402

MB = 2**20
LINK = Link(alpha=1e-5, beta=1e9)


def test_collectives_are_rings_and_all_reduce_the_better_of_a_ring_and_a_tree():
    # 8 ranks, 64 MiB: a ring all-reduce moves 2 * 7/8 of the bytes in 2 * 7 steps; a
    # tree twice the bytes in 2 * log2(8) = 6 steps: here the ring is faster
    ring = 2 * 7 / 8 * 64 * MB / 1e9 + 14e-5
    assert LINK.all_reduce(64 * MB, 8) == pytest.approx(ring)
    # 1024 ranks, 64 KiB: the ring's 2046 latency steps lose to the tree's 20
    assert LINK.all_reduce(64 * 1024, 1024) == pytest.approx(2 * 64 * 1024 / 1e9 + 20e-5)
    assert LINK.reduce_scatter(64 * MB, 8) == pytest.approx(7 / 8 * 64 * MB / 1e9 + 7e-5)
    assert LINK.all_gather(64 * MB, 5) == pytest.approx(4 / 5 * 64 * MB / 1e9 + 4e-5)
    assert LINK.all_reduce(64 * MB, 1) == 0.0
    assert LINK.shared(4).all_gather(64 * MB, 2) == pytest.approx(4 * 64 * MB / 2 / 1e9 + 1e-5)


def _cluster(overlap=1.0, per_node=8, inter=LINK):
    return Cluster("test", flops=1e12, per_node=per_node, intra=LINK, inter=inter, overlap=overlap)


W = Workload("w", params=10 * MB, flops_per_sample=3e10, batch=10, units=4)  # 0.3 s compute


def test_one_rank_is_its_compute_alone():
    r = step_time(W, _cluster(), 1, Plan())
    assert r["step"] == pytest.approx(0.3) and r["comm"] == 0 and r["efficiency"] == 1


def test_buckets_overlap_the_backward_and_only_the_tail_shows():
    # 40 MiB of gradients: buckets of 1, 25, 14 MiB, ready at 1/40, 26/40, 40/40 of the 0.2 s
    # backward; each all-reduce at 2 ranks takes its bytes / 1e9 + 2 alpha (ring). In order,
    # so the last one starts when the backward ends: exposed = its own time.
    times = [s * MB / 1e9 + 2e-5 for s in (1, 25, 14)]
    r = step_time(W, _cluster(), 2, Plan())
    assert r["comm"] == pytest.approx(sum(times))
    assert r["exposed"] == pytest.approx(times[-1])
    serial = step_time(W, _cluster(overlap=0.0), 2, Plan())  # nothing hidden
    assert serial["exposed"] == pytest.approx(sum(times))
    half = step_time(W, _cluster(overlap=0.5), 2, Plan())
    assert half["exposed"] == pytest.approx((times[-1] + sum(times)) / 2)


def test_compression_halves_the_bytes_and_zero_adds_a_gather():
    full, half = (step_time(W, _cluster(), 4, Plan(grad_bytes=b))["comm"] for b in (4, 2))
    assert half == pytest.approx(full / 2, rel=1e-3)  # (the alpha terms of one more bucket)
    zero = step_time(W, _cluster(), 4, Plan("zero"))
    scatter = sum(LINK.reduce_scatter(s * MB, 4) for s in (1, 25, 14))
    assert zero["comm"] == pytest.approx(scatter + LINK.all_gather(40 * MB, 4))


def test_hsdp_crosses_nodes_with_a_shard_and_diloco_every_h_steps():
    slow = Link(alpha=1e-4, beta=1e8)
    c = _cluster(per_node=2, inter=slow)  # 4 ranks: 2 nodes of 2
    hsdp = step_time(W, c, 4, Plan("hsdp"))
    unit = 40 * MB / 4
    want = 4 * (2 * LINK.all_gather(unit, 2) + LINK.reduce_scatter(unit, 2))
    # each unit's shard, across the 2 nodes: both ranks of a node at once, sharing its link
    want += 4 * (2 * 1 / 2 * unit / 2 / (1e8 / 2) + 2e-4)
    assert hsdp["comm"] == pytest.approx(want)
    fsdp = step_time(W, c, 4, Plan("fsdp"))  # every gather over the slow link
    assert fsdp["exposed"] > hsdp["exposed"]
    for h in (1, 8):
        d = step_time(W, c, 4, Plan("diloco", every=h))
        inner = step_time(W, _cluster(per_node=2), 2, Plan())
        # each rank's half of the float32 params gathered across the 2 nodes (both ranks of
        # a node at once, sharing its link), then the halves gathered within the node
        across = 1 / 2 * (2 * 20 * MB) / (1e8 / 2) + 1e-4
        meet = (across + LINK.all_gather(40 * MB, 2)) / h
        assert d["exposed"] == pytest.approx(inner["exposed"] + meet)


def test_cpu_ranks_beyond_the_cores_share_them():
    c = Cluster("cpu", 1e12, per_node=4, intra=LINK, inter=LINK, overlap=1.0, cores=2)
    assert step_time(W, c, 4, Plan())["compute"] == pytest.approx(0.6)
    assert step_time(W, c, 2, Plan())["compute"] == pytest.approx(0.3)


def test_an_unknown_mode_is_named():
    with pytest.raises(ValueError, match="mode='ring'.*'ddp'"):
        Plan("ring")
