"""The rewriter under a device mesh of 8 simulated CPU devices: a rewritten function keeps its arguments' shardings when
it traces, gives the original's values and output shardings under `jax.jit`, raises where the original raises, and
`verify=True` compares the outputs (their shardings too) even when no site was rewritten.

They run in a fresh interpreter with the eight devices (`conftest.run_under_mesh_devices`); in the suite's own
processes they are skipped."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import rewriter
from conftest import run_under_mesh_devices
from rewriter import api

REWRITE = dict(min_flops=0, min_dim=1)


@pytest.mark.slow(6)
def test_under_mesh_devices():
    run_under_mesh_devices(__file__)


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def mesh(request, mesh_devices):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(request.param,) * 2, devices=mesh_devices)


def placed(mesh, spec, shape, dtype=jnp.float32, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return jax.device_put(jnp.asarray(x, dtype), NamedSharding(mesh, spec))


def contraction(x, w):
    """x (b, k) @ w (k, n) as a broadcast product and a sum: one site."""
    return (x[:, :, None] * w[None, :, :]).sum(1)


def assert_same_layout(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)


def test_a_rewritten_contraction_keeps_values_and_output_shardings(mesh):
    x, w = placed(mesh, P("data", None), (8, 64)), placed(mesh, P(None, "model"), (64, 32), seed=1)
    fn = rewriter.rewrite(contraction, **REWRITE)
    want, got = jax.jit(contraction)(x, w), jax.jit(fn)(x, w)
    assert [s.status for s in fn.last_report.sites] == ["rewritten"]
    assert_same_layout(want, got)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(got), exact, rtol=1e-5, atol=1e-5)
    assert_same_layout(want, fn(x, w))  # called directly, too


def test_the_trace_sees_the_arguments_shardings(mesh_devices):
    # Under Explicit axes the shardings are part of the types: the trace must carry them (Auto axes have none to see).
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=mesh_devices)
    x, w = placed(mesh, P("data", None), (8, 64)), placed(mesh, P(None, "model"), (64, 32), seed=1)
    seen = []

    def spy(x, w):
        seen.append(jax.typeof(x).sharding.spec)
        return contraction(x, w)

    rewriter.rewrite(spy, **REWRITE)(x, w)
    assert seen and all(spec == P("data", None) for spec in seen), seen


def test_sharding_constraints_and_out_shardings_are_kept(mesh):
    x, w = placed(mesh, P("data", None), (8, 64)), placed(mesh, P(None, "model"), (64, 32), seed=1)
    column = NamedSharding(mesh, P(None, "model"))

    def constrained(x, w):  # under Explicit axes a layout is asked for with `reshard`, under Auto with a constraint
        if mesh.axis_types[0] == AxisType.Explicit:
            return jax.sharding.reshard(contraction(x, w), column)
        return jax.lax.with_sharding_constraint(contraction(x, w), column)

    got = rewriter.rewrite(constrained, **REWRITE)(x, w)
    assert got.sharding.is_equivalent_to(column, 2)
    assert_same_layout(jax.jit(constrained)(x, w), got)
    laid_out = jax.jit(contraction, out_shardings=column)
    assert_same_layout(laid_out(x, w), rewriter.rewrite(laid_out, **REWRITE)(x, w))


def test_bfloat16_values_are_the_originals_where_nothing_is_rewritten(mesh):
    x = placed(mesh, P("data", "model"), (8, 64), jnp.bfloat16)

    def reduce(x):
        return jnp.tanh(x).sum(axis=1) * x.mean()

    want, got = jax.jit(reduce)(x), jax.jit(rewriter.rewrite(reduce, **REWRITE))(x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert_same_layout(want, got)


def test_a_jitted_function_refuses_the_same_arguments(mesh):
    x, w = placed(mesh, P("data", None), (8, 64)), placed(mesh, P(None, "model"), (64, 32), seed=1)
    strict = jax.jit(contraction, in_shardings=(NamedSharding(mesh, P("model", None)), None))
    with pytest.raises(ValueError) as original:
        strict(x, w)
    with pytest.raises(ValueError) as rewritten:
        rewriter.rewrite(strict, **REWRITE)(x, w)
    assert str(rewritten.value).splitlines()[0] == str(original.value).splitlines()[0]
    fitting, whole = (jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in ((x, P("model", None)), (w, P())))
    np.testing.assert_allclose(rewriter.rewrite(strict, **REWRITE)(fitting, whole), strict(fitting, whole), rtol=1e-5)


def test_verify_compares_outputs_even_when_no_site_is_rewritten(mesh, monkeypatch):
    x = placed(mesh, P("data", None), (8, 64))
    plain = lambda x: jnp.tanh(x) * 2  # noqa: E731
    assert rewriter.rewrite(plain, verify=True, **REWRITE)(x).shape == (8, 64)  # the comparison passes
    evaluate = api._evaluate
    monkeypatch.setattr(api, "_evaluate", lambda *a: [y + 1 for y in evaluate(*a)])
    with pytest.raises(rewriter.VerificationError, match="with no site rewritten"):
        rewriter.rewrite(plain, verify=True, **REWRITE)(x)
    monkeypatch.setattr(api, "_evaluate", lambda *a: [jax.device_put(y, jax.devices()[0]) for y in evaluate(*a)])
    with pytest.raises(rewriter.VerificationError, match="0 is sharded as"):
        rewriter.rewrite(plain, verify=True, **REWRITE)(x)


def test_the_gradient_of_a_sharded_model_rewritten(mesh):
    # A two-layer MLP, its first product a broadcast-multiply-sum: the batch over "data", the hidden units over
    # "model" (the second matrix whole: two contracting axes on "model" are ambiguous under Explicit axes). The
    # rewritten gradient has the original's values (to rounding) and shardings.
    params = dict(w1=placed(mesh, P(None, "model"), (32, 64), seed=1), w2=placed(mesh, P(), (64, 16), seed=2))
    x, y = placed(mesh, P("data", None), (8, 32)), placed(mesh, P("data", None), (8, 16), seed=3)

    def loss(params, x, y):
        h = jnp.tanh((x[:, :, None] * params["w1"][None]).sum(1))
        return jnp.mean((h @ params["w2"] - y) ** 2)

    grad = jax.grad(loss)
    fn = rewriter.rewrite(grad, verify=True, **REWRITE)
    with jax.set_mesh(mesh):  # the scalar loss needs the mesh under Explicit axes
        want, got = jax.jit(grad)(params, x, y), jax.jit(fn)(params, x, y)
    assert any(s.status == "rewritten" for s in fn.last_report.sites)
    assert_same_layout(want, got)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-4, atol=1e-6)
