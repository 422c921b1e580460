"""The Pallas kernels, interpreted on CPU, against float64 references (the SSD's recurrence, the model's Mamba mixer
step and its attention over a KV cache); and their lowering for CUDA.

Every interpreted run poisons the kernels' outputs with NaN first (`interpret_mode()` does it), so an element a kernel
never writes fails the comparison. Inputs are fixed draws: each test derives its seed from its name and case (CRC-32),
so every run, locally and in CI, sees the same inputs; the seed is in every failure message.

Tolerances, as max |kernel - reference| / max |reference| over y and over the final state:
- float32 inputs: 1e-4. Interpreted, the kernels' float32 matmuls are exact float32 products; the remaining error
  is float32 rounding of sums over a few hundred terms (observed ~1e-6).
- 16-bit inputs (bfloat16, float16): 2e-2. The reference runs on the same values upcast to float64; the kernels
  round the decay-weighted x, the decayed C B^T and the entering state to the input dtype before their matmuls, as
  the reference Triton kernels do (observed ~4e-3 in bf16).
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import pallas as pl

import pallas_kernels
from granite_jax import model
from granite_jax.config import ModelConfig
from granite_jax.ssd import ssd_reference, ssd_step
from pallas_kernels import (
    AttentionConfig,
    DecodeConfig,
    PrefillConfig,
    _call,
    decode_attention,
    experts_down,
    experts_up,
    mamba_step,
    residual_rms_norm,
    rms_norm,
    route,
    ssd_decode,
    ssd_prefill,
    top_k,
)

TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}
H_TINY = dict(h=48, p=64, g=1, n=128, chunk=256)  # Granite-4.0-H-Tiny's Mamba layer


def _seed(case: str) -> int:
    """A fixed seed per test case: reproducible runs, different draws for different cases."""
    return zlib.crc32(case.encode())


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite output (an unwritten, NaN-poisoned element or an inf * 0)"
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _f64(t):
    return None if t is None else jnp.asarray(np.asarray(t, np.float64))


def _ssd_inputs(seed, b, L, h, p, g, n, dtype, *, initial=True, fast_decay=False, raw_dt=False):
    """x, dt, A, B, C, D, initial state (numpy draws: no per-op compiles). dt is softplus'ed, or raw."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)
    x, dt_raw, B, C, D = normal(b, L, h, p), normal(b, L, h) - 1.0, normal(b, L, g, n), normal(b, L, g, n), normal(h)
    if fast_decay:  # dt * |A| up to ~50 per step: cumulative log-decays far below -88 inside one chunk
        dt_raw = dt_raw + 3.0
    A = -np.exp(rng.uniform(0.0, 2.5, h) if fast_decay else rng.uniform(-3.0, 0.5, h)).astype(np.float32)
    s0 = normal(b, h, p, n) if initial else None
    dt = dt_raw if raw_dt else _softplus(dt_raw)
    cast = lambda t: jnp.asarray(t, dtype)
    return cast(x), cast(dt), jnp.asarray(A), cast(B), cast(C), jnp.asarray(D), None if s0 is None else jnp.asarray(s0)


def _softplus(t):
    return np.logaddexp(t, 0.0).astype(np.float32)


@jax.jit
def _ssd_reference64(x, dt, A, B, C, D, s0):
    return ssd_reference(x, dt, A, B, C, D, initial_state=s0)


def _reference(x, dt, A, B, C, D, s0):
    with jax.enable_x64(True):
        if s0 is None:
            s0 = np.zeros((x.shape[0], x.shape[2], x.shape[3], B.shape[3]))
        y, s = _ssd_reference64(*map(_f64, (x, dt, A, B, C, D, s0)))
        return np.asarray(y), np.asarray(s)


# ---------------------------------------------------------------------------------------------- prefill


def _case(b, L, h, p, g, n, chunk, dtype, **options):
    """Dims, dtype and options: `initial`, `fast_decay`, and PrefillConfig fields."""
    return (b, L, h, p, g, n, chunk, dtype, options)


PREFILL_CASES = {
    "ragged_L_batch_groups_initial": _case(
        2, 100, 4, 32, 2, 32, 32, jnp.float32, block_p=16, block_n=16, heads_per_program=2, pass_block=64
    ),
    "L_shorter_than_chunk_odd_dims": _case(1, 10, 2, 8, 1, 12, 16, jnp.float32, initial=False),
    "bf16_ragged_groups_initial": _case(
        2, 100, 4, 16, 2, 32, 32, jnp.bfloat16, heads_per_program=2, block_k=16, pass_block=128
    ),
    "fast_decay_multi_block": _case(
        1, 70, 4, 16, 1, 16, 32, jnp.float32, fast_decay=True, block_m=16, block_k=16, heads_per_program=4
    ),
    "bf16_fast_decay_one_group": _case(1, 64, 3, 16, 1, 16, 16, jnp.bfloat16, fast_decay=True, initial=False),
    "f16_short_auto_block_p": _case(1, 40, 2, 64, 1, 16, 16, jnp.float16),  # 6 local-state programs: block_p 64 -> 16
}


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_matches_float64_recurrence(name):
    b, L, h, p, g, n, chunk, dtype, opts = PREFILL_CASES[name]
    opts = dict(opts)
    seed = _seed(f"prefill/{name}")
    inputs = _ssd_inputs(
        seed, b, L, h, p, g, n, dtype, initial=opts.pop("initial", True), fast_decay=opts.pop("fast_decay", False)
    )
    config = PrefillConfig(**opts)
    x, dt, A, B, C, D, s0 = inputs
    with pallas_kernels.interpret_mode():
        y, state = jax.jit(lambda *a: ssd_prefill(*a[:6], chunk_size=chunk, initial_state=a[6], config=config))(*inputs)
    assert y.shape == (b, L, h, p) and y.dtype == jnp.float32
    assert state.shape == (b, h, p, n) and state.dtype == jnp.float32
    y_ref, s_ref = _reference(*inputs)
    tol = TOLERANCE[dtype]
    assert _rel_err(y, y_ref) < tol, f"y, seed {seed}"
    assert _rel_err(state, s_ref) < tol, f"final state, seed {seed}"


def test_prefill_applies_dt_bias_softplus_and_limit_in_kernel():
    b, L, h, p, g, n = 1, 40, 4, 16, 2, 16
    seed = _seed("prefill/dt_bias_softplus_limit")
    x, dt_raw, A, B, C, D, s0 = _ssd_inputs(seed, b, L, h, p, g, n, jnp.float32, raw_dt=True)
    bias = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(h, np.float32) * 2.0)
    limit = (0.05, 1.5)
    with pallas_kernels.interpret_mode():
        y, state = jax.jit(
            lambda x, dt, bias, s0: ssd_prefill(
                x, dt, A, B, C, D, chunk_size=16, initial_state=s0, dt_bias=bias, dt_softplus=True, dt_limit=limit
            )
        )(x, dt_raw, bias, s0)
    dt = np.clip(_softplus(np.asarray(dt_raw + bias)), *limit)
    y_ref, s_ref = _reference(x, dt, A, B, C, D, s0)
    assert _rel_err(y, y_ref) < TOLERANCE[jnp.float32], f"seed {seed}"
    assert _rel_err(state, s_ref) < TOLERANCE[jnp.float32], f"seed {seed}"


def test_prefill_chunk_rounds_to_a_supported_power_of_two():
    assert [pallas_kernels.kernel_chunk(c) for c in (1, 16, 48, 64, 100, 256, 1024)] == [16, 16, 64, 64, 128, 256, 256]


def test_configs_reject_tiles_triton_cannot_use():
    with pytest.raises(ValueError, match="block_m=48"):
        PrefillConfig(block_m=48)
    with pytest.raises(ValueError, match="block_k=8"):
        PrefillConfig(block_k=8)
    with pytest.raises(ValueError, match="pass_block=100: must be a power of two >= 16"):
        PrefillConfig(pass_block=100)
    with pytest.raises(ValueError, match="block_p=12"):
        DecodeConfig(block_p=12)


def test_prefill_rejects_bad_shapes():
    x = jnp.zeros((1, 8, 6, 16))
    B = jnp.zeros((1, 8, 4, 16))
    with pytest.raises(ValueError, match="must divide the head count"):
        ssd_prefill(x, jnp.zeros((1, 8, 6)), jnp.zeros(6), B, B, jnp.zeros(6))


def _tiny_prefill_inputs():
    x, B = jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 1, 16))
    return x, jnp.zeros((1, 8, 2)), jnp.zeros(2), B, B, jnp.zeros(2)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(dt_limit=(1.0, 0.0)), ValueError, r"dt_limit=\(1.0, 0.0\): low must be <= high"),
        (dict(dt_limit=(math.nan, 1.0)), ValueError, "NaN"),
        (dict(dt_limit=(0.0, "1")), TypeError, "dt_limit must be two real numbers"),
        (dict(dt_limit=0.5), TypeError, r"dt_limit must be a pair \(low, high\)"),
        (dict(chunk_size=-7), ValueError, "chunk_size=-7: must be an int >= 1"),
        (dict(chunk_size=0), ValueError, "chunk_size=0: must be an int >= 1"),
        (dict(chunk_size=4.0), TypeError, "chunk_size=4.0: must be an int, got float"),
        (dict(chunk_size=True), TypeError, "chunk_size=True: must be an int, got bool"),
        (dict(out_dtype=jnp.int32), ValueError, "out_dtype must be a floating-point dtype"),
        (dict(out_dtype=jnp.bool_), ValueError, "out_dtype must be a floating-point dtype"),
        (dict(out_dtype="float33"), TypeError, "out_dtype must be a floating-point dtype"),
        (dict(config={"block_m": 16}), TypeError, "config must be a PrefillConfig"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else None,
)
def test_prefill_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ssd_prefill(*_tiny_prefill_inputs(), **kwargs)


def test_decode_rejects_bad_arguments():
    state, x, dt, A, B, C, D = _decode_inputs(0, 1, 2, 16, 1, 16, jnp.float32)
    with pytest.raises(ValueError, match=r"ssd_decode: dt_limit=\(2.0, 1.0\): low must be <= high"):
        ssd_decode(state, x, dt, A, B, C, D, dt_limit=(2.0, 1.0))
    with pytest.raises(TypeError, match="config must be a DecodeConfig"):
        ssd_decode(state, x, dt, A, B, C, D, config=PrefillConfig())


def test_kernel_chunk_takes_ints_only():
    assert pallas_kernels.kernel_chunk(np.int64(100)) == 128
    with pytest.raises(TypeError, match="chunk_size=4.0: must be an int"):
        pallas_kernels.kernel_chunk(4.0)
    with pytest.raises(ValueError, match="chunk_size=-7"):
        pallas_kernels.kernel_chunk(-7)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: PrefillConfig(block_m=16.0), TypeError, "PrefillConfig.block_m=16.0: must be an int, got float"),
        (lambda: PrefillConfig(block_n=None), TypeError, "PrefillConfig.block_n=None: must be an int"),
        (lambda: PrefillConfig(block_k=True), TypeError, "PrefillConfig.block_k=True: must be an int, got bool"),
        (lambda: PrefillConfig(state_warps=2.0), TypeError, "PrefillConfig.state_warps=2.0: must be an int"),
        (lambda: PrefillConfig(state_stages=0), ValueError, "PrefillConfig.state_stages=0: must be an int >= 1"),
        (lambda: DecodeConfig(block_p=2.0), TypeError, "DecodeConfig.block_p=2.0: must be an int, got float"),
        (lambda: DecodeConfig(num_warps=0), ValueError, "DecodeConfig.num_warps=0: must be an int >= 1"),
        (lambda: DecodeConfig(num_stages=0), ValueError, "DecodeConfig.num_stages=0: must be an int >= 1"),
        (lambda: DecodeConfig(num_warps=4.0), TypeError, "DecodeConfig.num_warps=4.0: must be an int"),
    ],
    ids=lambda v: v.split(":")[0] if isinstance(v, str) else None,
)
def test_configs_reject_non_ints(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_configs_accept_unset_defaults_and_numpy_ints():
    assert PrefillConfig(block_p=None, block_k=None, block_m=np.int64(32)).block_m == 32
    assert DecodeConfig(block_p=1, num_warps=np.int32(8)).num_warps == 8


def test_inputs_are_reproducible():
    """Fixed seeds: the same case draws the same inputs on every run; different cases draw different ones."""
    assert _seed("prefill/a") == _seed("prefill/a") == zlib.crc32(b"prefill/a")
    seeds = {_seed(f"prefill/{name}") for name in PREFILL_CASES} | {_seed(f"decode/{n}") for n in DECODE_CASES}
    assert len(seeds) == len(PREFILL_CASES) + len(DECODE_CASES)
    first, again = (_ssd_inputs(_seed("prefill/a"), 1, 4, 2, 16, 1, 16, jnp.float32) for _ in range(2))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


# ---------------------------------------------------------------------------------------------- decode

DECODE_CASES = {
    # name: (b, h, p, g, n, dtype, block_p)
    "batch_groups_f32": (2, 4, 32, 2, 32, jnp.float32, 16),
    "bf16": (3, 4, 16, 1, 16, jnp.bfloat16, 16),
    "odd_dims": (1, 3, 8, 1, 12, jnp.float32, 16),
}


def _decode_inputs(seed, b, h, p, g, n, dtype, *, fast_decay=False):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)
    cast = lambda t: jnp.asarray(t, dtype)
    dt = _softplus(normal(b, h) + (4.0 if fast_decay else 0.0))
    A = -np.exp(rng.uniform(-3.0, 3.0 if fast_decay else 0.5, h)).astype(np.float32)
    state, x, B, C, D = normal(b, h, p, n), normal(b, h, p), normal(b, g, n), normal(b, g, n), normal(h)
    return jnp.asarray(state), cast(x), cast(dt), jnp.asarray(A), cast(B), cast(C), jnp.asarray(D)


@jax.jit
def _ssd_step64(state, x, dt, A, B, C, D):
    return ssd_step(state, x, dt, A, B, C, D)


def _step_reference(state, x, dt, A, B, C, D):
    with jax.enable_x64(True):
        y, s = _ssd_step64(*map(_f64, (state, x, dt, A, B, C, D)))
        return np.asarray(y), np.asarray(s)


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_matches_float64_step(name):
    b, h, p, g, n, dtype, block_p = DECODE_CASES[name]
    seed = _seed(f"decode/{name}")
    inputs = _decode_inputs(seed, b, h, p, g, n, dtype, fast_decay=name == "bf16")
    with pallas_kernels.interpret_mode():
        y, state = jax.jit(lambda *a: ssd_decode(*a, config=DecodeConfig(block_p=block_p)))(*inputs)
    assert y.shape == (b, h, p) and y.dtype == jnp.float32 and state.shape == (b, h, p, n)
    y_ref, s_ref = _step_reference(*inputs)
    tol = 1e-5  # elementwise float32 work only: no bf16 rounding inside the kernel
    assert _rel_err(y, y_ref) < tol, f"y, seed {seed}"
    assert _rel_err(state, s_ref) < tol, f"state, seed {seed}"


def test_decode_applies_dt_bias_softplus_and_limit_in_kernel():
    seed = _seed("decode/dt_bias_softplus_limit")
    state, x, dt_raw, A, B, C, D = _decode_inputs(seed, 2, 4, 16, 2, 16, jnp.float32)
    bias = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(4, np.float32) * 3.0)
    limit = (0.1, 2.0)
    with pallas_kernels.interpret_mode():
        y, new_state = jax.jit(lambda *a: ssd_decode(*a, dt_bias=bias, dt_softplus=True, dt_limit=limit))(
            state, x, dt_raw, A, B, C, D
        )
    y_ref, s_ref = _step_reference(state, x, np.clip(_softplus(np.asarray(dt_raw + bias)), *limit), A, B, C, D)
    assert _rel_err(y, y_ref) < 1e-5 and _rel_err(new_state, s_ref) < 1e-5, f"seed {seed}"


# ---------------------------------------------------------------------------------------------- the fused Mamba step

PLAIN_RMS_NORM = model.rms_norm.__wrapped__  # the model's definition, whatever backend runs
STEP_CASES = {
    # name: (b, h, p, g, n, dtype, block_p, slot, conv bias, dt limit): p of two blocks, a ring that wraps, a masked row
    "groups_two_blocks_f32": (2, 4, 32, 2, 16, jnp.float32, 16, 6, True, (0.0, math.inf)),
    "bf16_limit_no_bias": (3, 4, 16, 1, 32, jnp.bfloat16, 16, 1, False, (0.05, 2.0)),
    "h_tiny_head_f32": (1, 2, 64, 1, 128, jnp.float32, 16, 0, True, (0.0, math.inf)),
}


def _step_mixer(b, h, p, g, n, dtype, bias, limit, seed):
    """A Mamba mixer of these dims with random weights, its one-token inputs, as float32 numpy draws."""
    cfg = ModelConfig(vocab_size=8, hidden_size=8, layer_types=("mamba",), num_attention_heads=1, num_key_value_heads=1,
                      head_dim=8, intermediate_size=8, shared_intermediate_size=8, num_local_experts=0,
                      num_experts_per_tok=0, mamba_n_heads=h, mamba_d_head=p, mamba_d_state=n, mamba_n_groups=g,
                      mamba_expand=h * p // 8, mamba_conv_bias=bias, time_step_limit=limit)  # fmt: skip
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    conv_dim, K = h * p + 2 * g * n, cfg.mamba_d_conv
    weights = dict(conv_weight=normal(K, conv_dim) * 0.5, dt_bias=normal(h), A_log=rng.uniform(-2, 1.5, h).astype(
        np.float32), D=normal(h), weight=1 + 0.1 * normal(h * p))  # fmt: skip
    if bias:
        weights["conv_bias"] = normal(conv_dim)
    inputs = dict(zxbcdt=normal(b, 1, h * p + conv_dim + h), ring=normal(b, K, conv_dim), ssm=normal(b, h, p, n))
    inputs["mask"] = np.arange(b)[:, None] != 1  # row 1 (where there is one) is padding
    cast = lambda t: t if t.dtype == np.bool_ else np.asarray(jnp.asarray(t, dtype), np.float32)  # noqa: E731
    return cfg, {k: cast(v) for k, v in weights.items()}, {k: cast(v) if k != "ssm" else v for k, v in inputs.items()}


def _mixer_step64(cfg, weights, inputs, slot, monkeypatch):
    """The model's mixer (`MambaMixer.mix`, plain JAX) in float64: (the gated values it normalizes, normed y, ring,
    state)."""
    gated = []
    norm = model.rms_norm
    monkeypatch.setattr(model, "rms_norm", lambda x, *a: (gated.append(x), norm(x, *a))[1])
    with jax.enable_x64(True):
        mixer = model.MambaMixer(cfg, dtype=jnp.float64, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        for name, value in weights.items():
            target = mixer.norm.weight if name == "weight" else getattr(mixer, name)
            target[...] = jnp.asarray(value, jnp.float64)
        f64 = {k: jnp.asarray(v, jnp.bool_ if v.dtype == np.bool_ else jnp.float64) for k, v in inputs.items()}
        state = model.MambaState(f64["ring"], f64["ssm"])
        y, state = model.MambaMixer.mix.__wrapped__(mixer, f64["zxbcdt"], f64["mask"], state, slot)
        return np.asarray(gated[0][:, 0]), np.asarray(y[:, 0]), np.asarray(state.conv), np.asarray(state.ssm)


@pytest.mark.parametrize("name", STEP_CASES)
def test_mamba_step_is_the_mixers_float64_step(name, monkeypatch):
    b, h, p, g, n, dtype, block_p, slot, bias, limit = STEP_CASES[name]
    seed = _seed(f"mamba_step/{name}")
    cfg, weights, inputs = _step_mixer(b, h, p, g, n, dtype, bias, limit, seed)
    want_gated, want_y, want_ring, want_ssm = _mixer_step64(cfg, weights, inputs, slot, monkeypatch)
    w = {k: jnp.asarray(v, dtype) for k, v in weights.items()}

    def step(zxbcdt, ring, ssm, mask):
        gated, ring, ssm = mamba_step(zxbcdt, ring, slot, w["conv_weight"], w.get("conv_bias"), w["dt_bias"],
                                      w["A_log"], w["D"], ssm, groups=g, dt_limit=limit, token_mask=mask,
                                      config=DecodeConfig(block_p=block_p))  # fmt: skip
        return gated, PLAIN_RMS_NORM(gated, w["weight"], cfg.rms_norm_eps, g, dtype), ring, ssm

    with pallas_kernels.interpret_mode():
        got = jax.jit(step)(jnp.asarray(inputs["zxbcdt"][:, 0], dtype), jnp.asarray(inputs["ring"], dtype),
                            jnp.asarray(inputs["ssm"]), jnp.asarray(inputs["mask"][:, 0]))  # fmt: skip
    # float32: elementwise work and sums over n; 16-bit: the conv's output rounded to it, as the model rounds the
    # SSD's inputs (the float64 model does not), and y normed into it.
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    for what, g_, w_ in zip(("gated", "y", "ring", "state"), got, (want_gated, want_y, want_ring, want_ssm)):
        assert _rel_err(g_, w_) < tol, f"{what}, seed {seed}"
    assert np.array_equal(np.asarray(got[2], np.float32), np.asarray(jnp.asarray(want_ring, dtype), np.float32))
    if b > 1:  # the padding row's x, B and C are zero: its state only decays, and its output is zero
        assert np.all(np.asarray(got[0])[1] == 0)


def test_mamba_step_rejects_bad_arguments():
    b, h, p, g, n, K = 1, 2, 16, 1, 16, 4
    conv_dim = h * p + 2 * g * n
    zxbcdt, ring = jnp.zeros((b, h * p + conv_dim + h)), jnp.zeros((b, K, conv_dim))
    vectors, state = [jnp.zeros(h)] * 3, jnp.zeros((b, h, p, n))
    args = (zxbcdt, ring, 0, jnp.zeros((K, conv_dim)), None, *vectors)
    with pytest.raises(ValueError, match="groups=3 must divide the head count 2"):
        mamba_step(*args, state, groups=3)
    with pytest.raises(ValueError, match=r"zxbcdt must be \(b, d_inner \+ conv_dim \+ h\)"):
        mamba_step(zxbcdt[:, 1:], *args[1:], state, groups=g)
    with pytest.raises(ValueError, match="head_dim 12 and state_dim 16 must be powers of two"):
        p = 12
        conv_dim = h * p + 2 * g * n
        mamba_step(jnp.zeros((b, h * p + conv_dim + h)), jnp.zeros((b, K, conv_dim)), 0, jnp.zeros((K, conv_dim)),
                   None, *vectors, jnp.zeros((b, h, p, n)), groups=g)  # fmt: skip


# ---------------------------------------------------------------------------------------------- decode attention

ATTENTION_CASES = {
    # name: (b, kv, rep, hd, S, dtype, pad, slot, block_k, splits): padded rows, a last block past the cache, splits
    # past the filled blocks (empty ones), a row with no key to attend (pad past the slot), h-tiny's groups
    "padded_rows_f32": (3, 2, 3, 16, 40, jnp.float32, (0, 5, 30), 33, 16, 2),
    "empty_splits_bf16": (2, 1, 2, 32, 128, jnp.bfloat16, (0, 2), 3, 16, 8),
    "no_key_row_f32": (2, 2, 1, 16, 64, jnp.float32, (0, 60), 40, 16, None),
    "h_tiny_group_f32": (1, 1, 3, 128, 256, jnp.float32, (0,), 200, 64, None),
}


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_decode_attention_is_the_models_float64_attention(name):
    b, kv, rep, hd, S, dtype, pad, slot, block_k, splits = ATTENTION_CASES[name]
    seed = _seed(f"decode_attention/{name}")
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for shape in
               ((b, kv, rep, hd), (b, kv, S, hd), (b, kv, S, hd)))  # fmt: skip
    pad, scale = jnp.asarray(pad, jnp.int32), hd**-0.5
    config = AttentionConfig(block_k=block_k, splits=splits)
    new_kv = tuple(jnp.asarray(rng.standard_normal((b, kv, hd), np.float32), dtype) for _ in range(2))
    with pallas_kernels.interpret_mode():
        got, k_cache, v_cache = jax.jit(lambda *a: decode_attention(*a[:5], scale, new_kv=a[5:], config=config))(
            q, k, v, pad, slot, *new_kv
        )
    with jax.enable_x64(True):  # the model's own: the token's key and value into the cache, then attention
        pos = model.Positions(jnp.asarray([slot]), pad)
        cache = model.KVState(*map(_f64, (k, v)))
        k_new, v_new = (_f64(t)[:, :, None] for t in new_kv)
        want, want_cache = model.cache_and_attend.__wrapped__(_f64(q)[:, None], k_new, v_new, cache, pos, scale)
        want = want[:, 0]
    np.testing.assert_array_equal(np.asarray(k_cache, np.float64), np.asarray(want_cache.k))  # written in place
    np.testing.assert_array_equal(np.asarray(v_cache, np.float64), np.asarray(want_cache.v))
    assert got.shape == q.shape and got.dtype == dtype
    assert np.all(np.isfinite(np.asarray(got, np.float32))), "a row with no key to attend must stay finite"
    rows = np.asarray(pad) <= slot  # a row with no key averages the values it visits, as the model's: which differ
    # float32: sums of a few hundred products; 16-bit: the output rounded to it (scores and softmax are float32)
    assert _rel_err(got[rows], want[rows]) < (1e-5 if dtype == jnp.float32 else 1e-2), f"seed {seed}"


def test_decode_attention_rejects_bad_arguments():
    q, kv = jnp.zeros((1, 2, 3, 16)), jnp.zeros((1, 2, 32, 16))
    with pytest.raises(ValueError, match="must be \\(b, kv, rep, hd\\)"):
        decode_attention(q, kv[:, :1], kv, jnp.zeros(1, jnp.int32), 0, 1.0)
    with pytest.raises(ValueError, match="new_kv must be two \\(b, kv, hd\\)"):
        decode_attention(q, kv, kv, jnp.zeros(1, jnp.int32), 0, 1.0, new_kv=(q[:, :, 0], q[:, :, 0, :8]))
    with pytest.raises(ValueError, match="head_dim 12 must be a power of two"):
        decode_attention(q[..., :12], kv[..., :12], kv[..., :12], jnp.zeros(1, jnp.int32), 0, 1.0)
    with pytest.raises(ValueError, match="AttentionConfig.block_k=8"):
        AttentionConfig(block_k=8)


# ---------------------------------------------------------------------------------------------- RMSNorm

NORM_CASES = {
    # name: (rows, dim, groups, x dtype, weight dtype, out dtype): h-tiny's hidden norm in bf16 (three chunks of 512),
    # its gated norm (float32 in, bfloat16 out), groups of 48 channels (three chunks of 16)
    "hidden_bf16": (3, 1536, 1, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    "gated_f32_to_bf16": (2, 3072, 1, jnp.float32, jnp.bfloat16, jnp.bfloat16),
    "groups_f32": (2, 96, 2, jnp.float32, jnp.float32, jnp.float32),
}


@pytest.mark.parametrize("name", NORM_CASES)
def test_rms_norm_is_the_models_float64_norm(name):
    R, D, groups, x_dtype, w_dtype, dtype = NORM_CASES[name]
    seed = _seed(f"rms_norm/{name}")
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R, D), np.float32) * 3.0, x_dtype)
    w = jnp.asarray(1.0 + 0.2 * rng.standard_normal(D, np.float32), w_dtype)
    with pallas_kernels.interpret_mode():
        got = jax.jit(lambda x, w: rms_norm(x, w, 1e-5, groups=groups, dtype=dtype))(x, w)
    with jax.enable_x64(True):
        want = PLAIN_RMS_NORM(_f64(x), _f64(w), 1e-5, groups, jnp.float64)
    assert got.dtype == dtype and got.shape == (R, D)
    # float32: sums over a group; 16-bit: the normed values rounded to it, then the product
    assert _rel_err(got, want) < (1e-5 if dtype == jnp.float32 else 1e-2), f"seed {seed}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_residual_rms_norm_is_the_models_float64_add_and_norm(dtype):
    seed = _seed(f"residual_rms_norm/{jnp.dtype(dtype).name}")
    rng = np.random.default_rng(seed)
    x, update = (jnp.asarray(rng.standard_normal((3, 1536), np.float32) * 2.0, dtype) for _ in range(2))
    w = jnp.asarray(1.0 + 0.2 * rng.standard_normal(1536, np.float32), dtype)
    with pallas_kernels.interpret_mode():
        stream, y = jax.jit(lambda x, u, w: residual_rms_norm(x, u, 0.22, w, 1e-5))(x, update, w)
    with jax.enable_x64(True):
        want_stream, want_y = model.residual_rms_norm.__wrapped__(_f64(x), _f64(update), 0.22, _f64(w), 1e-5)
    assert stream.dtype == y.dtype == dtype
    tol = 1e-6 if dtype == jnp.float32 else 1e-2  # 16-bit: the update and the sum rounded to it, as the model rounds
    assert _rel_err(stream, want_stream) < tol and _rel_err(y, want_y) < 10 * tol, f"seed {seed}"


def test_rms_norm_rejects_bad_arguments():
    with pytest.raises(ValueError, match="weight must be \\(64,\\)"):
        rms_norm(jnp.zeros((1, 64)), jnp.zeros(32), 1e-5)
    with pytest.raises(ValueError, match="3 groups of 64 channels"):
        rms_norm(jnp.zeros((1, 64)), jnp.zeros(64), 1e-5, groups=3)


# ---------------------------------------------------------------------------------------------- the router's top-k


@pytest.mark.parametrize("experts, k", [(64, 6), (32, 8), (8, 8)])  # h-tiny's, and all of the experts
def test_top_k_is_lax_top_k(experts, k):
    seed = _seed(f"top_k/{experts}/{k}")
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((5, experts), np.float32)
    logits[1, :] = 0.5  # every expert equal: the lower ones first
    logits[2, ::3] = logits[2, 1]  # ties among the largest
    logits[3, :k] = -np.inf  # -inf logits are still experts
    with pallas_kernels.interpret_mode():
        values, indices = jax.jit(lambda x: top_k(x, k))(jnp.asarray(logits))
    want_values, want_indices = jax.lax.top_k(jnp.asarray(logits), k)
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values), err_msg=f"seed {seed}")
    with pytest.raises(ValueError, match=f"k={experts + 1} of {experts} experts: k must be in \\[1, E\\]"):
        top_k(jnp.asarray(logits), experts + 1)
    with pytest.raises(ValueError, match="E a power of two"):
        top_k(jnp.zeros((1, 72)), 10)  # h-small's 72 experts: XLA's top-k


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_route_is_the_models_float64_router_and_top_k(dtype):
    seed = _seed(f"route/{jnp.dtype(dtype).name}")
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((3, 1536), np.float32), dtype)  # h-tiny: 1536 channels, 64 experts, top 6
    w = jnp.asarray(rng.standard_normal((64, 1536), np.float32) * 0.05, dtype)
    with pallas_kernels.interpret_mode():
        values, indices = jax.jit(lambda x, w: route(x, w, 6))(x, w)
    with jax.enable_x64(True):
        logits = np.asarray(model.widened(model.linear.__wrapped__(_f64(x), _f64(w))))
    picked = np.take_along_axis(logits, np.asarray(indices), axis=1)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # 16-bit: the logits rounded to it, as the model's product is
    assert _rel_err(values, picked) < tol, f"seed {seed}"  # each value is its expert's logit
    want = np.sort(logits, axis=1)[:, ::-1][:, :6]
    assert _rel_err(values, want) < tol, f"seed {seed}"  # and they are the six largest, largest first
    if dtype == jnp.float32:
        np.testing.assert_array_equal(np.asarray(indices), np.argsort(-logits, axis=1, kind="stable")[:, :6])


# ---------------------------------------------------------------------------------------------- routed experts


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_experts_are_the_models_float64_experts(dtype):
    seed = _seed(f"experts/{jnp.dtype(dtype).name}")
    rng = np.random.default_rng(seed)
    E, H, F, N = 4, 256, 128, 3  # two blocks of input channels each way, experts repeated and unused
    x = jnp.asarray(rng.standard_normal((N, H), np.float32), dtype)
    w_in = jnp.asarray(rng.standard_normal((E, H, 2 * F), np.float32) * 0.1, dtype)
    w_out = jnp.asarray(rng.standard_normal((E, F, H), np.float32) * 0.1, dtype)
    chosen = jnp.asarray([[3, 0], [3, 1], [0, 3]], jnp.int32)  # two experts a token
    with pallas_kernels.interpret_mode():
        got = jax.jit(lambda x, w_in, e, w_out: experts_down(experts_up(x, w_in, e), w_out, e.reshape(-1)))(
            x, w_in, chosen, w_out
        )
    with jax.enable_x64(True):
        want = model.experts_swiglu.__wrapped__(_f64(x), chosen, _f64(w_in), _f64(w_out), None, None)
    got = got.reshape(N, 2, H)
    assert got.dtype == dtype
    # float32: sums of a few hundred products; 16-bit: the products and the SwiGLU rounded to it, as the model's are
    assert _rel_err(got, want) < (1e-5 if dtype == jnp.float32 else 3e-2), f"seed {seed}"


# ---------------------------------------------------------------------------------------------- platform


def test_kernels_refuse_to_run_without_a_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is attached")
    state, x, dt, A, B, C, D = _decode_inputs(0, 1, 2, 16, 1, 16, jnp.float32)
    with pytest.raises(pallas_kernels.PallasUnavailableError, match="needs an NVIDIA GPU; use 'xla'"):
        ssd_decode(state, x, dt, A, B, C, D)
    with pytest.raises(pallas_kernels.PallasUnavailableError, match="needs an NVIDIA GPU"):
        ssd_prefill(x[:, None], dt[:, None], A, B[:, None], C[:, None], D, chunk_size=16)
    with pytest.raises(pallas_kernels.PallasUnavailableError, match="needs an NVIDIA GPU"):
        pallas_kernels.check_available()  # what commands ask before loading a model
    with pallas_kernels.interpret_mode():
        pallas_kernels.check_available()


def test_interpret_mode_poisons_unwritten_outputs():
    def writes_first_half(x_ref, o_ref):
        o_ref[:8] = x_ref[:8]

    spec = pl.BlockSpec((16,), lambda i: (0,))
    with pallas_kernels.interpret_mode():
        out = _call.call(
            writes_first_half,
            name="half",
            grid=(1,),
            in_specs=[spec],
            out_specs=[spec],
            out_shape=[jax.ShapeDtypeStruct((16,), jnp.float32)],
            num_warps=1,
            num_stages=1,
        )(jnp.ones(16))[0]
    assert np.all(np.asarray(out[:8]) == 1) and np.all(np.isnan(np.asarray(out[8:])))


# ---------------------------------------------------------------------------------------------- CUDA lowering


def _prefill_structs(b, L, h, p, g, n, dtype):
    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    return (S((b, L, h, p), dtype), S((b, L, h), dtype), S((h,), f32), S((b, L, g, n), dtype), S((b, L, g, n), dtype),
            S((h,), f32), S((b, h, p, n), f32))  # fmt: skip


def _decode_structs(b, h, p, g, n, dtype):
    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    return (S((b, h, p, n), f32), S((b, h, p), dtype), S((b, h), dtype), S((h,), f32), S((b, g, n), dtype),
            S((b, g, n), dtype), S((h,), f32))  # fmt: skip


LOWERING_DIMS = {
    "h_tiny_8k": dict(b=1, L=8192, **H_TINY),
    "small_ragged": dict(b=2, L=100, h=4, p=16, g=2, n=32, chunk=16),  # 7 chunks: not a power of two
}


def _step_structs(b, h, p, g, n, dtype, K=4):
    S = jax.ShapeDtypeStruct
    conv_dim = h * p + 2 * g * n
    vector = S((h,), dtype)
    return (S((b, h * p + conv_dim + h), dtype), S((b, K, conv_dim), dtype), S((), jnp.int32),
            S((K, conv_dim), dtype), S((conv_dim,), dtype), vector, vector, vector, S((b, h, p, n), jnp.float32),
            S((b,), jnp.bool_))  # fmt: skip


def _step_fn(groups):
    return lambda *a: mamba_step(*a[:9], groups=groups, token_mask=a[9])


def _attention_structs(b, kv, rep, hd, S, dtype):
    S_ = jax.ShapeDtypeStruct
    cache = S_((b, kv, S, hd), dtype)
    return S_((b, kv, rep, hd), dtype), cache, cache, S_((b,), jnp.int32), S_((), jnp.int32)


def _attention_fn(q, k, v, pad, slot):
    return decode_attention(q, k, v, pad, slot, 0.0078125, new_kv=(q[:, :, 0], q[:, :, 1]))


def _prefill_fn(chunk):
    return lambda *a: ssd_prefill(*a[:6], chunk_size=chunk, initial_state=a[6], dt_bias=a[2], dt_softplus=True)


def _triton_calls(text: str) -> int:
    return text.count("__gpu$xla.gpu.triton")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dims", LOWERING_DIMS)
def test_kernels_lower_for_cuda(dims, dtype):
    d = dict(LOWERING_DIMS[dims])
    chunk = d.pop("chunk")
    b, L, h, p, g, n = (d[k] for k in "b L h p g n".split())
    with pallas_kernels.cuda_lowering():
        prefill = jax.jit(_prefill_fn(chunk)).trace(*_prefill_structs(b, L, h, p, g, n, dtype))
        prefill = prefill.lower(lowering_platforms=("cuda",)).as_text()
        decode = jax.jit(ssd_decode, donate_argnums=0).trace(*_decode_structs(b, h, p, g, n, dtype))
        decode = decode.lower(lowering_platforms=("cuda",)).as_text()
        norm = jax.jit(lambda x, w: rms_norm(x, w, 1e-5)).trace(
            *(jax.ShapeDtypeStruct(s, dtype) for s in ((b, 1536), (1536,)))
        )
        assert _triton_calls(norm.lower(lowering_platforms=("cuda",)).as_text()) == 1
        attention = jax.jit(_attention_fn).trace(*_attention_structs(b, 4, 3, 128, 1024, dtype))
        attention = attention.lower(lowering_platforms=("cuda",)).as_text()
        step = jax.jit(_step_fn(g), donate_argnums=(1, 8)).trace(*_step_structs(b, h, p, g, n, dtype))
        step = step.lower(lowering_platforms=("cuda",)).as_text()
    assert _triton_calls(prefill) == 3, "prefill: the local-state, pass and output kernels, all Triton custom calls"
    assert _triton_calls(decode) == 1 and _triton_calls(step) == 1
    assert _triton_calls(attention) == 2, "decode attention: the split and combine kernels"
    in_place = ("output_tuple_indices = [3], operand_index = 1", "output_tuple_indices = [4], operand_index = 2")
    assert all(alias in attention for alias in in_place), "decode attention must write the cache in place"
    assert "output_operand_aliases" in decode, "decode must update the state in place"
    in_place = ("output_tuple_indices = [1], operand_index = 2", "output_tuple_indices = [2], operand_index = 10")
    assert all(alias in step for alias in in_place), "the Mamba step must update the ring and the state in place"


# ---------------------------------------------------------------------------------------------- deviceless compile


@pytest.mark.aot
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernels_compile_for_h200_at_h_tiny_dims(dtype, h200_target):
    """Triton and ptxas accept the kernels for sm_90 (shared memory, registers); needs the CUDA PJRT plugin."""
    from pallas_kernels import aot

    d = dict(b=1, L=8192, **H_TINY)
    chunk = d.pop("chunk")
    with pallas_kernels.cuda_lowering():
        aot.compile_for_gpu(_prefill_fn(chunk), *_prefill_structs(**d, dtype=dtype))
        aot.compile_for_gpu(ssd_decode, *_decode_structs(8, d["h"], d["p"], d["g"], d["n"], dtype))
        aot.compile_for_gpu(_step_fn(d["g"]), *_step_structs(8, d["h"], d["p"], d["g"], d["n"], dtype))
        aot.compile_for_gpu(_attention_fn, *_attention_structs(8, 4, 3, 128, 8192, dtype))
