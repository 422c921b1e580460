"""The "pallas" backend: `pallas_kernels`' Triton kernels as the model's SSD, its one-token step, the Mamba mixer's
whole decode step, decode attention over the KV cache, and decoding's RMSNorms, router and experts
(`Runtime(ssd="pallas")`, NVIDIA GPUs; elsewhere they raise `pallas_kernels.PallasUnavailableError` when traced, except
inside the package's test modes). Forward only: differentiate with the "xla" SSD."""

from __future__ import annotations

import jax.numpy as jnp

import pallas_kernels
from granite_jax import model, ops
from granite_jax.ssd import ssd, ssd_step


def _prefill(reference, x, dt, A, B, C, D, *, chunk_size: int, initial_state=None):
    return pallas_kernels.ssd_prefill(x, dt, A, B, C, D, chunk_size=chunk_size, initial_state=initial_state)


def _decode(reference, state, x, dt, A, B, C, D):
    return pallas_kernels.ssd_decode(state, x, dt, A, B, C, D)


def _mix(reference, mixer, zxbcdt, token_mask, state, slot):
    """One token per row: conv, time steps, state update, D x and the gate in one kernel that updates the ring and the
    state in place (`pallas_kernels.mamba_step`), then the gated norm, whose statistic spans a group's heads."""
    cfg = mixer.cfg
    takes = pallas_kernels.takes_mamba_step(cfg.mamba_d_head, cfg.mamba_d_state) and zxbcdt.dtype == mixer.dtype
    if state is None or zxbcdt.shape[1] != 1 or mixer.blocks != 1 or not takes:  # the kernel reads transformers' order
        return reference(mixer, zxbcdt, token_mask, state, slot)
    bias = None if mixer.conv_bias is None else mixer.conv_bias[...]
    vectors = (mixer.dt_bias[...], mixer.A_log[...], mixer.D[...])
    mask = None if token_mask is None else token_mask[:, 0]
    gated, ring, ssm = pallas_kernels.mamba_step(
        zxbcdt[:, 0], state.conv, slot, mixer.conv_weight[...], bias, *vectors, state.ssm,
        groups=cfg.mamba_n_groups, dt_limit=cfg.time_step_limit, token_mask=mask,
    )  # fmt: skip
    y = model.rms_norm(gated[:, None], mixer.norm.weight[...], cfg.rms_norm_eps, cfg.mamba_n_groups, mixer.dtype)
    return y, model.MambaState(ring, ssm)


def _rms_norm(reference, x, weight, eps: float, groups: int = 1, dtype=None):
    """Rows of one token (decoding): the statistic and its use in one launch (`pallas_kernels.rms_norm`) where XLA
    runs two."""
    if x.ndim < 2 or x.shape[-2] != 1 or not pallas_kernels.takes_rms_norm(x.shape[-1], groups):
        return reference(x, weight, eps, groups, dtype)
    y = pallas_kernels.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, groups=groups, dtype=dtype or x.dtype)
    return y.reshape(x.shape)


def _residual_rms_norm(reference, x, update, multiplier: float, weight, eps: float):
    """Rows of one token: the residual add and the norm after it in one launch (`pallas_kernels.residual_rms_norm`)."""
    if x.ndim < 2 or x.shape[-2] != 1 or update.shape != x.shape or not pallas_kernels.takes_rms_norm(x.shape[-1]):
        return reference(x, update, multiplier, weight, eps)
    flat = (-1, x.shape[-1])
    stream, y = pallas_kernels.residual_rms_norm(x.reshape(flat), update.reshape(flat), multiplier, weight, eps)
    return stream.reshape(x.shape), y.reshape(x.shape)


def _top_experts(reference, logits, k: int):
    """The router's top-k in one launch (`pallas_kernels.top_k`) where XLA's is two."""
    if logits.ndim != 2 or logits.dtype != jnp.float32 or not pallas_kernels.takes_top_k(logits.shape[1]):
        return reference(logits, k)
    return pallas_kernels.top_k(logits, k)


def _route(reference, x, w, k: int):
    """Decoding's few rows (up to `model.GATHER_ROWS`, each program reads the whole router): the router's product and
    its top-k in one launch (`pallas_kernels.route`) where XLA's are three. More rows: the product on tensor cores."""
    if x.ndim != 2 or x.shape[0] > model.GATHER_ROWS or not pallas_kernels.takes_route(x.shape[1], w.shape[0]):
        return reference(x, w, k)
    return pallas_kernels.route(x, w, k)


def _experts_swiglu(reference, x, experts, w_in, w_out, in_scale, out_scale, *, blocks: int = 1):
    """Decoding's few rows: each token's experts read in place, the SwiGLU fused into the first product
    (`pallas_kernels.experts_up`, `experts_down`): two launches where the plain body is three and a copy of the
    tokens per expert."""
    H, F = x.shape[1], w_out.shape[1]
    plain = blocks != 1 or in_scale is not None or out_scale is not None  # meshes' blocks, float8 scales
    widening = x.dtype == w_in.dtype == w_out.dtype or x.dtype == jnp.float32  # as the plain body casts
    if plain or not widening or experts.size > model.GATHER_ROWS or not pallas_kernels.takes_experts(H, F):
        return reference(x, experts, w_in, w_out, in_scale, out_scale, blocks=blocks)
    h = pallas_kernels.experts_up(x, w_in, experts)
    return pallas_kernels.experts_down(h, w_out, experts.reshape(-1)).reshape(*experts.shape, -1)


def _cache_and_attend(reference, q, k, v, cache, pos, scale: float):
    """One query per row: flash-decoding over the filled slots (`pallas_kernels.decode_attention`), the token's key
    and value written into the cache by the same kernel: two launches where the plain body is two cache updates and
    a loop over blocks of keys."""
    if q.shape[1] != 1 or not pallas_kernels.takes_decode_attention(q.shape[-1], cache.k.shape[2]):
        return reference(q, k, v, cache, pos, scale)
    new_kv = (k[:, :, 0].astype(cache.k.dtype), v[:, :, 0].astype(cache.v.dtype))
    out, k_cache, v_cache = pallas_kernels.decode_attention(
        q[:, 0], cache.k, cache.v, pos.pad, pos.query_slots, scale, new_kv=new_kv
    )
    return out[:, None], model.KVState(k_cache, v_cache)


ops.register("pallas", ssd, _prefill)
ops.register("pallas", ssd_step, _decode)
ops.register("pallas", model.MambaMixer.mix, _mix, covers=(ssd_step,))
ops.register("pallas", model.cache_and_attend, _cache_and_attend, covers=(model.attend_cache,))
ops.register("pallas", model.rms_norm, _rms_norm)
ops.register("pallas", model.residual_rms_norm, _residual_rms_norm, covers=(model.rms_norm,))
ops.register("pallas", model.top_experts, _top_experts)
ops.register("pallas", model.route, _route, covers=(model.linear, model.top_experts))
ops.register("pallas", model.experts_swiglu, _experts_swiglu, covers=(model.expert_linear,))
