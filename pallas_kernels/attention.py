"""Attention of one query per row over a KV cache (decode) as a Pallas (Triton) kernel, split over the keys.

The contract is `granite_jax.model.attend_cache` for one query per row: for row b and KV head k, the `rep` query heads
of its group attend to the cache slots [pad[b], slot] (causal, no padding keys), with softmax scale `scale`.

Flash-decoding (Dao et al. 2023): one program per (row, KV head, split of the filled slots). A program walks its
split's blocks of `block_k` keys with the online softmax (running max m, normalizer l and output acc per query head,
rescaled by exp(m_old - m_new) as each block arrives; Dao et al. 2022, Alg. 1) and writes its (m, l, acc); the splits
are then combined by a second kernel, one program per (row, KV head): out = sum_s exp(m_s - M) acc_s / sum_s
exp(m_s - M) l_s with M = max_s m_s. The splits make enough
programs to keep the GPU's memory busy at batch 1, where there are as many (row, KV head) pairs as KV heads; only the
filled slots are read, each once. Two launches, where the model's plain body is a loop of a dozen
kernels per block whose condition the host reads each iteration.

Scores and the softmax are float32; each query head is its own row of work (a group's `rep` query heads need not be
a power of two, which Triton's blocks must be).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _call
from pallas_kernels._common import F32, Array, check_int

MASKED = -1e30  # the model's: finite, so a row with no key to attend gives a uniform softmax, not NaN
PROGRAMS = 264  # programs to aim for: two per SM of an H100/H200 (132 SMs)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Tiling and launch parameters of the decode attention kernel. splits: None for enough programs to fill the
    GPU (`PROGRAMS`), at most one per block of keys."""

    block_k: int = 64  # keys per block
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_int("AttentionConfig.block_k", self.block_k, minimum=16, power_of_two=True)
        if self.splits is not None:
            check_int("AttentionConfig.splits", self.splits, minimum=1)
        for name in ("num_warps", "num_stages"):
            check_int(f"AttentionConfig.{name}", getattr(self, name), minimum=1)


def takes_decode_attention(head_dim: int, cache_len: int) -> bool:
    """Whether `decode_attention` runs these dims: a power-of-two head dim and at least 16 cache slots."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and cache_len >= 16


def decode_attention(
    q: Array,
    k: Array,
    v: Array,
    pad: Array,
    slot: Array | int,
    scale: float,
    *,
    new_kv: tuple[Array, Array] | None = None,
    config: AttentionConfig | None = None,
) -> tuple[Array, Array, Array]:
    """q (b, kv, rep, hd): one query per row at cache slot `slot` (a scalar or a (1,) array); k and v (b, kv, S, hd):
    the cache; pad (b,): each row's padding slots. new_kv: this token's key and value (b, kv, hd), written into the
    cache at `slot` by the kernel (in place under donation) and attended to. Returns (out (b, kv, rep, hd) in q's
    dtype, k, v)."""
    b, kv, rep, hd = q.shape
    S = k.shape[2]
    if k.shape != (b, kv, S, hd) or v.shape != k.shape or pad.shape != (b,):
        raise ValueError(f"decode_attention: q {q.shape}, k {k.shape}, v {v.shape} and pad {pad.shape} must be "
                         f"(b, kv, rep, hd), (b, kv, S, hd) twice and (b,)")  # fmt: skip
    if new_kv is not None and any(t.shape != (b, kv, hd) for t in new_kv):
        raise ValueError(f"decode_attention: new_kv must be two (b, kv, hd) = {(b, kv, hd)}")
    if not takes_decode_attention(hd, S):
        raise ValueError(f"decode_attention: head_dim {hd} must be a power of two >= 16 and the cache >= 16 slots")
    if config is not None and not isinstance(config, AttentionConfig):
        raise TypeError(f"decode_attention: config must be an AttentionConfig or None, got {type(config).__name__}")
    cfg = config or AttentionConfig()
    block = min(cfg.block_k, 1 << (S.bit_length() - 1))  # a power of two within the cache
    splits = _floor_pow2(min(cfg.splits or -(-PROGRAMS // (b * kv)), -(-S // block)))  # loaded whole to combine
    writes = new_kv is not None
    kernel = functools.partial(_split_kernel, rep=rep, block=block, splits=splits, scale=float(scale), writes=writes)
    rows = lambda *shape: pl.BlockSpec((None, None, *shape), lambda i, j, *_: (i, j) + (0,) * len(shape))  # noqa: E731
    split = lambda *shape: pl.BlockSpec((None, None, None, *shape), lambda i, j, s: (i, j, s) + (0,) * len(shape))  # noqa
    out_specs = [split(rep), split(rep), split(rep, hd)] + [rows(S, hd)] * 2 * writes
    out_shape = [
        jax.ShapeDtypeStruct((b, kv, splits, rep), F32),
        jax.ShapeDtypeStruct((b, kv, splits, rep), F32),
        jax.ShapeDtypeStruct((b, kv, splits, rep, hd), F32),
    ] + [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)] * writes
    slot = jnp.asarray(slot, jnp.int32)
    m, norm, acc, *cache = _call.call(
        kernel,
        name="decode_attention",
        grid=(b, kv, splits),
        in_specs=[
            rows(rep, hd),
            rows(S, hd),
            rows(S, hd),
            pl.BlockSpec((None,), lambda i, j, s: (i,)),
            pl.BlockSpec((None,), lambda i, j, s: (0,)),
        ]
        + [rows(hd)] * 2 * writes,  # fmt: skip
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={1: 3, 2: 4} if writes else None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )(q, k, v, pad.astype(jnp.int32), slot if slot.shape == (1,) else slot.reshape(1), *(new_kv or ()))
    out = _call.call(
        functools.partial(_combine_kernel, rep=rep),
        name="decode_attention_combine",
        grid=(b, kv),
        in_specs=[rows(splits, rep), rows(splits, rep), rows(splits, rep, hd)],
        out_specs=[rows(rep, hd)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
        num_warps=cfg.num_warps,
        num_stages=1,
    )(m, norm, acc)[0]
    return (out, *cache) if writes else (out, k, v)


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _split_kernel(*refs, rep, block, splits, scale, writes):
    q_ref, k_ref, v_ref, pad_ref, slot_ref = refs[:5]
    new_k, new_v = (refs[5][...], refs[6][...]) if writes else (None, None)
    m_ref, norm_ref, acc_ref = refs[5 + 2 * writes : 8 + 2 * writes]
    split = pl.program_id(2)
    S = k_ref.shape[0]
    slot, pad = slot_ref[...], pad_ref[...]
    filled = slot // block + 1  # the blocks holding slots [0, slot]
    per = (filled + splits - 1) // splits
    first, last = split * per, jnp.minimum((split + 1) * per, filled)
    queries = [q_ref[r, :].astype(F32) for r in range(rep)]
    if writes:  # one program writes the token's key and value; every program reads them from here, not the cache,
        k_out_ref, v_out_ref = refs[-2:]  # so no read races the write

        @pl.when(split == 0)
        def _():
            k_out_ref[slot, :] = new_k
            v_out_ref[slot, :] = new_v

    def step(j, carry):
        start = jnp.minimum(j * block, S - block)  # a last block past the cache is shifted back, its seen slots masked
        slots = start + lax.broadcasted_iota(jnp.int32, (block,), 0)
        keep = (slots >= j * block) & (slots <= slot) & (slots >= pad)
        keys, values = k_ref[pl.ds(start, block), :].astype(F32), v_ref[pl.ds(start, block), :].astype(F32)
        if writes:
            fresh = (slots == slot)[:, None]
            keys = jnp.where(fresh, new_k.astype(F32)[None, :], keys)
            values = jnp.where(fresh, new_v.astype(F32)[None, :], values)
        out = []
        for query, (m, norm, acc) in zip(queries, carry):
            scores = jnp.where(keep, jnp.sum(keys * query[None, :], axis=1) * scale, MASKED)
            m_new = jnp.maximum(m, jnp.max(scores))
            p = jnp.exp(scores - m_new)
            rescale = jnp.exp(m - m_new)
            out.append((m_new, norm * rescale + jnp.sum(p), acc * rescale + jnp.sum(p[:, None] * values, axis=0)))
        return tuple(out)

    zero = jnp.zeros((), F32)
    init = tuple((zero + MASKED, zero, jnp.zeros_like(query)) for query in queries)
    result = lax.fori_loop(first, jnp.maximum(first, last), step, init)
    for r, (m, norm, acc) in enumerate(result):
        m_ref[r] = m
        norm_ref[r] = norm
        acc_ref[r, :] = acc


def _combine_kernel(m_ref, norm_ref, acc_ref, out_ref, *, rep):
    for r in range(rep):
        m = m_ref[:, r]
        weights = jnp.exp(m - jnp.max(m))
        norm = jnp.sum(weights * norm_ref[:, r])
        out_ref[r, :] = (jnp.sum(weights[:, None] * acc_ref[:, r, :], axis=0) / norm).astype(out_ref.dtype)
