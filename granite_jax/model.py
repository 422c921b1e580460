"""Granite 4.0 (GraniteMoeHybrid) in Flax NNX: hybrid Mamba-2 / attention decoder with MoE and a shared MLP.

A port of transformers' `GraniteMoeHybridForCausalLM` (`models/granitemoehybrid/modeling_granitemoehybrid.py`),
readable top to bottom: norms, the Mamba-2 mixer, attention, the MoE and the shared MLP, the decoder layer, the model.
Attribute names mirror the Hugging Face checkpoint so that `params.py` is a plain table.

Batches are left-padded: `pad[b]` is the number of padding tokens before row b's prompt. Padding never reaches a real
token: attention masks it out and the Mamba mixer zeroes it before and after the causal conv, so its state stays
exactly that of the prompt run alone. The decode cache is a pytree (`Cache`) passed in and returned, never stored in
the module, so one jitted step can donate it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.typing import DTypeLike

from granite_jax import cpu_kernels
from granite_jax.config import ATTENTION, MAMBA, ModelConfig
from granite_jax.ssd import ssd, ssd_step

Array = jax.Array
_MASKED = -1e30  # finite, so fully masked (padding) rows give a harmless uniform softmax instead of NaN
# Cache slots per step of `attend_cache`: one-token decode steps visit up to a block of unfilled slots, and 256 made
# batch-8 decode steps of the h-350m shape ~5% faster than 512 (same process, interleaved, 2026-11-30).
KV_BLOCK, DECODE_KV_BLOCK = 512, 256


# ---------------------------------------------------------------------------------------------- cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MambaState:
    conv: Array  # (b, K, conv_dim): the last pre-activation conv inputs, in the activation dtype, as a ring: the
    # input of slot t at t mod K, so that a decode step writes one entry in place (`conv_step`); the K-1 before the
    # next slot are read, the other is stale
    ssm: Array  # (b, h, p, n) float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVState:
    k: Array  # (b, kv_heads, S, head_dim): head-major, so attention reads each head's keys contiguously
    v: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    """Decode state of every layer. Slot s of row b holds that row's token s - pad[b]; `index` is the next slot."""

    layers: tuple[MambaState | KVState, ...]
    pad: Array  # (b,) int32
    index: Array  # () int32

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, pad: Array | None = None) -> Cache:
        layers = []
        for kind in cfg.layer_types:
            if kind == MAMBA:
                conv = jnp.zeros((batch, cfg.mamba_d_conv, cfg.mamba_conv_dim), dtype)
                ssm_shape = (batch, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state)
                layers.append(MambaState(conv, jnp.zeros(ssm_shape, jnp.float32)))
            else:
                kv_shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
                layers.append(KVState(jnp.zeros(kv_shape, dtype), jnp.zeros(kv_shape, dtype)))
        pad = jnp.zeros((batch,), jnp.int32) if pad is None else jnp.asarray(pad, jnp.int32)
        return cls(tuple(layers), pad, jnp.zeros((), jnp.int32))

    @property
    def max_len(self) -> int | None:
        """KV slots per row; None for a model without attention layers (its state does not grow)."""
        kv = [s for s in self.layers if isinstance(s, KVState)]
        return kv[0].k.shape[2] if kv else None


@dataclasses.dataclass(frozen=True)
class Positions:
    """Where the current tokens sit: their slots, and how many padding slots open each row."""

    query_slots: Array  # (T,) slot of each current token
    pad: Array  # (b,)

    @property
    def token_mask(self) -> Array:  # (b, T) True for real tokens
        return self.query_slots[None, :] >= self.pad[:, None]

    @property
    def positions(self) -> Array:  # (b, T) position of each token in its own sequence (RoPE)
        return jnp.maximum(self.query_slots[None, :] - self.pad[:, None], 0)

    def attention_mask(self, key_slots: Array) -> Array:  # (b, T, S): causal, and no padding keys
        causal = key_slots[None, :] <= self.query_slots[:, None]
        return causal[None] & (key_slots[None, None, :] >= self.pad[:, None, None])


# ---------------------------------------------------------------------------------------------- layers


class Packed(nnx.Variable):
    """A weight copied into `cpu_kernels.pack`'s panel layout for decoding on CPUs: derived, not a parameter."""


class Linear(nnx.Module):
    """y = x W^T, bias-free, with W stored (out, in) as in the checkpoint.

    The layout is for decoding: XLA:CPU's matrix-vector product contracting W's contiguous last axis runs ~1.35x
    faster at batch 1 than `x @ W` with W (in, out) (nnx.Linear's layout), and the same at prefill sizes. After
    `pack()`, float32 and bfloat16 products of 2-16 rows on a CPU stream a panel-layout copy of W through
    `cpu_kernels`'s kernel (docs/generation.md).
    """

    def __init__(self, d_in: int, d_out: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=0)
        self.weight = nnx.Param(init(rngs.params(), (d_out, d_in), param_dtype))
        self.dtype = dtype
        self.packed: Packed | None = nnx.data(None)  # a data attribute: `pack` may set it

    def __call__(self, x: Array) -> Array:
        packed = None if self.packed is None else self.packed[...]
        return cpu_kernels.linear(x.astype(self.dtype), self.weight[...], packed)  # W as stored: see `linear`

    def pack(self) -> None:
        self.packed = Packed(cpu_kernels.pack(self.weight[...]))


# ---------------------------------------------------------------------------------------------- norms


def rms_normalize(x: Array, eps: float) -> Array:
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        return (self.weight[...] * rms_normalize(x, self.eps).astype(x.dtype)).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """The weight of the Mamba mixer's gated norm (`gated_rms_norm`, applied by `mixer_middle`)."""

    def __init__(self, dim: int, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))


def gated_rms_norm(y: Array, z: Array, weight: Array, groups: int, eps: float, dtype) -> Array:
    """weight * norm(y * silu(z)), one RMS statistic per group of d_inner / groups channels (gate before the norm)."""
    gated = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    grouped = gated.reshape(*gated.shape[:-1], groups, -1)
    normed = rms_normalize(grouped, eps).reshape(gated.shape)
    return (weight * normed.astype(dtype)).astype(dtype)


# ---------------------------------------------------------------------------------------------- Mamba-2 mixer


def conv_step(x: Array, ring: Array, slot: Array | int, weight: Array, bias: Array | None) -> tuple[Array, Array]:
    """`causal_conv` of one token x (b, 1, C) at `slot` on a ring of inputs (`MambaState.conv`): (out, new ring).

    x is written over the oldest entry first, in place, and the conv reads the updated ring, as attention reads the
    updated KV cache: a shifted copy of the history, or reads of the old ring beside the update, made XLA copy every
    layer's conv state at each decode step. The taps are summed as in `causal_conv` (`weighted_taps`)."""
    K = ring.shape[1]
    ring = lax.dynamic_update_slice_in_dim(ring, x.astype(ring.dtype), slot % K, axis=1)
    taps = [lax.dynamic_index_in_dim(ring, (slot + 1 + k) % K, axis=1).astype(x.dtype) for k in range(K)]
    return weighted_taps(taps, weight, bias), ring


def ring_history(ring: Array, slot: Array | int) -> Array:
    """The K-1 inputs before `slot` (b, K-1, C), oldest first, from a ring of K (`MambaState.conv`)."""
    return jnp.roll(ring, -(slot % ring.shape[1]), axis=1)[:, 1:]  # slots slot-K (stale) .. slot-1, then the K-1


def history_ring(history: Array, slot: Array | int) -> Array:
    """`ring_history`'s inverse: the ring of K for the K-1 inputs (b, K-1, C) before `slot` (its stale entry zero)."""
    stale = jnp.zeros((history.shape[0], 1, history.shape[2]), history.dtype)
    timed = jnp.concatenate([stale, history], axis=1)  # slots slot-K .. slot-1
    return jnp.roll(timed, slot % timed.shape[1], axis=1)


def weighted_taps(taps: list[Array], weight: Array, bias: Array | None) -> Array:
    """sum_k taps[k] * weight[k] (+ bias) in float32, oldest tap first: the depthwise conv of K shifted inputs."""
    w = weight.astype(jnp.float32)
    out = sum(tap.astype(jnp.float32) * w[k] for k, tap in enumerate(taps))
    return out if bias is None else out + bias.astype(jnp.float32)


def causal_conv(x: Array, history: Array, weight: Array, bias: Array | None) -> tuple[Array, Array]:
    """Depthwise causal conv over time. x (b, T, C), history (b, K-1, C), weight (K, C). Returns (out, new history)."""
    K, T = weight.shape[0], x.shape[1]
    padded = jnp.concatenate([history.astype(x.dtype), x], axis=1)  # (b, K-1+T, C)
    return weighted_taps([padded[:, k : k + T] for k in range(K)], weight, bias), padded[:, T:]


class MambaMixer(nnx.Module):
    """Mamba-2 mixer: in_proj -> [z | xBC | dt]; causal conv + SiLU on xBC -> [x | B | C]; SSD; gated norm; out_proj."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg, self.dtype = cfg, dtype
        h, conv_dim = cfg.mamba_n_heads, cfg.mamba_conv_dim
        linear = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.in_proj = Linear(cfg.hidden_size, cfg.mamba_in_proj_dim, **linear)
        bound = 1 / math.sqrt(cfg.mamba_d_conv)
        self.conv_weight = nnx.Param(
            jax.random.uniform(rngs.params(), (cfg.mamba_d_conv, conv_dim), param_dtype, -bound, bound)
        )
        self.conv_bias = nnx.Param(jnp.zeros((conv_dim,), param_dtype)) if cfg.mamba_conv_bias else None
        self.dt_bias = nnx.Param(jnp.ones((h,), param_dtype))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, h + 1, dtype=jnp.float32)).astype(param_dtype))
        self.D = nnx.Param(jnp.ones((h,), param_dtype))
        self.norm = GatedRMSNorm(cfg.mamba_d_inner, param_dtype=param_dtype)
        self.out_proj = Linear(cfg.mamba_d_inner, cfg.hidden_size, **linear)

    def __call__(
        self, x: Array, token_mask: Array | None = None, state: MambaState | None = None, slot: Array | int = 0
    ) -> tuple[Array, MambaState]:
        """x (b, T, H) at slots [slot, slot + T), from `state` (None: from scratch) -> (out, new state)."""
        cfg, T = self.cfg, x.shape[1]
        masked = x if token_mask is None else x * token_mask[..., None].astype(x.dtype)
        zxbcdt = self.in_proj(masked)
        ring, ssm = (None, None) if state is None else (state.conv, state.ssm)
        middle = functools.partial(mixer_middle, cfg, self.dtype)
        args = (zxbcdt, token_mask, ring, slot, self.weights(), ssm)
        if state is not None and T == 1 and cfg.ssd_impl != "pallas":
            # One decoding step: on CPUs one kernel call (cpu_kernels.mamba_step), elsewhere `mixer_middle`.
            y, ring, ssm = cpu_kernels.mamba_step(*args, cfg.time_step_limit, cfg.rms_norm_eps, middle)
        else:
            y, ring, ssm = middle(*args)
        return self.out_proj(y), MambaState(ring, ssm)

    def weights(self) -> MambaWeights:
        bias = None if self.conv_bias is None else self.conv_bias[...]
        return MambaWeights(
            self.conv_weight[...], bias, self.dt_bias[...], self.A_log[...], self.D[...], self.norm.weight[...]
        )


class MambaWeights(NamedTuple):
    """The mixer's weights between its projections, in `cpu_kernels.mamba_step`'s order."""

    conv_weight: Array  # (K, conv_dim)
    conv_bias: Array | None  # (conv_dim,)
    dt_bias: Array  # (heads,)
    A_log: Array  # (heads,)
    D: Array  # (heads,)
    norm_weight: Array  # (d_inner,)


def mixer_middle(
    cfg: ModelConfig,
    dtype,
    zxbcdt: Array,
    token_mask: Array | None,
    ring: Array | None,
    slot: Array | int,
    weights: MambaWeights,
    ssm: Array | None,
) -> tuple[Array, Array, Array]:
    """The Mamba-2 mixer between its projections: in_proj's output zxbcdt (b, T, d_inner + conv_dim + heads) = [z | xBC
    | dt] at slots [slot, slot + T) after the conv inputs in `ring` and the SSD state `ssm` (both None: from scratch)
    -> (the gated, normed SSD output y (b, T, d_inner), the new ring, the new state). token_mask (b, T): the real
    tokens (None: all); the others' conv outputs are zeroed, so that padding never enters the state. `weights`
    (`MambaMixer.weights`) may be float32 or bfloat16; the arithmetic is float32 up to the SSD's inputs (`dtype`)."""
    b, T, _ = zxbcdt.shape
    h, p, g, n = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups, cfg.mamba_d_state
    z, xBC, dt = jnp.split(zxbcdt, [cfg.mamba_d_inner, cfg.mamba_d_inner + cfg.mamba_conv_dim], -1)
    xBC, ring = mamba_conv(xBC, ring, slot, weights.conv_weight, weights.conv_bias)
    xBC = jax.nn.silu(xBC) if token_mask is None else jax.nn.silu(xBC) * token_mask[..., None].astype(xBC.dtype)
    # The SSD's x, B, C in the model's dtype, as transformers' conv1d returns them: bfloat16 models give the Pallas
    # kernels bfloat16 tiles (float32 inputs cost them 3xTF32 products, 3.3x the time at h-tiny dims on an H200).
    xs, B, C = jnp.split(xBC.astype(dtype), [h * p, h * p + g * n], -1)

    lo, hi = cfg.time_step_limit
    dt = jnp.clip(jax.nn.softplus(dt.astype(jnp.float32) + weights.dt_bias.astype(jnp.float32)), lo, hi)
    A = -jnp.exp(weights.A_log.astype(jnp.float32))
    D = weights.D.astype(jnp.float32)
    xs, B, C = xs.reshape(b, T, h, p), B.reshape(b, T, g, n), C.reshape(b, T, g, n)
    if ssm is not None and T == 1:
        if cfg.ssd_impl == "pallas":
            from pallas_kernels import ssd_decode

            y, ssm = ssd_decode(ssm, xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
        else:
            y, ssm = ssd_step(ssm, xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
        y = y[:, None]
    else:
        y, ssm = ssd(xs, dt, A, B, C, D, chunk_size=cfg.mamba_chunk_size, initial_state=ssm, impl=cfg.ssd_impl)
    y = gated_rms_norm(y.reshape(b, T, h * p), z, weights.norm_weight, g, cfg.rms_norm_eps, dtype)
    return y, ring, ssm


def mamba_conv(
    xBC: Array, ring: Array | None, slot: Array | int, weight: Array, bias: Array | None
) -> tuple[Array, Array]:
    """The causal conv of xBC (b, T, conv_dim) at slots [slot, slot + T) after the inputs in `ring` (None: zeros),
    and the ring after them."""
    b, T, _ = xBC.shape
    if ring is None:
        ring = jnp.zeros((b, *weight.shape), xBC.dtype)
    if T == 1:
        return conv_step(xBC, ring, slot, weight, bias)
    out, history = causal_conv(xBC, ring_history(ring, slot), weight, bias)
    return out, history_ring(history, slot + T).astype(ring.dtype)


# ---------------------------------------------------------------------------------------------- attention


def rope(x: Array, positions: Array, theta: float) -> Array:
    """Neox-style rotary embedding (rotate_half). x (b, T, heads, d), positions (b, T)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (b, T, d/2)
    cos, sin = (jnp.concatenate([f(angles)] * 2, -1)[:, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], -1) * sin


class Attention(nnx.Module):
    """Grouped-query attention; the softmax scale is `attention_multiplier`; NoPE unless `rope_theta` is set."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        H, hd = cfg.hidden_size, cfg.head_dim
        linear = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = Linear(H, cfg.num_attention_heads * hd, **linear)
        self.k_proj = Linear(H, cfg.num_key_value_heads * hd, **linear)
        self.v_proj = Linear(H, cfg.num_key_value_heads * hd, **linear)
        self.o_proj = Linear(cfg.num_attention_heads * hd, H, **linear)

    def __call__(self, x: Array, pos: Positions, state: KVState | None = None) -> tuple[Array, KVState | None]:
        cfg = self.cfg
        b, T, _ = x.shape
        kv, rep, hd = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
        q = self.q_proj(x).reshape(b, T, kv, rep, hd)
        k = self.k_proj(x).reshape(b, T, kv, hd)
        v = self.v_proj(x).reshape(b, T, kv, hd)
        if cfg.rope_theta is not None:
            q = rope(q.reshape(b, T, kv * rep, hd), pos.positions, cfg.rope_theta).reshape(q.shape)
            k = rope(k, pos.positions, cfg.rope_theta)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (b, kv, T, hd)
        if state is None:
            out = attend(q, k, v, pos.attention_mask(pos.query_slots), cfg.attention_multiplier)
        else:
            start = (0, 0, pos.query_slots[0], 0)
            state = KVState(
                lax.dynamic_update_slice(state.k, k.astype(state.k.dtype), start),
                lax.dynamic_update_slice(state.v, v.astype(state.v.dtype), start),
            )
            out = attend_cache(q, state, pos, cfg.attention_multiplier)
        return self.o_proj(out.reshape(b, T, kv * rep * hd)), state


def attend(q: Array, k: Array, v: Array, mask: Array, scale: float) -> Array:
    """Softmax attention. q (b, T, kv, rep, hd), k and v (b, kv, S, hd), mask (b, T, S) -> (b, T, kv, rep, hd)."""
    scores = jnp.einsum("btkrd,bksd->bkrts", q, k).astype(jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkrts,bksd->btkrd", probs, v)


def attend_cache(q: Array, cache: KVState, pos: Positions, scale: float, block: int | None = None) -> Array:
    """`attend` over the filled cache slots [0, last query slot] only, `block` keys at a time (default:
    DECODE_KV_BLOCK for one query per row, KV_BLOCK for a prompt segment). One query per row (decoding) goes through
    `cpu_kernels.decode_attention`: on CPUs a kernel, elsewhere these blocks.

    The online softmax of flash attention (Dao et al. 2022, Alg. 1): a running max m, normalizer and output acc per
    query, rescaled by exp(m_old - m_new) as each block arrives. Time and memory grow with the filled slots, not with
    the preallocated cache. A last block that would run past the cache is shifted back and its already-seen slots
    masked, so any cache length works.
    """
    if q.shape[1] == 1:

        def one(q, k, v, pad, slot):
            return _attend_blocks(q, KVState(k, v), Positions(slot[None], pad), scale, block)

        return cpu_kernels.decode_attention(q, cache.k, cache.v, pos.pad, pos.query_slots[0], scale, one)
    return _attend_blocks(q, cache, pos, scale, block)


def _attend_blocks(q: Array, cache: KVState, pos: Positions, scale: float, block: int | None) -> Array:
    S = cache.k.shape[2]
    b, T, kv, rep, hd = q.shape
    block = min(block or (DECODE_KV_BLOCK if T == 1 else KV_BLOCK), S)

    def step(j, carry):
        m, norm, acc = carry
        first = j * block
        start = jnp.minimum(first, S - block)
        k, v = (lax.dynamic_slice_in_dim(t, start, block, axis=2).astype(q.dtype) for t in (cache.k, cache.v))
        slots = start + jnp.arange(block, dtype=jnp.int32)
        mask = pos.attention_mask(slots) & (slots >= first)[None, None, :]
        scores = jnp.einsum("btkrd,bksd->bkrts", q, k).astype(jnp.float32) * scale
        scores = jnp.where(mask[:, None, None], scores, _MASKED)
        m_new = jnp.maximum(m, scores.max(-1))
        p = jnp.exp(scores - m_new[..., None])
        rescale = jnp.exp(m - m_new)
        norm = norm * rescale + p.sum(-1)
        acc = acc * rescale[..., None] + jnp.einsum("bkrts,bksd->bkrtd", p.astype(v.dtype), v).astype(jnp.float32)
        return m_new, norm, acc

    m = jnp.full((b, kv, rep, T), _MASKED, jnp.float32)
    init = (m, jnp.zeros_like(m), jnp.zeros((b, kv, rep, T, hd), jnp.float32))
    n_blocks = pos.query_slots[-1] // block + 1
    _, norm, acc = lax.fori_loop(0, n_blocks, step, init)
    return (acc / norm[..., None]).astype(q.dtype).transpose(0, 3, 1, 2, 4)


# ---------------------------------------------------------------------------------------------- feed-forward


class SharedMLP(nnx.Module):
    """SwiGLU with fused [gate | up] input projection."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        linear = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_linear = Linear(cfg.hidden_size, 2 * cfg.shared_intermediate_size, **linear)
        self.output_linear = Linear(cfg.shared_intermediate_size, cfg.hidden_size, **linear)

    def __call__(self, x: Array) -> Array:
        gate, up = jnp.split(self.input_linear(x), 2, axis=-1)
        return self.output_linear(jax.nn.silu(gate) * up)


class MoE(nnx.Module):
    """Top-k routed experts: top-k over raw router logits, softmax over the k chosen, SwiGLU experts [gate | up]."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg, self.dtype = cfg, dtype
        E, H, F = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        init = nnx.initializers.normal(0.02)
        self.router = Linear(H, E, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_linear = nnx.Param(init(rngs.params(), (E, H, 2 * F), param_dtype))
        self.output_linear = nnx.Param(init(rngs.params(), (E, F, H), param_dtype))

    def __call__(self, x: Array) -> Array:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x).astype(jnp.float32)
        top_logits, experts = lax.top_k(logits, self.cfg.num_experts_per_tok)  # (N, k)
        gates = jax.nn.softmax(top_logits, axis=-1).astype(self.dtype)
        # Many rows (prefill) off the CPU: ragged_dot on the rows grouped by expert. Otherwise one row per (token,
        # chosen expert) through `cpu_kernels.expert_linear`: on CPUs a kernel reading each chosen expert once.
        ragged = jax.default_backend() != "cpu" and x.shape[0] * experts.shape[1] > cpu_kernels.GATHER_ROWS
        return (self._ragged if ragged else self._rows)(x, experts, gates).reshape(shape)

    def _swiglu(self, h: Array) -> Array:
        gate, up = jnp.split(h, 2, axis=-1)
        return jax.nn.silu(gate) * up

    def _rows(self, x: Array, experts: Array, gates: Array) -> Array:
        """One row per (token, chosen expert), each through its expert's weights by `cpu_kernels.expert_linear`."""
        N, k = experts.shape
        rows, flat = jnp.repeat(x.astype(self.dtype), k, axis=0), experts.reshape(-1)  # (N k, H), (N k,)
        w_in, w_out = self.input_linear[...], self.output_linear[...]  # cast after the gather, if at all
        h = self._swiglu(cpu_kernels.expert_linear(rows, w_in, flat))  # (N k, I)
        y = cpu_kernels.expert_linear(h, w_out, flat).reshape(N, k, -1)  # (N, k, H)
        return jnp.einsum("nkd,nk->nd", y, gates)

    def _ragged(self, x: Array, experts: Array, gates: Array) -> Array:
        """Sort the N*k (token, expert) rows by expert; `lax.ragged_dot` through each expert's group; scatter back.
        (XLA:CPU lowers ragged_dot to a dense product over every expert: CPUs take `_rows`.)"""
        N, k = experts.shape
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        tokens = order // k
        group_sizes = jnp.bincount(flat, length=self.cfg.num_local_experts).astype(jnp.int32)
        rows = x[tokens].astype(self.dtype)
        w_in, w_out = (cpu_kernels.cast_at_use(w[...], rows) for w in (self.input_linear, self.output_linear))
        h = self._swiglu(lax.ragged_dot(rows, w_in, group_sizes))
        y = lax.ragged_dot(h, w_out, group_sizes) * gates.reshape(-1)[order][:, None]
        return jnp.zeros_like(x).at[tokens].add(y.astype(x.dtype))


# ---------------------------------------------------------------------------------------------- decoder


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, kind: str, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.kind, self.residual_multiplier = kind, cfg.residual_multiplier
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.mamba = MambaMixer(cfg, **kw) if kind == MAMBA else None
        self.self_attn = Attention(cfg, **kw) if kind == ATTENTION else None
        self.block_sparse_moe = MoE(cfg, **kw) if cfg.num_local_experts else None
        self.shared_mlp = SharedMLP(cfg, **kw)

    def __call__(self, x: Array, pos: Positions, state):
        h = self.input_layernorm(x)
        if self.mamba is not None:
            h, state = self.mamba(h, pos.token_mask, state, pos.query_slots[0])
        else:
            h, state = self.self_attn(h, pos, state)
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        ffn = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            ffn = self.block_sparse_moe(h) + ffn
        return x + ffn * self.residual_multiplier, state


class Granite(nnx.Module):
    """GraniteMoeHybridForCausalLM. `model(tokens)` gives logits; `model.forward(...)` also threads a `Cache`."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg, self.dtype = cfg, dtype
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List(
            [DecoderLayer(cfg, kind, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for kind in cfg.layer_types]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        )
        self.packed_embedding: Packed | None = nnx.data(None)  # the tied output embedding, packed like `Linear.pack`

    def __call__(self, tokens: Array, *, pad: Array | None = None) -> Array:
        """Logits (b, T, vocab) of left-padded tokens (b, T); `pad[b]` counts row b's padding tokens.

        Concrete arguments are checked (ValueError); traced ids out of [0, vocab_size) make their row's logits NaN.
        """
        logits, _, _ = self.forward(tokens, pad=pad)
        return logits

    def forward(
        self,
        tokens: Array,
        *,
        pad: Array | None = None,
        cache: Cache | None = None,
        last_only: bool = False,
        return_hidden: bool = False,
    ) -> tuple[Array, Cache | None, tuple[Array, ...]]:
        """Run tokens (b, T) from the cache's state (or from scratch). Returns (logits, new cache, layer outputs).

        With a cache the tokens occupy slots [cache.index, cache.index + T) and `pad` is taken from the cache.
        `last_only` computes logits for the last position only (prefill); `return_hidden` collects every layer's output.
        Shapes and dtypes are checked, and so are the values of concrete (untraced) tokens and pad: ValueError. Traced
        token ids out of [0, vocab_size), negative ones included, make their row's logits NaN (see `embed`).
        """
        tokens = _checked_tokens(tokens, self.cfg.vocab_size)
        b, T = tokens.shape
        if cache is not None:
            _check_cache_batch(cache, b)
            _check_room(cache, T)
            pos = Positions(cache.index + jnp.arange(T, dtype=jnp.int32), cache.pad)
        else:
            pad = jnp.zeros((b,), jnp.int32) if pad is None else _checked_pad(pad, b, T)
            pos = Positions(jnp.arange(T, dtype=jnp.int32), pad)
        x = self.embed(tokens) * jnp.asarray(self.cfg.embedding_multiplier, self.dtype)
        hidden, states = [], []
        for i, layer in enumerate(self.layers):
            x, state = layer(x, pos, None if cache is None else cache.layers[i])
            states.append(state)
            if return_hidden:
                hidden.append(x)
        logits = self.head(x[:, -1:] if last_only else x)
        new_cache = None
        if cache is not None:
            new_cache = Cache(tuple(states), cache.pad, cache.index + T)
            if cache.max_len is not None:  # past the end, KV writes would be clamped onto the last slots: poison
                logits = jnp.where(new_cache.index <= cache.max_len, logits, jnp.nan)
        return logits, new_cache, tuple(hidden)

    def embed(self, tokens: Array) -> Array:
        """The embedding rows of tokens (b, T), in the activations' dtype: gathered, then cast (`nnx.Embed` casts the
        whole table first, a copy of it per call when the weights are kept in another dtype; see also
        `cpu_kernels.take_rows`). Ids out of [0, vocab_size) give rows of NaN."""
        return cpu_kernels.take_rows(self.embed_tokens.embedding[...], tokens).astype(self.dtype)

    def head(self, x: Array) -> Array:
        """Logits (..., vocab) of last-layer outputs (..., H): final norm, output projection, `logits_scaling`."""
        x = self.norm(x)
        if self.lm_head is None:
            # Tied: contract the (V, H) embedding over its contiguous axis, as `Linear` does. `x @ embedding.T`
            # (Embed.attend) made XLA:CPU copy the whole transposed embedding on every call, which costs more than the
            # product in decoding.
            embedding = self.embed_tokens.embedding[...]
            packed = None if self.packed_embedding is None else self.packed_embedding[...]
            logits = cpu_kernels.linear(x.astype(self.dtype), embedding, packed)
        else:
            logits = self.lm_head(x)
        return logits / self.cfg.logits_scaling


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _checked_tokens(tokens, vocab_size: int) -> Array:
    """tokens as an array, after checking they are (b, T) integers, non-empty, and (when concrete) valid ids."""
    tokens = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens)  # range-checked before any narrowing
    if tokens.ndim != 2 or not tokens.size:
        raise ValueError(f"tokens: expected a non-empty (batch, length) array, got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens: expected integer token ids, got dtype {tokens.dtype}")
    if _concrete(tokens):
        _check_range("tokens", tokens, 0, vocab_size, f"token ids in [0, vocab_size={vocab_size})")
    return jnp.asarray(tokens)


def _checked_pad(pad, b: int, T: int) -> Array:
    """pad as int32 (b,), after checking its shape, dtype and (when concrete) that 0 <= pad < T."""
    pad = pad if isinstance(pad, jax.Array) else np.asarray(pad)
    if pad.shape != (b,):
        raise ValueError(f"pad: expected shape ({b},), one count per row of tokens, got shape {pad.shape}")
    if not jnp.issubdtype(pad.dtype, jnp.integer):
        raise ValueError(f"pad: expected integer padding counts, got dtype {pad.dtype}")
    if _concrete(pad):
        _check_range("pad", pad, 0, T, f"0 <= pad < T={T} (each row needs a real token)")
    return jnp.asarray(pad, jnp.int32)


def _check_range(name: str, x: Array, low: int, high: int, expected: str) -> None:
    values = np.asarray(x)
    bad = np.argwhere((values < low) | (values >= high))
    if len(bad):
        where = tuple(int(i) for i in bad[0])
        raise ValueError(f"{name}[{', '.join(map(str, where))}] = {values[where]}: expected {expected}")


def _check_cache_batch(cache: Cache, b: int) -> None:
    if cache.pad.shape != (b,):
        raise ValueError(f"cache: holds {cache.pad.shape[0] if cache.pad.ndim else 0} rows, tokens have {b}")


def _check_room(cache: Cache, T: int) -> None:
    """Raise when T tokens from cache.index do not fit the KV cache (checked where the index is known)."""
    if cache.max_len is None:
        return
    if T > cache.max_len:
        raise ValueError(f"{T} tokens do not fit a KV cache of {cache.max_len} slots")
    if not isinstance(cache.index, jax.core.Tracer) and int(cache.index) + T > cache.max_len:
        raise ValueError(f"{T} tokens from slot {int(cache.index)} do not fit a KV cache of {cache.max_len} slots")


def abstract_model(cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32) -> Granite:
    """The model with shape-only parameters: nothing is allocated (for parameter counts and loading)."""
    return nnx.eval_shape(lambda: Granite(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))


def count_params(model: Granite) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def weight_dtype(model: Granite) -> str | list[str]:
    """The dtype name of the model's parameters, or their sorted names if they mix dtypes."""
    names = sorted({jnp.dtype(x.dtype).name for x in jax.tree.leaves(nnx.state(model, nnx.Param))})
    return names[0] if len(names) == 1 else names


def pack_for_decoding(model: Granite) -> int:
    """Give every `Linear` of a `packable` model, and a tied output embedding, a copy of its weight in the layout that
    decode steps stream on CPUs (`cpu_kernels.pack`); returns the bytes added (0: other dtypes, nothing packed).

    The copies double the memory those weights take and are not updated with them: pack again after changing them.
    """
    if not packable(model):
        return 0
    for linear in _linears(model):
        linear.pack()
    if model.lm_head is None:
        model.packed_embedding = Packed(cpu_kernels.pack(model.embed_tokens.embedding[...]))
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, Packed)))


def packing_bytes(model: Granite) -> int:
    """About what `pack_for_decoding` would add (before padding to whole panels)."""
    return sum(w.dtype.itemsize * math.prod(w.shape) for w in _packed_weights(model))


def packable(model: Granite) -> bool:
    """Whether the panel kernel takes this model's products: activations and the weights it would pack float32 or
    bfloat16."""
    dtypes = {jnp.dtype(model.dtype), *(w.dtype for w in _packed_weights(model))}
    return dtypes <= set(cpu_kernels.KERNEL_DTYPES)


def _packed_weights(model: Granite) -> list[nnx.Param]:
    """The weights `pack_for_decoding` copies: every `Linear`'s, and a tied output embedding."""
    weights = [linear.weight for linear in _linears(model)]
    return weights + ([model.embed_tokens.embedding] if model.lm_head is None else [])


def _linears(model: Granite) -> list[Linear]:
    return [module for _, module in nnx.iter_graph(model) if isinstance(module, Linear)]


def with_ssd_impl(model: Granite, impl: str) -> Granite:
    """The same weights (shared, not copied) running another SSD implementation ("xla", "naive" or "pallas")."""
    return _sharing_weights(model, model.cfg.replace(ssd_impl=impl), model.dtype)


def with_dtype(model: Granite, dtype: DTypeLike) -> Granite:
    """The same weights (shared, not copied, in the dtype they are stored in) computing in `dtype`."""
    return _sharing_weights(model, model.cfg, dtype)


def _sharing_weights(model: Granite, cfg: ModelConfig, dtype: DTypeLike) -> Granite:
    """A model of `cfg` computing in `dtype` on `model`'s parameters. Packed decode copies (`pack_for_decoding`) are
    not carried over: pack the new model again if it decodes on CPUs."""
    other = abstract_model(cfg, dtype=dtype)
    nnx.update(other, nnx.state(model, nnx.Param))  # the weights as they are, dtype included
    return other
