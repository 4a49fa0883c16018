"""JAX's published shard_map transposes, translated, against hand-derived gradients.

The examples are those of JAX's "Efficient transposition of replication-inducing
collectives" (jep/17111), each on a 2-rank mesh with axis 'i', differentiated
with pardist.grad inside a bare shard_map (JAX's semantics: the gradient of the
loss as seen by this rank; a loss that varies over 'i' counts as its sum over
'i'). Inputs differ on every rank, so a missing or extra psum changes numbers.
"""

from __future__ import annotations

import torch
from numerics import assert_close64

import pardist
from pardist import P

N = 2  # ranks on axis 'i'
F64 = torch.float64  # gradients in float64, compared up to its rounding (numerics.py)


def inputs():
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(3, generator=g, dtype=F64) for _ in range(N)]  # rank r's block of x
    ys = [torch.randn(3 * N, generator=g, dtype=F64) for _ in range(N)]  # rank r's y
    c = torch.randn(3 * N, generator=g, dtype=F64)  # the same on every rank
    return xs, ys, c


def g(x):
    return torch.sin(x).sum()


def dg(x):
    return torch.cos(x)


def _examples():
    mesh = pardist.Mesh({"i": N})
    xs, ys, c = inputs()
    r = pardist.rank()
    x, y = xs[r], ys[r]

    def mapped(f, in_specs):
        step = pardist.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=P("i"))
        return lambda *args: step(*args)

    grad = pardist.grad
    out = {}
    # Example 1: psum into an invariant value; its transpose is the identity (pbroadcast).
    out["f1"] = mapped(lambda x: grad(lambda x: pardist.psum(g(x), "i"))(x), P("i"))(x)
    # Example 2: psum into a varying product: the transpose keeps the psum.
    out["f2"] = mapped(
        lambda x, y: grad(lambda x: (pardist.psum(g(x), "i") * y).sum())(x), (P("i"), P("i"))
    )(x, y[:3])
    # Example 3: the "cursed identity", P() -> P(): transposes to the identity, at any depth.
    out["f3"] = mapped(
        lambda c: grad(lambda c: grad(lambda c: (c * c).sum() / 2)(c).sum())(c), P()
    )(c)
    # Example 4: all_gather to an invariant value: the transpose is this rank's block.
    out["f4"] = mapped(
        lambda x, c: grad(lambda x: (pardist.all_gather(x, "i", invariant=True) * c).sum())(x),
        (P("i"), P()),
    )(x, c)
    # Example 5: all_gather into a varying product: the transpose is psum_scatter.
    out["f5"] = mapped(
        lambda x, y: grad(lambda x: (pardist.all_gather(x, "i") * y).sum())(x), (P("i"), P("i"))
    )(x, y)
    # A replicated input used with a varying one gets the psum of its cotangents (pvary).
    out["pvary"] = mapped(lambda c, x: grad(lambda c: (c[:3] * x).sum())(c), (P(), P("i")))(c, x)
    # psum of an invariant value: N copies.
    out["psum_invariant"] = mapped(lambda c: grad(lambda c: pardist.psum(c.sum(), "i"))(c), P())(c)
    # pmax into an invariant value: the cotangent goes to the rank holding the maximum only.
    out["pmax"] = mapped(lambda x: grad(lambda x: pardist.pmax(x.max(), "i"))(x), P("i"))(x)
    # psum_scatter and all_to_all transpose into all_gather and all_to_all (dims swapped).
    out["psum_scatter"] = mapped(
        lambda y, x: grad(lambda y: (pardist.psum_scatter(y, "i") * x).sum())(y), (P("i"), P("i"))
    )(y, x)
    z = torch.outer(y, x)  # rank r's (3N, 3) block
    out["all_to_all"] = mapped(
        lambda z, y: grad(lambda z: (pardist.all_to_all(z, "i", 0, 1) * y[:3, None]).sum())(z),
        (P("i"), P("i")),
    )(z, y)
    # torch.func.grad inside a step gets the same transposes as pardist.grad.
    out["torch.func"] = mapped(
        lambda c, x: torch.func.grad(lambda c: (c[:3] * x).sum())(c), (P(), P("i"))
    )(c, x)
    # A replicated value indexed by a varying index (inside an index tuple) is lifted too.
    idx = torch.tensor([r, r + 1])
    out["index"] = mapped(lambda m, i: grad(lambda m: m[:, i].sum())(m), (P(), P("i")))(
        torch.ones(2, 3 * N, dtype=F64), idx
    )
    # Second order: the backward of psum (a pvary) transposes back into a psum.
    f = lambda x: pardist.pmean((x**3).sum(), "i")  # noqa: E731
    out["second_order"] = mapped(lambda x: grad(lambda x: grad(f)(x).sum())(x), P("i"))(x)
    return out


def one_hot_max(xs, r):
    """d pmax(max x) / d x on rank r: 1 at the global maximum, if rank r holds it."""
    top = max(range(N), key=lambda k: xs[k].max())
    return torch.nn.functional.one_hot(xs[r].argmax(), 3).to(F64) * (r == top)


def all_to_all_grad(ys, r):
    """Rank j sends block k of its (3N, 3) z to rank k, which puts it at columns [3j, 3j+3);
    rank k's loss weighs every row by y_k[:3]. So block k of rank r's gradient is y_k[:3]
    repeated across the 3 columns it sent."""
    return torch.cat([ys[k][:3, None].expand(3, 3) for k in range(N)])


def test_jax_examples(run):
    xs, ys, c = inputs()
    for r, got in enumerate(run(N, _examples)):
        expected = {
            "f1": dg(xs[r]),  # not N * cos: the cotangent of psum is not psum'd again
            "f2": dg(xs[r]) * sum(y[:3].sum() for y in ys),
            "f3": torch.ones_like(c),
            "f4": c[3 * r : 3 * r + 3],  # no communication, no factor N
            "f5": sum(y[3 * r : 3 * r + 3] for y in ys),
            "pvary": torch.cat([sum(xs), torch.zeros(3 * N - 3)]),
            "psum_invariant": torch.full_like(c, float(N)),
            "second_order": 6 * xs[r] / N,
            "pmax": one_hot_max(xs, r),
            "psum_scatter": torch.cat(xs),  # all_gather of the cotangents
            "all_to_all": all_to_all_grad(ys, r),
            "torch.func": torch.cat([sum(xs), torch.zeros(3 * N - 3)]),
            "index": sum(
                torch.zeros(3 * N, dtype=F64).index_add_(
                    0, torch.tensor([k, k + 1]), torch.ones(2, dtype=F64)
                )
                for k in range(N)
            ).expand(2, 3 * N),
        }
        for name, want in expected.items():
            assert_close64(got[name], want, f"{name} on rank {r}")


def _varying_output_replicated():
    mesh = pardist.Mesh({"i": N})
    step = pardist.shard_map(
        lambda x: {"whole": pardist.all_gather(x, "i")}, mesh=mesh, in_specs=P("i"), out_specs=P()
    )
    try:
        step(torch.ones(2))
    except ValueError as e:
        return str(e)


def test_varying_output_with_replicated_out_spec_is_an_error(run):
    # JAX's check: all_gather's result varies over 'i' (use invariant=True, or P('i')).
    for msg in run(N, _varying_output_replicated):
        assert "output['whole'] varies over ('i',)" in msg
        assert "out_specs replicate it over ('i',)" in msg and "invariant=True" in msg


def _legacy_and_manual():
    mesh = pardist.Mesh({"i": N})
    xs, _, _ = inputs()
    x = xs[pardist.rank()]
    f = lambda x: (pardist.psum(x, "i") ** 2).sum()  # noqa: E731
    out = {}
    for check in (True, False):
        step = pardist.shard_map(
            lambda x: pardist.grad(f)(x), mesh=mesh, in_specs=P("i"), out_specs=P("i"),
            check_vma=check,
        )  # fmt: skip
        out[check] = step(x)
    # check_vma=False checks outputs by value only (the first call): equal values pass.
    gathered = pardist.shard_map(
        lambda x: pardist.all_gather(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P(),
        check_vma=False,
    )(x)  # fmt: skip
    try:  # a collective over an axis the step is not manual over
        pardist.shard_map(
            lambda x: pardist.psum(x, "i"), mesh=mesh, in_specs=P(), out_specs=P(),
            axis_names=(),
        )(x)  # fmt: skip
    except ValueError as e:
        out["manual"] = str(e)
    return out, gathered


def test_check_vma_false_is_jaxs_legacy_rule_and_axis_names_limits_the_axes(run):
    xs, _, _ = inputs()
    total = sum(xs)
    for out, gathered in run(N, _legacy_and_manual):
        assert_close64(out[True], 2 * total, "check_vma=True: psum's transpose is the identity")
        assert_close64(out[False], 2 * N * total, "check_vma=False: psum's transpose is psum")
        assert_close64(gathered, torch.cat(xs), "gathered")
        assert "is not one of the step's manual axes (axis_names=[])" in out["manual"]


def _grouped():
    r = pardist.rank()
    x = torch.tensor([1.0, 10.0], dtype=F64) * (r + 1)
    groups = [[0, 2], [1, 3]]
    sums = pardist.psum(x, "gpu", axis_index_groups=groups)
    means = pardist.pmean({"x": x, "n": 1.0}, "gpu", axis_index_groups=groups)
    # The grouped sum varies over the axis (between groups) and transposes into itself.
    step = pardist.shard_map(
        lambda x: pardist.grad(lambda x: (pardist.psum(x, "gpu", axis_index_groups=groups) ** 2)
                              .sum())(x),
        in_specs=P("gpu"), out_specs=P("gpu"),
    )  # fmt: skip
    return sums, means, step(x)


def test_axis_index_groups_sum_within_each_group(run):
    for r, (sums, means, g) in enumerate(run(4, _grouped)):
        mates = (1 + r % 2) + (3 + r % 2)  # ranks r % 2 and r % 2 + 2, each times rank + 1
        want = torch.tensor([1.0, 10.0], dtype=F64) * mates
        assert_close64(sums, want, "psum")
        assert_close64(means, {"x": want / 2, "n": 1.0}, "pmean")
        assert_close64(g, 2 * 2 * want, "gradient: the grouped sum of the cotangents 2 * sums")
