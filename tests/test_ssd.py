"""The chunked SSD forms ("xla", "naive") and the one-token step against the float64 sequential recurrence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from granite_jax import ops
from granite_jax.ssd import segsum, ssd, ssd_chunked, ssd_chunked_naive, ssd_reference, ssd_step

# jitted: run eagerly, every operation would compile on its own
IMPLS = {
    "xla": jax.jit(ssd_chunked, static_argnames="chunk_size"),
    "naive": jax.jit(ssd_chunked_naive, static_argnames="chunk_size"),
}


def random_inputs(rng, b, L, h, p, g, n, dt_scale=1.0):
    return dict(
        x=rng.standard_normal((b, L, h, p)),
        dt=np.log1p(np.exp(rng.standard_normal((b, L, h)))) * dt_scale,
        A=-np.exp(rng.standard_normal(h)),
        B=rng.standard_normal((b, L, g, n)),
        C=rng.standard_normal((b, L, g, n)),
        D=rng.standard_normal(h),
    )


def float64_reference(inputs, initial_state):
    with jax.enable_x64(True):
        y, s = jax.jit(ssd_reference)(
            **{k: jnp.asarray(v, jnp.float64) for k, v in inputs.items()},
            initial_state=None if initial_state is None else jnp.asarray(initial_state, jnp.float64),
        )
        return np.asarray(y), np.asarray(s)


def rel(a, b):
    return np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max()


SHAPES = [  # (b, L, h, p, g, n, chunk)
    (1, 5, 4, 8, 1, 16, 16),  # shorter than a chunk
    (2, 48, 4, 8, 1, 16, 16),  # several whole chunks
    (2, 37, 6, 4, 3, 8, 8),  # not a multiple, g > 1
]


@pytest.mark.parametrize("impl", ["xla", "naive"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_float64_recurrence(impl, shape, with_state):
    b, L, h, p, g, n, chunk = shape
    rng = np.random.default_rng(sum(shape))
    inputs = random_inputs(rng, b, L, h, p, g, n)
    s0 = rng.standard_normal((b, h, p, n)) if with_state else None
    y_ref, s_ref = float64_reference(inputs, s0)
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in inputs.items()}
    y, s = IMPLS[impl](**f32, chunk_size=chunk, initial_state=None if s0 is None else jnp.asarray(s0, jnp.float32))
    assert y.dtype == s.dtype == jnp.float32
    assert rel(y, y_ref) < 2e-5 and rel(s, s_ref) < 2e-5


@pytest.mark.parametrize("runtime", [ops.Runtime(), ops.Runtime(kernels=False), ops.Runtime(ssd="naive")])
def test_the_models_ssd_under_each_runtime_with_the_checkpoints_256_chunk(runtime):
    # Released configs say chunk 256; a backend may run other chunks (the CPU kernels' runs 64-token ones) and the
    # "naive" runtime the broadcast-sum form: each is the same scan.
    rng = np.random.default_rng(11)
    inputs = random_inputs(rng, 1, 300, 4, 8, 1, 16)
    s0 = rng.standard_normal((1, 4, 8, 16))
    y_ref, s_ref = float64_reference(inputs, s0)
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in inputs.items()}
    with ops.using(runtime):
        y, s = jax.jit(lambda f32, s0: ssd(**f32, chunk_size=256, initial_state=s0))(f32, jnp.asarray(s0, jnp.float32))
    assert rel(y, y_ref) < 2e-5 and rel(s, s_ref) < 2e-5


@pytest.mark.parametrize("impl", ["xla", "naive"])
def test_fast_decaying_heads_stay_finite_and_exact(impl):
    rng = np.random.default_rng(7)
    inputs = random_inputs(rng, 1, 64, 4, 8, 1, 16, dt_scale=30.0)  # dt * |A| up to ~100 per step
    y_ref, s_ref = float64_reference(inputs, None)
    y, s = IMPLS[impl](**{k: jnp.asarray(v, jnp.float32) for k, v in inputs.items()}, chunk_size=32)
    assert np.isfinite(np.asarray(y)).all() and rel(y, y_ref) < 2e-5 and rel(s, s_ref) < 2e-5


@pytest.mark.parametrize("t", [9, 64, 128, 256])  # direct sums below 128 positions, blocked from 128
def test_segment_sums_are_sums_of_their_own_segments(t):
    # Every entry as accurate as summing its own segment, even where the chunk's running sum is thousands of times
    # larger (a difference of cumsums would lose ~1e-4 relative here), so exp(segsum) keeps full precision.
    rng = np.random.default_rng(t)
    a = -np.abs(rng.standard_normal((2, 3, t))) * rng.choice([0.01, 30.0], (2, 3, t))
    want = np.full((2, 3, t, t), -np.inf)
    for i in range(t):
        for j in range(i + 1):
            want[..., i, j] = a[..., j + 1 : i + 1].sum(-1)
    got = np.asarray(jax.jit(segsum)(jnp.asarray(a, jnp.float32)), np.float64)
    finite = np.isfinite(want)
    assert (np.isfinite(got) == finite).all()
    segment_size = np.abs(want[finite]) + np.abs(a).max()  # the terms of one segment, not the whole chunk
    assert (np.abs(got[finite] - want[finite]) <= 1e-6 * segment_size).all()


@pytest.mark.parametrize("impl", ["xla", "naive"])
def test_fast_decaying_heads_in_256_token_chunks(impl):
    rng = np.random.default_rng(8)
    inputs = random_inputs(rng, 1, 300, 4, 8, 1, 16, dt_scale=30.0)
    y_ref, s_ref = float64_reference(inputs, None)
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in inputs.items()}
    y, s = IMPLS[impl](**f32, chunk_size=256)
    assert np.isfinite(np.asarray(y)).all() and rel(y, y_ref) < 2e-5 and rel(s, s_ref) < 2e-5


def test_bfloat16_inputs_give_float32_outputs():
    # The reference runs on the rounded inputs, so the bound measures the float32 arithmetic, not the rounding
    # (max rel error 2.3e-7 over seeds 0-29 on CPU, 1.5e-7 for this one: bounded at ~10x).
    inputs = random_inputs(np.random.default_rng(8), 1, 40, 4, 8, 1, 16)
    bf16 = {k: jnp.asarray(v, jnp.bfloat16 if k in ("x", "B", "C") else jnp.float32) for k, v in inputs.items()}
    y_ref, s_ref = float64_reference({k: np.asarray(v, np.float64) for k, v in bf16.items()}, None)
    y, s = jax.jit(ssd, static_argnames="chunk_size")(**bf16, chunk_size=16)
    assert y.dtype == s.dtype == jnp.float32 and rel(y, y_ref) < 2e-6 and rel(s, s_ref) < 2e-6


@pytest.mark.parametrize("shape", SHAPES[1:])
def test_bfloat16_operands_accumulate_in_float32(shape):
    # operand_dtype=bfloat16 (tensor cores' form): each contraction's operands round to bfloat16 (relative 2^-9), the
    # sums stay float32, so the error is the rounding's order, not more; float32 operands are 100x closer.
    b, L, h, p, g, n, chunk = shape
    inputs = random_inputs(np.random.default_rng(3), b, L, h, p, g, n)
    y_ref, s_ref = float64_reference(inputs, None)
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in inputs.items()}
    fast = jax.jit(ssd_chunked, static_argnames=("chunk_size", "operand_dtype"))
    y, s = fast(**f32, chunk_size=chunk, operand_dtype=jnp.bfloat16)
    y32, _ = fast(**f32, chunk_size=chunk)
    assert y.dtype == s.dtype == jnp.float32
    assert rel(y, y_ref) < 2e-2 and rel(s, s_ref) < 2e-2
    assert rel(y32, y_ref) < rel(y, y_ref) / 100  # the bfloat16 form does round: the flag is not ignored


def test_step_is_one_token_of_the_recurrence():
    rng = np.random.default_rng(9)
    inputs = random_inputs(rng, 2, 1, 4, 8, 2, 16)
    s0 = rng.standard_normal((2, 4, 8, 16))
    y_ref, s_ref = float64_reference(inputs, s0)
    f32 = {k: jnp.asarray(v[:, 0] if v.ndim > 1 else v, jnp.float32) for k, v in inputs.items()}
    y, s = ssd_step(jnp.asarray(s0, jnp.float32), f32["x"], f32["dt"], f32["A"], f32["B"], f32["C"], f32["D"])
    assert rel(y, y_ref[:, 0]) < 1e-5 and rel(s, s_ref) < 1e-5


def _shapes_inputs(b=1, L=10, h=4, p=8, g=2, n=16):
    inputs = {
        k: jnp.asarray(v, jnp.float32) for k, v in random_inputs(np.random.default_rng(0), b, L, h, p, g, n).items()
    }
    return inputs, jnp.zeros((b, h, p, n), jnp.float32)


@pytest.mark.parametrize("chunk_size", [0, -1, 4.0, True, None])
@pytest.mark.parametrize("fn", [ssd, ssd_chunked, ssd_chunked_naive], ids=["ssd", "chunked", "naive"])
def test_bad_chunk_size_is_named(fn, chunk_size):
    inputs, _ = _shapes_inputs()
    with pytest.raises(ValueError, match=f"chunk_size: expected a positive int, got {chunk_size}"):
        fn(**inputs, chunk_size=chunk_size)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(dt=jnp.zeros((1, 5, 4))), r"dt: expected shape \(b, L, h\) = \(1, 10, 4\), got \(1, 5, 4\)"),
        (dict(A=jnp.zeros(3)), r"A: expected shape \(h\) = \(4,\), got \(3,\)"),
        (dict(D=jnp.zeros(2)), r"D: expected shape \(h\) = \(4,\), got \(2,\)"),
        (
            dict(B=jnp.zeros((1, 10, 3, 16)), C=jnp.zeros((1, 10, 3, 16))),
            "B, C: their g=3 groups do not divide x's h=4",
        ),
        (dict(C=jnp.zeros((1, 10, 2, 8))), r"C: expected shape \(b, L, g, n\) = \(1, 10, 2, 16\)"),
        (dict(x=jnp.zeros((10, 4, 8))), r"x: expected shape \(b, L, h, p\), got \(10, 4, 8\)"),
        (
            dict(initial_state=jnp.zeros((1, 4, 8, 17))),
            r"initial_state: expected shape \(b, h, p, n\) = \(1, 4, 8, 16\), got \(1, 4, 8, 17\)",
        ),
    ],
)
@pytest.mark.parametrize("jit", [False, True])
def test_misshaped_ssd_inputs_are_named(change, message, jit):
    inputs, _ = _shapes_inputs()
    run = lambda **kw: ssd(**kw, chunk_size=4)
    with pytest.raises(ValueError, match=message):
        (jax.jit(run) if jit else run)(**(inputs | change))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(B=jnp.zeros((1, 2, 8))), r"B: expected shape \(b, g, n\) = \(1, 2, 16\), got \(1, 2, 8\)"),
        (dict(state=jnp.zeros((2, 4, 8, 16))), r"state: expected shape \(b, h, p, n\) = \(1, 4, 8, 16\)"),
        (dict(dt=jnp.zeros((1, 2))), r"dt: expected shape \(b, h\) = \(1, 4\), got \(1, 2\)"),
        (dict(B=jnp.zeros((1, 3, 16)), C=jnp.zeros((1, 3, 16))), "B, C: their g=3 groups do not divide x's h=4"),
    ],
)
def test_misshaped_step_inputs_are_named_at_trace_time(change, message):
    inputs, state = _shapes_inputs()
    step = {k: v[:, 0] if v.ndim > 1 else v for k, v in inputs.items()} | dict(state=state)
    with pytest.raises(ValueError, match=message):
        jax.jit(lambda kw: ssd_step(**kw))(step | change)
