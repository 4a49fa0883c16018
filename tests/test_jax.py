"""pardist against JAX itself: the same losses, inputs and meshes (tests/jax_cases.py).

JAX's CPU build computes every case inside ``jax.shard_map`` (``check_vma=True``, on
2 and 4 CPU devices, float64; scripts/jax_reference.py, in a process of its own). pardist
computes the same on 2 and 4 ranks (separate processes), on a 1-D mesh and a 2x2 one:

- in ``pardist.shard_map``: each rank's loss, ``pardist.grad`` of it with respect to the
  replicated w and the sharded x, the second order (reverse over reverse, and
  ``torch.func.hessian``: forward over reverse), ``torch.func.jvp``, and the axes the
  value and the gradients vary over (``pardist.varying_axes``, JAX's ``typeof(v).vma``);
- in ``pardist.data_parallel`` (eager and ``compile=True``): ``pardist.value_and_grad``
  with respect to both, which must be JAX's ``value_and_grad`` of the loss ``pmean``'d
  over the mesh (one rule set for both combinators), and its second order.

Both sides in float64, compared to float64 rounding (numerics.py). Skipped where JAX is
not installed (CI's main leg installs it).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax_cases
import numpy as np
import pytest
import torch
from numerics import assert_close64

import pardist
from pardist import P

pytest.importorskip("jax")
HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def jax_numbers(tmp_path_factory):
    path = tmp_path_factory.mktemp("jax") / "reference.npz"
    script = os.path.join(HERE, "scripts", "jax_reference.py")
    subprocess.run([sys.executable, script, str(path)], check=True, timeout=600)
    return dict(np.load(path))


class Ops:
    """jax_cases' operations in torch and pardist."""

    sin, cos, tanh = torch.sin, torch.cos, torch.tanh
    psum, pmean, pmin = pardist.psum, pardist.pmean, pardist.pmin
    ppermute, pvary = pardist.ppermute, pardist.pvary
    axis_index, axis_size = pardist.axis_index, pardist.axis_size

    @staticmethod
    def pmax(x, a, groups=None):
        return pardist.pmax(x, a, axis_index_groups=groups)

    @staticmethod
    def all_gather(x, a, dim=0, tiled=True, invariant=False, groups=None):
        return pardist.all_gather(
            x, a, dim, tiled=tiled, invariant=invariant, axis_index_groups=groups
        )

    @staticmethod
    def psum_scatter(x, a, dim=0, tiled=True, groups=None):
        return pardist.psum_scatter(x, a, dim, tiled=tiled, axis_index_groups=groups)

    @staticmethod
    def all_to_all(x, a, split, concat, tiled=True, groups=None):
        return pardist.all_to_all(x, a, split, concat, tiled=tiled, axis_index_groups=groups)

    @staticmethod
    def pbroadcast(x, a, src):
        return pardist.broadcast(x, a, src=src)


def _pardist(mesh_name: str, names: list[str], compile: bool):  # noqa: A002
    """Every case of ``names`` on this rank: {key: this rank's block (a tensor)}."""
    shape = jax_cases.MESHES[mesh_name]
    axes = tuple(shape)
    mesh = pardist.Mesh(shape)
    spec = P(axes if len(axes) > 1 else axes[0])
    data = {k: torch.from_numpy(v) for k, v in jax_cases.inputs(mesh_name).items()}
    r, n = pardist.rank(), pardist.world_size()
    w, tw = data["w"], data["tw"]
    x, tx = data["x"].chunk(n)[r], data["tx"].chunk(n)[r]
    out = {}

    def mapped(body, *args):
        specs = tuple(P() if a.shape == (3,) else spec for a in args)
        return pardist.shard_map(body, mesh=mesh, in_specs=specs, out_specs=spec)(*args)

    for name in names:
        case = jax_cases.CASES[name]
        f = lambda w, x: case.f(Ops, w, x)  # noqa: E731, B023
        key = f"{mesh_name}/{name}"
        if not compile:
            out[f"{key}/value"] = mapped(lambda w, x: f(w, x)[None], w, x)  # noqa: B023
        if not case.grad:
            continue
        types = []

        def typed(w, x):
            v = f(w, x)  # noqa: B023
            gw, gx = pardist.grad(f, argnums=(0, 1))(w, x)  # noqa: B023
            types.extend(",".join(sorted(pardist.varying_axes(t))) for t in (v, gw, gx))  # noqa: B023
            return v[None]

        grad_w = pardist.grad(f)
        if not compile:
            mapped(typed, w, x)
            out[f"{key}/types"] = "|".join(types)
            out[f"{key}/gw"] = mapped(lambda w, x: grad_w(w, x)[None], w, x)  # noqa: B023
            out[f"{key}/gx"] = mapped(lambda w, x: pardist.grad(f, argnums=1)(w, x), w, x)  # noqa: B023
            second = lambda w, x: (grad_w(w, x) ** 2).sum()  # noqa: E731, B023
            out[f"{key}/second"] = mapped(lambda w, x: pardist.grad(second)(w, x)[None], w, x)  # noqa: B023
            hessian = lambda w, x: torch.func.hessian(f)(w, x)[None]  # noqa: E731, B023
            out[f"{key}/hessian"] = mapped(hessian, w, x)
            jvp = lambda w, x, tw, tx: torch.func.jvp(f, (w, x), (tw, tx))[1][None]  # noqa: E731, B023
            out[f"{key}/jvp"] = mapped(jvp, w, x, tw, tx)

        def both(w, x):
            value, (gw, gx) = pardist.value_and_grad(f, argnums=(0, 1))(w, x)  # noqa: B023
            return value[None], gw[None], gx

        step = pardist.data_parallel(
            both,
            axis=axes,
            mesh=mesh,
            in_specs=(P(), spec),
            out_specs=(spec, spec, spec),
            compile={"backend": "aot_eager"} if compile else False,  # dynamo and AOTAutograd
        )
        out[f"{key}/dp_value"], out[f"{key}/dp_gw"], out[f"{key}/dp_gx"] = step(w, x)
        # A second call: typed once per input structure, the step then runs untyped (every
        # value varying over the data axes, each collective's result lifted back): the
        # same numbers.
        out[f"{key}/dp_value#2"], out[f"{key}/dp_gw#2"], out[f"{key}/dp_gx#2"] = step(w, x)
        if not compile:
            second_mean = lambda w, x: (pardist.grad(f)(w, x) ** 2).sum()  # noqa: E731, B023
            out[f"{key}/dp_second"] = pardist.data_parallel(
                lambda w, x: pardist.grad(second_mean)(w, x)[None],  # noqa: B023
                axis=axes,
                mesh=mesh,
                in_specs=(P(), spec),
                out_specs=spec,
            )(w, x)
    return out


def _compare(results: list[dict], jax_numbers: dict) -> list[str]:
    """The keys compared; an assertion error names the first that differs."""
    keys = sorted(results[0])
    for key in keys:
        want = jax_numbers[key.split("#")[0]]
        if key.endswith("/types"):
            assert all(r[key] == str(want) for r in results), (key, results[0][key], want)
            continue
        got = torch.cat([r[key] for r in results])
        assert_close64(got, torch.from_numpy(np.asarray(want, dtype=np.float64)), key)
    return keys


def _names(mesh_name: str) -> list[str]:
    return [name for name, case in jax_cases.CASES.items() if mesh_name in case.meshes]


@pytest.mark.parametrize("mesh_name", list(jax_cases.MESHES))
def test_every_collective_equals_jax_in_shard_map_and_data_parallel(run, jax_numbers, mesh_name):
    names = _names(mesh_name)
    results = run(jax_cases.ranks(mesh_name), _pardist, mesh_name, names, False, timeout=600)
    keys = _compare(results, jax_numbers)
    assert len(keys) > 9 * len(names) - 20  # every quantity of every case was compared


# The collectives a compiled step holds in its graph (the others run the step eagerly).
COMPILED = ["psum_square", "psum_times_x", "pmean_of_loss", "all_gather", "all_gather_invariant"]


@pytest.mark.parametrize("mesh_name", ["1d2", "2d"])
def test_compiled_data_parallel_equals_jax(run, jax_numbers, mesh_name):
    names = COMPILED + (["axis_index", "psum_both"] if mesh_name == "2d" else ["axis_index"])
    results = run(jax_cases.ranks(mesh_name), _pardist, mesh_name, names, True, timeout=900)
    _compare(results, jax_numbers)
