"""How closely the tests compare numbers, and why (issue 30).

A tolerance comes from analysis, never from what one machine measured: which
kernels torch picks (ATEN_CPU_CAPABILITY), how many threads split a sum
(OMP_NUM_THREADS) and the CPU itself change float32 rounding, and a value that is
zero in exact arithmetic (the bias before a batch norm) is pure rounding noise.

Tests about correctness (pardist's numbers equal one process's, torch's or
DDP's) therefore run both sides in float64 and compare with ``assert_close64``:
every value may differ by at most ``REL64`` of the largest magnitude among the
compared values. Why that bounds float64 rounding: each value in these tests is
reached through at most ~10^4 roundings (sums of up to a few hundred terms, a few
layers, a few steps), each off by at most 2^-53 = 1.1e-16 of an intermediate value
at most ~10^2 times that magnitude: ~1e-10 of it if every rounding added up the
same way, which they do not (they add up like a random walk, ~1e-12). A real bug
is far above it: a gradient scaled by 1.001 is 1e-3 off, a term left out or
counted twice is O(1) off, and a detour through float32 is 2^-24 = 6e-8 off.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

REL64 = 1e-10


def _leaves(tree, path: str = "") -> list[tuple[str, object]]:
    """(path, leaf) pairs, dicts in key order (so that insertion order does not pair the
    wrong values), sharded tensors as full ones."""
    if isinstance(tree, dict):
        return [x for k in sorted(tree, key=str) for x in _leaves(tree[k], f"{path}[{k!r}]")]
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return [x for i, v in enumerate(tree) for x in _leaves(v, f"{path}[{i}]")]
    if isinstance(tree, torch.Tensor) or not tree_flatten(tree)[1].children_specs:
        return [(path, tree.full_tensor() if hasattr(tree, "full_tensor") else tree)]
    return _leaves(tree_flatten(tree)[0], path)


def _magnitude(x) -> float:
    if isinstance(x, torch.Tensor):
        return x.detach().abs().max().item() if x.numel() and x.is_floating_point() else 0.0
    return abs(x) if isinstance(x, float) else 0.0


def assert_close64(got, want, msg: str = "") -> None:
    """``got`` equals ``want`` up to float64 rounding: trees of float64 tensors (and
    Python floats) whose values differ by at most REL64 of the largest magnitude in
    ``want``; integer tensors and other leaves are equal."""
    a, b = _leaves(got), _leaves(want)
    paths = [p for p, _ in b]
    assert [p for p, _ in a] == paths, f"{msg}: values at {[p for p, _ in a]}, expected {paths}"
    scale = max((_magnitude(y) for _, y in b), default=0.0)
    tol = REL64 * scale
    for (path, x), (_, y) in zip(a, b):
        where = f"{msg}{path}"
        if isinstance(y, torch.Tensor) and y.is_floating_point():
            assert isinstance(x, torch.Tensor), f"{where}: {type(x).__name__}, not a tensor"
            assert x.dtype == y.dtype == torch.float64, f"{where}: {x.dtype} vs {y.dtype}"
            assert x.shape == y.shape, f"{where}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
            err = (x.detach() - y.detach()).abs().max().item() if y.numel() else 0.0
            assert err <= tol, f"{where}: off by {err:.3g}, tolerance {tol:.3g} (float64)"
        elif isinstance(y, torch.Tensor):
            assert torch.equal(x, y), where
        elif isinstance(y, float):
            assert abs(x - y) <= tol, f"{where}: {x!r} vs {y!r}, tolerance {tol:.3g}"
        else:
            assert x == y, where
