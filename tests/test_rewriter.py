"""Rewriter unit tests: each skip reason, the pattern's corners, every higher-order primitive, the API, verification
and the report. Values are checked against float64 numpy einsum."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from test_rewriter_helpers import all_eqns, assert_close, oracle, oracle_bound, primitives, sums_of_products

import rewriter
from rewriter import Options, Report, VerificationError

GATE_OFF = dict(min_flops=0, min_dim=1)


def rand(*shape, seed=0, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32).astype(dtype)


def matmul_as_sum(a, b):
    """(i, k) x (k, j) -> (i, j), the broadcast way."""
    return (a[:, :, None] * b[None, :, :]).sum(1)


def only_site(report: Report):
    assert len(report.sites) == 1, str(report)
    return report.sites[0]


def check_rewritten(fn, args, spec, *, rtol=1e-5, factor=1.0, **options):
    """fn(*args) rewritten equals the float64 einsum, and its jaxpr has a dot_general and no summed product."""
    fast = rewriter.rewrite(fn, **(GATE_OFF | options))
    out = fast(*args)
    assert_close(out, factor * oracle(spec, *args), abs(factor) * oracle_bound(spec, *args), rtol, spec)
    jaxpr = jax.make_jaxpr(fast)(*args)
    assert "dot_general" in primitives(jaxpr), str(jaxpr)
    assert sums_of_products(jaxpr) == 0, str(jaxpr)
    return fast


def largest_value(jaxpr) -> int:
    return max(math.prod(v.aval.shape) for e in all_eqns(jaxpr) for v in e.outvars)


# ------------------------------------------------------------------------------------------------- skip reasons


def skip_reason(fn, *args, **options) -> str:
    site = only_site(rewriter.analyze(fn, *args, options=Options(**options)))
    assert site.status == "skipped"
    return site.reason


def test_skip_sum_over_unit_dims():
    a, b = rand(64, 64), rand(64, 64, seed=1)
    reason = skip_reason(lambda a, b: (a[..., None] * b[..., None]).sum(-1), a, b, **GATE_OFF)
    assert reason.startswith("sum over size-1 dims only")


def test_skip_vector_by_vector():
    a, b = rand(256, 256), rand(256, 256, seed=1)
    assert skip_reason(lambda a, b: (a * b).sum(-1), a, b).startswith("vector-by-vector")


def test_skip_tiny_contraction():
    a, b = rand(256, 4), rand(4, 256, seed=1)
    reason = skip_reason(matmul_as_sum, a, b, min_dim=16)
    assert reason.startswith("tiny contraction") and "K=4" in reason


def test_skip_tiny_free_side():
    a, b = rand(256, 256), rand(256, 2, seed=1)  # nearly a matrix-vector product
    reason = skip_reason(matmul_as_sum, a, b, min_dim=16)
    assert reason.startswith("tiny contraction") and "N=2" in reason


def test_default_min_dim_follows_the_backend():
    assert Options().gate_min_dim() == (2 if jax.default_backend() == "cpu" else 16)
    assert Options(min_dim=7).gate_min_dim() == 7
    a, b = rand(512, 2), rand(2, 512, seed=1)  # K = 2: a dot on CPU, a reduction on GPU
    expected = "rewritten" if jax.default_backend() == "cpu" else "skipped"
    assert only_site(rewriter.analyze(matmul_as_sum, a, b)).status == expected
    a, b = rand(512, 512), rand(512, 1, seed=1)  # a matrix-vector product stays a reduction everywhere
    assert skip_reason(matmul_as_sum, a, b).startswith("tiny contraction")


def test_skip_below_flop_threshold():
    a, b = rand(64, 64), rand(64, 64, seed=1)  # 2 * 64^3 = 524,288 FLOPs
    assert skip_reason(matmul_as_sum, a, b).startswith("below the FLOP threshold")
    assert skip_reason(matmul_as_sum, a, b, min_flops=1e9).startswith("below the FLOP threshold")
    site = only_site(rewriter.analyze(matmul_as_sum, a, b, options=Options(min_flops=1e5)))
    assert site.status == "rewritten" and site.flops == 2 * 64**3


def test_skip_one_tensor_operand():
    a = rand(64, 64)
    assert skip_reason(lambda a: (a * 3.0).sum(0), a, **GATE_OFF).startswith("one tensor operand")


def test_skip_non_float():
    a = jnp.ones((64, 64), jnp.int32)
    assert skip_reason(matmul_as_sum, a, a, **GATE_OFF).startswith("non-float operands")


def test_skip_product_with_other_consumers():
    a, b = rand(64, 64), rand(64, 64, seed=1)

    def f(a, b):
        product = a[:, :, None] * b[None]
        return product.sum(1), product

    assert skip_reason(f, a, b, **GATE_OFF) == "the product has other consumers"
    out, product = rewriter.rewrite(f, **GATE_OFF)(a, b)
    assert product.shape == (64, 64, 64)
    assert_close(out, oracle("ik,kj->ij", a, b), oracle_bound("ik,kj->ij", a, b), 1e-5)


def test_product_behind_a_shared_value_is_an_operand():
    """A plain multiply whose result is also returned is computed anyway: not fused, not counted as removed, and its
    product not recomputed inside the next contraction."""
    g, m, c = rand(64, 64), rand(64, seed=1), rand(64, 16, seed=2)

    def f(g, m, c):
        masked = (g[..., None] * m[:, None, None]).sum(-1)  # a sum over a size-1 dim: a plain multiply
        return (masked[:, :, None] * c[None]).sum(1), masked

    fast = rewriter.rewrite(f, **GATE_OFF)
    out, masked = fast(g, m, c)
    want = oracle("ik,i,kj->ij", g, m, c)
    assert_close(out, want, oracle_bound("ik,i,kj->ij", g, m, c), 1e-5)
    first, second = fast.last_report.sites
    assert (first.status, second.status, second.spec) == ("skipped", "rewritten", "ab,bc->ac"), str(fast.last_report)
    muls = [e for e in all_eqns(jax.make_jaxpr(fast)(g, m, c)) if e.primitive.name == "mul"]
    assert len(muls) == 1, muls


def test_report_counts_a_broadcast_between_product_and_sum():
    a, b = rand(128, 96), rand(96, 80, seed=1)
    f = lambda a, b: jnp.broadcast_to((a[:, :, None] * b[None])[:, None], (128, 3, 96, 80)).sum((1, 2))
    site = only_site(rewriter.analyze(f, a, b, options=Options(**GATE_OFF)))
    assert site.intermediate_shape == (128, 3, 96, 80) and site.intermediate_elements == 128 * 3 * 96 * 80
    assert site.naive_flops == 128 * 96 * 80 + 128 * 3 * 96 * 80  # the multiplies, then the adds of the sum
    out = rewriter.rewrite(f, **GATE_OFF)(a, b)
    assert_close(out, 3 * oracle("ik,kj->ij", a, b), 3 * oracle_bound("ik,kj->ij", a, b), 1e-5)


# ------------------------------------------------------------------------------------------------- the pattern


def test_default_gate_rewrites_a_real_matmul():
    a, b = rand(128, 96), rand(96, 80, seed=1)
    fast = check_rewritten(matmul_as_sum, (a, b), "ik,kj->ij", min_flops=1e6, min_dim=16)
    site = only_site(fast.last_report)
    assert site.spec == "ab,bc->ac" and site.operand_shapes == [(128, 96), (96, 80)]
    assert site.intermediate_shape == (128, 96, 80) and site.intermediate_elements == 128 * 96 * 80
    assert site.intermediate_bytes == 4 * 128 * 96 * 80 and site.flops == 2 * 128 * 96 * 80
    assert largest_value(jax.make_jaxpr(matmul_as_sum)(a, b)) == 128 * 96 * 80
    assert largest_value(jax.make_jaxpr(fast)(a, b)) == 128 * 80  # the output: the product is gone


def test_negated_divided_and_copied_products():
    a, b, s = rand(8, 6), rand(6, 5, seed=1), rand(seed=2)
    check_rewritten(lambda a, b: (-(a[:, :, None] * b[None])).sum(1), (a, b), "ik,kj->ij", factor=-1.0)
    check_rewritten(lambda a, b: (a[:, :, None] * b[None] / 4.0).sum(1), (a, b), "ik,kj->ij", factor=0.25)
    divided = lambda a, b, s: (-a[:, :, None] * b[None] / s).sum(1)
    fast = rewriter.rewrite(divided, **GATE_OFF)
    factor = -1.0 / float(s)
    assert_close(fast(a, b, s), factor * oracle("ik,kj->ij", a, b), abs(factor) * oracle_bound("ik,kj->ij", a, b), 1e-5)
    assert sums_of_products(jax.make_jaxpr(fast)(a, b, s)) == 0
    check_rewritten(lambda a, b: jnp.array(a[:, :, None] * b[None], copy=True).sum(1), (a, b), "ik,kj->ij")


def test_division_by_a_tensor_is_not_a_scalar_factor():
    a, b = rand(8, 6), rand(6, 5, seed=1)
    d = jnp.abs(rand(8, 6, 5, seed=2)) + 1.0
    fast = rewriter.rewrite(lambda a, b, d: (a[:, :, None] * b[None] / d).sum(1), **GATE_OFF)
    want = (np.asarray(a, np.float64)[:, :, None] * np.asarray(b, np.float64)[None] / np.asarray(d, np.float64)).sum(1)
    np.testing.assert_allclose(np.asarray(fast(a, b, d)), want, rtol=1e-5, atol=1e-6)
    assert not fast.last_report.rewritten


def test_scalar_factors_and_several_summed_axes():
    a, b, s = rand(6, 5, 4), rand(4, 7, 5, seed=1), rand(seed=2)

    def f(a, b, s):  # sum over k (5) and m (4); two scalar factors
        return (2.0 * a[:, :, :, None] * jnp.transpose(b, (2, 0, 1))[None] * s).sum((1, 2))

    fast = rewriter.rewrite(f, **GATE_OFF)
    want = 2.0 * float(s) * oracle("ikm,mjk->ij", a, b)
    assert_close(fast(a, b, s), want, 2.0 * abs(float(s)) * oracle_bound("ikm,mjk->ij", a, b), 1e-5)
    assert only_site(fast.last_report).status == "rewritten"


def test_bf16_sum_accumulates_in_float32():
    a, b = rand(32, 64, dtype=jnp.bfloat16), rand(64, 16, seed=1, dtype=jnp.bfloat16)
    source = jax.make_jaxpr(matmul_as_sum)(a, b)
    assert "convert_element_type" in primitives(source)  # bf16 sum: mul -> convert -> reduce_sum
    fast = check_rewritten(matmul_as_sum, (a, b), "ik,kj->ij", rtol=1e-2)
    assert fast(a, b).dtype == jnp.bfloat16
    body = jax.make_jaxpr(fast)(a, b).jaxpr.eqns[0].params["jaxpr"].jaxpr
    dots = [e for e in body.eqns if e.primitive.name == "dot_general"]
    assert dots[0].params["preferred_element_type"] == jnp.float32
    assert only_site(fast.last_report).operand_dtypes == ["bfloat16", "bfloat16"]


def test_sum_widened_to_float64_accumulates_in_float64():
    with jax.enable_x64(True):
        a = jnp.asarray([[1e8, 1.0, -1e8]] * 2, jnp.float32)
        b = jnp.ones((3, 2), jnp.float32)
        widened_sum = lambda a, b: (a[:, :, None] * b[None]).sum(1, dtype=jnp.float64)
        widened_operands = lambda a, b: (a.astype(jnp.float64)[:, :, None] * b.astype(jnp.float64)[None]).sum(1)
        for f in (widened_sum, widened_operands):
            fast = rewriter.rewrite(f, **GATE_OFF)
            np.testing.assert_array_equal(fast(a, b), np.ones((2, 2)))  # float32 accumulation would give 0
            assert only_site(fast.last_report).status == "rewritten"


def test_mean_views_and_unit_reshapes():
    a, c = rand(3, 1, 8, 5), rand(4, 8, seed=1)

    def f(a, c):  # squeeze, a unit-dim reshape, a transpose; a mean is a sum then a divide
        x = jnp.squeeze(a, 1).reshape(3, 8, 5, 1)[..., 0]  # (i, k, m)
        return (x[:, :, :, None] * jnp.transpose(c)[None, :, None, :]).mean(1)  # (i, m, j)

    fast = rewriter.rewrite(f, **GATE_OFF)
    a2 = np.asarray(a)[:, 0]
    assert_close(fast(a, c), oracle("ikm,jk->imj", a2, c) / 8, oracle_bound("ikm,jk->imj", a2, c) / 8, 1e-5)
    assert only_site(fast.last_report).status == "rewritten"


def test_hidden_broadcast_is_dropped():
    """B and C are shared by 4 heads but materialised per head (repeat, pad, chunk): the dot runs once, not 4 times."""
    L, h, n = 60, 4, 32
    B, C = rand(L, 1, n), rand(L, 1, n, seed=1)
    per_head = lambda t: jnp.pad(jnp.repeat(t, h, axis=1), ((0, 4), (0, 0), (0, 0))).reshape(2, 32, h, n)

    def scores(B, C):
        return (per_head(C)[:, :, None] * per_head(B)[:, None]).sum(-1)  # (c, l, s, h)

    fast = rewriter.rewrite(scores, **GATE_OFF)
    site = only_site(fast.analyze(B, C))
    assert site.hidden_broadcasts == 2
    assert site.flops == 2 * 2 * 32 * 32 * n  # per group, not per head
    chunks = lambda t: np.pad(np.asarray(t)[:, 0], ((0, 4), (0, 0))).reshape(2, 32, n)
    spec = "cln,csn->cls"
    want = np.repeat(oracle(spec, chunks(C), chunks(B))[..., None], h, -1)
    bound = np.repeat(oracle_bound(spec, chunks(C), chunks(B))[..., None], h, -1)
    assert_close(fast(B, C), want, bound, 1e-5)


def chain(a, b, mask, c):
    """(A @ B) * mask[:, None] @ C as two broadcast sums and a plain multiply (a sum over a unit axis)."""
    g = (a[:, :, None] * b[None]).sum(1)  # (i, j)
    m = (g[..., None] * mask[:, None, None]).sum(-1)
    return (m[:, :, None] * c[None]).sum(1)  # (i, l)


def test_chain_fuses_when_cheaper():
    a, b, mask, c = rand(256, 16), rand(16, 256, seed=1), rand(256, seed=2), rand(256, 16, seed=3)
    spec = "ik,kj,i,jl->il"
    fast = rewriter.rewrite(chain, **GATE_OFF)
    assert_close(fast(a, b, mask, c), oracle(spec, a, b, mask, c), oracle_bound(spec, a, b, mask, c), 1e-5)
    first, plain, last = fast.last_report.sites
    assert (first.status, first.fused_into) == ("fused", last.id)
    assert (plain.status, plain.fused_into) == ("fused", last.id)
    assert last.status == "rewritten" and len(last.operand_shapes) == 4
    assert last.flops < 2 * 256 * 16 * 256 * 2  # cheaper than the two GEMMs: B @ C first

    unfused = rewriter.rewrite(chain, fuse_chains=False, **GATE_OFF)
    assert_close(unfused(a, b, mask, c), oracle(spec, a, b, mask, c), oracle_bound(spec, a, b, mask, c), 1e-5)
    assert [s.status for s in unfused.last_report.sites] == ["rewritten", "fused", "rewritten"]


def test_chain_not_fused_when_no_cheaper():
    a, b, mask, c = rand(16, 256), rand(256, 16, seed=1), rand(16, seed=2), rand(16, 256, seed=3)
    report = rewriter.analyze(chain, a, b, mask, c, options=Options(**GATE_OFF))
    assert [s.status for s in report.sites] == ["rewritten", "fused", "rewritten"]
    assert report.sites[1].fused_into == report.sites[2].id


# ----------------------------------------------------------------------------------------- higher-order primitives


def with_scan(a, b):
    return lax.scan(lambda carry, x: (carry, matmul_as_sum(x, b)), 0.0, a)[1]


def with_while(a, b):
    def body(state):
        i, acc = state
        return i + 1, acc + matmul_as_sum(a, b)

    return lax.while_loop(lambda s: s[0] < 2, body, (0, jnp.zeros((a.shape[0], b.shape[1]))))[1] / 2


def with_cond(a, b):
    return lax.cond(a.sum() > -1e30, matmul_as_sum, lambda x, y: 2 * matmul_as_sum(x, y), a, b)


@jax.custom_jvp
def custom_jvp_matmul(a, b):
    return matmul_as_sum(a, b)


custom_jvp_matmul.defjvp(lambda p, t: (custom_jvp_matmul(*p), t[0] @ p[1] + p[0] @ t[1]))


@jax.custom_vjp
def custom_vjp_matmul(a, b):
    return matmul_as_sum(a, b)


custom_vjp_matmul.defvjp(lambda a, b: (custom_vjp_matmul(a, b), (a, b)), lambda r, g: (g @ r[1].T, r[0].T @ g))


def with_shard_map(a, b):
    mesh = jax.make_mesh((1,), ("x",))
    spec = jax.sharding.PartitionSpec
    body = lambda a, b: lax.psum(matmul_as_sum(a, b), "x")
    return jax.shard_map(body, mesh=mesh, in_specs=(spec(), spec()), out_specs=spec())(a, b)


@pytest.mark.parametrize(
    "fn, path",
    [
        (jax.jit(matmul_as_sum), "jit(matmul_as_sum)"),
        (jax.checkpoint(matmul_as_sum), "remat2"),
        (with_while, "while.body_jaxpr"),
        (with_cond, "cond.branches[0]"),
        (custom_jvp_matmul, "custom_jvp_call"),
        (custom_vjp_matmul, "custom_vjp_call"),
        (with_shard_map, "shard_map"),
    ],
    ids=["jit", "remat", "while", "cond", "custom_jvp", "custom_vjp", "shard_map"],
)
def test_higher_order_primitives(fn, path):
    a, b = rand(8, 6), rand(6, 5, seed=1)
    fast = check_rewritten(fn, (a, b), "ik,kj->ij")
    sites = fast.last_report.sites
    assert sites and all(s.status == "rewritten" for s in sites), str(fast.last_report)
    assert sites[0].path == path
    if fn is with_while:  # while_loop has no reverse mode
        ta = rand(8, 6, seed=2)
        _, tangent = jax.jvp(fast, (a, b), (ta, jnp.zeros_like(b)))
        assert_close(tangent, oracle("ik,kj->ij", ta, b), oracle_bound("ik,kj->ij", ta, b), 1e-5)
        return
    ga = jax.grad(lambda a, b: fast(a, b).sum())(a, b)
    ones = np.ones((8, 5))
    assert_close(ga, oracle("ij,kj->ik", ones, b), oracle_bound("ij,kj->ik", ones, b), 1e-5)


def test_shard_map_with_varying_values_in_a_scan():
    """Bodies are re-traced with their inputs' full types: here a carry varying over the mesh axis."""
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec

    def f(a, b):
        def body(a, b):
            init = lax.pcast(jnp.zeros((8, 5)), ("x",), to="varying")
            return lax.scan(lambda c, _: (c + matmul_as_sum(a, b), None), init, None, length=3)[0]

        return jax.shard_map(body, mesh=mesh, in_specs=(spec("x"), spec()), out_specs=spec("x"))(a, b)

    a, b = rand(8, 6), rand(6, 5, seed=1)
    check_rewritten(f, (a, b), "ik,kj->ij", factor=3.0)


def test_pallas_kernel_body_is_reported_not_rewritten():
    from jax.experimental import pallas as pl

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = matmul_as_sum(a_ref[...], b_ref[...])

    def f(a, b):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 8), jnp.float32), interpret=True)(a, b)

    a, b = rand(8, 8), rand(8, 8, seed=1)
    fast = rewriter.rewrite(f, **GATE_OFF)
    assert_close(fast(a, b), oracle("ik,kj->ij", a, b), oracle_bound("ik,kj->ij", a, b), 1e-5)
    site = only_site(fast.last_report)
    assert site.status == "skipped" and "refs" in site.reason, str(fast.last_report)


def test_zero_size_dims():
    x, w = rand(16, 16), rand(16, 16, seed=1)

    def hidden_broadcast_over_nothing(x, w):
        big = jnp.exp(jnp.broadcast_to(x[None], (0, 16, 16)))
        return (big[:, :, :, None] * w[None, None]).sum((0, 2))

    out = rewriter.rewrite(hidden_broadcast_over_nothing)(x, w)  # default options
    np.testing.assert_array_equal(np.asarray(out), np.zeros((16, 16), np.float32))
    assert "zero-size" in skip_reason(hidden_broadcast_over_nothing, x, w, **GATE_OFF)  # not just below min_flops
    assert "zero-size" in skip_reason(matmul_as_sum, jnp.zeros((4, 0)), jnp.zeros((0, 3)), **GATE_OFF)


def test_more_labels_than_letters():
    shape = (2,) * 27
    a = jax.ShapeDtypeStruct(shape, jnp.float32)
    f = lambda a, b: (a[(...,) + (None,) * 27] * b[(None,) * 27]).sum(tuple(range(20, 34)))
    site = only_site(rewriter.analyze(f, a, a, options=Options(**GATE_OFF)))
    assert len(site.spec.split("->")[0].split(",")[0]) == 27 and site.status == "rewritten", site


def test_scan_body_rewritten():
    a, b = rand(3, 8, 6), rand(6, 5, seed=1)
    fast = check_rewritten(with_scan, (a, b), "tik,kj->tij")
    assert only_site(fast.last_report).path == "scan"


def test_nested_higher_order_primitives():
    a, b = rand(3, 8, 6), rand(6, 5, seed=1)
    nested = jax.jit(lambda a, b: lax.cond(True, jax.checkpoint(with_scan), with_scan, a, b))
    fast = check_rewritten(nested, (a, b), "tik,kj->tij")
    paths = sorted(s.path for s in fast.last_report.sites)
    assert paths[0].startswith("jit(") and "cond.branches" in paths[0] and paths[0].endswith("scan"), paths


# ------------------------------------------------------------------------------------------------- API


def test_composes_with_jit_grad_vmap():
    a, b = rand(4, 8, 6), rand(6, 5, seed=1)
    fast = rewriter.rewrite(matmul_as_sum, **GATE_OFF)
    batched = jax.jit(jax.vmap(fast, in_axes=(0, None)))(a, b)
    assert_close(batched, oracle("tik,kj->tij", a, b), oracle_bound("tik,kj->tij", a, b), 1e-5)
    w = rand(8, 5, seed=2)
    ga, gb = jax.jit(jax.grad(lambda a, b: jnp.sum(fast(a, b) * w), (0, 1)))(a[0], b)
    assert_close(ga, oracle("ij,kj->ik", w, b), oracle_bound("ij,kj->ik", w, b), 1e-5)
    assert_close(gb, oracle("ij,ik->kj", w, a[0]), oracle_bound("ij,ik->kj", w, a[0]), 1e-5)
    jaxpr = jax.make_jaxpr(jax.grad(lambda a: jnp.sum(fast(a, b))))(a[0])
    assert sums_of_products(jaxpr) == 0


def test_closure_over_traced_values_and_static_arguments():
    a, b = rand(8, 6), rand(6, 5, seed=1)

    def loss(scale):
        fast = rewriter.rewrite(lambda a, b, power: (scale**power * a[:, :, None] * b[None]).sum(1), **GATE_OFF)
        return fast(a, b, power=2).sum()

    assert_close(jax.grad(loss)(3.0), 6.0 * oracle("ik,kj->", a, b), 6.0 * oracle_bound("ik,kj->", a, b), 1e-5)


def test_static_arguments_of_different_types_trace_apart():
    a, b = rand(8, 6), rand(6, 5, seed=1)
    signed = rewriter.rewrite(
        lambda a, b, flag: matmul_as_sum(a, b) if flag is True else -matmul_as_sum(a, b), **GATE_OFF
    )
    np.testing.assert_array_equal(signed(a, b, 1), -signed(a, b, True))  # 1 == True, but a different trace
    scaled = rewriter.rewrite(lambda a, b, n: (matmul_as_sum(a, b), jnp.arange(5) * n), **GATE_OFF)
    assert scaled(a, b, 1)[1].dtype == jnp.int32
    assert scaled(a, b, 1.0)[1].dtype == jnp.float32


def test_side_effect_without_outputs_is_kept(capfd):
    a, b = rand(8, 6), rand(6, 5, seed=1)

    def f(a, b):
        jax.debug.print("first {x}", x=a[0, 0])
        return matmul_as_sum(a, b)

    check_rewritten(f, (a, b), "ik,kj->ij")
    jax.effects_barrier()
    assert "first" in capfd.readouterr().out


def test_analyze_abstract_full_size_allocates_nothing():
    big = jax.ShapeDtypeStruct((4096, 8192), jnp.float32)
    report = rewriter.analyze(matmul_as_sum, big, jax.ShapeDtypeStruct((8192, 4096), jnp.float32))
    site = only_site(report)
    assert site.intermediate_elements == 4096 * 8192 * 4096 and site.status == "rewritten"


def test_report_table_and_json(tmp_path):
    a, b = rand(128, 96), rand(96, 80, seed=1)
    report = rewriter.analyze(lambda a, b: (matmul_as_sum(a, b), (a * a).sum()), a, b)
    text = str(report)
    assert "rewritten" in text and "skipped" in text and "983,040" in text and "test_rewriter.py:" in text
    path = tmp_path / "report.json"
    report.to_json(path)
    loaded = Report.from_json(path)
    assert loaded.sites == report.sites and json.loads(path.read_text())["sites"][0]["status"] == "rewritten"
    assert loaded.sites[0].source.startswith("tests/test_rewriter.py:") or "test_rewriter.py:" in loaded.sites[0].source


def test_bad_input_errors():
    with pytest.raises(TypeError, match="expected a callable"):
        rewriter.rewrite(42)
    with pytest.raises(TypeError, match="unknown rewriter option"):
        rewriter.rewrite(matmul_as_sum, min_flop=3)
    with pytest.raises(ValueError, match="min_dim"):
        rewriter.rewrite(matmul_as_sum, min_dim=0)
    with pytest.raises(ValueError, match="min_flops"):
        Options(min_flops=-1)
    with pytest.raises(ValueError, match="precision"):
        rewriter.rewrite(matmul_as_sum, precision="fastest")
    with pytest.raises(TypeError, match="either options"):
        rewriter.rewrite(matmul_as_sum, options=Options(), verify=True)
    with pytest.raises(TypeError, match="neither an array nor hashable"):
        rewriter.rewrite(lambda a, b: a)(rand(2), {1, 2})


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"verify": "no"}, TypeError, "verify must be a bool"),
        ({"verify": 1}, TypeError, "verify must be a bool"),
        ({"fuse_chains": 0.5}, TypeError, "fuse_chains must be a bool"),
        ({"fuse_chains": None}, TypeError, "fuse_chains must be a bool"),
        ({"rtol": math.nan}, ValueError, "rtol must be None or a finite number"),
        ({"atol": math.nan}, ValueError, "atol must be None or a finite number"),
        ({"rtol": math.inf}, ValueError, "rtol must be None or a finite number"),
        ({"atol": True}, ValueError, "atol must be None or a finite number"),
        ({"min_flops": math.nan}, ValueError, "min_flops must be a finite number"),
        ({"min_flops": math.inf}, ValueError, "min_flops must be a finite number"),
        ({"min_flops": False}, ValueError, "min_flops must be a finite number"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else None,
)
def test_options_reject_non_bools_and_non_finite_numbers(kwargs, error, match):
    with pytest.raises(error, match=match):
        Options(**kwargs)
    with pytest.raises(error, match=match):
        rewriter.rewrite(matmul_as_sum, **kwargs)


def test_options_accept_valid_edge_values():
    options = Options(min_flops=0, rtol=0, atol=0.0, fuse_chains=False, verify=True)
    assert options.min_flops == 0 and options.rtol == 0 and not options.fuse_chains and options.verify
    assert Options(min_flops=np.float64(1e3), rtol=np.float64(1e-3)).min_flops == 1e3


def test_options_must_be_an_options_instance():
    a, b = rand(8, 8), rand(8, 8, seed=1)
    for bad in ({"min_flops": 0}, {}, "fast"):
        with pytest.raises(TypeError, match="options must be a rewriter.Options"):
            rewriter.rewrite(matmul_as_sum, options=bad)
        with pytest.raises(TypeError, match="options must be a rewriter.Options"):
            rewriter.analyze(matmul_as_sum, a, b, options=bad)
    assert rewriter.analyze(matmul_as_sum, a, b, options=None).options == dataclasses.asdict(Options())


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"a": 1}', r"not a rewriter report: missing key\(s\) \['function', 'sites'\]"),
        ('{"function": "f"}', r"missing key\(s\) \['sites'\]"),
        ("{not json", "not a rewriter report: invalid JSON"),
        ('{"function": "f", "sites": {}}', "'sites' must be a list"),
        ('{"function": "f", "sites": [3]}', "site #0 must be an object"),
        ('{"function": "f", "sites": [{"id": 1}]}', r"site #0 has missing key\(s\) \['path'"),
        ('{"function": "f", "sites": [], "options": 3}', "'options' must be an object"),
    ],
)
def test_report_from_json_rejects_what_is_not_a_report(text, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        Report.from_json(text)
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        Report.from_json(path)


def test_report_from_json_round_trips_an_empty_report():
    report = Report("f", [], {"min_flops": 0})
    assert Report.from_json(report.to_json()) == report


def dot_precisions(fast, *args):
    eqns = jax.make_jaxpr(fast)(*args).jaxpr.eqns[0].params["jaxpr"].jaxpr.eqns
    return [e.params["precision"] for e in eqns if e.primitive.name == "dot_general"]


def test_precision(monkeypatch):
    a, b = rand(8, 6), rand(6, 5, seed=1)
    previous = jax.config.jax_default_matmul_precision
    try:
        jax.config.update("jax_default_matmul_precision", None)
        highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
        assert dot_precisions(rewriter.rewrite(matmul_as_sum, **GATE_OFF), a, b) == [highest]
        fast = rewriter.rewrite(matmul_as_sum, precision="default", **GATE_OFF)
        assert dot_precisions(fast, a, b) == [(lax.Precision.DEFAULT, lax.Precision.DEFAULT)]
        jax.config.update("jax_default_matmul_precision", "tensorfloat32")  # a user choice is respected
        tf32 = (lax.Precision.HIGH, lax.Precision.HIGH)
        assert dot_precisions(rewriter.rewrite(matmul_as_sum, **GATE_OFF), a, b) == [tf32]
    finally:
        jax.config.update("jax_default_matmul_precision", previous)


# ------------------------------------------------------------------------------------------------- verification


def test_verify_passes_on_a_correct_rewrite():
    a, b = rand(8, 6), rand(6, 5, seed=1)
    fast = rewriter.rewrite(lambda a, b: (matmul_as_sum(a, b), matmul_as_sum(b.T, a.T)), verify=True, **GATE_OFF)
    out, _ = fast(a, b)
    assert_close(out, oracle("ik,kj->ij", a, b), oracle_bound("ik,kj->ij", a, b), 1e-5)


def test_verify_names_the_wrong_site(monkeypatch):
    a, b = rand(8, 6), rand(6, 5, seed=1)
    from rewriter import interpret

    real = interpret.emit.contract

    def broken(c, plan, read, out_aval, precision):  # corrupt only contractions with a 5-sized output dim
        y = real(c, plan, read, out_aval, precision)
        return y + 1.0 if out_aval.shape[-1] == 5 else y

    monkeypatch.setattr(interpret.emit, "contract", broken)
    fast = rewriter.rewrite(lambda a, b: (matmul_as_sum(a, b), matmul_as_sum(b.T, a.T)), verify=True, **GATE_OFF)
    with pytest.raises(VerificationError, match=r"site #1 .*test_rewriter.py:\d+") as info:
        fast(a, b)
    assert "site #2" not in str(info.value)
    with pytest.raises(VerificationError):  # a failed check is repeated on the next call, never skipped
        fast(a, b)


def test_verify_with_typed_prng_keys_in_and_out():
    def f(a, b, key):
        return matmul_as_sum(a, b) + jax.random.normal(key, (8, 5)), jax.random.split(key)

    a, b, key = rand(8, 6), rand(6, 5, seed=1), jax.random.key(0)
    # eagerly: real keys; under jit: stand-in keys of the same implementation (a fresh rewrite each: one verification)
    for g in (rewriter.rewrite(f, verify=True, **GATE_OFF), jax.jit(rewriter.rewrite(f, verify=True, **GATE_OFF))):
        out, keys = g(a, b, key)
        want, want_keys = f(a, b, key)
        assert_close(out, want, oracle_bound("ik,kj->ij", a, b) + np.abs(want), 1e-5)
        np.testing.assert_array_equal(jax.random.key_data(keys), jax.random.key_data(want_keys))


def test_verify_compares_complex_outputs(monkeypatch):
    from rewriter import interpret

    real = interpret.emit.contract
    monkeypatch.setattr(interpret.emit, "contract", lambda *args: real(*args) + 1.0)
    fast = rewriter.rewrite(lambda a, b: matmul_as_sum(a, b) * 1j, verify=True, **GATE_OFF)
    with pytest.raises(VerificationError, match="site #1"):
        fast(rand(8, 6), rand(6, 5, seed=1))


def test_verify_under_jit_uses_stand_in_inputs(monkeypatch):
    from rewriter import interpret

    real = interpret.emit.contract
    monkeypatch.setattr(interpret.emit, "contract", lambda *args: real(*args) * 1.5)
    fast = rewriter.rewrite(matmul_as_sum, verify=True, **GATE_OFF)
    with pytest.raises(VerificationError, match="site #1"):
        jax.jit(fast)(rand(8, 6), rand(6, 5, seed=1))
