"""Device memory of a Granite 4.0 model serving `sessions` sequences of up to `context` tokens, predicted part by part
without allocating anything.

Weights, the KV cache and the Mamba states are exact: they are the byte sizes of the arrays the model and its `Cache`
are made of (shape-only, through `jax.eval_shape`), so they follow the model's own layout and dtypes (float8 weights
carry their scales). A hybrid's KV cache grows with the context in its attention layers only; each Mamba layer keeps a
conv ring (K inputs of the conv width) and an SSM state (h, p, n) in float32 per sequence, whatever the context.

The activations are an estimate of the largest set of buffers alive at once while a prefill segment runs (the
generator prefills every session's segment in one call): the residual stream and the logits of the last position,
plus the largest layer's working set, counted from the shapes of `granite_jax.model`'s computation:
- Mamba: the in_proj output, the conv output and the gated output in float32, and the chunked SSD's per-chunk
  (l, l) decay and score matrices per head and its chunk states (`granite_jax.ssd.ssd_chunked`);
- attention: q, k, v, and a block of KV_BLOCK keys' float32 scores, their exponentials and probabilities
  (`attend_cache`'s online softmax), with its running output;
- the feed-forward: the k routed copies of each token, their SwiGLU input and output, and the shared MLP's; on a
  GPU, prefill's grouped expert product (`granite_jax.gpu`) and the expert matrices it gathers per block of rows;
- on a CPU computing in a narrower dtype than float32, XLA:CPU widens every matrix's weights to float32 for its
  products and holds those copies at once: twice the narrow weights' bytes (GPUs multiply bfloat16 natively); and its
  decode loop, which follows the prefill, holds two float32 copies of the embedding table beside them.
XLA fuses some of these and adds copies of its own (on CPUs, two of a narrow attention layer's K and V, counted);
`tests/test_memory.py` holds the estimate to the compiled program's own memory analysis on small configs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from granite_jax import gpu
from granite_jax.config import ATTENTION, MAMBA, ModelConfig
from granite_jax.model import KV_BLOCK, Cache, KVState, MambaState, abstract_model

PARTS = ("weights", "kv_cache", "mamba_state", "activations")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes of each part (PARTS) for `sessions` sequences of `context` tokens, prefilled `prefill_chunk` at a time."""

    weights: int
    kv_cache: int
    mamba_state: int
    activations: int
    context: int
    sessions: int
    prefill_chunk: int
    weight_dtype: str
    dtype: str
    platform: str

    @property
    def total(self) -> int:
        return sum(getattr(self, p) for p in PARTS)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"total": self.total}


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def weight_bytes(cfg: ModelConfig, *, dtype: Any = jnp.bfloat16, weight_dtype: Any = jnp.bfloat16) -> int:
    """Bytes of the model's parameters as `granite_jax` holds them (shape-only: nothing is allocated)."""
    return _weight_bytes(cfg, jnp.dtype(dtype), jnp.dtype(weight_dtype))


@functools.cache  # an abstract h-tiny takes ~2.5 s to build, and `fit` predicts dozens of times
def _weight_bytes(cfg: ModelConfig, dtype: jnp.dtype, weight_dtype: jnp.dtype) -> int:
    return _nbytes(nnx.state(abstract_model(cfg, dtype=dtype, param_dtype=weight_dtype), nnx.Param))


def cache_bytes(cfg: ModelConfig, *, context: int, sessions: int, dtype: Any = jnp.bfloat16) -> tuple[int, int]:
    """(KV cache bytes, Mamba state bytes) of `sessions` sequences with `context` KV slots each."""
    cache = jax.eval_shape(lambda: Cache.init(cfg, sessions, context, dtype))
    kv = sum(_nbytes(s) for s in cache.layers if isinstance(s, KVState))
    mamba = sum(_nbytes(s) for s in cache.layers if isinstance(s, MambaState))
    return kv, mamba


def activation_bytes(
    cfg: ModelConfig, *, rows: int, tokens: int, context: int, dtype: Any = jnp.bfloat16, platform: str = "gpu"
) -> int:
    """Estimated peak bytes of the buffers a prefill segment of `tokens` tokens for `rows` rows holds at once on
    `platform` ("gpu" or "cpu")."""
    a, f32, n = jnp.dtype(dtype).itemsize, 4, rows * tokens
    residual = 2 * n * cfg.hidden_size * f32 + rows * cfg.vocab_size * f32
    layers = {kind: 0 for kind in cfg.layer_types}
    if MAMBA in layers:
        h, chunk = cfg.mamba_n_heads, min(cfg.mamba_chunk_size, tokens)
        states = 2 * f32 * h * cfg.mamba_d_head * cfg.mamba_d_state
        ssd = rows * math.ceil(tokens / chunk) * (f32 * chunk * chunk * (2 * h + cfg.mamba_n_groups) + states)
        mixer = n * (a * cfg.mamba_in_proj_dim + f32 * (cfg.mamba_conv_dim + 2 * cfg.mamba_d_inner))
        layers[MAMBA] = mixer + ssd
    if ATTENTION in layers:
        q_heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        block = min(KV_BLOCK, context)
        qkv = n * a * (q_heads + 2 * kv_heads) * hd
        # XLA:CPU keeps two copies of the layer's updated K and V when they are narrower than float32 (it converts
        # them for the products); XLA:GPU updates them in place
        kv_copies = 2 * 2 * rows * kv_heads * context * hd * a if platform == "cpu" and a < f32 else 0
        layers[ATTENTION] = qkv + n * f32 * q_heads * (3 * block + hd) + kv_copies  # scores, their exp, probabilities
    ffn = n * a * 3 * cfg.shared_intermediate_size + _experts_bytes(cfg, n, a, platform)
    prefill = residual + max(max(layers.values()), ffn)
    if platform != "cpu" or a >= f32:
        return prefill
    widened = 2 * weight_bytes(cfg, dtype=dtype, weight_dtype=dtype) - _embedding_bytes(cfg, a)
    # The decode loop (`Steps.decode_chunk`) widens the embedding table for its lookups too, hoisting that out of the
    # loop: two more float32 tables (h-350m's: 0.62 GB) beside the widened matrices, against a prefill's buffers.
    return widened + max(prefill, 2 * cfg.vocab_size * cfg.hidden_size * f32)


def _experts_bytes(cfg: ModelConfig, tokens: int, itemsize: int, platform: str) -> int:
    """The routed experts' buffers for `tokens` tokens: each token's k copies, their SwiGLU input and output, the
    router's logits; on a GPU where it runs (`gpu.takes_grouped`), the grouped product's blocks of rows, the
    matrix it gathers for each block and the blocks' outputs, for the larger of its two products."""
    if not cfg.num_local_experts:
        return 0
    E, H, F = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    rows = tokens * cfg.num_experts_per_tok
    total = rows * itemsize * (2 * H + 3 * F) + tokens * 4 * E
    if platform == "gpu":
        block = gpu.block_rows(rows, E)
        blocks = -(-rows // block) + E
        products = [(K, N) for K, N in ((H, 2 * F), (F, H)) if gpu.takes_grouped(rows, (E, K, N), itemsize)]
        total += max((itemsize * blocks * (block * K + K * N + block * N) for K, N in products), default=0)
    return total


def _embedding_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes of an untied embedding table (gathered from, never widened); 0 when it is the tied head."""
    return 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * itemsize * 2


def predict(
    cfg: ModelConfig,
    *,
    context: int,
    sessions: int = 1,
    dtype: Any = jnp.bfloat16,
    weight_dtype: Any = None,
    prefill_chunk: int = 512,
    platform: str = "gpu",
) -> MemoryPlan:
    """The memory of `sessions` sequences of up to `context` tokens (prompt and generated), computing in `dtype` with
    weights in `weight_dtype` (None: `dtype`), prompts prefilled `prefill_chunk` tokens at a time for all sessions."""
    weight_dtype = dtype if weight_dtype is None else weight_dtype
    kv, mamba = cache_bytes(cfg, context=context, sessions=sessions, dtype=dtype)
    chunk = min(prefill_chunk, context)
    return MemoryPlan(
        weights=weight_bytes(cfg, dtype=dtype, weight_dtype=weight_dtype),
        kv_cache=kv,
        mamba_state=mamba,
        activations=activation_bytes(cfg, rows=sessions, tokens=chunk, context=context, dtype=dtype, platform=platform),
        context=context,
        sessions=sessions,
        prefill_chunk=chunk,
        weight_dtype=jnp.dtype(weight_dtype).name,
        dtype=jnp.dtype(dtype).name,
        platform=platform,
    )


def fit(cfg: ModelConfig, capacity: int, *, context: int | None = None, sessions: int | None = None, **options) -> int:
    """The largest context (given `sessions`) or session count (given `context`) whose `predict(...)` total fits in
    `capacity` bytes; 0 if none does. `options` go to `predict`."""
    if (context is None) == (sessions is None):
        raise ValueError("fit: give exactly one of context and sessions")

    def fits(x: int) -> bool:
        given = dict(context=x, sessions=sessions) if context is None else dict(context=context, sessions=x)
        return predict(cfg, **given, **options).total <= capacity

    low, high = 0, 1
    while fits(high):  # the totals grow with both
        low, high = high, high * 2
        if high > 1 << 40:
            return low
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
