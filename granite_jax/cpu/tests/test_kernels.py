"""The CPU kernels (`granite_jax.cpu.kernels`) against float64: each FFI call on the shapes, dtypes and edge cases its
C++ handles (vector tails, thread chunks, partial panels, empty contractions), and the state-updating ones over
several donated steps. Which op reaches which kernel is `test_backend`'s; building them is `test_build`'s."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from granite_jax import ops, ssd
from granite_jax.cpu import build, kernels, packing
from granite_jax.model import KVState, MambaMixer, MambaState, Positions, attend_cache
from granite_jax.ops import Runtime
from granite_jax.presets import released_config
from granite_jax.testing import attention_float64

pytestmark = pytest.mark.skipif(
    build._unsupported() is not None, reason=f"the CPU kernels do not run here: {build._unsupported()}"
)
PLAIN = Runtime(kernels=False)


def operands(rows: tuple[int, ...], k: int, n: int, seed: int = 0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((*rows, k)), rng.standard_normal((n, k))
    return x.astype(dtype), w.astype(dtype)  # numpy (bfloat16 by ml_dtypes): nothing compiled eagerly


def float64_product(x, w):
    """x @ w.T in float64 from the inputs' exact values, and the same product of absolute values."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return x64 @ w64.T, np.abs(x64) @ np.abs(w64).T


def assert_close_to_float64(got, want, bound, k: int) -> None:
    """A float32 dot product of length k errs by at most gamma_k |x| |w| ~ k u |x| |w| (u = 2^-24, `bound` = |x| |w|;
    checked at twice that). The kernels' outputs are float32 whatever their operands' dtypes."""
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= 2 * k * 2.0**-24 * bound + 1e-30)


def rel(a, b) -> float:
    return np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max()


@pytest.fixture(scope="module", autouse=True)
def loaded():
    """The kernels' targets registered with XLA (by the first `available()`; the raw calls do not register them).
    Where the CPU and compiler allow them (this module's skip), they must load: a silent fallback would hide a broken
    build behind XLA's products."""
    assert build.available(), build.unavailable_reason()


# ---------------------------------------------------------------------------------------------- products


@functools.partial(jax.jit, static_argnums=2)
def panel_product(x, w, n):
    return kernels.panels(x, packing.pack(w), n)


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
def test_panels_match_float64(rows, k, n, dtype):
    x, w = operands(rows, k, n, dtype=dtype)
    assert_close_to_float64(panel_product(x, w, n), *float64_product(x, w), k)


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
def test_one_row_matches_float64(rows, k, n, dtype):
    x, w = operands(rows, k, n, dtype=dtype)
    assert_close_to_float64(jax.jit(kernels.matvec)(x, w), *float64_product(x, w), k)


MIXED = [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)]  # (x, w): float32 on bfloat16 weights, and back


@pytest.mark.parametrize("x_dtype,w_dtype", MIXED)
@pytest.mark.parametrize("rows", [(1,), (3,)], ids=["one row", "panels"])
def test_mixed_dtypes_match_float64(rows, x_dtype, w_dtype):
    # x and w of different kernel dtypes: each read as it is (no converted copy of w), the result the float64 product
    # of the two sets of exact values.
    x, w = (a.astype(t) for a, t in zip(operands(rows, 200, 45), (x_dtype, w_dtype), strict=True))
    got = jax.jit(kernels.matvec)(x, w) if rows == (1,) else panel_product(x, w, 45)
    assert_close_to_float64(got, *float64_product(x, w), 200)


@pytest.mark.parametrize("rows", [1, 3], ids=["one row", "panels"])
def test_empty_contraction_gives_zeros(rows):
    x, w = np.ones((rows, 0), np.float32), np.ones((5, 0), np.float32)
    got = jax.jit(kernels.matvec)(x, w) if rows == 1 else panel_product(x, w, 5)
    np.testing.assert_array_equal(np.asarray(got), np.zeros((rows, 5), np.float32))


@pytest.mark.parametrize("rows", [1, 4], ids=["one row", "panels"])
def test_vmap_calls_the_kernel_per_element(rows):
    x, w = operands((rows,), 40, 21)
    xs = np.stack([x, 2 * x, -x])
    product = kernels.matvec if rows == 1 else lambda x, w: kernels.panels(x, packing.pack(w), 21)
    got = jax.jit(jax.vmap(product, in_axes=(0, None)))(xs, w)
    np.testing.assert_allclose(np.asarray(got), np.einsum("bmk,nk->bmn", xs, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(64, 64), (3, 21), (1, 1), (0, 5)])
def test_widen_is_exact(shape):
    # The widened copy is the bfloat16 values exactly (every bfloat16 is a float32), vector lanes and scalar tails.
    w = np.random.default_rng(1).standard_normal(shape).astype(jnp.bfloat16)
    after = np.ones((2, 3), np.float32)  # only ordered before the copy: never read
    got = jax.jit(kernels.widen)(after, w)
    assert got.dtype == jnp.float32 and got.shape == shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w, np.float32))


def test_take_rows_widens_rows_exactly_and_gives_nan_rows_past_the_table():
    table = np.random.default_rng(3).standard_normal((50, 21)).astype(jnp.bfloat16)  # 21: two vectors and a tail
    ids = np.array([[0, 49, -1, 50, 7], [3, 3, 2**30, -(2**30), 2]], np.int32)
    got = np.asarray(jax.jit(kernels.take_rows)(table, ids))
    valid = (ids >= 0) & (ids < 50)
    assert got.shape == (2, 5, 21) and got.dtype == np.float32
    np.testing.assert_array_equal(got[valid], table.astype(np.float32)[ids[valid]])
    assert np.isnan(got[~valid]).all()


# ---------------------------------------------------------------------------------------------- expert products


def expert_operands(r: int, e: int, k: int, n: int, seed: int = 0, dtype=np.float32):
    """x (r, k), w (e, k, n) and each row's expert. Only the chosen experts are random, the others zero: a read of the
    wrong expert shows, and h-tiny's 64 experts cost no more to make than the few a batch chooses."""
    rng = np.random.default_rng(seed)
    experts = rng.integers(0, e, r).astype(np.int32)
    x = rng.standard_normal((r, k), np.float32).astype(dtype)
    w = np.zeros((e, k, n), dtype)
    chosen = np.unique(experts)
    w[chosen] = rng.standard_normal((len(chosen), k, n), np.float32).astype(dtype)
    return x, w, experts


def expert_reference(x, w, experts):
    """float64 y[r] = x[r] w[experts[r]] and the same product of absolute values (a rounding bound), expert by
    expert (a gather of (R, K, N) would not fit at prefill sizes)."""
    x64 = np.asarray(x, np.float64)
    want, bound = np.zeros((len(x), w.shape[2])), np.zeros((len(x), w.shape[2]))
    for e in np.unique(experts):
        rows, w64 = experts == e, np.asarray(w[e], np.float64)
        want[rows], bound[rows] = x64[rows] @ w64, np.abs(x64[rows]) @ np.abs(w64)
    return want, bound


# h-tiny's expert matrices (16 of its 64 experts: the kernel reads only the chosen ones) at batch 1 (6 rows, in and
# out), batch 8 (48 rows, repeated experts); K with a tail past the four-row step and shorter than one chunk, N with a
# tail past the 8-float vector; one expert; prefill-like runs of ~40 rows per expert (register tiles on 16-column
# strips, a 12-column tail, K in chunks whose partials are summed) and ~3 rows per expert over many experts (K uncut:
# the rows' outputs written directly; some experts tiled, some not), odd counts leaving a row without a partner.
@pytest.mark.parametrize(
    "r,e,k,n",
    [
        (6, 16, 1536, 1024),
        (6, 16, 512, 1536),
        (48, 16, 512, 1536),
        (3, 5, 130, 9),
        (2, 1, 3, 7),
        (301, 8, 520, 700),
        (201, 64, 256, 44),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_expert_rows_match_float64(r, e, k, n, dtype):
    x, w, experts = expert_operands(r, e, k, n, dtype=dtype)
    got = jax.jit(kernels.expert_rows)(x, w, experts)
    assert_close_to_float64(got, *expert_reference(x, w, experts), 10)  # a 10-term sum's bound, tighter than k's


@pytest.mark.parametrize("x_dtype,w_dtype", MIXED)
def test_mixed_dtype_expert_rows_match_float64(x_dtype, w_dtype):
    x, w, experts = expert_operands(12, 5, 96, 40, seed=3, dtype=x_dtype)
    w = np.asarray(w, w_dtype)
    got = jax.jit(kernels.expert_rows)(x, w, experts)
    assert_close_to_float64(got, *expert_reference(x, w, experts), 96)


def test_expert_rows_edge_cases():
    x, w, experts = expert_operands(3, 4, 0, 5)  # an empty contraction: zeros
    np.testing.assert_array_equal(np.asarray(jax.jit(kernels.expert_rows)(x, w, experts)), np.zeros((3, 5)))
    x, w, experts = expert_operands(0, 4, 16, 8)  # no rows
    assert jax.jit(kernels.expert_rows)(x, w, experts).shape == (0, 8)
    x, w, _ = expert_operands(2, 4, 16, 8)
    for bad in ([1, 4], [-1, 0]):  # XLA's gather would clamp them silently
        with pytest.raises(Exception, match="expert index is out of range"):
            jax.block_until_ready(jax.jit(kernels.expert_rows)(x, w, np.array(bad, np.int32)))


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
        y, s = ssd.ssd_reference(**{k: v for k, v in f64.items() if k != "state"}, initial_state=f64["state"])
        return np.asarray(y), np.asarray(s)


def step_args(inputs, t):
    f32 = {k: np.asarray(v, np.float32) for k, v in inputs.items()}
    return f32["x"][:, t], f32["dt"][:, t], f32["A"], f32["B"][:, t], f32["C"][:, t], f32["D"]


def kernel_ssd_step(state, x, dt, A, B, C, D):
    """`ssd_step` as the model runs it on CPUs: the state update kernel (`kernels.ssm_update`) and D x beside it."""
    with ops.using(Runtime()):
        return ssd.ssd_step(state, x, dt, A, B, C, D)


# h-350m's heads; a state size with a tail past the 16-float loop and g > 1; one smaller than a vector.
@pytest.mark.parametrize("b,h,p,g,n", [(8, 48, 32, 1, 128), (3, 6, 5, 3, 21), (2, 4, 1, 1, 7)])
def test_state_update_matches_float64(b, h, p, g, n):
    inputs = ssm_inputs(b, 1, h, p, g, n)
    state = np.asarray(inputs["state"], np.float32)
    text, (y, s) = text_and_outputs(kernel_ssd_step, state, *step_args(inputs, 0))
    assert "granite_ssm_update_f32" in text
    y_ref, s_ref = float64_tokens(inputs)
    assert y.dtype == s.dtype == jnp.float32
    assert rel(y, y_ref[:, 0]) < 1e-6 and rel(s, s_ref) < 1e-6


def test_state_update_in_place_over_several_tokens():
    # The decode loop: the state donated to each step and updated in the same buffer.
    inputs = ssm_inputs(2, 6, 4, 8, 2, 16, seed=1)
    step = jax.jit(kernel_ssd_step, donate_argnums=0)
    state, ys = np.asarray(inputs["state"], np.float32), []
    for t in range(6):
        y, state = step(state, *step_args(inputs, t))
        ys.append(y)
    y_ref, s_ref = float64_tokens(inputs)
    assert rel(np.stack(ys, 1), y_ref) < 1e-6 and rel(state, s_ref) < 1e-6


def test_state_update_kernel_alone():
    # The raw call: state <- decay * state + dtx B^T, y = state C, with no D term.
    inputs = ssm_inputs(2, 1, 6, 5, 3, 21, seed=6)
    x, dt, A, B, C, _ = step_args(inputs, 0)
    state = np.asarray(inputs["state"], np.float32)
    decay, dtx = np.exp(dt * A), dt[..., None] * x
    s, y = jax.jit(kernels.ssm_update)(state, decay, dtx, B, C)
    Bh, Ch = (np.repeat(np.asarray(t, np.float64), 2, axis=1) for t in (B, C))  # 6 heads read 3 groups
    want = np.asarray(decay, np.float64)[..., None, None] * state + np.einsum("bhp,bhn->bhpn", dtx, Bh)
    assert rel(s, want) < 1e-6 and rel(y, np.einsum("bhpn,bhn->bhp", want, Ch)) < 1e-6


# ---------------------------------------------------------------------------------------------- Mamba decoding step


def mamba_case(b, h, p, g, n, K, *, bias=True, weight_dtype=np.float32, limit=(0.0, math.inf), seed=0):
    """A config with these Mamba dims, random float32 (zxbcdt, ring, state) and the mixer's weights (conv weight,
    conv bias or None, dt bias, A_log, D, norm weight) in weight_dtype."""
    cfg = released_config("granite-4.0-h-350m").replace(
        hidden_size=h * p, mamba_expand=1, mamba_n_heads=h, mamba_d_head=p, mamba_n_groups=g, mamba_d_state=n,
        mamba_d_conv=K, mamba_conv_bias=bias, num_attention_heads=1, num_key_value_heads=1, time_step_limit=limit,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    conv = h * p + 2 * g * n
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731  (numpy: nothing compiled eagerly)
    data = normal(b, 1, h * p + conv + h), normal(b, K, conv), normal(b, h, p, n)
    weights = [normal(K, conv), normal(conv) if bias else None, normal(h), 0.5 * normal(h), normal(h), normal(h * p)]
    return cfg, data, [None if w is None else jnp.asarray(w.astype(weight_dtype)) for w in weights]


def mixer_of(cfg, weights, dtype) -> MambaMixer:
    """A `MambaMixer` computing in `dtype` with these weights (its projections, which `mix` does not use, abstract)."""
    mixer = nnx.eval_shape(lambda: MambaMixer(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
    params = (mixer.conv_weight, mixer.conv_bias, mixer.dt_bias, mixer.A_log, mixer.D, mixer.norm.weight)
    for param, value in zip(params, weights, strict=True):
        assert (param is None) == (value is None)
        if param is not None:
            param.set_value(value)
    return mixer


def mixed(mixer: MambaMixer, runtime: Runtime):
    """`mixer.mix` of one token under `runtime`, on plain arrays: (y, ring, state)."""

    def mix(zxbcdt, mask, ring, state, slot):
        with ops.using(runtime):
            y, new = mixer.mix(zxbcdt, mask, MambaState(ring, state), slot)
        return y, new.conv, new.ssm

    return mix


def float64_mix(cfg, weights):
    """The model's plain-JAX `MambaMixer.mix` in float64 on the inputs' exact values, jitted once: a function of
    (zxbcdt, mask, ring, state, slot) giving numpy (y, ring, state)."""
    wide = lambda t: None if t is None else jnp.asarray(np.asarray(t, np.float32), jnp.float64)  # noqa: E731
    with jax.enable_x64(True):
        mix = jax.jit(mixed(mixer_of(cfg, [wide(w) for w in weights], jnp.float64), PLAIN))

    def run(zxbcdt, mask, ring, state, slot):
        with jax.enable_x64(True):
            return [np.asarray(t) for t in mix(wide(zxbcdt), mask, wide(ring), wide(state), slot)]

    return run


def text_and_outputs(fn, *args):
    """The program `fn` lowers to here (StableHLO text) and its outputs, traced and compiled once."""
    lowered = jax.jit(fn).trace(*args).lower()
    return lowered.as_text(), lowered.compile()(*args)


# h-350m's Mamba dims at batch 8; batch 1 with no mask; a head size and state size off the vectors, two groups, three
# taps, no conv bias, bfloat16 weights, a masked row and time steps clipped at both ends; bfloat16 weights, g = h.
@pytest.mark.parametrize(
    "b,h,p,g,n,K,bias,weight_dtype,limit,slot",
    [
        (8, 48, 32, 1, 128, 4, True, np.float32, (0.0, math.inf), 300),
        (1, 48, 32, 1, 128, 4, True, np.float32, (0.0, math.inf), 0),
        (3, 6, 5, 2, 13, 3, False, jnp.bfloat16, (0.4, 1.5), 7),
        (2, 4, 16, 4, 8, 4, True, jnp.bfloat16, (0.0, math.inf), 1),
    ],
)
def test_mamba_step_matches_float64(b, h, p, g, n, K, bias, weight_dtype, limit, slot):
    cfg, (zxbcdt, ring, state), weights = mamba_case(
        b, h, p, g, n, K, bias=bias, weight_dtype=weight_dtype, limit=limit
    )
    mask = None if b == 1 else (np.arange(b) % 3 != 2)[:, None]  # the third row is padding
    args = (zxbcdt, mask, ring, state, np.int32(slot))
    text, (y, new_ring, new_state) = text_and_outputs(mixed(mixer_of(cfg, weights, jnp.float32), Runtime()), *args)
    assert "granite_mamba_step" in text and "granite_ssm_update_f32" not in text  # one call: the state update inside
    y64, ring64, state64 = float64_mix(cfg, weights)(*args)
    assert y.shape == (b, 1, h * p) and y.dtype == new_ring.dtype == new_state.dtype == jnp.float32
    np.testing.assert_array_equal(new_ring, ring64.astype(np.float32))  # the new input, written into slot % K
    assert rel(y, y64) < 1e-5 and rel(new_state, state64) < 1e-5
    if b >= 3:  # a padding row's conv output is zero: its state only decays
        np.testing.assert_allclose(y[2], 0.0, atol=1e-6)


def test_mamba_step_saturates_like_float64_on_large_activations():
    # The kernel's SiLU uses its own exp, clamped to [-87.3, 88]. Far past the clamp and at exact zeros it still gives
    # float64's values, finite: z and the conv's inputs at +-1e4 and 0 on the vector lanes and on the scalar tail (the
    # conv's 90 channels: 11 vectors and 2), the rest at 60 sigma; time steps of 1e4 (softplus is x itself, the decay
    # underflows to 0) and -1e4 (dt 0, no decay).
    cfg, (zxbcdt, ring, state), weights = mamba_case(2, 6, 8, 1, 21, 4, seed=4)
    big = 60.0 * zxbcdt
    d_inner, conv = 6 * 8, 6 * 8 + 2 * 21
    extremes = [1e4, -1e4, 0.0]
    for start in (0, d_inner, d_inner + conv - 3):  # z's first lanes, the conv's first lanes and its tail
        big[:, 0, start : start + 3] = extremes
    big[:, 0, d_inner + conv : d_inner + conv + 3] = extremes  # three heads' time steps
    args = (big, np.ones((2, 1), np.bool_), 60.0 * ring, state, np.int32(1))
    y, _, new_state = jax.jit(mixed(mixer_of(cfg, weights, jnp.float32), Runtime()))(*args)
    y64, _, state64 = float64_mix(cfg, weights)(*args)
    assert np.isfinite(y).all() and np.isfinite(new_state).all()
    assert rel(y, y64) < 1e-5 and rel(new_state, state64) < 1e-5


def test_mamba_step_in_place_over_several_tokens():
    # The decode loop: ring and state donated to each step and updated in their buffers, the ring's slot going round.
    cfg, (zxbcdt, ring, state), weights = mamba_case(2, 6, 8, 2, 16, 4, seed=1)
    step = jax.jit(mixed(mixer_of(cfg, weights, jnp.float32), Runtime()), donate_argnums=(2, 3))
    tokens = np.random.default_rng(2).standard_normal((7, *zxbcdt.shape), np.float32)
    mask = np.ones((2, 1), np.bool_)
    ring64, state64, float64_step = (
        np.asarray(ring, np.float64),
        np.asarray(state, np.float64),
        float64_mix(cfg, weights),
    )
    for t in range(7):
        y, ring, state = step(tokens[t], mask, ring, state, np.int32(t + 5))
        y64, ring64, state64 = float64_step(tokens[t], mask, ring64, state64, np.int32(t + 5))
        assert rel(y, y64) < 1e-5
    assert rel(ring, ring64) == 0 and rel(state, state64) < 1e-5


# ---------------------------------------------------------------------------------------------- decode attention


def attention_inputs(b, kv, rep, d, S, pad, seed=0, cache_dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, 1, kv, rep, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, kv, S, d)).astype(cache_dtype) for _ in range(2))
    return q, k, v, np.asarray(pad, np.int32)


@functools.partial(jax.jit, static_argnames="scale")
def kernel_attention(q, k, v, pad, slot, scale=0.3):
    return kernels.decode_attention(q[:, 0], k, v, pad, slot, scale)[:, None]


@functools.partial(jax.jit, static_argnames="scale")
def plain_attention(q, k, v, pad, slot, scale=0.3):
    with ops.using(PLAIN):
        return attend_cache(q, KVState(k, v), Positions(jnp.reshape(slot, (1,)), pad), scale)


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
def test_decode_attention_matches_float64(b, kv, rep, d, S, slot, pad, cache_dtype):
    q, k, v, pad = attention_inputs(b, kv, rep, d, S, pad, cache_dtype=cache_dtype)
    slot = np.int32(slot)
    got = kernel_attention(q, k, v, pad, slot)
    want = attention_float64(q, k, v, np.array([min(int(slot), S - 1)]), pad, 0.3)
    assert got.shape == q.shape and got.dtype == jnp.float32
    assert rel(got, want) < 1e-5
    assert rel(plain_attention(q, k, v, pad, slot), want) < 1e-5  # what it replaces, on the same inputs


def test_decode_attention_without_a_slot_gives_zeros():
    # A row whose padding reaches past the query slot (decoding never asks for one): zeros; the other row as usual.
    q, k, v, pad = attention_inputs(2, 2, 3, 16, 40, [0, 25])
    got = np.asarray(kernel_attention(q, k, v, pad, np.int32(20)))
    assert np.all(got[1] == 0)
    assert rel(got[:1], attention_float64(q[:1], k[:1], v[:1], np.array([20]), pad[:1], 0.3)) < 1e-5
