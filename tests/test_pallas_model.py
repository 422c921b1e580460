"""The model under Runtime(ssd="pallas") (kernels interpreted on CPU) equals the "xla" SSD on a tiny config.

Covers the prefill kernels (a prompt longer than a chunk and not a multiple of it, groups, an initial state when
prefilling a second segment from the cache) and the decode kernels (single-token steps through the cache: the fused
Mamba step, decode attention and the norms). Also: the
Generator's prefill and decode steps lower for CUDA with no CPU kernel left in them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels
from granite_jax.config import ModelConfig
from granite_jax.generation import SamplingConfig
from granite_jax.generation.steps import abstract_steps
from granite_jax.model import Cache, Granite, with_runtime
from granite_jax.ops import Runtime
from granite_jax.presets import released_config

TOLERANCE = 1e-5  # float32 throughout: relative (Frobenius) error of the logits (measured 4-6e-7)
TINY = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    layer_types=("mamba", "attention", "mamba"),
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    shared_intermediate_size=32,
    num_local_experts=0,
    num_experts_per_tok=0,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_n_groups=2,
    mamba_chunk_size=16,
    # Weights of transformers' scale (0.02) make the SSD's state terms ~1e-6 of its D x skip: below float32 logits'
    # resolution, so the kernels would go unchecked. At this scale they carry the output.
    initializer_range=0.3,
)
# With routed experts, at dims the router's and experts' kernels take (multiples of 128).
TINY_MOE = TINY.replace(hidden_size=128, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                        mamba_n_heads=8, mamba_d_head=32)  # fmt: skip


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite logits"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@jax.jit
def _prefill_then_decode(model, prompt, second, steps):
    """Logits of: the prompt from scratch, a second segment from the cache, then single-token decode steps."""
    cache = Cache.init(model.cfg, prompt.shape[0], prompt.shape[1] + second.shape[1] + steps.shape[1])
    first, cache, _ = model.forward(prompt, cache=cache)
    middle, cache, _ = model.forward(second, cache=cache)
    decoded = []
    for t in range(steps.shape[1]):
        logits, cache, _ = model.forward(steps[:, t : t + 1], cache=cache)
        decoded.append(logits)
    return first, middle, jnp.concatenate(decoded, axis=1), cache.layers[0].ssm


@pytest.mark.parametrize("cfg", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_pallas_model_equals_xla(cfg):
    xla = Granite(cfg, rngs=nnx.Rngs(0))
    pallas = with_runtime(xla, Runtime(ssd="pallas"))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40 + 9 + 2)))
    prompt, second, steps = tokens[:, :40], tokens[:, 40:49], tokens[:, 49:]

    want = _prefill_then_decode(xla, prompt, second, steps)
    with pallas_kernels.interpret_mode():
        got = _prefill_then_decode(pallas, prompt, second, steps)
    for name, g, w in zip(("prompt logits", "second segment logits", "decode logits", "final state"), got, want):
        err = _rel_err(g, w)
        print(f"{name}: {err:.1e}")
        assert err <= TOLERANCE, name


def _generation_steps(cfg, ssd: str, dtype, weight_dtype, prompt_len: int, cache_len: int) -> dict:
    """name -> (fn, args): the Generator's prefill and decode steps at batch 1, sampling on, model and arguments
    abstract."""
    sampling = SamplingConfig(temperature=0.7, top_k=5)
    return abstract_steps(
        cfg,
        batch=1,
        prompt_len=prompt_len,
        cache_len=cache_len,
        dtype=dtype,
        weight_dtype=weight_dtype,
        runtime=Runtime(ssd=ssd),
        sampling=sampling,
    )


@pytest.mark.parametrize(
    "ssd_impl, dtype, weight_dtype",
    [("pallas", jnp.bfloat16, jnp.bfloat16), ("pallas", jnp.float32, jnp.bfloat16), ("xla", jnp.float32, jnp.float32)],
)
def test_generation_steps_lower_for_cuda(ssd_impl, dtype, weight_dtype):
    # The Generator's own steps, on a hybrid MoE model, traced for CUDA on this CPU-only machine: every CPU kernel
    # (batch 1: the decode products go to the matrix-vector kernel on CPUs) must give way to its XLA version
    # (`lax.platform_dependent`), and with "pallas" the SSD runs as Triton calls (three per Mamba layer in prefill;
    # in decode one per Mamba layer, the fused mixer step).
    cfg = TINY_MOE
    mamba_layers = cfg.layer_types.count("mamba")
    steps = _generation_steps(cfg, ssd_impl, dtype, weight_dtype, prompt_len=40, cache_len=64)
    with pallas_kernels.cuda_lowering():
        for name, (fn, args) in steps.items():
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert "granite_" not in text, f"{name}: a CPU kernel in the CUDA program"
            # prefill: the SSD's three kernels per Mamba layer, per layer the router (40 rows, as few as decoding's;
            # their 80 routed rows are not), and the final norm of the last position; decode: per Mamba layer the
            # fused step and its gated norm, per attention layer attention's split and combine kernels, per layer
            # two norms, the router and the experts' two, and the final norm
            layers = len(cfg.layer_types)
            decode = 2 * mamba_layers + 2 * (layers - mamba_layers) + 5 * layers + 1
            triton = 3 * mamba_layers + layers + 1 if name == "prefill" else decode
            assert text.count("__gpu$xla.gpu.triton") == (triton if ssd_impl == "pallas" else 0)
            kernels = ("mamba_step", "decode_attention", "rms_norm", "residual_rms_norm", "route", "experts_up")
            if ssd_impl == "pallas" and name == "decode":
                assert "ssd_decode" not in text and all(k in text for k in kernels)


@pytest.mark.slow(15)
@pytest.mark.aot
def test_generation_steps_compile_for_h200(h200_target):
    # Beyond lowering: XLA's GPU compiler, Triton and ptxas accept the Generator's steps at h-tiny's shape (a Mamba
    # and an attention layer, both MoE, as its fifth and sixth) with the Pallas SSD, for an 8K-token cache, in float32
    # over bfloat16 weights (the bfloat16 steps compile for an H200 in the kernel-budget report's test).
    dtype = jnp.float32
    from pallas_kernels import aot

    cfg = released_config("granite-4.0-h-tiny")
    cfg = cfg.replace(layer_types=cfg.layer_types[4:6])
    assert set(cfg.layer_types) == {"mamba", "attention"} and cfg.num_local_experts > 0
    steps = _generation_steps(cfg, "pallas", dtype, jnp.bfloat16, prompt_len=4096, cache_len=8192)
    with pallas_kernels.cuda_lowering():
        for fn, args in steps.values():
            aot.compile_for_gpu(fn, *args)
