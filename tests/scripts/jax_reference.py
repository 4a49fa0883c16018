"""JAX's numbers for tests/jax_cases.py: ``python jax_reference.py OUT.npz``.

Each case runs inside ``jax.shard_map`` (``check_vma=True``, JAX's default) on a mesh of
CPU devices, in float64, two ways:

- ``shard_map``: the loss as each rank sees it, ``jax.grad`` of it with respect to w and
  x, the gradient of ``(grad_w f)**2`` summed (second order), ``jax.hessian`` with respect
  to w (forward over reverse), ``jax.jvp`` of it, and the
  varying axes of the value and of both gradients (``jax.typeof(v).mat.varying``);
- ``data_parallel``: ``jax.value_and_grad`` of the loss averaged over every mesh axis
  (``pmean``), and the second order of that mean, what ``pardist.data_parallel`` with
  ``pardist.value_and_grad`` must give.

Every output leaves ``shard_map`` under ``P(all axes)`` with a leading dim of one per
rank (so the npz holds each rank's result, in rank order), and the varying axes as a
string. Run as a process of its own: XLA's device count is read at import.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax_cases  # noqa: E402

jax.config.update("jax_enable_x64", True)


def _axes(a):
    return a if isinstance(a, tuple) else (a,)


class Ops:
    """jax_cases' operations in JAX."""

    sin, cos, tanh = jnp.sin, jnp.cos, jnp.tanh

    @staticmethod
    def psum(x, a):
        return lax.psum(x, a)

    @staticmethod
    def pmean(x, a):
        return lax.pmean(x, a)

    @staticmethod
    def pmax(x, a, groups=None):
        return lax.pmax(x, a, axis_index_groups=groups)

    @staticmethod
    def pmin(x, a):
        return lax.pmin(x, a)

    @staticmethod
    def all_gather(x, a, dim=0, tiled=True, invariant=False, groups=None):
        to = "invarying" if invariant else "varying"
        return lax.all_gather(x, a, axis=dim, tiled=tiled, to=to, axis_index_groups=groups)

    @staticmethod
    def psum_scatter(x, a, dim=0, tiled=True, groups=None):
        return lax.psum_scatter(x, a, scatter_dimension=dim, tiled=tiled, axis_index_groups=groups)

    @staticmethod
    def all_to_all(x, a, split, concat, tiled=True, groups=None):
        return lax.all_to_all(x, a, split, concat, tiled=tiled, axis_index_groups=groups)

    @staticmethod
    def ppermute(x, a, perm):
        return lax.ppermute(x, a, perm)

    @staticmethod
    def axis_index(a):
        return lax.axis_index(a)

    @staticmethod
    def axis_size(a):
        return lax.axis_size(a)

    @staticmethod
    def pbroadcast(x, a, src):
        # lax.pbroadcast has no CPU lowering; its docstring's equivalent, lifted back to
        # varying (pbroadcast's type): the same value and the same transpose.
        masked = jnp.where(lax.axis_index(a) == src, x, jnp.zeros_like(x))
        return lax.pcast(lax.psum(masked, a), _axes(a), to="varying")

    @staticmethod
    def pvary(x, a):
        return lax.pcast(x, _axes(a), to="varying")


def _vma(v) -> str:
    return ",".join(sorted(jax.typeof(v).mat.varying))


def _pmean(v, axes):
    """pmean over ``axes`` of a value varying over some of them (JAX 0.10 wants one state:
    lifted first, as pardist lifts by itself)."""
    missing = tuple(a for a in axes if a not in jax.typeof(v).mat.varying)
    return lax.pmean(lax.pcast(v, missing, to="varying") if missing else v, axes)


def run(mesh_name: str, case_name: str, case) -> dict:
    shape = jax_cases.MESHES[mesh_name]
    axes = tuple(shape)
    auto = (jax.sharding.AxisType.Auto,) * len(axes)
    mesh = jax.make_mesh(tuple(shape.values()), axes, axis_types=auto)
    data = {k: jnp.asarray(v) for k, v in jax_cases.inputs(mesh_name).items()}
    spec = P(axes)
    f = lambda w, x: case.f(Ops, w, x)  # noqa: E731
    out, types = {}, {}

    def mapped(body, *args):
        specs = tuple(P() if a.shape == (3,) else spec for a in args)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=spec))(*args)

    w, x, tw, tx = data["w"], data["x"], data["tw"], data["tx"]
    out["value"] = mapped(lambda w, x: f(w, x)[None], w, x)
    if case.grad:
        jvp = lambda w, x, tw, tx: jax.jvp(f, (w, x), (tw, tx))[1][None]  # noqa: E731
        out["jvp"] = mapped(jvp, w, x, tw, tx)

    def typed(w, x):
        v = f(w, x)
        names = [_vma(v)]
        if case.grad:
            gw, gx = jax.grad(f, argnums=(0, 1))(w, x)
            names += [_vma(gw), _vma(gx)]
        types[case_name] = names
        return v[None]

    mapped(typed, w, x)
    if case.grad:
        out["gw"] = mapped(lambda w, x: jax.grad(f)(w, x)[None], w, x)
        out["gx"] = mapped(lambda w, x: jax.grad(f, argnums=1)(w, x), w, x)
        second = lambda w, x: (jax.grad(f)(w, x) ** 2).sum()  # noqa: E731
        out["second"] = mapped(lambda w, x: jax.grad(second)(w, x)[None], w, x)
        out["hessian"] = mapped(lambda w, x: jax.hessian(f)(w, x)[None], w, x)
        mean = lambda w, x: _pmean(f(w, x), axes)  # noqa: E731
        both = lambda w, x: jax.value_and_grad(mean, argnums=(0, 1))(w, x)  # noqa: E731
        out["dp_value"] = mapped(lambda w, x: both(w, x)[0][None], w, x)
        out["dp_gw"] = mapped(lambda w, x: both(w, x)[1][0][None], w, x)
        out["dp_gx"] = mapped(lambda w, x: both(w, x)[1][1], w, x)
        second_mean = lambda w, x: _pmean((jax.grad(mean)(w, x) ** 2).sum(), axes)  # noqa: E731
        out["dp_second"] = mapped(lambda w, x: jax.grad(second_mean)(w, x)[None], w, x)
    out = {k: np.asarray(v) for k, v in out.items()}
    out["types"] = np.asarray("|".join(types[case_name]))
    return out


def main(path: str) -> None:
    results = {}
    for name, case in jax_cases.CASES.items():
        for mesh_name in case.meshes:
            for key, value in run(mesh_name, name, case).items():
                results[f"{mesh_name}/{name}/{key}"] = value
    np.savez(path, **results)


if __name__ == "__main__":
    main(sys.argv[1])
