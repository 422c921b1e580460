"""Chunked SSD prefill as two Pallas (Triton) kernels. The definition is `granite_jax.ssd.ssd_reference`.

Per head, with a_t = dt_t * A and, inside chunk c, the cumulative log-decay s_t = a_{cQ} + ... + a_t:

1. `_chunk_state_kernel`, one program per (batch, head, block of p), walking the chunks in order. For each chunk it
   computes dt (bias, softplus, clamp), its cumsum s, stores the state *entering* the chunk, then advances it:
       state <- exp(s_last) * state + (x * dt * exp(s_last - s))^T @ B
   It writes the entering states (b, c, h, p, n) f32, the final state, and dt and s as (b, h, L') f32 rows.
   This fuses the reference's kernels 1 (cumsum), 2 (chunk states) and 3 (state passing).
2. `_chunk_output_kernel`, one program per (batch, chunk, head, block of rows m), fully parallel. It computes
       y_m = exp(s_m) * (C_m @ state_in^T)                                   (the inter-chunk term)
           + sum_{k-blocks <= m} ((C_m @ B_k^T) * exp(s_m - s_k) * dt_k * [m >= k]) @ x_k   (the diagonal term)
           + D * x_m
   fusing the reference's kernels 4 (C B^T) and 5 (chunk scan); causal k-blocks above the diagonal are skipped.

Numerics: dt, the cumulative decays, the carried states and every accumulator are float32; matmul operands are the
input dtype for 16-bit inputs (the decayed C B^T and the state are rounded to it, as in the reference kernels) and
float32 with exact products otherwise. Every exponent is clamped with min(., 0), and every load past L is masked to
zero, so padded or masked lanes never produce inf * 0. Requires A <= 0 and dt >= 0 (Mamba: A = -exp(A_log)).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _call
from pallas_kernels._common import F32, Array, dot, operand_dtype, pad_axis, padded_dim, process_dt

MIN_CHUNK, MAX_CHUNK = 16, 256


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Tiling and launch parameters of the two prefill kernels (to be tuned on the GPU)."""

    block_m: int = 64  # chunk rows per output program; also the width of its causal k-blocks
    block_p: int = 64  # head-dim rows of the state per state program
    block_k: int = 64  # sequence rows the state program folds into the state per step
    state_warps: int = 4
    state_stages: int = 2
    output_warps: int = 4
    output_stages: int = 2


def kernel_chunk(chunk_size: int) -> int:
    """The chunk the kernels use: `chunk_size` rounded up to a power of two in [16, 256].

    The SSD does not depend on the chunk beyond rounding, so a model chunk the kernels cannot tile is replaced rather
    than refused.
    """
    return min(MAX_CHUNK, max(MIN_CHUNK, 1 << max(0, (chunk_size - 1).bit_length())))


def ssd_prefill(
    x: Array,
    dt: Array,
    A: Array,
    B: Array,
    C: Array,
    D: Array,
    *,
    chunk_size: int = 256,
    initial_state: Array | None = None,
    dt_bias: Array | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    out_dtype: jnp.dtype = F32,
    config: PrefillConfig | None = None,
) -> tuple[Array, Array]:
    """Chunked SSD forward. Same contract as `granite_jax.ssd.ssd_chunked`.

    x (b, L, h, p); dt (b, L, h), raw when `dt_bias`/`dt_softplus`/`dt_limit` are given (applied in the kernel as
    softplus(dt + dt_bias) clamped to dt_limit), else already processed; A, D (h,); B, C (b, L, g, n) with g | h;
    initial_state (b, h, p, n). Returns y (b, L, h, p) in `out_dtype` (float32 by default) and the final state
    (b, h, p, n) in float32. Any L; p and n that are not powers of two >= 16 are zero-padded (an extra copy).
    """
    b, length, h, p = x.shape
    g, n = B.shape[2:]
    _check_shapes(x, dt, A, B, C, D, initial_state, dt_bias)
    cfg = config or PrefillConfig()
    if length == 0:
        final = jnp.zeros((b, h, p, n), F32) if initial_state is None else initial_state.astype(F32)
        return jnp.zeros((b, 0, h, p), out_dtype), final
    chunk = kernel_chunk(chunk_size)
    pp, nn = padded_dim(p), padded_dim(n)
    x = pad_axis(x, 3, pp)
    B, C = pad_axis(B, 3, nn), pad_axis(C, 3, nn)
    init = jnp.zeros((b, h, pp, nn), F32) if initial_state is None else initial_state.astype(F32)
    init = pad_axis(pad_axis(init, 2, pp), 3, nn)
    bias = jnp.zeros((h,), F32) if dt_bias is None else dt_bias.astype(F32)
    dt_args = dict(softplus=bool(dt_softplus), limit=(float(dt_limit[0]), float(dt_limit[1])))

    states_in, final, dt_rows, decay_rows = _chunk_states(x, dt, A, bias, B, init, chunk, cfg, dt_args)
    y = _chunk_outputs(x, B, C, D, dt_rows, decay_rows, states_in, chunk, cfg, out_dtype)
    if pp != p:
        y = y[..., :p]
    if (pp, nn) != (p, n):
        final = final[:, :, :p, :n]
    return y, final


def _check_shapes(x, dt, A, B, C, D, initial_state, dt_bias) -> None:
    if x.ndim != 4:
        raise ValueError(f"ssd_prefill: x must be (b, L, h, p), got shape {x.shape}")
    b, length, h, p = x.shape
    if B.ndim != 4 or B.shape[:2] != (b, length) or C.shape != B.shape:
        raise ValueError(f"ssd_prefill: B and C must be (b, L, g, n) = ({b}, {length}, g, n); got {B.shape}, {C.shape}")
    g, n = B.shape[2:]
    if g == 0 or h % g:
        raise ValueError(f"ssd_prefill: the group count g={g} must divide the head count h={h}")
    if dt.shape != (b, length, h):
        raise ValueError(f"ssd_prefill: dt must be (b, L, h) = {(b, length, h)}, got {dt.shape}")
    for name, t in (("A", A), ("D", D)) + ((("dt_bias", dt_bias),) if dt_bias is not None else ()):
        if t.shape != (h,):
            raise ValueError(f"ssd_prefill: {name} must be (h,) = ({h},), got {t.shape}")
    if initial_state is not None and initial_state.shape != (b, h, p, n):
        raise ValueError(f"ssd_prefill: initial_state must be (b, h, p, n) = {(b, h, p, n)}, got {initial_state.shape}")


# ---------------------------------------------------------------------------------------------- kernel 1: states


def _chunk_states(x, dt, A, bias, B, init, chunk, cfg: PrefillConfig, dt_args):
    """States entering each chunk (b, c, h, p, n), the final state, and dt and the in-chunk decay cumsum (b, h, L')."""
    b, length, h, p = x.shape
    g, n = B.shape[2:]
    group = h // g
    n_chunks = pl.cdiv(length, chunk)
    padded_len = n_chunks * chunk
    bp = min(cfg.block_p, p)
    block_k = min(cfg.block_k, chunk)
    kernel = functools.partial(
        _chunk_state_kernel, length=length, chunk=chunk, block_k=block_k, op_dtype=operand_dtype(x.dtype), **dt_args
    )
    scalar = pl.BlockSpec((None,), lambda i, j, k: (j,))
    return _call.call(
        kernel,
        name="ssd_chunk_states",
        grid=(b, h, p // bp),
        in_specs=[
            pl.BlockSpec((None, padded_len, None, bp), lambda i, j, k: (i, 0, j, k)),  # x
            pl.BlockSpec((None, padded_len, None), lambda i, j, k: (i, 0, j)),  # dt
            scalar,  # A
            scalar,  # dt_bias
            pl.BlockSpec((None, padded_len, None, n), lambda i, j, k: (i, 0, j // group, 0)),  # B
            pl.BlockSpec((None, None, bp, n), lambda i, j, k: (i, j, k, 0)),  # initial state
        ],
        out_specs=[
            pl.BlockSpec((None, n_chunks, None, bp, n), lambda i, j, k: (i, 0, j, k, 0)),  # states entering chunks
            pl.BlockSpec((None, None, bp, n), lambda i, j, k: (i, j, k, 0)),  # final state
            pl.BlockSpec((None, None, padded_len), lambda i, j, k: (i, j, 0)),  # dt rows
            pl.BlockSpec((None, None, padded_len), lambda i, j, k: (i, j, 0)),  # decay cumsum rows
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, n_chunks, h, p, n), F32),
            jax.ShapeDtypeStruct((b, h, p, n), F32),
            jax.ShapeDtypeStruct((b, h, padded_len), F32),
            jax.ShapeDtypeStruct((b, h, padded_len), F32),
        ],
        num_warps=cfg.state_warps,
        num_stages=cfg.state_stages,
    )(x, dt, A, bias, B, init)


def _chunk_state_kernel(
    x_ref, dt_ref, A_ref, bias_ref, B_ref, init_ref, states_ref, final_ref, dt_out_ref, decay_out_ref,
    *, length, chunk, block_k, op_dtype, softplus, limit,
):  # fmt: skip
    A = A_ref[...].astype(F32)
    bias = bias_ref[...].astype(F32)
    writes_rows = pl.program_id(2) == 0  # the p-blocks of a head share dt and s; one of them writes them

    def advance(start, state, offset):
        """The state over rows [start, start + block_k), `offset` the chunk's decay cumsum before them."""
        rows = pl.ds(start, block_k)
        valid = start + jnp.arange(block_k) < length
        dt = pltriton.load(dt_ref.at[rows], mask=valid, other=0.0)
        dt = jnp.where(valid, process_dt(dt, bias, softplus, limit), 0.0)
        local = jnp.cumsum(dt * A)  # cumulative log-decay inside the block, <= 0
        total = jnp.sum(dt * A)
        decay = offset + local  # s: cumulative log-decay since the chunk's start

        @pl.when(writes_rows)
        def _():
            dt_out_ref[rows] = dt
            decay_out_ref[rows] = decay

        x = pltriton.load(x_ref.at[rows, :], mask=valid[:, None], other=0.0).astype(F32)
        Bk = pltriton.load(B_ref.at[rows, :], mask=valid[:, None], other=0.0).astype(op_dtype)
        weight = jnp.exp(jnp.minimum(total - local, 0.0)) * dt  # decay from each row to the block's end, times dt
        contribution = dot((x * weight[:, None]).astype(op_dtype), Bk, trans_a=True)  # (bp, n)
        return jnp.exp(jnp.minimum(total, 0.0)) * state + contribution, offset + total

    def chunk_step(ci, state):
        states_ref[ci] = state
        blocks = lambda j, carry: advance(ci * chunk + j * block_k, *carry)
        state, _ = jax.lax.fori_loop(0, chunk // block_k, blocks, (state, jnp.zeros((), F32)))
        return state

    final_ref[...] = jax.lax.fori_loop(0, states_ref.shape[0], chunk_step, init_ref[...].astype(F32))


# ---------------------------------------------------------------------------------------------- kernel 2: outputs


def _chunk_outputs(x, B, C, D, dt_rows, decay_rows, states_in, chunk, cfg: PrefillConfig, out_dtype):
    """y (b, L, h, p): inter-chunk term from the entering states, causal diagonal term, D skip."""
    b, length, h, p = x.shape
    g, n = B.shape[2:]
    group = h // g
    n_chunks = states_in.shape[1]
    bm = min(cfg.block_m, chunk)
    per_chunk = chunk // bm
    kernel = functools.partial(_chunk_output_kernel, length=length, chunk=chunk, op_dtype=operand_dtype(x.dtype))
    (y,) = _call.call(
        kernel,
        name="ssd_chunk_outputs",
        grid=(b * n_chunks, h, per_chunk),
        in_specs=[
            pl.BlockSpec((None, chunk, None, p), lambda i, j, m: (i // n_chunks, i % n_chunks, j, 0)),  # x
            pl.BlockSpec((None, chunk, None, n), lambda i, j, m: (i // n_chunks, i % n_chunks, j // group, 0)),  # B
            pl.BlockSpec((None, chunk, None, n), lambda i, j, m: (i // n_chunks, i % n_chunks, j // group, 0)),  # C
            pl.BlockSpec((None,), lambda i, j, m: (j,)),  # D
            pl.BlockSpec((None, None, chunk), lambda i, j, m: (i // n_chunks, j, i % n_chunks)),  # dt rows
            pl.BlockSpec((None, None, chunk), lambda i, j, m: (i // n_chunks, j, i % n_chunks)),  # decay rows
            pl.BlockSpec((None, None, None, p, n), lambda i, j, m: (i // n_chunks, i % n_chunks, j, 0, 0)),  # state
        ],
        out_specs=[
            pl.BlockSpec((None, bm, None, p), lambda i, j, m: (i // n_chunks, (i % n_chunks) * per_chunk + m, j, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, length, h, p), out_dtype)],
        num_warps=cfg.output_warps,
        num_stages=cfg.output_stages,
    )(x, B, C, D, dt_rows, decay_rows, states_in)
    return y


def _chunk_output_kernel(x_ref, B_ref, C_ref, D_ref, dt_ref, decay_ref, state_ref, y_ref, *, length, chunk, op_dtype):
    bm = y_ref.shape[0]
    m = pl.program_id(2)
    chunk_start = (pl.program_id(0) % pl.cdiv(length, chunk)) * chunk
    rows = pl.ds(m * bm, bm)
    row_ids = m * bm + jnp.arange(bm)
    row_valid = chunk_start + row_ids < length
    decay_m = decay_ref[rows]
    C_m = pltriton.load(C_ref.at[rows, :], mask=row_valid[:, None], other=0.0).astype(op_dtype)

    # Inter-chunk: the state entering the chunk, read out by C and decayed to each row.
    from_state = dot(C_m, state_ref[...].astype(op_dtype), trans_b=True) * jnp.exp(jnp.minimum(decay_m, 0.0))[:, None]

    def diagonal_block(k, acc):
        cols = pl.ds(k * bm, bm)
        col_ids = k * bm + jnp.arange(bm)
        col_valid = chunk_start + col_ids < length
        B_k = pltriton.load(B_ref.at[cols, :], mask=col_valid[:, None], other=0.0).astype(op_dtype)
        x_k = pltriton.load(x_ref.at[cols, :], mask=col_valid[:, None], other=0.0).astype(op_dtype)
        scores = dot(C_m, B_k, trans_b=True)  # (bm, bm)
        decay = jnp.exp(jnp.minimum(decay_m[:, None] - decay_ref[cols][None, :], 0.0)) * dt_ref[cols][None, :]
        weights = jnp.where(row_ids[:, None] >= col_ids[None, :], scores * decay, 0.0)
        return acc + dot(weights.astype(op_dtype), x_k)

    y = jax.lax.fori_loop(0, m + 1, diagonal_block, from_state)
    x_m = pltriton.load(x_ref.at[rows, :], mask=row_valid[:, None], other=0.0).astype(F32)
    y = y + D_ref[...].astype(F32) * x_m
    pltriton.store(y_ref, y.astype(y_ref.dtype), mask=row_valid[:, None])
