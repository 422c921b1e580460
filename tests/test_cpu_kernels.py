"""The CPU decode kernels (granite_jax.cpu_kernels) against float64, and where they are and are not used."""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import attention_float64

from granite_jax import cpu_kernels
from granite_jax.model import KVState, MambaWeights, Positions, _attend_blocks, mixer_middle
from granite_jax.presets import released_config
from granite_jax.ssd import ssd_reference, ssd_step

# Tests of the kernels skip where they cannot run; tests of the fallbacks (XLA's products, the reasons) run everywhere.
needs_kernel = pytest.mark.skipif(
    cpu_kernels._unsupported() is not None, reason=f"kernel unsupported here: {cpu_kernels._unsupported()}"
)


def operands(rows: tuple[int, ...], k: int, n: int, seed: int = 0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((*rows, k)), rng.standard_normal((n, k))
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


def assert_close_to_float64(got, want, bound, k: int, dtype) -> None:
    """A float32 dot product of length k errs by at most gamma_k |x| |w| ~ k u |x| |w| (u = 2^-24, `bound` = |x| |w|;
    checked at twice that); bfloat16 results are then rounded to 8 significant bits (half an ulp: 2^-9 relative)."""
    assert got.shape == want.shape and got.dtype == dtype
    rounding = 2.0**-8 * np.abs(want) if dtype == jnp.bfloat16 else 0.0
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= 2 * k * 2.0**-24 * bound + rounding + 1e-30)


def float64_product(x, w):
    """x @ w.T in float64 from the inputs' exact values, and the same product of absolute values."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return x64 @ w64.T, np.abs(x64) @ np.abs(w64).T


def lowered(fn, *args, platform: str = "cpu") -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@needs_kernel
def test_kernel_builds_on_this_machine():
    # Where the CPU and compiler allow it (needs_kernel), the kernel must load: a silent fallback would hide a
    # broken build behind XLA's products.
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()


def packed_linear(x, w):
    """What `Linear` runs after `pack()`: the product through w's panels (packed inside, so gradients reach w)."""
    return cpu_kernels.linear(x, w, cpu_kernels.pack(w))


@pytest.mark.parametrize("n,k", [(1, 3), (8, 5), (13, 7), (24, 1)])
def test_pack_is_panels_of_eight_rows(n, k):
    w = np.arange(n * k, dtype=np.float32).reshape(n, k) + 1
    packed = np.asarray(cpu_kernels.pack(w))
    assert packed.shape == (-(-n // 8), k, 8)
    for row in range(packed.shape[0] * 8):  # panel[p, :, c] is row 8p + c; rows past n are zero
        want = w[row] if row < n else np.zeros(k, np.float32)
        np.testing.assert_array_equal(packed[row // 8, :, row % 8], want)
    np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack(packed, n)), w)


# Row counts 2..16 (also as (b, 1) leading dims): one group of eight rows of x, partial groups, two groups. K with
# odd lengths, N with and without whole panels of 8, and larger than one thread chunk.
@pytest.mark.parametrize(
    "rows,k,n",
    [
        ((2,), 8, 3),
        ((3,), 13, 7),
        ((4,), 1, 1),
        ((5,), 64, 200),
        ((8, 1), 768, 301),
        ((11,), 33, 90),
        ((16,), 100, 2),
        ((7, 2), 9, 50),
        ((8,), 96, 1000),
        ((12,), 300, 301),  # two groups of rows over several blocks of K
        ((16,), 768, 100),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@needs_kernel
def test_matches_float64(rows, k, n, dtype):
    x, w = operands(rows, k, n, dtype=dtype)
    packed = cpu_kernels.pack(w)
    assert cpu_kernels.uses_kernel(x, packed)
    assert cpu_kernels.TARGET in lowered(cpu_kernels.linear, x, w, packed)
    got = jax.jit(cpu_kernels.linear)(x, w, packed)
    assert_close_to_float64(got, *float64_product(x, w), k, dtype)


# One row, on w as it is: K with and without whole vectors of 8 and whole cache lines (43: lines, a vector and three
# left over), N from one row to several thread chunks with rows left over after the four streams of a chunk, the tied
# head's shape.
@pytest.mark.parametrize(
    "rows,k,n",
    [
        ((1,), 1, 1),
        ((1,), 7, 3),
        ((1, 1), 8, 33),
        ((1,), 15, 129),
        ((1,), 43, 77),
        ((1,), 768, 1001),
        ((1,), 64, 100352),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@needs_kernel
def test_one_row_matches_float64(rows, k, n, dtype):
    x, w = operands(rows, k, n, dtype=dtype)
    assert cpu_kernels.uses_matvec(x, w)
    assert cpu_kernels.MATVEC_TARGET in lowered(cpu_kernels.linear, x, w)
    got = jax.jit(cpu_kernels.linear)(x, w)
    assert_close_to_float64(got, *float64_product(x, w), k, dtype)


MIXED = [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)]  # (x, w): float32 on bfloat16 weights, and back


@pytest.mark.parametrize("x_dtype,w_dtype", MIXED)
@pytest.mark.parametrize("rows", [(1,), (3,)], ids=["one row", "packed"])
@needs_kernel
def test_mixed_dtypes_match_float64(rows, x_dtype, w_dtype):
    # x and w of different kernel dtypes: the kernels read each as it is (no converted copy of w), and the result is
    # the float64 product of the two sets of exact values, rounded to x's dtype; gradients reach both.
    x, w = (jnp.asarray(a, t) for a, t in zip(operands(rows, 200, 45), (x_dtype, w_dtype), strict=True))
    linear = cpu_kernels.linear if rows == (1,) else packed_linear
    assert cpu_kernels.uses_matvec(x, w) if rows == (1,) else cpu_kernels.uses_kernel(x, cpu_kernels.pack(w))
    text = lowered(linear, x, w)
    assert (cpu_kernels.MATVEC_TARGET if rows == (1,) else cpu_kernels.TARGET) in text
    assert_close_to_float64(jax.jit(linear)(x, w), *float64_product(x, w), 200, x_dtype)
    gx, gw = jax.jit(jax.grad(lambda x, w: jnp.sum(linear(x, w).astype(jnp.float32)), argnums=(0, 1)))(x, w)
    assert gx.dtype == x_dtype and gw.dtype == w_dtype
    w64 = np.asarray(w, np.float64)
    tolerance = 1e-6 if x_dtype == jnp.float32 else 2.0**-8  # a sum of N float32 terms; rounded to bfloat16
    assert np.all(np.abs(np.asarray(gx, np.float64) - w64.sum(0)) <= tolerance * np.abs(w64).sum(0))
    x64 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])  # d/dw of the sum: every row of gw is the sum of x's rows
    tolerance = 1e-6 if w_dtype == jnp.float32 else 2.0**-8
    want = np.broadcast_to(x64.sum(0), w.shape)
    assert np.all(np.abs(np.asarray(gw, np.float64) - want) <= tolerance * np.abs(x64).sum(0) + 1e-30)


@needs_kernel
def test_weights_cast_at_use_are_exact_and_wait_for_their_product():
    # bfloat16 weights under float32 activations, many rows (XLA's product, as in prefill): each weight is widened
    # exactly, by a kernel that takes the activations as an operand, so that each conversion comes after the product
    # before it. Left to XLA, the eight conversions below run first and are all alive at once.
    rng = np.random.default_rng(5)
    ws = [jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.bfloat16) for _ in range(8)]  # gain ~1 per layer
    x = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
    widened = jax.jit(cpu_kernels.cast_at_use)(ws[0], x)
    assert widened.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(widened), np.asarray(ws[0], np.float32))
    assert cpu_kernels.WIDEN_TARGET in lowered(cpu_kernels.cast_at_use, ws[0], x)
    assert cpu_kernels.WIDEN_TARGET not in lowered(cpu_kernels.cast_at_use, ws[0], x, platform="cuda")

    def chain(x, ws):
        for w in ws:
            x = jnp.tanh(cpu_kernels.linear(x, w))
        return x

    want = np.asarray(x, np.float64)
    for w in ws:
        want = np.tanh(want @ np.asarray(w, np.float64).T)
    np.testing.assert_allclose(np.asarray(jax.jit(chain)(x, ws)), want, rtol=1e-4, atol=1e-5)
    temp = jax.jit(chain).trace(x, ws).lower().compile().memory_analysis().temp_size_in_bytes
    assert temp < 4 * 64 * 64 * 4  # a few float32 weights at a time, not eight
    gw = jax.jit(jax.grad(lambda w: jnp.sum(chain(x, [w])), argnums=0))(ws[0])
    assert gw.dtype == jnp.bfloat16 and gw.shape == ws[0].shape


@pytest.mark.parametrize("x_dtype,w_dtype", MIXED)
@needs_kernel
def test_mixed_dtype_expert_rows_match_float64(x_dtype, w_dtype):
    x, w, experts = expert_operands(12, 5, 96, 40, seed=3)
    x, w = jnp.asarray(x, x_dtype), jnp.asarray(w, w_dtype)
    assert cpu_kernels.uses_expert_kernel(x, w)
    assert cpu_kernels.EXPERT_TARGET in lowered(cpu_kernels.expert_linear, x, w, experts)
    got = jax.jit(cpu_kernels.expert_linear)(x, w, experts)
    assert_close_to_float64(got, *expert_reference(x, w, experts), 96, x_dtype)


@pytest.mark.parametrize("linear", [packed_linear, cpu_kernels.linear], ids=["packed", "one row"])
@needs_kernel
def test_empty_contraction_gives_zeros(linear):
    rows = 3 if linear is packed_linear else 1
    x, w = np.ones((rows, 0), np.float32), np.ones((5, 0), np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(linear)(x, w)), np.zeros((rows, 5), np.float32))


@pytest.mark.parametrize(
    "rows,dtype",
    [((17,), jnp.float32), ((4, 8), jnp.float32), ((17,), jnp.bfloat16), ((8,), jnp.float16), ((1,), jnp.float16)],
)
def test_other_products_stay_with_xla(rows, dtype):
    # More than MAX_ROWS rows (prefill, training), float16.
    x, w = (jnp.asarray(a, dtype) for a in operands(rows, 32, 24))
    assert not cpu_kernels.uses_kernel(x, cpu_kernels.pack(w)) and not cpu_kernels.uses_matvec(x, w)
    text = lowered(packed_linear, x, w)
    assert cpu_kernels.TARGET not in text and cpu_kernels.MATVEC_TARGET not in text
    got = np.asarray(packed_linear(x, w), np.float64)
    x64, w64 = (np.asarray(t, np.float64) for t in (x, w))
    tolerance = 1e-5 if dtype == jnp.float32 else 3e-2  # 16-bit outputs are rounded to 8 or 11 significant bits
    assert np.all(np.abs(got - x64 @ w64.T) <= tolerance * (np.abs(x64) @ np.abs(w64).T))


@needs_kernel
def test_unpacked_weights_stay_with_xla():
    x, w = operands((8,), 32, 24)
    text = lowered(cpu_kernels.linear, x, w)
    assert cpu_kernels.TARGET not in text and cpu_kernels.MATVEC_TARGET not in text


@pytest.mark.parametrize("rows", [(8,), (1,)])
def test_other_platforms_get_xla_products(rows):
    x, w = operands(rows, 32, 24)
    text = lowered(packed_linear, x, w, platform="cuda")
    assert cpu_kernels.TARGET not in text and cpu_kernels.MATVEC_TARGET not in text and "dot_general" in text


@pytest.mark.parametrize("rows,linear", [((4,), packed_linear), ((1,), cpu_kernels.linear)], ids=["packed", "one row"])
@needs_kernel
def test_gradients_and_vmap(rows, linear):
    x, w = operands(rows, 40, 21)
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(linear(x, w))), argnums=(0, 1)))(x, w)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    upstream = np.cos(x64 @ w64.T)  # d sum(sin(y)) / dy, y = x w^T
    for got, want in zip(grads, (upstream @ w64, upstream.T @ x64)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    xs = np.stack([np.asarray(x), 2 * np.asarray(x), -np.asarray(x)])
    batched = jax.jit(jax.vmap(linear, in_axes=(0, None)))(xs, w)
    np.testing.assert_allclose(np.asarray(batched), np.einsum("bmk,nk->bmn", xs, w), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- expert products


def expert_operands(r: int, e: int, k: int, n: int, seed: int = 0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = np.asarray(jnp.asarray(rng.standard_normal((r, k)), dtype))
    w = np.asarray(jnp.asarray(rng.standard_normal((e, k, n)), dtype))
    return x, w, rng.integers(0, e, r).astype(np.int32)


def expert_reference(x, w, experts):
    """float64 y[r] = x[r] w[experts[r]] and the same product of absolute values (a rounding bound), expert by
    expert (a gather of (R, K, N) would not fit at prefill sizes)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want, bound = np.zeros((len(x), w.shape[2])), np.zeros((len(x), w.shape[2]))
    for e in np.unique(experts):
        rows = experts == e
        want[rows], bound[rows] = x64[rows] @ w64[e], np.abs(x64[rows]) @ np.abs(w64[e])
    return want, bound


# h-tiny's experts at batch 1 (6 rows, in and out), batch 8 (48 rows, repeated experts); K with a tail past the
# four-row step and shorter than one chunk, N with a tail past the 8-float vector; one expert; prefill-like runs of
# ~40 rows per expert (register tiles on 16-column strips, a 12-column tail, K in chunks whose partials are summed)
# and ~3 rows per expert over many experts (K uncut: the rows' outputs written directly; some experts tiled, some
# not), odd counts leaving a row without a partner.
@pytest.mark.parametrize(
    "r,e,k,n",
    [
        (6, 64, 1536, 1024),
        (6, 64, 512, 1536),
        (48, 64, 512, 1536),
        (3, 5, 130, 9),
        (2, 1, 3, 7),
        (301, 8, 520, 700),
        (201, 64, 256, 44),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@needs_kernel
def test_expert_rows_match_float64(r, e, k, n, dtype):
    x, w, experts = expert_operands(r, e, k, n, dtype=dtype)
    assert cpu_kernels.uses_expert_kernel(x, w)
    assert cpu_kernels.EXPERT_TARGET in lowered(cpu_kernels.expert_linear, x, w, experts)
    got = jax.jit(cpu_kernels.expert_linear)(x, w, experts)
    assert_close_to_float64(got, *expert_reference(x, w, experts), 10, dtype)


@pytest.mark.parametrize("r", [40, 150])  # XLA gathers the chosen experts up to GATHER_ROWS rows, runs blocks past it
def test_expert_rows_by_xla_match_float64(r):
    x, w, experts = expert_operands(r, 6, 48, 24, seed=2)
    got = np.asarray(jax.jit(cpu_kernels._expert_xla)(x, w, experts), np.float64)
    want, bound = expert_reference(x, w, experts)
    assert np.all(np.abs(got - want) <= 1e-5 * bound + 1e-6)


@needs_kernel
def test_expert_rows_edge_cases():
    x, w, experts = expert_operands(3, 4, 0, 5)
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu_kernels.expert_linear)(x, w, experts)), np.zeros((3, 5)))
    x, w, _ = expert_operands(2, 4, 16, 8)
    with pytest.raises(Exception, match="expert index is out of range"):  # XLA's gather would clamp it silently
        jax.block_until_ready(jax.jit(cpu_kernels.expert_linear)(x, w, np.array([1, 4], np.int32)))


def test_expert_rows_elsewhere_are_xla():
    x, w, experts = expert_operands(4, 3, 16, 8)
    assert cpu_kernels.EXPERT_TARGET not in lowered(cpu_kernels.expert_linear, x, w, experts, platform="cuda")
    for x_dtype, w_dtype in ((jnp.float16, jnp.float16), (jnp.float32, jnp.float16)):  # float16 x or w
        xo, wo = jnp.asarray(x, x_dtype), jnp.asarray(w, w_dtype)
        assert not cpu_kernels.uses_expert_kernel(xo, wo)
        assert cpu_kernels.EXPERT_TARGET not in lowered(cpu_kernels.expert_linear, xo, wo, experts)


@pytest.mark.parametrize("r", [5, 150])  # the tangents by XLA's gather, and past GATHER_ROWS by its blocks
@needs_kernel
def test_expert_rows_gradients(r):
    x, w, experts = expert_operands(r, 3, 12, 7, seed=1)
    loss = lambda x, w: jnp.sum(jnp.sin(cpu_kernels.expert_linear(x, w, experts)))  # noqa: E731
    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    upstream = np.cos(np.einsum("rk,rkn->rn", x64, w64[experts]))
    want_w = np.zeros_like(w64)
    np.add.at(want_w, experts, np.einsum("rk,rn->rkn", x64, upstream))  # rows sharing an expert add up
    np.testing.assert_allclose(np.asarray(gx), np.einsum("rn,rkn->rk", upstream, w64[experts]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gw), want_w, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_expert_rows_gradients_do_not_gather_every_row():
    # Training on many tokens differentiates the kernel's product: its tangents must not build the (R, K, N) gather.
    x, w, experts = expert_operands(512, 16, 256, 256, seed=4)
    loss = lambda x, w: jnp.sum(cpu_kernels.expert_linear(x, w, experts) ** 2)  # noqa: E731
    stats = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w).lower().compile().memory_analysis()
    gather_bytes = x.shape[0] * w.shape[1] * w.shape[2] * 4
    assert stats.temp_size_in_bytes < gather_bytes / 4, (stats.temp_size_in_bytes, gather_bytes)


# ---------------------------------------------------------------------------------------------- Mamba state update


def ssm_inputs(b, L, h, p, g, n, seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        state=rng.standard_normal((b, h, p, n)),
        x=rng.standard_normal((b, L, h, p)),
        dt=np.log1p(np.exp(rng.standard_normal((b, L, h)))),
        A=-np.exp(rng.standard_normal(h)),
        B=rng.standard_normal((b, L, g, n)),
        C=rng.standard_normal((b, L, g, n)),
        D=rng.standard_normal(h),
    )


def float64_tokens(inputs):
    """ssd_reference in float64 over the inputs' L tokens, from their state."""
    with jax.enable_x64(True):
        f64 = {k: jnp.asarray(v, jnp.float64) for k, v in inputs.items()}
        y, s = ssd_reference(**{k: v for k, v in f64.items() if k != "state"}, initial_state=f64["state"])
        return np.asarray(y), np.asarray(s)


def step_args(inputs, t):
    f32 = {k: np.asarray(v, np.float32) for k, v in inputs.items()}
    return f32["x"][:, t], f32["dt"][:, t], f32["A"], f32["B"][:, t], f32["C"][:, t], f32["D"]


def rel(a, b):
    return np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max()


# h-350m's heads; a state size with a tail past the 16-float loop and g > 1; one smaller than a vector.
@pytest.mark.parametrize("b,h,p,g,n", [(8, 48, 32, 1, 128), (3, 6, 5, 3, 21), (2, 4, 1, 1, 7)])
@needs_kernel
def test_state_update_matches_float64(b, h, p, g, n):
    inputs = ssm_inputs(b, 1, h, p, g, n)
    state = np.asarray(inputs["state"], np.float32)
    assert cpu_kernels.SSM_TARGET in lowered(ssd_step, state, *step_args(inputs, 0))
    y, s = jax.jit(ssd_step)(state, *step_args(inputs, 0))
    y_ref, s_ref = float64_tokens(inputs)
    assert y.dtype == s.dtype == jnp.float32
    assert rel(y, y_ref[:, 0]) < 1e-6 and rel(s, s_ref) < 1e-6


@needs_kernel
def test_state_update_in_place_over_several_tokens():
    # The decode loop: the state donated to each step and updated in the same buffer.
    inputs = ssm_inputs(2, 6, 4, 8, 2, 16, seed=1)
    step = jax.jit(ssd_step, donate_argnums=0)
    state, ys = jnp.asarray(inputs["state"], jnp.float32), []
    for t in range(6):
        y, state = step(state, *step_args(inputs, t))
        ys.append(y)
    y_ref, s_ref = float64_tokens(inputs)
    assert rel(np.stack(ys, 1), y_ref) < 1e-6 and rel(state, s_ref) < 1e-6


def test_state_update_elsewhere_is_xla():
    inputs = ssm_inputs(2, 1, 4, 8, 1, 16)
    state = np.asarray(inputs["state"], np.float32)
    text = lowered(ssd_step, state, *step_args(inputs, 0), platform="cuda")
    assert cpu_kernels.SSM_TARGET not in text
    with jax.enable_x64(True):  # float64 is XLA's, and equals the recurrence
        token = [inputs[k][:, 0] if inputs[k].ndim > 1 else inputs[k] for k in ("x", "dt", "A", "B", "C", "D")]
        f64 = [inputs["state"], *token]  # numpy float64
        assert cpu_kernels.SSM_TARGET not in lowered(ssd_step, *f64)
        y, s = ssd_step(*f64)
    y_ref, s_ref = float64_tokens(inputs)
    assert rel(y, y_ref[:, 0]) < 1e-12 and rel(s, s_ref) < 1e-12


@needs_kernel
def test_state_update_gradients():
    inputs = ssm_inputs(2, 1, 4, 8, 2, 16, seed=2)
    state = np.asarray(inputs["state"], np.float32)
    args = step_args(inputs, 0)

    def loss(y, s):
        return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.cos(s))

    def through_step(state, x, rest):
        return loss(*ssd_step(state, x, *rest))

    def through_reference(state, x, rest):  # the token-by-token recurrence, one token
        dt, A, B, C, D = rest
        y, s = ssd_reference(x[:, None], dt[:, None], A, B[:, None], C[:, None], D, initial_state=state)
        return loss(y[:, 0], s)

    got = jax.jit(jax.grad(through_step, argnums=(0, 1)))(state, args[0], args[1:])
    with jax.enable_x64(True):
        args64 = [jnp.asarray(a, jnp.float64) for a in (state, *args)]
        want = jax.grad(through_reference, argnums=(0, 1))(args64[0], args64[1], args64[2:])
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- Mamba decoding step


def mamba_case(b, h, p, g, n, K, *, bias=True, weight_dtype=np.float32, limit=(0.0, float("inf")), seed=0):
    """A config with these Mamba dims, random float32 (zxbcdt, ring, state) and random MambaWeights in weight_dtype
    (no conv bias unless `bias`)."""
    cfg = released_config("granite-4.0-h-350m").replace(
        hidden_size=h * p, mamba_expand=1, mamba_n_heads=h, mamba_d_head=p, mamba_n_groups=g, mamba_d_state=n,
        mamba_d_conv=K, num_attention_heads=1, num_key_value_heads=1, time_step_limit=limit,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    conv = h * p + 2 * g * n
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    data = normal(b, 1, h * p + conv + h), normal(b, K, conv), normal(b, h, p, n)
    weights = [normal(K, conv), normal(conv) if bias else None, normal(h), 0.5 * normal(h), normal(h), normal(h * p)]
    return cfg, data, MambaWeights(*(None if w is None else w.astype(weight_dtype) for w in weights))


def kernel_middle(cfg, zxbcdt, mask, ring, slot, weights, state):
    reference = functools.partial(mixer_middle, cfg, jnp.float32)
    args = (zxbcdt, mask, ring, slot, weights, state)
    return cpu_kernels.mamba_step(*args, cfg.time_step_limit, cfg.rms_norm_eps, reference)


def float64_middle(cfg, zxbcdt, mask, ring, slot, weights, state):
    """`model.mixer_middle` (the XLA path) in float64 on the inputs' exact values."""
    with jax.enable_x64(True):
        wide = lambda t: jnp.asarray(t, jnp.float64)  # noqa: E731
        args = (wide(zxbcdt), mask, wide(ring), slot, jax.tree.map(wide, weights), wide(state))
        return [np.asarray(t) for t in jax.jit(functools.partial(mixer_middle, cfg, jnp.float64))(*args)]


# h-350m's Mamba dims at batch 8; batch 1 with no mask; a head size and state size off the vectors, two groups, three
# taps, no conv bias, bfloat16 weights, a masked row and time steps clipped at both ends; bfloat16 weights, g = h.
@pytest.mark.parametrize(
    "b,h,p,g,n,K,bias,weight_dtype,limit,slot",
    [
        (8, 48, 32, 1, 128, 4, True, np.float32, (0.0, float("inf")), 300),
        (1, 48, 32, 1, 128, 4, True, np.float32, (0.0, float("inf")), 0),
        (3, 6, 5, 2, 13, 3, False, jnp.bfloat16, (0.4, 1.5), 7),
        (2, 4, 16, 4, 8, 4, True, jnp.bfloat16, (0.0, float("inf")), 1),
    ],
)
@needs_kernel
def test_mamba_step_matches_float64(b, h, p, g, n, K, bias, weight_dtype, limit, slot):
    cfg, (zxbcdt, ring, state), weights = mamba_case(
        b, h, p, g, n, K, bias=bias, weight_dtype=weight_dtype, limit=limit
    )
    mask = None if b == 1 else jnp.asarray(np.arange(b) % 3 != 2)[:, None]  # the third row is padding
    args = (zxbcdt, mask, ring, jnp.int32(slot), weights, state)
    assert cpu_kernels.MAMBA_TARGET in lowered(functools.partial(kernel_middle, cfg), *args)
    y, new_ring, new_state = jax.jit(functools.partial(kernel_middle, cfg))(*args)
    y64, ring64, state64 = float64_middle(cfg, *args)
    assert y.shape == (b, 1, h * p) and y.dtype == new_ring.dtype == new_state.dtype == jnp.float32
    np.testing.assert_array_equal(new_ring, ring64.astype(np.float32))  # the new input, written into slot % K
    assert rel(y, y64) < 1e-5 and rel(new_state, state64) < 1e-5
    if b >= 3:  # a padding row's conv output is zero: its state only decays
        np.testing.assert_allclose(y[2], 0.0, atol=1e-6)


@needs_kernel
def test_mamba_step_saturates_like_float64_on_large_activations():
    # The kernel's SiLU uses its own exp, clamped to [-87.3, 88]. Far past the clamp and at exact zeros it still gives
    # float64's values, finite: z and the conv's inputs at +-1e4 and 0 on the vector lanes and on the scalar tail (the
    # conv's 90 channels: 11 vectors and 2), the rest at 60 sigma; time steps of 1e4 (softplus is x itself, the decay
    # underflows to 0) and -1e4 (dt 0, no decay).
    cfg, (zxbcdt, ring, state), weights = mamba_case(2, 6, 8, 1, 21, 4, seed=4)
    big = 60.0 * np.asarray(zxbcdt)
    d_inner, conv = 6 * 8, 6 * 8 + 2 * 21
    extremes = [1e4, -1e4, 0.0]
    for start in (0, d_inner, d_inner + conv - 3):  # z's first lanes, the conv's first lanes and its tail
        big[:, 0, start : start + 3] = extremes
    big[:, 0, d_inner + conv : d_inner + conv + 3] = extremes  # three heads' time steps
    zxbcdt, ring = jnp.asarray(big), 60.0 * ring
    args = (zxbcdt, jnp.ones((2, 1), jnp.bool_), ring, jnp.int32(1), weights, state)
    y, _, new_state = jax.jit(functools.partial(kernel_middle, cfg))(*args)
    y64, _, state64 = float64_middle(cfg, *args)
    assert np.isfinite(y).all() and np.isfinite(new_state).all()
    assert rel(y, y64) < 1e-5 and rel(new_state, state64) < 1e-5


@needs_kernel
def test_mamba_step_in_place_over_several_tokens():
    # The decode loop: ring and state donated to each step and updated in their buffers, the ring's slot going round.
    cfg, (zxbcdt, ring, state), weights = mamba_case(2, 6, 8, 2, 16, 4, seed=1)
    step = jax.jit(functools.partial(kernel_middle, cfg), donate_argnums=(2, 5))
    tokens = jnp.asarray(np.random.default_rng(2).standard_normal((7, *zxbcdt.shape)), jnp.float32)
    mask = jnp.ones((2, 1), jnp.bool_)
    ring64, state64 = np.asarray(ring, np.float64), np.asarray(state, np.float64)
    for t in range(7):
        y, ring, state = step(tokens[t], mask, ring, jnp.int32(t + 5), weights, state)
        y64, ring64, state64 = float64_middle(cfg, tokens[t], mask, ring64, jnp.int32(t + 5), weights, state64)
        assert rel(y, y64) < 1e-5
    assert rel(ring, ring64) == 0 and rel(state, state64) < 1e-5


def test_mamba_step_elsewhere_is_xla():
    cfg, (zxbcdt, ring, state), weights = mamba_case(2, 4, 8, 1, 16, 4)
    mask, slot = jnp.ones((2, 1), jnp.bool_), jnp.int32(3)
    fn = functools.partial(kernel_middle, cfg)
    assert cpu_kernels.MAMBA_TARGET not in lowered(fn, zxbcdt, mask, ring, slot, weights, state, platform="cuda")
    bf16 = [a.astype(jnp.bfloat16) for a in (zxbcdt, ring)]  # a bfloat16 model's activations: XLA's
    assert cpu_kernels.MAMBA_TARGET not in lowered(fn, bf16[0], mask, bf16[1], slot, weights, state)
    mixed = weights._replace(norm_weight=weights.norm_weight.astype(jnp.bfloat16))  # two weight dtypes: XLA's
    assert cpu_kernels.MAMBA_TARGET not in lowered(fn, zxbcdt, mask, ring, slot, mixed, state)


@needs_kernel
def test_mamba_step_gradients():
    cfg, (zxbcdt, ring, state), weights = mamba_case(2, 4, 8, 2, 16, 4, seed=3)
    mask = jnp.ones((2, 1), jnp.bool_)

    def loss(middle, zxbcdt, weights, state):
        y, new_ring, new_state = middle(zxbcdt, mask, ring, jnp.int32(2), weights, state)
        return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.cos(new_state)) + jnp.sum(new_ring**2)

    kernel, xla = functools.partial(kernel_middle, cfg), functools.partial(mixer_middle, cfg, jnp.float32)
    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)
    assert cpu_kernels.MAMBA_TARGET in grad.lower(kernel, zxbcdt, weights, state).as_text()
    got, want = (jax.tree.leaves(grad(middle, zxbcdt, weights, state)) for middle in (kernel, xla))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def attention_inputs(b, kv, rep, d, S, pad, seed=0, cache_dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, 1, kv, rep, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, kv, S, d)), cache_dtype) for _ in range(2))
    return q, k, v, jnp.asarray(pad, jnp.int32)


def xla_attention(q, k, v, pad, slot, scale=0.3):
    return _attend_blocks(q, KVState(k, v), Positions(jnp.reshape(slot, (1,)), pad), scale, None)


def kernel_attention(q, k, v, pad, slot, scale=0.3):
    return cpu_kernels.decode_attention(q, k, v, pad, slot, scale, functools.partial(xla_attention, scale=scale))


# h-350m's heads at a filled length past two key blocks, with left padding; a head size with a tail past the vectors
# and the query's slot short of the cache's end; one query per group; one key; a slot past the cache (the keys stop at
# its end); bfloat16 caches.
@pytest.mark.parametrize(
    "b,kv,rep,d,S,slot,pad,cache_dtype",
    [
        (2, 4, 3, 64, 300, 290, [0, 37], np.float32),
        (3, 2, 4, 20, 70, 50, [5, 0, 50], np.float32),
        (1, 1, 1, 8, 16, 0, [0], np.float32),
        (1, 2, 2, 16, 50, 60, [3], np.float32),
        (2, 4, 3, 64, 200, 199, [3, 130], jnp.bfloat16),
    ],
)
@needs_kernel
def test_decode_attention_matches_float64(b, kv, rep, d, S, slot, pad, cache_dtype):
    q, k, v, pad = attention_inputs(b, kv, rep, d, S, pad, cache_dtype=cache_dtype)
    slot = jnp.int32(slot)
    assert cpu_kernels.ATTENTION_TARGET in lowered(kernel_attention, q, k, v, pad, slot)
    got = jax.jit(kernel_attention)(q, k, v, pad, slot)
    want = attention_float64(q, k, v, np.array([min(int(slot), S - 1)]), pad, 0.3)
    assert got.shape == q.shape and got.dtype == jnp.float32
    assert rel(got, want) < 1e-5
    assert rel(jax.jit(xla_attention)(q, k, v, pad, slot), want) < 1e-5  # the fallback, on the same inputs


@needs_kernel
def test_decode_attention_without_a_slot_gives_zeros():
    # A row whose padding reaches past the query slot (decoding never asks for one): zeros; the other row as usual.
    q, k, v, pad = attention_inputs(2, 2, 3, 16, 40, [0, 25])
    got = np.asarray(jax.jit(kernel_attention)(q, k, v, pad, jnp.int32(20)))
    assert np.all(got[1] == 0)
    assert rel(got[:1], attention_float64(q[:1], k[:1], v[:1], np.array([20]), pad[:1], 0.3)) < 1e-5


def test_decode_attention_elsewhere_is_xla():
    q, k, v, pad = attention_inputs(2, 2, 3, 16, 40, [0, 4])
    slot = jnp.int32(30)
    assert cpu_kernels.ATTENTION_TARGET not in lowered(kernel_attention, q, k, v, pad, slot, platform="cuda")
    bf16 = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)  # a bfloat16 model's: XLA's
    assert cpu_kernels.ATTENTION_TARGET not in lowered(kernel_attention, *bf16, pad, slot)


@needs_kernel
def test_decode_attention_tangents():
    # Forward mode, as XLA's blocks allow (their loop runs to the filled length: not reverse-differentiable).
    q, k, v, pad = attention_inputs(2, 2, 3, 16, 90, [0, 9], seed=3)
    slot = jnp.int32(80)
    tangents = tuple(jnp.asarray(np.random.default_rng(4).standard_normal(t.shape), jnp.float32) for t in (q, k, v))

    def tangent(attention):
        return jax.jvp(lambda q, k, v: attention(q, k, v, pad, slot), (q, k, v), tangents)

    # The kernel's tangent is XLA's by construction; the primal beside it is the kernel's.
    assert cpu_kernels.ATTENTION_TARGET in jax.jit(tangent, static_argnums=0).lower(kernel_attention).as_text()
    (got, dgot), (want, dwant) = jax.jit(tangent, static_argnums=0)(kernel_attention), tangent(xla_attention)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dgot), np.asarray(dwant), rtol=1e-5, atol=1e-6)


def _reason_in_subprocess(tmp_path, **env) -> str:
    code = "from granite_jax import cpu_kernels; print(cpu_kernels.unavailable_reason())"
    env = {**os.environ, "GRANITE_JAX_CACHE_DIR": str(tmp_path / "cache"), **env}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_disabled_by_environment(tmp_path):
    assert "GRANITE_JAX_CPU_KERNELS=0" in _reason_in_subprocess(tmp_path, GRANITE_JAX_CPU_KERNELS="0")


@needs_kernel  # elsewhere the reason is the CPU or the environment, not the build
def test_failed_build_falls_back_with_a_reason(tmp_path):
    reason = _reason_in_subprocess(tmp_path, CXX="/bin/false")
    assert reason.startswith("could not build or load small_matmul.cc + ssm_update.cc"), reason
    assert not list((tmp_path / "cache").glob("*.so"))


def _panels_in_subprocess(tmp_path, **env) -> tuple[str, str, str]:
    """(unavailable_reason, panels_use_avx512 as the built library reports it, describe) in a fresh process."""
    code = (
        "from granite_jax import cpu_kernels as c; print(c.unavailable_reason(), c.panels_use_avx512(), c.describe())"
    )
    env = {**os.environ, "GRANITE_JAX_CACHE_DIR": str(tmp_path / "cache"), **env}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    reason, avx512, description = out.strip().split(" ", 2)
    return reason, avx512, description


@needs_kernel
def test_avx512_panels_follow_the_cpu_and_the_environment(tmp_path):
    has_avx512 = "avx512f" in cpu_kernels._cpu_flags()
    reason, avx512, description = _panels_in_subprocess(tmp_path)
    assert reason == "None" and avx512 == str(has_avx512) and ("(AVX-512)" in description) == has_avx512
    assert _panels_in_subprocess(tmp_path, GRANITE_JAX_CPU_AVX512="0")[:2] == ("None", "False")


@needs_kernel
@pytest.mark.skipif("avx512f" not in cpu_kernels._cpu_flags(), reason="no AVX-512F: no AVX-512 build is tried")
def test_a_compiler_without_avx512_gets_the_avx2_build(tmp_path):
    compiler = tmp_path / "cxx"
    real = cpu_kernels._compiler()
    compiler.write_text(
        f'#!/bin/sh\ncase "$*" in *-mavx512f*) echo "no AVX-512 here" >&2; exit 1;; esac\nexec {real} "$@"\n'
    )
    compiler.chmod(0o755)
    assert _panels_in_subprocess(tmp_path, CXX=str(compiler))[:2] == ("None", "False")


@needs_kernel
@pytest.mark.skipif("avx512f" not in cpu_kernels._cpu_flags(), reason="no AVX-512F: the AVX2 build is the one above")
def test_avx2_build_matches_float64_on_an_avx512_cpu(tmp_path):
    # This process runs the AVX-512 build of the panel kernel; the float64 comparisons run again on the AVX2 build.
    env = {**os.environ, "GRANITE_JAX_CPU_AVX512": "0", "GRANITE_JAX_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", __file__]
    proc = subprocess.run(
        [*cmd, "-k", "test_matches_float64 or test_mixed_dtypes"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]


@needs_kernel
def test_build_is_cached(tmp_path):
    assert _reason_in_subprocess(tmp_path) == "None"
    (library,) = (tmp_path / "cache").glob("cpu_kernels-*.so")
    stamp = library.stat().st_mtime_ns
    assert _reason_in_subprocess(tmp_path) == "None"
    assert library.stat().st_mtime_ns == stamp


BENCHMARK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "cpu_kernels.py")


@needs_kernel
def test_benchmark_script_times_every_weight_shape(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, BENCHMARK, "--rows", "1,9", "--chain-mib", "1", "--repeats", "1", "--json", str(out)]
    cmd += ["--contexts", "40,300"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    shapes = {(r["out"], r["inp"]) for r in doc["results"]}
    # h-350m: Mamba in/out, attention q/k/v/o, shared-MLP in/out and the tied head (vocab x hidden)
    assert {(3376, 768), (768, 1536), (768, 768), (256, 768), (4096, 768), (768, 2048), (100352, 768)} <= shapes
    assert sorted({r["rows"] for r in doc["results"]}) == [1, 9]
    assert all(r["kernel_gb_s"] > 0 and r["xla_gb_s"] > 0 for r in doc["results"])
    assert doc["environment"]["cpu_kernels"].startswith("cpu_kernels:")
    assert [r["batch"] for r in doc["state_update"]] == [1, 9]
    assert all(r["layers"] == 28 and r["kernel_gb_s"] > 0 and r["xla_gb_s"] > 0 for r in doc["state_update"])
    assert [r["batch"] for r in doc["mamba_step"]] == [1, 9]
    assert all(
        r["layers"] == 28 and r["kernel_us_per_layer"] > 0 and r["xla_us_per_layer"] > 0 for r in doc["mamba_step"]
    )
    assert "| 100352 x 768 | 9 |" in proc.stdout
    # decode attention over h-350m's KV heads (4 of 64, 3 queries each) at each batch and filled length
    assert [(r["rows"], r["context"]) for r in doc["attention"]] == [(1, 40), (9, 40), (1, 300), (9, 300)]
    assert all((r["kv_heads"], r["queries_per_kv"], r["head_dim"]) == (4, 3, 64) for r in doc["attention"])
    assert all(r["kernel_gb_s"] > 0 and r["xla_gb_s"] > 0 for r in doc["attention"])
    assert "| 9 | 300 |" in proc.stdout


@needs_kernel
def test_benchmark_script_times_expert_products(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, BENCHMARK, "--shape", "granite-4.0-h-tiny", "--parts", "experts", "--expert-tokens", "1,12"]
    cmd += ["--dtype", "bfloat16", "--chain-mib", "1", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["results"] == [] and doc["state_update"] == []  # only the parts asked for
    # h-tiny: 64 experts, 6 per token, hidden 1536, expert width 512: rows = tokens x 6, in (1536 -> 1024), out;
    # 12 tokens are 72 rows, past the gather: XLA's blocks
    got = [(r["tokens"], r["rows"], r["experts"], r["inp"], r["out"]) for r in doc["experts"]]
    assert got == [(t, 6 * t, 64, k, n) for t in (1, 12) for k, n in ((1536, 1024), (512, 1536))]
    rates = ("kernel_gb_s", "xla_gb_s", "kernel_gflop_s", "xla_gflop_s")
    assert all(r[rate] > 0 for r in doc["experts"] for rate in rates)
    assert "| 12 | 72 | 64 x 512 x 1536 |" in proc.stdout and "one layer, bfloat16" in proc.stdout
    dense = [sys.executable, BENCHMARK, "--parts", "experts", "--rows", "1", "--repeats", "1"]
    proc = subprocess.run(dense, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0 and "granite-4.0-h-350m has no routed experts" in proc.stdout, proc.stderr[-3000:]


@needs_kernel
def test_decode_attention_benchmark_compares_the_two_steps(tmp_path):
    out = tmp_path / "ab.json"
    script = os.path.join(os.path.dirname(BENCHMARK), "decode_attention.py")
    cmd = [sys.executable, script, "--layers", "4", "--prompt-len", "40", "--rounds", "2", "--steps", "2"]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert len(doc["rounds"]) == 2 and all(r["kernel_s"] > 0 and r["xla_s"] > 0 for r in doc["rounds"])
    assert doc["median_xla_over_kernel"] > 0 and "40-token context" in proc.stdout


def test_benchmark_script_refuses_bad_arguments(tmp_path, call_main):
    no_dir = str(tmp_path / "no" / "x.json")
    bad = (
        (["--rows", "2,x"], "argument --rows: expected comma-separated positive integers, got '2,x'"),
        (["--rows", "17"], "argument --rows: the kernels take 1-16 rows, got 17"),
        (["--json", no_dir], "--json"),
        (["--parts", "products,gpu"], "argument --parts: expected a comma-separated subset of products,state,mamba,"),
        (["--expert-tokens", "0"], "argument --expert-tokens: every value must be >= 1"),
        (["--chain-mib", "0"], "argument --chain-mib: must be >= 1, got 0"),
        (["--dtype", "float16"], "--dtype"),
    )
    for args, message in bad:
        code, err = call_main(BENCHMARK, args)
        assert code == 2 and message in err, err
    proc = subprocess.run([sys.executable, BENCHMARK, *bad[0][0]], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and bad[0][1] in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_take_rows_widens_rows_exactly_and_gives_nan_rows_past_the_table(dtype):
    table = jax.random.normal(jax.random.key(3), (50, 21)).astype(dtype)  # 21: two vectors and a scalar tail
    ids = jnp.array([[0, 49, -1, 50, 7], [3, 3, 2**30, -(2**30), 2]], jnp.int32)
    got = np.asarray(jax.jit(cpu_kernels.take_rows)(table, ids))
    rows = np.asarray(table.astype(jnp.float32))
    valid = (np.asarray(ids) >= 0) & (np.asarray(ids) < 50)
    assert got.shape == (2, 5, 21) and got.dtype == np.float32
    np.testing.assert_array_equal(got[valid], rows[np.asarray(ids)[valid]])
    assert np.isnan(got[~valid]).all()
    text = jax.jit(cpu_kernels.take_rows).lower(table, ids).as_text()
    assert (cpu_kernels.TAKE_TARGET in text) == (dtype == jnp.bfloat16 and cpu_kernels.available())
    # gradients reach the table as through XLA's gather (a repeated id twice)
    loss = lambda f: lambda t: (f(t, jnp.array([[0, 49, 7], [3, 3, 2]])) ** 2).sum()
    grad = jax.grad(loss(cpu_kernels.take_rows))(table)
    want = jax.grad(loss(lambda t, i: jnp.take(t, i, axis=0).astype(jnp.float32)))(table)
    np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(want, np.float32))
