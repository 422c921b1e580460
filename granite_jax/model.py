"""Granite 4.0 (GraniteMoeHybrid) in Flax NNX: hybrid Mamba-2 / attention decoder with MoE and a shared MLP.

A port of transformers' `GraniteMoeHybridForCausalLM` (`models/granitemoehybrid/modeling_granitemoehybrid.py`),
readable top to bottom: products and norms, the Mamba-2 mixer, attention, the MoE and the shared MLP, the decoder
layer, the model. Attribute names mirror the Hugging Face checkpoint so that the importer is a plain table.

Batches are left-padded: `pad[b]` is the number of padding tokens before row b's prompt. Padding never reaches a real
token: attention masks it out and the Mamba mixer zeroes it before and after the causal conv, so its state stays
exactly that of the prompt run alone. The decode cache is a pytree (`Cache`) passed in and returned, never stored in
the module, so one jitted step can donate it.

Everything here is plain JAX. The functions marked `@ops.replaceable` are where a platform's kernels may take over
(`granite_jax.ops`); which do is the model's `Runtime`, entered by `Granite.forward`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.typing import DTypeLike

from granite_jax import ops
from granite_jax.config import ATTENTION, MAMBA, ModelConfig
from granite_jax.ops import Runtime
from granite_jax.ssd import ssd, ssd_step

Array = jax.Array
_MASKED = -1e30  # finite, so fully masked (padding) rows give a harmless uniform softmax instead of NaN
# Cache slots per step of `attend_cache`: a one-token decode step visits up to a block of unfilled slots.
KV_BLOCK, DECODE_KV_BLOCK = 512, 256
GATHER_ROWS = 64  # up to this many rows `expert_linear` gathers the chosen experts' matrices; beyond, it groups rows
# Float8 weights: the matrices of the projections, the shared MLP and the experts in float8 (e4m3) with one float32
# scale per output channel, as the released FP8 checkpoints store them (compressed-tensors "float-quantized",
# strategy "channel"); the embedding, the router, the norms and the Mamba mixer's vectors stay in bfloat16.
FLOAT8 = jnp.dtype(jnp.float8_e4m3fn)
FLOAT8_MAX = float(jnp.finfo(FLOAT8).max)  # 448


# ---------------------------------------------------------------------------------------------- cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MambaState:
    conv: Array  # (b, K, conv channels): the last pre-activation conv inputs, in the activation dtype, as a ring: the
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
    def init(
        cls,
        cfg: ModelConfig,
        batch: int,
        max_len: int,
        dtype=jnp.float32,
        pad: Array | None = None,
        row_blocks: int = 1,
    ) -> Cache:
        """A zeroed cache. row_blocks: the model's (`Granite.row_blocks`), which sets the conv ring's width."""
        layers = []
        for kind in cfg.layer_types:
            if kind == MAMBA:
                conv = jnp.zeros((batch, cfg.mamba_d_conv, mamba_conv_channels(cfg, row_blocks)), dtype)
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


# ---------------------------------------------------------------------------------------------- products, norms


def is_float8(dtype: DTypeLike) -> bool:
    return jnp.dtype(dtype) == FLOAT8


def dense_dtype(param_dtype: DTypeLike) -> DTypeLike:
    """The dtype of the parameters that are not quantized matrices: bfloat16 beside float8 weights."""
    return jnp.bfloat16 if is_float8(param_dtype) else param_dtype


def quantize(w: Array, axis: int) -> tuple[Array, Array]:
    """Symmetric float8 quantization with one scale per slice along every axis but `axis` (the input channels):
    (q, scale) with w ~ q * scale, scale = max |w| / 448 in float32 (1 for an all-zero channel)."""
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / FLOAT8_MAX, 1.0)
    return (w / scale).astype(FLOAT8), jnp.squeeze(scale, axis)


@ops.replaceable
def linear(x: Array, w: Array) -> Array:
    """x (..., K) @ w (N, K)^T in x's dtype, w cast to it where it is used."""
    return lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())))


@ops.replaceable
def scaled_linear(x: Array, w: Array, scale: Array) -> Array:
    """x (..., K) @ (scale[:, None] * w)^T for a float8 w (N, K) with one scale per output channel: w widened to x's
    dtype, the products accumulated in float32, each output channel then scaled (exact: its scale is a common
    factor of its dot product)."""
    y = lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * scale).astype(x.dtype)


class Linear(nnx.Module):
    """y = x W^T, bias-free, with W stored (out, in) as in the checkpoint: the product contracts W's contiguous axis,
    the one a decode step's matrix-vector product streams. Under float8 weights W is kept quantized with its
    per-output-channel `weight_scale`. A fresh W is normal with standard deviation `std` (transformers'
    `_init_weights`: the config's `initializer_range`)."""

    def __init__(
        self, d_in: int, d_out: int, *, std: float, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        init = nnx.initializers.normal(std)
        w, scale = init(rngs.params(), (d_out, d_in), jnp.float32 if is_float8(param_dtype) else param_dtype), None
        if is_float8(param_dtype):
            w, scale = quantize(w, axis=1)
        self.weight = nnx.Param(w)
        self.weight_scale = None if scale is None else nnx.Param(scale)
        self.dtype = dtype

    def __call__(self, x: Array) -> Array:
        if self.weight_scale is None:
            return linear(x.astype(self.dtype), self.weight[...])
        return scaled_linear(x.astype(self.dtype), self.weight[...], self.weight_scale[...])


def widened(x: Array) -> Array:
    """x in float32, or in float64 if it is: norms, softmaxes, the conv and the SSD run in at least float32, and a
    float64 model (gradient checks against finite differences) stays float64 throughout."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


@ops.replaceable
def embedding_rows(table: Array, ids: Array) -> Array:
    """table[ids] in float32 (`widened`) for a (V, H) table: (..., H), rows of NaN for ids outside [0, V)."""
    ids = ids.astype(jnp.int32)
    ids = jnp.where(ids < 0, table.shape[0], ids)  # past the end: `take` would wrap negative ids around (-1: last row)
    return widened(jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan))


def rms_normalize(x: Array, eps: float) -> Array:
    x = widened(x)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


@ops.replaceable
def rms_norm(x: Array, weight: Array, eps: float, groups: int = 1, dtype=None) -> Array:
    """weight * x / rms(x), one RMS statistic per group of x's last axis split into `groups`, in `dtype` (x's)."""
    dtype = dtype or x.dtype
    normed = rms_normalize(x.reshape(*x.shape[:-1], groups, -1), eps).reshape(x.shape)
    return (weight * normed.astype(dtype)).astype(dtype)


@ops.replaceable
def residual_rms_norm(x: Array, update: Array, multiplier: float, weight: Array, eps: float) -> tuple[Array, Array]:
    """The residual stream after its update, x + update * multiplier, and that stream's `rms_norm`."""
    x = x + update * multiplier
    return x, rms_norm(x, weight, eps)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        return rms_norm(x, self.weight[...], self.eps)

    def after_residual(self, x: Array, update: Array, multiplier: float) -> tuple[Array, Array]:
        """(x + update * multiplier, its norm): the residual add and the norm that follows it (`residual_rms_norm`)."""
        return residual_rms_norm(x, update, multiplier, self.weight[...], self.eps)


class GatedRMSNorm(nnx.Module):
    """The weight of the Mamba mixer's gated norm (applied by `gated_rms_norm`)."""

    def __init__(self, dim: int, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))


def gated_rms_norm(y: Array, z: Array, weight: Array, groups: int, eps: float, dtype) -> Array:
    """weight * norm(y * silu(z)), one RMS statistic per group of d_inner / groups channels (gate before the norm)."""
    return rms_norm(widened(y) * jax.nn.silu(widened(z)), weight, eps, groups, dtype)


# ---------------------------------------------------------------------------------------------- Mamba-2 mixer


def conv_step(x: Array, ring: Array, slot: Array | int, weight: Array, bias: Array | None) -> tuple[Array, Array]:
    """`causal_conv` of one token x (b, 1, C) at `slot` on a ring of inputs (`MambaState.conv`): (out, new ring).

    x is written over the oldest entry first, in place, and the conv reads the updated ring, as attention reads the
    updated KV cache: a shifted copy of the history, or reads of the old ring beside the update, would make XLA copy
    every layer's conv state at each decode step. The taps are summed as in `causal_conv` (`weighted_taps`)."""
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
    w = widened(weight)
    out = sum(widened(tap) * w[k] for k, tap in enumerate(taps))
    return out if bias is None else out + widened(bias)


def causal_conv(x: Array, history: Array, weight: Array, bias: Array | None) -> tuple[Array, Array]:
    """Depthwise causal conv over time. x (b, T, C), history (b, K-1, C), weight (K, C). Returns (out, new history)."""
    K, T = weight.shape[0], x.shape[1]
    padded = jnp.concatenate([history.astype(x.dtype), x], axis=1)  # (b, K-1+T, C)
    return weighted_taps([padded[:, k : k + T] for k in range(K)], weight, bias), padded[:, T:]


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


def mamba_conv_channels(cfg: ModelConfig, blocks: int = 1) -> int:
    """The conv's channels [x | B | C] over `blocks` blocks: x's d_inner once, B's and C's groups once per block
    where blocks outnumber groups (`MambaMixer`)."""
    return cfg.mamba_d_inner + 2 * max(cfg.mamba_n_groups, blocks) * cfg.mamba_d_state


class MambaMixer(nnx.Module):
    """Mamba-2 mixer (Dao & Gu 2024, §7): in_proj -> [z | xBC | dt]; causal conv + SiLU on xBC -> [x | B | C]; the
    SSD of (x, dt, A, B, C, D); the gated norm of its output by z; out_proj.

    `blocks` splits in_proj's rows (and the conv's channels) into that many blocks by heads, each
    [z | x B C | dt] for its heads with the B and C groups they read, so that a mesh's model axis splits them on
    block boundaries and every device runs its heads from its own rows (`granite_jax.sharding`; vLLM's
    tensor-parallel Mamba-2 lays its rows out the same way). One block is transformers' order."""

    def __init__(
        self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, blocks: int = 1, rngs: nnx.Rngs
    ):
        self.cfg, self.dtype, self.blocks = cfg, dtype, blocks
        h, conv_dim = cfg.mamba_n_heads, mamba_conv_channels(cfg, blocks)
        linear_kw = dict(std=cfg.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.in_proj = Linear(cfg.hidden_size, cfg.mamba_d_inner + conv_dim + h, **linear_kw)
        param_dtype = dense_dtype(param_dtype)  # the vectors below
        conv_init = nnx.initializers.normal(cfg.initializer_range)
        self.conv_weight = nnx.Param(conv_init(rngs.params(), (cfg.mamba_d_conv, conv_dim), param_dtype))
        self.conv_bias = nnx.Param(jnp.zeros((conv_dim,), param_dtype)) if cfg.mamba_conv_bias else None
        self.dt_bias = nnx.Param(jnp.ones((h,), param_dtype))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, h + 1, dtype=jnp.float32)).astype(param_dtype))
        self.D = nnx.Param(jnp.ones((h,), param_dtype))
        self.norm = GatedRMSNorm(cfg.mamba_d_inner, param_dtype=param_dtype)
        self.out_proj = Linear(cfg.mamba_d_inner, cfg.hidden_size, **linear_kw)

    def __call__(
        self, x: Array, token_mask: Array | None = None, state: MambaState | None = None, slot: Array | int = 0
    ) -> tuple[Array, MambaState]:
        """x (b, T, H) at slots [slot, slot + T), from `state` (None: from scratch) -> (out, new state).
        token_mask (b, T): the real tokens (None: all); the others never enter the state."""
        masked = x if token_mask is None else x * token_mask[..., None].astype(x.dtype)
        y, state = self.mix(self.in_proj(masked), token_mask, state, slot)
        return self.out_proj(y), state

    @ops.replaceable
    def mix(
        self, zxbcdt: Array, token_mask: Array | None, state: MambaState | None, slot: Array | int
    ) -> tuple[Array, MambaState]:
        """Between the projections: in_proj's output [z | xBC | dt] (b, T, d_inner + conv_dim + heads) -> the gated,
        normed SSD output (b, T, d_inner) and the state after it. Arithmetic in float32 up to the SSD's inputs, which
        are in the model's dtype, as transformers' conv1d returns them."""
        cfg, (b, T, _), s = self.cfg, zxbcdt.shape, self.blocks
        h, p, g, n = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups, cfg.mamba_d_state
        hp, gn = h * p // s, max(g // s, 1) * n  # a block's x (and z) channels, and its B (and C) channels
        z, xBC, dt = jnp.split(zxbcdt.reshape(b, T, s, -1), [hp, 2 * hp + 2 * gn], -1)

        bias = None if self.conv_bias is None else self.conv_bias[...]
        xBC = xBC.reshape(b, T, -1)
        xBC, ring = mamba_conv(xBC, None if state is None else state.conv, slot, self.conv_weight[...], bias)
        xBC = jax.nn.silu(xBC)
        if token_mask is not None:  # padding's conv outputs are zeroed: they never enter the state
            xBC = xBC * token_mask[..., None].astype(xBC.dtype)
        xs, B, C = jnp.split(xBC.astype(self.dtype).reshape(b, T, s, -1), [hp, hp + gn], -1)
        # Over blocks, B and C hold each block's groups: the SSD's heads read group h // (heads / groups) of them,
        # which is the group their block carries.
        xs, B, C = xs.reshape(b, T, h, p), B.reshape(b, T, -1, n), C.reshape(b, T, -1, n)
        z, dt = z.reshape(b, T, h * p), dt.reshape(b, T, h)

        lo, hi = cfg.time_step_limit
        dt = jnp.clip(jax.nn.softplus(widened(dt) + widened(self.dt_bias[...])), lo, hi)
        A = -jnp.exp(widened(self.A_log[...]))
        D = widened(self.D[...])
        if state is not None and T == 1:
            y, ssm = ssd_step(state.ssm, xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
            y = y[:, None]
        else:
            initial = None if state is None else state.ssm
            y, ssm = ssd(xs, dt, A, B, C, D, chunk_size=cfg.mamba_chunk_size, initial_state=initial)

        y = gated_rms_norm(y.reshape(b, T, h * p), z, self.norm.weight[...], g, cfg.rms_norm_eps, self.dtype)
        return y, MambaState(ring, ssm)


# ---------------------------------------------------------------------------------------------- attention


def rope(x: Array, positions: Array, theta: float) -> Array:
    """Neox-style rotary embedding (rotate_half). x (b, T, heads, d), positions (b, T)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.promote_types(x.dtype, jnp.float32)) / d)
    angles = positions.astype(inv_freq.dtype)[..., None] * inv_freq  # (b, T, d/2)
    cos, sin = (jnp.concatenate([f(angles)] * 2, -1)[:, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], -1) * sin


class Attention(nnx.Module):
    """Grouped-query attention; the softmax scale is `attention_multiplier`; NoPE unless `rope_theta` is set."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        H, hd = cfg.hidden_size, cfg.head_dim
        linear_kw = dict(std=cfg.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = Linear(H, cfg.num_attention_heads * hd, **linear_kw)
        self.k_proj = Linear(H, cfg.num_key_value_heads * hd, **linear_kw)
        self.v_proj = Linear(H, cfg.num_key_value_heads * hd, **linear_kw)
        self.o_proj = Linear(cfg.num_attention_heads * hd, H, **linear_kw)

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
            out, state = cache_and_attend(q, k, v, state, pos, cfg.attention_multiplier)
        return self.o_proj(out.reshape(b, T, kv * rep * hd)), state


def attend(q: Array, k: Array, v: Array, mask: Array, scale: float) -> Array:
    """Softmax attention. q (b, T, kv, rep, hd), k and v (b, kv, S, hd), mask (b, T, S) -> (b, T, kv, rep, hd)."""
    scores = widened(jnp.einsum("btkrd,bksd->bkrts", q, k)) * scale
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkrts,bksd->btkrd", probs, v)


@ops.replaceable
def cache_and_attend(
    q: Array, k: Array, v: Array, cache: KVState, pos: Positions, scale: float
) -> tuple[Array, KVState]:
    """This segment's keys and values (b, kv, T, hd) written into the cache at its slots, then `attend_cache` over it:
    (the attention output, the cache)."""
    start = (0, 0, pos.query_slots[0], 0)
    cache = KVState(
        lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), start),
        lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), start),
    )
    return attend_cache(q, cache, pos, scale), cache


@ops.replaceable
def attend_cache(q: Array, cache: KVState, pos: Positions, scale: float, block: int | None = None) -> Array:
    """`attend` over the filled cache slots [0, last query slot] only, `block` keys at a time (default:
    DECODE_KV_BLOCK for one query per row, KV_BLOCK for a prompt segment).

    The online softmax of flash attention (Dao et al. 2022, Alg. 1): a running max m, normalizer and output acc per
    query, rescaled by exp(m_old - m_new) as each block arrives. Time and memory grow with the filled slots, not with
    the preallocated cache. A last block that would run past the cache is shifted back and its already-seen slots
    masked, so any cache length works.
    """
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


def swiglu(h: Array, blocks: int = 1) -> Array:
    """silu(gate) * up of a fused [gate | up] projection, its columns in `blocks` blocks [gate_i | up_i] (one block
    a device of a mesh's model axis, so each device's gates meet their ups: `granite_jax.sharding`)."""
    gate, up = jnp.split(h.reshape(*h.shape[:-1], blocks, 2, -1), 2, axis=-2)
    return (jax.nn.silu(gate) * up).reshape(*h.shape[:-1], -1)


class SharedMLP(nnx.Module):
    """SwiGLU with fused [gate | up] input projection (its rows in `blocks` blocks: `swiglu`)."""

    def __init__(
        self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, blocks: int = 1, rngs: nnx.Rngs
    ):
        linear_kw = dict(std=cfg.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.blocks = blocks
        self.input_linear = Linear(cfg.hidden_size, 2 * cfg.shared_intermediate_size, **linear_kw)
        self.output_linear = Linear(cfg.shared_intermediate_size, cfg.hidden_size, **linear_kw)

    def __call__(self, x: Array) -> Array:
        return self.output_linear(swiglu(self.input_linear(x), self.blocks))


@ops.replaceable
def expert_linear(x: Array, w: Array, experts: Array) -> Array:
    """Each row through its expert's matrix: y[r] = x[r] @ w[experts[r]], x (R, K), w (E, K, N), experts (R,) -> (R, N)
    in x's dtype. Few rows (decoding) gather the chosen experts' matrices; many are grouped by expert for one
    `lax.ragged_dot` (a grouped product), reading each expert's matrix once."""
    if x.shape[0] <= GATHER_ROWS:
        return jnp.einsum("rk,rkn->rn", x, w[experts].astype(x.dtype))  # only the chosen experts are cast
    order = jnp.argsort(experts, stable=True)
    group_sizes = jnp.bincount(experts, length=w.shape[0]).astype(jnp.int32)
    y = lax.ragged_dot(x[order], w.astype(x.dtype), group_sizes)
    return jnp.zeros_like(y).at[order].set(y, unique_indices=True)


class MoE(nnx.Module):
    """Top-k routed experts: top-k over raw router logits, softmax over the k chosen, SwiGLU experts [gate | up]
    (their columns in `blocks` blocks: `swiglu`)."""

    def __init__(
        self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, blocks: int = 1, rngs: nnx.Rngs
    ):
        self.cfg, self.dtype, self.blocks = cfg, dtype, blocks
        E, H, F = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        std = cfg.initializer_range
        self.router = Linear(H, E, std=std, dtype=dtype, param_dtype=dense_dtype(param_dtype), rngs=rngs)
        self.input_linear, self.input_linear_scale = _experts(rngs, (E, H, 2 * F), std, param_dtype)
        self.output_linear, self.output_linear_scale = _experts(rngs, (E, F, H), std, param_dtype)

    def __call__(self, x: Array) -> Array:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_logits, experts = route(x.astype(self.router.dtype), self.router.weight[...], self.cfg.num_experts_per_tok)
        gates = jax.nn.softmax(top_logits, axis=-1).astype(self.dtype)
        scales = [None if s is None else s[...] for s in (self.input_linear_scale, self.output_linear_scale)]
        w_in, w_out = self.input_linear[...], self.output_linear[...]
        y = experts_swiglu(x.astype(self.dtype), experts, w_in, w_out, *scales, blocks=self.blocks)  # (N, k, H)
        return jnp.einsum("nkd,nk->nd", y, gates).reshape(shape)


@ops.replaceable
def route(x: Array, w: Array, k: int) -> tuple[Array, Array]:
    """The router's logits of rows x (N, H), x @ w (E, H)^T widened, through `top_experts`: (N, k) each."""
    return top_experts(widened(linear(x, w)), k)


@ops.replaceable
def top_experts(logits: Array, k: int) -> tuple[Array, Array]:
    """The k largest router logits of each row (N, E) and their experts, (N, k) each."""
    return lax.top_k(logits, k)


@ops.replaceable
def experts_swiglu(
    x: Array,
    experts: Array,
    w_in: Array,
    w_out: Array,
    in_scale: Array | None,
    out_scale: Array | None,
    *,
    blocks: int = 1,
) -> Array:
    """Each token x (N, H) through the SwiGLU of each of its experts (N, k) -> (N, k, H): w_in (E, H, 2F) [gate | up]
    in `blocks` blocks (`swiglu`), w_out (E, F, H), float8 weights' scales (E, out) or None."""
    (N, k), chosen = experts.shape, experts.reshape(-1)
    rows = jnp.repeat(x, k, axis=0)  # one per (token, expert)
    h = swiglu(_scaled(expert_linear(rows, w_in, chosen), in_scale, chosen), blocks)
    return _scaled(expert_linear(h, w_out, chosen), out_scale, chosen).reshape(N, k, -1)


def _experts(
    rngs: nnx.Rngs, shape: tuple[int, int, int], std: float, param_dtype
) -> tuple[nnx.Param, nnx.Param | None]:
    """The experts' matrices (E, in, out), normal with standard deviation `std`, and under float8 weights their
    scales (E, out), one per output channel."""
    w = nnx.initializers.normal(std)(rngs.params(), shape, jnp.float32 if is_float8(param_dtype) else param_dtype)
    if not is_float8(param_dtype):
        return nnx.Param(w), None
    w, scale = quantize(w, axis=1)
    return nnx.Param(w), nnx.Param(scale)


def _scaled(y: Array, scale: Array | None, experts: Array) -> Array:
    """Rows y (R, out) of float8 experts' products times their experts' output scales (scale (E, out))."""
    return y if scale is None else (y.astype(jnp.float32) * scale[experts]).astype(y.dtype)


# ---------------------------------------------------------------------------------------------- decoder


class DecoderLayer(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        kind: str,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        row_blocks: int = 1,
        rngs: nnx.Rngs,
    ):
        self.kind, self.residual_multiplier = kind, cfg.residual_multiplier
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm_kw = dict(param_dtype=dense_dtype(param_dtype))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm_kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm_kw)
        self.mamba = MambaMixer(cfg, **kw, blocks=row_blocks) if kind == MAMBA else None
        self.self_attn = Attention(cfg, **kw) if kind == ATTENTION else None
        self.block_sparse_moe = MoE(cfg, **kw, blocks=row_blocks) if cfg.num_local_experts else None
        self.shared_mlp = SharedMLP(cfg, **kw, blocks=row_blocks)

    def __call__(self, x: Array, pos: Positions, state):
        h = self.input_layernorm(x)
        if self.mamba is not None:
            h, state = self.mamba(h, pos.token_mask, state, pos.query_slots[0])
        else:
            h, state = self.self_attn(h, pos, state)
        x, h = self.post_attention_layernorm.after_residual(x, h, self.residual_multiplier)
        ffn = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            ffn = self.block_sparse_moe(h) + ffn
        return x + ffn * self.residual_multiplier, state


def normal_zero_row(std: float, row: int | None):
    """An embedding initializer: normal with standard deviation `std`, row `row` (the padding token's) zero, as
    transformers' `_init_weights` leaves `nn.Embedding`'s `padding_idx` row."""

    def init(key: Array, shape: tuple[int, ...], dtype=jnp.float32) -> Array:
        w = nnx.initializers.normal(std)(key, shape, dtype)
        return w if row is None else w.at[row].set(0)

    return init


class Granite(nnx.Module):
    """GraniteMoeHybridForCausalLM. `model(tokens)` gives logits; `model.forward(...)` also threads a `Cache`.

    `runtime` (`ops.Runtime`, default `Runtime()`) chooses the SSD implementation and the platform kernels; it is not
    a weight, and `with_runtime` swaps it without touching them. `row_blocks`: the blocks the Mamba mixers'
    and SwiGLUs' fused projections lay their rows out in (`MambaMixer`, `swiglu`; a mesh's model axis size, set by
    `granite_jax.sharding`; 1 is transformers' order)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        runtime: Runtime | None = None,
        row_blocks: int = 1,
        rngs: nnx.Rngs,
    ):
        self.cfg, self.dtype, self.runtime, self.row_blocks = cfg, dtype, runtime or Runtime(), row_blocks
        dense = dense_dtype(param_dtype)  # the embedding is the tied head: float8 weights keep it in bfloat16
        std = cfg.initializer_range
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dtype,
            param_dtype=dense,
            embedding_init=normal_zero_row(std, cfg.pad_token_id),
            rngs=rngs,
        )
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, kind, dtype=dtype, param_dtype=param_dtype, row_blocks=row_blocks, rngs=rngs)
                for kind in cfg.layer_types
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=dense)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, std=std, dtype=dtype, param_dtype=dense, rngs=rngs)
        )

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
        with ops.using(self.runtime):
            x = self.embed(tokens) * jnp.asarray(self.cfg.embedding_multiplier, self.dtype)
            hidden, states = [], []
            for i, layer in enumerate(self.layers):
                x, state = run_layer(layer, x, pos, None if cache is None else cache.layers[i], self.runtime.remat)
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
        whole table first, a copy of it per call when the weights are kept in another dtype). Ids out of
        [0, vocab_size) give rows of NaN."""
        return embedding_rows(self.embed_tokens.embedding[...], tokens).astype(self.dtype)

    def head(self, x: Array) -> Array:
        """Logits (..., vocab) of last-layer outputs (..., H): final norm, output projection, `logits_scaling`."""
        x = self.norm(x)
        if self.lm_head is None:  # tied: the (V, H) embedding is the head's (out, in) weight, contracted in place
            logits = linear(x.astype(self.dtype), self.embed_tokens.embedding[...])
        else:
            logits = self.lm_head(x)
        return logits / self.cfg.logits_scaling


def run_layer(layer: DecoderLayer, x: Array, pos: Positions, state, remat: bool):
    """layer(x, pos, state); under `remat` its activations are recomputed in the backward pass (`jax.checkpoint`)."""
    if not remat:
        return layer(x, pos, state)
    return nnx.remat(lambda layer, x: layer(x, pos, state))(layer, x)


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


def abstract_model(
    cfg: ModelConfig,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    runtime: Runtime | None = None,
    row_blocks: int = 1,
) -> Granite:
    """The model with shape-only parameters: nothing is allocated (for parameter counts and loading)."""
    kw = dict(dtype=dtype, param_dtype=param_dtype, runtime=runtime, row_blocks=row_blocks)
    with _tracer_errors_without_origins():
        return nnx.eval_shape(lambda: Granite(cfg, **kw, rngs=nnx.Rngs(0)))


@contextlib.contextmanager
def _tracer_errors_without_origins():
    """Tracing with a tracer's attribute errors left without their note on where the tracer came from. flax NNX probes
    `getattr(value, "sharding", None)` on every Variable assignment (each random key drawn); before jax-ml/jax#40041
    that message walked every equation traced so far, so a large model's abstract construction was quadratic
    (h-small's: ~4x slower). The note only ever served an error message."""
    try:
        from jax._src.interpreters.partial_eval import DynamicJaxprTracer
    except ImportError:
        yield
        return
    original = DynamicJaxprTracer.__dict__.get("_origin_msg")
    if original is None:
        yield
        return
    DynamicJaxprTracer._origin_msg = lambda self: ""
    try:
        yield
    finally:
        DynamicJaxprTracer._origin_msg = original


def count_params(model: Granite) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def weight_dtype(model: Granite) -> str | list[str]:
    """The dtype name of the model's parameters ("float8" for float8 matrices beside bfloat16 and their float32
    scales), or their sorted names if they mix dtypes otherwise."""
    names = sorted({jnp.dtype(x.dtype).name for x in jax.tree.leaves(nnx.state(model, nnx.Param))})
    if FLOAT8.name in names:
        return "float8"
    return names[0] if len(names) == 1 else names


def with_runtime(model: Granite, runtime: Runtime) -> Granite:
    """The same weights (shared, not copied) run with another `Runtime`."""
    graphdef, state = nnx.split(model)
    other = nnx.merge(graphdef, state)
    other.runtime = runtime
    return other


def with_float8_weights(model: Granite) -> Granite:
    """The model with its matrices quantized to float8, one scale per output channel (`quantize`), and its other
    parameters in bfloat16."""
    other = abstract_model(
        model.cfg, dtype=model.dtype, param_dtype=FLOAT8, runtime=model.runtime, row_blocks=model.row_blocks
    )
    source = {path: v[...] for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    state = nnx.state(other, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    for path, v in flat.items():
        if is_float8(v.dtype):
            q, scale = quantize(source[path], axis=1)
            flat[path].set_value(q)
            flat[(*path[:-1], path[-1] + "_scale")].set_value(scale)
        elif path in source:
            v.set_value(source[path].astype(v.dtype))
    nnx.update(other, nnx.from_flat_state(flat))
    return other


def with_dtype(model: Granite, dtype: DTypeLike) -> Granite:
    """The same weights (shared, not copied, in the dtype they are stored in) computing in `dtype`."""
    other = abstract_model(model.cfg, dtype=dtype, runtime=model.runtime, row_blocks=model.row_blocks)
    nnx.update(other, nnx.state(model, nnx.Param))  # the weights as they are, dtype included
    return other
