"""The cases pardist is compared with JAX on: each a loss written once, for both.

Each case is ``f(o, w, x) -> scalar`` over an operations object ``o``: JAX's
(``scripts/jax_reference.py``: ``jax.numpy`` and ``jax.lax`` inside ``jax.shard_map``
with ``check_vma=True``) or pardist's (``test_jax.py``: torch and pardist's collectives
inside ``pardist.shard_map`` and ``pardist.data_parallel``). ``w`` (3,) is replicated,
``x`` (4, 3) is each rank's block of a (4 x ranks, 3) array split over every mesh axis.
Both sides read the same float64 inputs (:func:`inputs`). Nothing here imports torch or
JAX.

MESHES are the meshes, each with the axes a case's collectives may use; a case names
the meshes it runs on. ``grad=False``: JAX differentiates it in neither mode (pmax,
pmin), so only the forward is compared (pardist's pmax gradient is tested against a
hand-derived one in test_transposes.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

MESHES = {
    "1d2": {"gpu": 2},
    "1d4": {"gpu": 4},
    "2d": {"node": 2, "gpu": 2},
}
ROWS = 4  # each rank's rows of x
GROUPS = [[0, 2], [1, 3]]  # axis_index_groups of the 4-rank mesh


def inputs(mesh: str) -> dict[str, np.ndarray]:
    """w, the global x, and tangents for both (float64), the same for JAX and pardist."""
    ranks = int(np.prod(list(MESHES[mesh].values())))
    g = np.random.RandomState(7)
    return {
        "w": g.randn(3),
        "x": g.randn(ROWS * ranks, 3),
        "tw": g.randn(3),
        "tx": g.randn(ROWS * ranks, 3),
    }


@dataclasses.dataclass(frozen=True)
class Case:
    f: Callable
    meshes: tuple[str, ...] = ("1d2", "1d4", "2d")
    grad: bool = True  # JAX differentiates it (not pmax / pmin)


def _ring(o, a):
    n = o.axis_size(a)
    return [(i, (i + 1) % n) for i in range(n)]


CASES = {
    # psum of a varying value: invariant; transposes to the identity (JAX's default rule).
    "psum_square": Case(lambda o, w, x: (o.psum(x * w, "gpu") ** 2).sum()),
    "psum_sin": Case(lambda o, w, x: o.sin(o.psum(x, "gpu") * w).sum()),
    # psum into a varying product: the transpose keeps the psum.
    "psum_times_x": Case(lambda o, w, x: (o.psum(o.sin(x * w), "gpu") * x).sum()),
    "psum_tree": Case(
        lambda o, w, x: (lambda t: t["a"] * o.sin(t["b"]))(
            o.psum({"a": (x * w).sum(), "b": (x * x * w).sum()}, "gpu")
        )
    ),
    "psum_of_invariant": Case(lambda o, w, x: o.psum((w * w).sum(), "gpu") * x.sum()),
    "psum_number": Case(lambda o, w, x: o.psum(1.0, "gpu") * (x * w).sum()),
    "pmean": Case(lambda o, w, x: o.tanh(o.pmean(x * w, "gpu")).sum() + (x * x).sum()),
    "pmean_of_loss": Case(lambda o, w, x: o.pmean((o.sin(x * w) ** 2).sum(), "gpu")),
    "pmax": Case(lambda o, w, x: o.pmax(x * w, "gpu").sum(), grad=False),
    "pmin": Case(lambda o, w, x: o.pmin(x * w, "gpu").sum(), grad=False),
    "all_gather": Case(lambda o, w, x: (o.all_gather(o.sin(x * w), "gpu") ** 2).sum()),
    "all_gather_dim1": Case(
        lambda o, w, x: (o.all_gather(x * w, "gpu", dim=1) * o.cos(x).sum()).sum()
    ),
    "all_gather_untiled": Case(
        lambda o, w, x: (o.all_gather(x * w, "gpu", tiled=False) ** 3).sum()
    ),
    # A replicated loss over invariant gathered logits (all_gather_invariant).
    "all_gather_invariant": Case(
        lambda o, w, x: o.sin(o.all_gather(x * w, "gpu", invariant=True)).sum()
    ),
    "psum_scatter": Case(lambda o, w, x: (o.psum_scatter(x * w, "gpu") ** 2).sum()),
    "psum_scatter_untiled": Case(
        lambda o, w, x: (
            o.psum_scatter((x * w)[: o.axis_size("gpu")], "gpu", tiled=False) ** 2
        ).sum()
    ),
    "all_to_all": Case(lambda o, w, x: (o.all_to_all(x * w, "gpu", 0, 1) ** 2 * x.sum()).sum()),
    "all_to_all_untiled": Case(
        lambda o, w, x: (
            o.all_to_all((x * w)[: o.axis_size("gpu")], "gpu", 0, 0, tiled=False) ** 2 * x.sum()
        ).sum()
    ),
    # (JAX 0.10's own transpose of an untiled all_to_all that moves the dim fails its shape
    # check: the forward only.)
    "all_to_all_untiled_moved": Case(
        lambda o, w, x: (
            o.all_to_all((x * w)[: o.axis_size("gpu")].T, "gpu", 1, 0, tiled=False) ** 2
        ).sum(),
        grad=False,
    ),
    "ppermute": Case(lambda o, w, x: (o.ppermute(x * w, "gpu", _ring(o, "gpu")) * x).sum()),
    "ppermute_partial": Case(
        lambda o, w, x: (o.ppermute(o.sin(x * w), "gpu", [(0, 1)]) ** 2).sum()
    ),
    # axis_index varies over its axis: the gradient of w through it sums over the ranks.
    "axis_index": Case(lambda o, w, x: (w * (o.axis_index("gpu") + 1)).sum() + (x * w).sum()),
    "pbroadcast": Case(lambda o, w, x: (o.pbroadcast(x * w, "gpu", 1) ** 2 * x).sum()),
    "pvary": Case(lambda o, w, x: (o.pvary(w * w, "gpu") * x).sum()),
    # Within groups of the axis's indices (axis_index_groups), on 4 ranks.
    "all_gather_groups": Case(
        lambda o, w, x: (o.all_gather(x * w, "gpu", groups=GROUPS) ** 2 * x.sum()).sum(), ("1d4",)
    ),
    "psum_scatter_groups": Case(
        lambda o, w, x: (o.psum_scatter(o.sin(x * w), "gpu", groups=GROUPS) ** 2).sum(), ("1d4",)
    ),
    # (JAX 0.10 differentiates no all_to_all over groups: "Please open a feature request".)
    "all_to_all_groups": Case(
        lambda o, w, x: (o.all_to_all(x * w, "gpu", 0, 1, groups=GROUPS) ** 2 * x.sum()).sum(),
        ("1d4",),
        False,
    ),
    "pmax_groups": Case(lambda o, w, x: o.pmax(x * w, "gpu", groups=GROUPS).sum(), ("1d4",), False),
    # Over the other axis and both, on the 2-D mesh.
    "psum_node": Case(lambda o, w, x: (o.psum(x * w, "node") ** 2).sum(), ("2d",)),
    "psum_both": Case(lambda o, w, x: o.sin(o.psum(x * w, ("node", "gpu"))).sum(), ("2d",)),
    "all_gather_node": Case(
        lambda o, w, x: (o.all_gather(x * w, "node", invariant=True) ** 2).sum(), ("2d",)
    ),
    "pmean_nested": Case(lambda o, w, x: o.pmean(o.psum(x * w, "gpu").sum() ** 2, "node"), ("2d",)),
}


def ranks(mesh: str) -> int:
    return int(np.prod(list(MESHES[mesh].values())))


def all_axes(mesh: str) -> tuple[str, ...]:
    return tuple(MESHES[mesh])
