"""The "cpu" backend (`granite_jax.cpu.backend`, `packing`): which op reaches which kernel under `Runtime()` on CPUs,
per shape and dtype, read from the lowered program; that everything else, other platforms and `Runtime(kernels=False)`
stay plain JAX; the packed panels a decode step of 2-16 rows streams (made by `ops.prepare`, found through
`ops.bound`); and a tiny model's decode steps with the kernels against the plain-JAX model.

The kernels' arithmetic is `test_kernels`'s. Tests that look for a kernel skip where the kernels do not run; those of
the plain-JAX side run everywhere."""

from __future__ import annotations

import functools
import gc
import logging
import re
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from granite_jax import model, ops, sampling, ssd
from granite_jax.checkpoint import load_model, save_checkpoint
from granite_jax.cpu import backend, build, packing
from granite_jax.generation.steps import DEVICE_STOPS, Steps
from granite_jax.model import Cache, KVState, Linear, MambaMixer, MambaState, Positions, abstract_model, with_runtime
from granite_jax.ops import Runtime
from granite_jax.presets import released_config
from granite_jax.sampling import SamplingConfig

RUNS = build._unsupported() is None  # where the kernels must run (test_build checks that they load)
needs_kernels = pytest.mark.skipif(not RUNS, reason=f"the CPU kernels do not run here: {build._unsupported()}")
PLAIN = Runtime(kernels=False)
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def kernels_in(text: str) -> set[str]:
    """The kernels' FFI targets called in a lowered (StableHLO) or compiled (HLO) program's text."""
    found = re.findall(r'(?:@|custom_call_target=")(granite_[a-z0-9_]+)', text)
    return set(found) & set(build.TARGETS)


def lowered(fn, *args, platform: str = "cpu") -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def check_routing(fn, args, expected: set[str]) -> None:
    """Under `Runtime()` on CPUs, `fn(*args)` calls the kernels `expected` (none where they do not run); lowered for
    CUDA, or under `Runtime(kernels=False)`, none."""
    assert kernels_in(lowered(ops.under(Runtime(), fn), *args)) == (expected if RUNS else set())
    assert not kernels_in(lowered(ops.under(Runtime(), fn), *args, platform="cuda"))
    assert not kernels_in(lowered(ops.under(PLAIN, fn), *args))


def outputs(fn, *args, runtime: Runtime | None = None):
    """`fn(*args)` jitted under `runtime` (default `Runtime()`), as numpy."""
    return jax.tree.map(np.asarray, jax.jit(ops.under(runtime or Runtime(), fn))(*args))


def rounding(dtype) -> float:
    """Half an ulp, relative, of a result rounded to `dtype` (0 for float32: the float64 bound covers it)."""
    return {jnp.dtype(BF16): 2.0**-8, jnp.dtype(F16): 2.0**-11}.get(jnp.dtype(dtype), 0.0)


def assert_product_close(got, x, w, dtype) -> None:
    """got = x @ w.T up to a float32 dot product's rounding (2 k u |x| |w|), then rounding to `dtype`."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want, bound = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    assert got.dtype == dtype and got.shape == want.shape
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= 2 * x.shape[-1] * 2.0**-24 * bound + rounding(dtype) * np.abs(want) + 1e-30)


# ---------------------------------------------------------------------------------------------- products


class Weight(nnx.Module):
    """One streamed weight as a model holds it: `ops.bound` finds its panels by parameter path ("weight")."""

    def __init__(self, w):
        self.weight = nnx.Param(jnp.asarray(w))


def linear_on(w, panels: bool):
    """(fn, leading args): `model.linear(x, w)` traced inside `ops.bound` with w's panels (`packing.pack`) or none, as a
    decode step binds them."""
    graphdef, state = nnx.split(Weight(w))
    prepared = {"cpu": {"weight": packing.pack(jnp.asarray(w))}} if panels else {}

    def fn(state, prepared, x):
        holder = nnx.merge(graphdef, state)
        with ops.bound(holder, prepared):
            return model.linear(x, holder.weight[...])

    return fn, (state, prepared)


# (rows, x dtype, w dtype, panels bound, kernels expected): one row by the matrix-vector kernel on w as it is; 2-16 rows
# by the panel kernel where the step has panels; more rows (prefill) and rows without panels by XLA's product, a
# bfloat16 w under float32 x widened by a kernel right where it is used; float16 by XLA.
LINEAR_CASES = [
    ((1,), F32, F32, False, {"granite_matvec"}),
    ((1, 1), BF16, BF16, False, {"granite_matvec"}),
    ((1,), F32, BF16, False, {"granite_matvec"}),
    ((1,), BF16, F32, False, {"granite_matvec"}),
    ((1,), F32, F32, True, {"granite_matvec"}),
    ((2,), F32, F32, True, {"granite_small_matmul"}),
    ((8, 1), BF16, BF16, True, {"granite_small_matmul"}),
    ((16,), F32, BF16, True, {"granite_small_matmul"}),
    ((3, 2), BF16, F32, True, {"granite_small_matmul"}),
    ((3,), F32, F32, False, set()),
    ((3,), BF16, BF16, False, set()),
    ((3,), F32, BF16, False, {"granite_widen"}),
    ((17,), F32, F32, True, set()),
    ((4, 8), BF16, BF16, True, set()),
    ((17,), F32, BF16, True, {"granite_widen"}),
    ((1,), F16, F16, False, set()),
    ((1,), F32, F16, False, set()),
    ((8,), F16, F16, True, set()),
]


@pytest.mark.parametrize("rows,x_dtype,w_dtype,panels,expected", LINEAR_CASES)
def test_linear_routing(rows, x_dtype, w_dtype, panels, expected):
    rng = np.random.default_rng(len(rows) + rows[0])
    x, w = rng.standard_normal((*rows, 48)).astype(x_dtype), rng.standard_normal((21, 48)).astype(w_dtype)
    fn, lead = linear_on(w, panels)
    check_routing(fn, (*lead, x), expected)
    got = outputs(fn, *lead, x)
    if RUNS and expected - {"granite_widen"}:  # a kernel's float32 arithmetic, rounded to x's dtype
        assert_product_close(got, x, w, x_dtype)
    else:  # XLA's product, as plain JAX runs it (a widened weight is the same values)
        np.testing.assert_array_equal(got, outputs(fn, *lead, x, runtime=PLAIN))


@needs_kernels
def test_widened_weights_are_exact_and_wait_for_their_product():
    # bfloat16 weights under float32 activations, many rows (XLA's product, as in prefill): each weight is widened
    # exactly, by a kernel that takes the activations as an operand, so that each conversion comes after the product
    # before it. Left to XLA, the eight conversions below run first and are all alive at once.
    rng = np.random.default_rng(5)
    ws = [(rng.standard_normal((64, 64)) / 8).astype(BF16) for _ in range(8)]  # gain ~1 per layer
    x = rng.standard_normal((40, 64)).astype(np.float32)

    def chain(x, ws):
        for w in ws:
            x = jnp.tanh(model.linear(x, w))
        return x

    assert kernels_in(lowered(ops.under(Runtime(), chain), x, ws)) == {"granite_widen"}
    want = np.asarray(x, np.float64)
    for w in ws:
        want = np.tanh(want @ np.asarray(w, np.float64).T)
    np.testing.assert_allclose(outputs(chain, x, ws), want, rtol=1e-4, atol=1e-5)
    temp = jax.jit(ops.under(Runtime(), chain)).trace(x, ws).lower().compile().memory_analysis().temp_size_in_bytes
    assert temp < 4 * 64 * 64 * 4  # a few float32 weights at a time, not eight


# ---------------------------------------------------------------------------------------------- experts, embedding


def expert_operands(r, e, k, n, x_dtype, w_dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((r, k)).astype(x_dtype)
    w = rng.standard_normal((e, k, n)).astype(w_dtype)
    return x, w, rng.integers(0, e, r).astype(np.int32)


def expert_float64(x, w, experts):
    """float64 y[r] = x[r] w[experts[r]] and the same product of absolute values."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)[experts]
    return np.einsum("rk,rkn->rn", x64, w64), np.einsum("rk,rkn->rn", np.abs(x64), np.abs(w64))


# Any number of rows (decode's few, prefill's past GATHER_ROWS) of float32 or bfloat16 x and w: the expert kernel;
# float16 x or w: XLA.
@pytest.mark.parametrize(
    "rows,x_dtype,w_dtype,expected",
    [
        (6, F32, F32, {"granite_expert_matvec"}),
        (6, BF16, BF16, {"granite_expert_matvec"}),
        (12, F32, BF16, {"granite_expert_matvec"}),
        (12, BF16, F32, {"granite_expert_matvec"}),
        (80, F32, F32, {"granite_expert_matvec"}),
        (6, F16, F16, set()),
        (6, F32, F16, set()),
        (80, F16, F32, set()),
    ],
)
def test_expert_linear_routing(rows, x_dtype, w_dtype, expected):
    x, w, experts = expert_operands(rows, 5, 24, 16, x_dtype, w_dtype, seed=rows)
    check_routing(model.expert_linear, (x, w, experts), expected)
    got = outputs(model.expert_linear, x, w, experts)
    want, bound = expert_float64(x, w, experts)
    assert got.dtype == x_dtype
    # The kernel's float32 arithmetic; XLA's in x's dtype (w cast to it), loosely
    tolerance = 2 * 24 * 2.0**-24 if RUNS and expected else 1e-2
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= tolerance * bound + rounding(x_dtype) * np.abs(want) + 1e-30)


@pytest.mark.parametrize("r", [40, 150])  # XLA gathers the chosen experts up to GATHER_ROWS rows, groups rows past it
def test_plain_expert_rows_match_float64(r):
    x, w, experts = expert_operands(r, 6, 48, 24, F32, F32, seed=2)
    got = outputs(model.expert_linear, x, w, experts, runtime=PLAIN)
    want, bound = expert_float64(x, w, experts)
    assert np.all(np.abs(got - want) <= 1e-5 * bound + 1e-6)


@pytest.mark.parametrize("dtype,expected", [(BF16, {"granite_take_rows"}), (F32, set()), (F16, set())])
def test_embedding_rows_routing(dtype, expected):
    # A bfloat16 table is read by a kernel (XLA:CPU would widen all of it to gather from it); the rows are the same,
    # NaN rows for ids outside the table included.
    table = np.random.default_rng(3).standard_normal((50, 21)).astype(dtype)
    ids = np.array([[0, 49, -1, 50, 7], [3, 3, 2**30, -(2**30), 2]], np.int32)
    check_routing(model.embedding_rows, (table, ids), expected)
    got = outputs(model.embedding_rows, table, ids)
    assert got.dtype == np.float32 and got.shape == (2, 5, 21)
    np.testing.assert_array_equal(got, outputs(model.embedding_rows, table, ids, runtime=PLAIN))
    assert np.isnan(got[0, 2:4]).all() and np.isnan(got[1, 2:4]).all()


# ---------------------------------------------------------------------------------------------- attention, greedy


def attention_inputs(b, T, q_dtype, cache_dtype, S=40, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, T, 2, 3, 16)).astype(q_dtype)
    k, v = (rng.standard_normal((b, 2, S, 16)).astype(cache_dtype) for _ in range(2))
    return q, k, v, np.array([0, 4][:b], np.int32), np.arange(30, 30 + T, dtype=np.int32)


def attend(q, k, v, pad, slots):
    return model.attend_cache(q, KVState(k, v), Positions(slots, pad), 0.25)


# One query per row (decoding) of float32 over a float32 or bfloat16 cache: the kernel; a bfloat16 model's queries,
# several queries (prefill), a float16 cache: XLA's blocks.
@pytest.mark.parametrize(
    "T,q_dtype,cache_dtype,expected",
    [
        (1, F32, F32, {"granite_decode_attention"}),
        (1, F32, BF16, {"granite_decode_attention"}),
        (1, BF16, BF16, set()),
        (3, F32, F32, set()),
        (1, F32, F16, set()),
    ],
)
def test_attend_cache_routing(T, q_dtype, cache_dtype, expected):
    args = attention_inputs(2, T, q_dtype, cache_dtype)
    check_routing(attend, args, expected)
    if not expected:  # plain JAX under either runtime
        return
    got, want = outputs(attend, *args), outputs(attend, *args, runtime=PLAIN)
    assert got.dtype == want.dtype == q_dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "shape,dtype,expected",
    [
        ((3, 50), F32, {"granite_greedy"}),
        ((1, 100352), F32, {"granite_greedy"}),
        ((3, 50), BF16, set()),
        ((50,), F32, set()),
    ],
)
def test_greedy_routing(shape, dtype, expected):
    logits = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    check_routing(sampling.greedy_tokens, (logits,), expected)
    got = outputs(sampling.greedy_tokens, logits)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(np.asarray(logits, np.float32), axis=-1))


def test_greedy_inside_a_sampling_step_is_the_kernel():
    # sample_tokens picks greedy or a draw at run time (lax.cond): both are in the program, the greedy one the kernel's.
    params = SamplingConfig().device_params()
    logits = np.zeros((2, 64), np.float32)
    text = lowered(ops.under(Runtime(), sampling.sample_tokens), logits, params, np.int32(0))
    assert kernels_in(text) == ({"granite_greedy"} if RUNS else set())


# ---------------------------------------------------------------------------------------------- SSD


def ssm_inputs(b, h, p, g, n, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((b, h, p, n)).astype(np.float32 if dtype == np.float64 else dtype),
        rng.standard_normal((b, h, p)).astype(dtype),
        np.log1p(np.exp(rng.standard_normal((b, h)))).astype(dtype),
        -np.exp(rng.standard_normal(h)).astype(dtype),
        rng.standard_normal((b, g, n)).astype(dtype),
        rng.standard_normal((b, g, n)).astype(dtype),
        rng.standard_normal(h).astype(dtype),
    )


@pytest.mark.parametrize(
    "dtypes,expected",
    [
        ((F32,) * 7, {"granite_ssm_update_f32"}),
        ((F32, BF16, F32, F32, BF16, BF16, F32), set()),  # a bfloat16 model's x, B, C: XLA's
    ],
    ids=["float32", "bfloat16 x, B, C"],
)
def test_ssd_step_routing(dtypes, expected):
    args = [a.astype(t) for a, t in zip(ssm_inputs(2, 4, 8, 2, 16), dtypes, strict=True)]
    check_routing(ssd.ssd_step, args, expected)
    got, want = outputs(ssd.ssd_step, *args), outputs(ssd.ssd_step, *args, runtime=PLAIN)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_float64_ssd_step_is_plain_jax_and_exact():
    args = ssm_inputs(2, 4, 8, 1, 16, dtype=np.float64)
    with jax.enable_x64(True):
        args = (args[0].astype(np.float64), *args[1:])
        assert not kernels_in(lowered(ops.under(Runtime(), ssd.ssd_step), *args))
        y, s = outputs(ssd.ssd_step, *args)
        state, x, dt, A, B, C, D = (jnp.asarray(a) for a in args)
        y_ref, s_ref = ssd.ssd_reference(x[:, None], dt[:, None], A, B[:, None], C[:, None], D, initial_state=state)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, y_ref[:, 0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s, s_ref, rtol=1e-12, atol=1e-12)


def test_ssd_chunk_on_cpus_is_64_and_other_platforms_keep_the_configs(monkeypatch):
    # Prefill's SSD on CPUs runs in chunks of at most 64 (backend.CPU_CHUNK): the same result up to rounding. Lowered
    # for another platform, the program keeps the config's chunk (its (64, 64) decay blocks are only in the CPU's).
    assert backend.CPU_CHUNK == 64
    seen = []
    chunked = ssd.ssd_chunked

    def spy(*args, chunk_size, **kwargs):
        seen.append(chunk_size)
        return chunked(*args, chunk_size=chunk_size, **kwargs)

    monkeypatch.setattr(ssd, "ssd_chunked", spy)
    rng = np.random.default_rng(0)
    b, L, h, p, g, n = 1, 200, 2, 4, 1, 8
    args = (
        rng.standard_normal((b, L, h, p), np.float32),
        np.log1p(np.exp(rng.standard_normal((b, L, h), np.float32))),
        -np.exp(rng.standard_normal(h, np.float32)),
        rng.standard_normal((b, L, g, n), np.float32),
        rng.standard_normal((b, L, g, n), np.float32),
        rng.standard_normal(h, np.float32),
    )
    results = {}
    for chunk, runtime in ((256, Runtime()), (16, Runtime()), (256, PLAIN)):
        seen.clear()
        results[chunk, runtime] = outputs(lambda *a, c=chunk: ssd.ssd(*a, chunk_size=c), *args, runtime=runtime)
        expected = {chunk, 64} if runtime.kernels and RUNS and chunk > 64 else {chunk}  # both branches are traced
        assert set(seen) == expected, (chunk, runtime)
    ssd_256 = ops.under(Runtime(), lambda *a: ssd.ssd(*a, chunk_size=256))
    cpu, cuda = (lowered(ssd_256, *args, platform=platform) for platform in ("cpu", "cuda"))
    assert ("x64x64x" in cpu) == RUNS and "x256x256x" in cuda and "x64x64x" not in cuda
    for got, want in zip(results[256, Runtime()], results[256, PLAIN], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="chunk_size: expected a positive int"), ops.using(Runtime()):
        ssd.ssd(*args, chunk_size=0)


# ---------------------------------------------------------------------------------------------- the Mamba step


def mamba_mixer(weight_dtypes=(F32,) * 6, K=4, dtype=F32, seed=0) -> MambaMixer:
    """A small `MambaMixer` computing in `dtype`, its mixing weights random in `weight_dtypes` (conv weight, conv bias,
    dt bias, A_log, D, norm weight); its projections, which `mix` does not use, abstract."""
    cfg = released_config("granite-4.0-h-350m").replace(
        hidden_size=32, mamba_expand=1, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=16,
        mamba_d_conv=K, num_attention_heads=1, num_key_value_heads=1,
    )  # fmt: skip
    mixer = nnx.eval_shape(lambda: MambaMixer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    params = (mixer.conv_weight, mixer.conv_bias, mixer.dt_bias, mixer.A_log, mixer.D, mixer.norm.weight)
    for param, weight_dtype in zip(params, weight_dtypes, strict=True):
        param.set_value(jnp.asarray((0.5 * rng.standard_normal(param.shape)).astype(weight_dtype)))
    return mixer


def mix_inputs(mixer: MambaMixer, b, T, dtype=F32, seed=1):
    cfg, rng = mixer.cfg, np.random.default_rng(seed)
    zxbcdt = rng.standard_normal((b, T, cfg.mamba_in_proj_dim)).astype(dtype)
    ring = rng.standard_normal((b, cfg.mamba_d_conv, cfg.mamba_conv_dim)).astype(dtype)
    state = rng.standard_normal((b, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state)).astype(np.float32)
    return zxbcdt, np.ones((b, T), np.bool_), ring, state, np.int32(5)


def mix_of(mixer: MambaMixer, with_state: bool = True):
    def mix(zxbcdt, mask, ring, state, slot):
        y, new = mixer.mix(zxbcdt, mask, MambaState(ring, state) if with_state else None, slot)
        return y, new.conv, new.ssm

    return mix


# One token per row from a state, float32 activations on float32 or bfloat16 weights of one dtype: the fused step
# (its state update inside: no separate kernel). Otherwise the plain mixer, whose one-token state update of float32
# inputs is still the state-update kernel: weights of two dtypes, a conv past 16 taps. A bfloat16 model's activations,
# prefill (T > 1), no state: plain JAX throughout.
@pytest.mark.parametrize(
    "weights,K,T,dtype,with_state,expected",
    [
        ((F32,) * 6, 4, 1, F32, True, {"granite_mamba_step"}),
        ((BF16,) * 6, 4, 1, F32, True, {"granite_mamba_step"}),
        ((F32,) * 5 + (BF16,), 4, 1, F32, True, {"granite_ssm_update_f32"}),
        ((F32,) * 6, 17, 1, F32, True, {"granite_ssm_update_f32"}),
        ((BF16,) * 6, 4, 1, BF16, True, set()),
        ((F32,) * 6, 4, 3, F32, True, set()),
        ((F32,) * 6, 4, 1, F32, False, set()),
    ],
    ids=["float32", "bfloat16 weights", "two weight dtypes", "17 taps", "bfloat16 model", "prefill", "no state"],
)
def test_mamba_mix_routing(weights, K, T, dtype, with_state, expected):
    mixer = mamba_mixer(weights, K, dtype)
    args = mix_inputs(mixer, 2, T, dtype)
    check_routing(mix_of(mixer, with_state), args, expected)
    if not expected:  # plain JAX under either runtime
        return
    got = outputs(mix_of(mixer, with_state), *args)
    want = outputs(mix_of(mixer, with_state), *args, runtime=PLAIN)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- packing


@pytest.mark.parametrize("n,k", [(1, 3), (8, 5), (13, 7), (24, 1)])
def test_pack_is_panels_of_eight_rows(n, k):
    w = np.arange(n * k, dtype=np.float32).reshape(n, k) + 1
    packed = np.asarray(packing.pack(w))
    assert packed.shape == (-(-n // 8), k, 8)
    for row in range(packed.shape[0] * 8):  # panel[p, :, c] is row 8p + c; rows past n are zero
        want = w[row] if row < n else np.zeros(k, np.float32)
        np.testing.assert_array_equal(packed[row // 8, :, row % 8], want)
    np.testing.assert_array_equal(np.asarray(packing.unpack(packed, n)), w)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    """`tiny(dtype="float32", weight_dtype=None)`: the tiny MoE hybrid (its default runtime), loaded once per dtypes."""
    return functools.cache(
        lambda dtype="float32", weight_dtype=None: load_model(tiny_checkpoint, dtype=dtype, weight_dtype=weight_dtype)
    )


def untied(tied):
    """The tiny model with an output head of its own (the embedding no longer streamed by the head's product)."""
    other = abstract_model(tied.cfg.replace(tie_word_embeddings=False))
    nnx.update(other, nnx.state(tied, nnx.Param))
    head = np.random.default_rng(11).standard_normal(other.lm_head.weight.shape) / 8
    other.lm_head.weight.set_value(jnp.asarray(head, np.float32))
    return other


def plain(m):
    """The same weights run as plain JAX."""
    return with_runtime(m, PLAIN)


def streamed(m) -> dict[str, jax.Array]:
    """The weights a step multiplies by, by parameter path: every `Linear`'s and, when tied, the embedding."""
    found = {
        ".".join(map(str, (*path, "weight"))): n.weight[...] for path, n in nnx.iter_graph(m) if isinstance(n, Linear)
    }
    if m.cfg.tie_word_embeddings:
        found["embed_tokens.embedding"] = m.embed_tokens.embedding[...]
    return found


def panel_bytes(prepared) -> int:
    return sum(a.nbytes for a in prepared.get("cpu", {}).values())


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_prepare_packs_every_streamed_weight_outside_the_model(tiny, head, tmp_path):
    # What a decode step of 2-16 rows binds: a panel copy of every Linear's weight (and of a tied embedding, the head's
    # weight), kept beside the model, not in it: its state and saved checkpoints hold the parameters alone.
    m = tiny() if head == "tied" else untied(tiny())
    leaves = jax.tree.leaves(nnx.state(m))
    prepared = ops.prepare(m, 3)
    if not RUNS:
        assert prepared == {}
        return
    weights = streamed(m)
    assert set(prepared) == {"cpu"} and set(prepared["cpu"]) == set(weights)
    for path, w in weights.items():
        np.testing.assert_array_equal(np.asarray(packing.unpack(prepared["cpu"][path], w.shape[0])), np.asarray(w))
    assert panel_bytes(prepared) == sum(4 * -(-w.shape[0] // 8) * 8 * w.shape[1] for w in weights.values())
    assert ops.prepare(m, 16)["cpu"] is prepared["cpu"]  # made once per model, for any step of 2-16 rows
    assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(m)), leaves, strict=True))  # nothing added to it
    restored = load_model(save_checkpoint(m, tmp_path / "saved"))
    assert len(jax.tree.leaves(nnx.state(restored))) == len(leaves)
    for a, b in zip(jax.tree.leaves(nnx.state(m, nnx.Param)), jax.tree.leaves(nnx.state(restored, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@needs_kernels
def test_only_steps_of_2_to_16_rows_of_float32_and_bfloat16_models_get_panels(tiny):
    f32 = tiny()
    for rows in (1, 17):
        assert ops.prepare(f32, rows) == {"cpu": {}}
    assert ops.prepare(with_runtime(f32, Runtime(pack_weights=False)), 3) == {"cpu": {}}
    assert ops.prepare(plain(f32), 3) == {}
    assert ops.prepare(tiny("float16"), 3) == {"cpu": {}}
    assert ops.prepare(tiny("float32", "float16"), 3) == {"cpu": {}}
    bf16, mixed = ops.prepare(tiny("bfloat16"), 3)["cpu"], ops.prepare(tiny("float32", "bfloat16"), 3)["cpu"]
    assert {p.dtype for p in bf16.values()} == {p.dtype for p in mixed.values()} == {jnp.dtype(BF16)}
    assert 2 * panel_bytes({"cpu": mixed}) == panel_bytes(ops.prepare(f32, 3)) > 0  # half the float32 panels


@needs_kernels
def test_packing_declines_when_the_panels_would_not_fit(tiny, monkeypatch, caplog):
    # Panels take as much memory again as the weights: not made past half the available memory, with a warning, unless
    # Runtime(pack_weights=True); made where the available memory is unknown.
    needed = sum(w.nbytes for w in streamed(tiny()).values())
    monkeypatch.setattr(packing, "available_memory", lambda: 2 * needed - 1)
    declined = with_runtime(tiny(), Runtime())
    with caplog.at_level(logging.WARNING, logger=packing.__name__):
        assert ops.prepare(declined, 3) == {"cpu": {}} == ops.prepare(declined, 8)  # decided once for the model
    (record,) = [r for r in caplog.records if r.name == packing.__name__]
    assert "not packing the weights for decoding" in record.getMessage()
    assert "Runtime(pack_weights=True) packs anyway" in record.getMessage()
    declined.runtime = Runtime(pack_weights=True)  # another choice decides again
    assert len(ops.prepare(declined, 3)["cpu"]) > 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=packing.__name__):
        assert len(ops.prepare(with_runtime(tiny(), Runtime(pack_weights=True)), 3)["cpu"]) > 0
        monkeypatch.setattr(packing, "available_memory", lambda: 2 * needed)
        assert len(ops.prepare(with_runtime(tiny(), Runtime()), 3)["cpu"]) > 0
        monkeypatch.setattr(packing, "available_memory", lambda: None)
        assert len(ops.prepare(with_runtime(tiny(), Runtime()), 3)["cpu"]) > 0
    assert not [r for r in caplog.records if r.name == packing.__name__]


@needs_kernels
def test_panels_are_remade_when_the_weights_change_and_go_with_the_model(tiny_checkpoint):
    m = load_model(tiny_checkpoint)  # its own (its weights are changed below)
    first = ops.prepare(m, 3)["cpu"]
    assert ops.prepare(m, 5)["cpu"] is first
    doubled = jax.tree.map(lambda a: a * 2, nnx.state(m, nnx.Param))
    nnx.update(m, doubled)
    again = ops.prepare(m, 3)["cpu"]
    assert again is not first
    path = "layers.0.mamba.in_proj.weight"
    np.testing.assert_array_equal(np.asarray(again[path]), 2 * np.asarray(first[path]))
    gone = weakref.ref(m)
    del m
    gc.collect()
    assert gone() is None  # the panels do not keep the model alive


# ---------------------------------------------------------------------------------------------- decode steps


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def forward_step(graphdef, state, prepared, ids, cache):
    """A decode (or prefill) step as generation runs it: the weights and their prepared arrays bound inside the jit."""
    m = nnx.merge(graphdef, state)
    with ops.bound(m, prepared):
        logits, cache, _ = m.forward(ids, cache=cache)
    return logits, cache


def decode_texts(m, batch: int, platforms=("cpu", "cuda")) -> list[str]:
    """A decode step of `batch` rows traced once, lowered for each platform: StableHLO texts."""
    graphdef, state = nnx.split(m)
    cache = jax.eval_shape(lambda: Cache.init(m.cfg, batch, 16, m.dtype))
    ids = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    traced = forward_step.trace(graphdef, state, ops.prepare(m, batch), ids, cache)
    return [traced.lower(lowering_platforms=(platform,)).as_text() for platform in platforms]


def decoded(m, ids, prefill: int = 0) -> np.ndarray:
    """Logits (b, T - prefill + 1 or T, V) of ids (b, T) teacher-forced one token per step, after a prefill of the
    first `prefill` tokens (its last position's logits first)."""
    graphdef, state = nnx.split(m)
    b, T = ids.shape
    prepared, cache = ops.prepare(m, b), Cache.init(m.cfg, b, 16, m.dtype)
    out = []
    if prefill:
        logits, cache = forward_step(graphdef, state, prepared, ids[:, :prefill], cache)
        out.append(logits[:, -1:])
    for t in range(prefill, T):
        logits, cache = forward_step(graphdef, state, prepared, ids[:, t : t + 1], cache)
        out.append(logits)
    return np.concatenate([np.asarray(o, np.float32) for o in out], axis=1)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


LINEAR_KERNEL = {1: "granite_matvec", 3: "granite_small_matmul"}  # one row, and 2-16 rows on panels


# Which kernels a decode step runs, per model dtype (activations, weights) and batch: every product, the experts',
# the embedding lookup of a bfloat16 table; with float32 activations the Mamba step and the attention too.
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    "dtype,weight_dtype,others",
    [
        ("float32", None, {"granite_expert_matvec", "granite_mamba_step", "granite_decode_attention"}),
        ("bfloat16", None, {"granite_expert_matvec", "granite_take_rows"}),
        (
            "float32",
            "bfloat16",
            {"granite_expert_matvec", "granite_mamba_step", "granite_decode_attention", "granite_take_rows"},
        ),
    ],
)
def test_decode_step_kernels(tiny, dtype, weight_dtype, others, batch):
    m = tiny(dtype, weight_dtype)
    cpu, cuda = decode_texts(m, batch)
    assert kernels_in(cpu) == ({LINEAR_KERNEL[batch], *others} if RUNS else set())
    assert not kernels_in(cuda)
    (cpu,) = decode_texts(plain(m), batch, platforms=("cpu",))
    assert not kernels_in(cpu)


# One row (the matrix-vector kernel) and three (panels); a tied head (the embedding streamed from panels) and an
# untied one; a prefill of 12 rows (panels too) before the steps; float32 on bfloat16 weights.
@pytest.mark.parametrize(
    "head,batch,weight_dtype,prefill",
    [("tied", 1, None, 0), ("tied", 3, None, 4), ("untied", 3, None, 0), ("tied", 3, "bfloat16", 0)],
)
def test_decode_with_kernels_is_the_plain_jax_model(tiny, head, batch, weight_dtype, prefill):
    # The kernels (with the step's panels) compute what the plain-JAX model computes, up to float32 rounding; float32
    # on bfloat16 weights too, the kernels widening them in registers where XLA converts them.
    m = tiny("float32", weight_dtype)
    m = m if head == "tied" else untied(m)
    ids = np.random.default_rng(7).integers(3, 300, (batch, 8)).astype(np.int32)
    got, want = decoded(m, ids, prefill), decoded(plain(m), ids, prefill)
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("batch", [1, 3])
def test_bfloat16_decode_stays_close_to_float32(tiny, batch):
    # bfloat16 decode steps on CPUs: the products by the matrix-vector or the panel kernel and the expert kernel
    # (float32 arithmetic on bfloat16 weights). Teacher-forced token by token, the logits stay those of the float32
    # model up to bfloat16 rounding.
    ids = np.random.default_rng(9).integers(3, 300, (batch, 8)).astype(np.int32)
    assert rel_err(decoded(tiny("bfloat16"), ids), decoded(plain(tiny()), ids)) < 3e-2


@needs_kernels
def test_float32_prefill_on_bfloat16_weights_keeps_no_float32_copy_of_them(tiny):
    # XLA's products of many rows take the weights in float32: each bfloat16 weight is widened right before its
    # product (the widen kernel), so the compiled prefill needs no more temporary memory than the float32 model's
    # plus one widened weight (converted all at once, they would add all of the weights again in float32).
    ids = jnp.ones((2, 64), jnp.int32)
    forward = jax.jit(lambda m, ids: m(ids))
    temp = {}
    for weights in ("float32", "bfloat16"):
        m = tiny("float32", weights)
        temp[weights] = forward.trace(m, ids).lower().compile().memory_analysis().temp_size_in_bytes
    widened = [4 * w.size for w in streamed(m).values()]
    assert temp["bfloat16"] <= temp["float32"] + max(widened) < temp["float32"] + sum(widened) / 2


@needs_kernels
def test_decode_chunks_read_a_bfloat16_embedding_in_place(tiny):
    # XLA:CPU gathers from a bfloat16 table by widening all of it, which a chunk's loop of decode steps hoists out of
    # its body: a float32 copy of the embedding per call, unless the lookup is the take_rows kernel.
    m = tiny("bfloat16")
    steps, S = Steps(m), jax.ShapeDtypeStruct
    ids, live, params, step = S((2,), jnp.int32), S((2,), jnp.bool_), SamplingConfig().device_params(), S((), jnp.int32)
    args = (steps.abstract_cache(2, 16), ids, live, params, S((DEVICE_STOPS,), jnp.int32), step, step)
    hlo = steps.jitted["decode_chunk"].lower(steps.weights, ops.prepare(m, 2), *args, chunk=4).compile().as_text()
    assert "granite_take_rows" in kernels_in(hlo)
    table = f"f32[{m.cfg.vocab_size},{m.cfg.hidden_size}]"
    assert table not in hlo, "the decode chunk widens the whole embedding table"
