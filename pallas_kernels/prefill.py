"""Chunked SSD prefill as three Pallas (Triton) kernels. The definition is `granite_jax.ssd.ssd_reference`.

Per head, with a_t = dt_t * A and, inside chunk c, the cumulative log-decay s_t = a_{cQ} + ... + a_t:

1. `_local_state_kernel`, one program per (batch, chunk, head, block of the (p, n) state), all in parallel. It
   computes dt (bias, softplus, clamp) and s, and folds the chunk's rows into a state from zero, `block_k` rows per
   step:
       state <- exp(a_k + ... + a_last) * state + (x * dt * exp(decay from each row to the step's end))^T @ B
   It writes the chunk-local state (b, c, h, p, n) in float32, and dt and s as (b, h, L') float32 rows. This fuses
   the reference's kernels 1 (cumsum) and 2 (chunk states).
2. `_pass_kernel`, one program per (batch, head, block of the flattened state), walking the chunks in order:
       entering_0 = initial state,  entering_{c+1} = exp(s at chunk c's end) * entering_c + local_c
   It writes the entering states in the matmul operand dtype and the final state in float32 (the reference's
   kernel 3). Elementwise: the only sequential work, one small step per chunk.
3. `_chunk_output_kernel`, one program per (batch, chunk, block of heads, block of rows m), fully parallel:
       y_m = exp(s_m) * (C_m @ state_in^T)                                                  (inter-chunk term)
           + sum_{k-blocks <= m} ((C_m @ B_k^T) * exp(s_m - s_k) * dt_k * [m >= k]) @ x_k      (diagonal term)
           + D * x_m
   C_m @ B_k^T is computed once per program and shared by its heads; causal k-blocks above the diagonal are skipped.
   This fuses the reference's kernels 4 (C B^T) and 5 (chunk scan).

`ssd_prefill` runs them in order; each also runs alone (`local_states`, `pass_states`, `chunk_outputs`), so that
its time can be measured (`benchmarks/gpu_ssd.py`).

Kernels 1 and 2 are two, not one kernel walking each head's whole sequence in order with the state, because the walk
is sequential where the chunk-local states are not: on an H200 at h-tiny dims (batch 1, bf16, 8k tokens) the walk
took 141 us of a 361 us SSD, the two kernels 103 us of a 271 us one (docs/kernels.md).

Numerics: dt, the cumulative decays, the carried state and every accumulator are float32; matmul operands are the
input dtype for 16-bit inputs (the decay-weighted x, the decayed C B^T and the entering state are rounded to it, as in
the reference kernels) and float32 with exact products otherwise. Every exponent is clamped with min(., 0) and every
load past L is masked to zero, so padded or masked lanes never produce inf * 0. Requires A <= 0 and dt >= 0 (Mamba:
A = -exp(A_log), dt after softplus).
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
from pallas_kernels._common import (
    F32,
    Array,
    check_dt_limit,
    check_int,
    dot,
    operand_dtype,
    pad_axis,
    padded_dim,
    process_dt,
)

MIN_CHUNK, MAX_CHUNK = 16, 256


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Tiling and launch parameters of the three prefill kernels (defaults from H200 sweeps and static analysis).

    Block sizes larger than the dimension they tile are clipped to it.
    """

    block_m: int = 64  # chunk rows per output program; also the width of its causal k-blocks
    heads_per_program: int = 1  # heads of one group per output program, sharing its C B^T tiles
    block_p: int | None = None  # head-dim rows of the state per local-state program; None: see `_state_block_p`
    block_n: int = 128  # state columns per local-state program
    block_k: int | None = None  # chunk rows the local-state program folds into the state per step; None: 128 for
    # 16-bit inputs, 64 for float32
    state_warps: int | None = None  # None: 4 for 16-bit inputs, 8 for float32 (3xTF32 needs the registers)
    state_stages: int = 2
    output_warps: int | None = None  # None: as state_warps
    output_stages: int | None = None  # None: 3 for 16-bit inputs (1.07x over 2 on an H200), 2 for float32,
    # whose tiles take twice the shared memory
    pass_block: int = 1024  # float32 state values per program of the pass over the chunks

    def __post_init__(self):
        optional = ("block_p", "block_k", "state_warps", "output_warps", "output_stages")  # None: a default
        for name in ("block_m", "block_p", "block_n", "block_k"):  # Triton dot tiles
            if getattr(self, name) is not None or name not in optional:
                check_int(f"PrefillConfig.{name}", getattr(self, name), minimum=16, power_of_two=True)
        check_int("PrefillConfig.pass_block", self.pass_block, minimum=16, power_of_two=True)
        for name in ("heads_per_program", "state_warps", "output_warps", "state_stages", "output_stages"):
            if getattr(self, name) is not None or name not in optional:
                check_int(f"PrefillConfig.{name}", getattr(self, name), minimum=1)


def kernel_chunk(chunk_size: int) -> int:
    """The chunk the kernels use: `chunk_size` rounded up to a power of two in [16, 256].

    The SSD does not depend on the chunk beyond rounding, so a model chunk the kernels cannot tile is replaced rather
    than refused. `chunk_size` must be an int >= 1.
    """
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
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
    _check_shapes(x, dt, A, B, C, D, initial_state, dt_bias)
    chunk = kernel_chunk(chunk_size)
    limit = check_dt_limit("ssd_prefill", dt_limit)
    out_dtype = _check_out_dtype(out_dtype)
    if config is not None and not isinstance(config, PrefillConfig):
        raise TypeError(f"ssd_prefill: config must be a PrefillConfig or None, got {type(config).__name__}")
    b, length, h, p = x.shape
    g, n = B.shape[2:]
    cfg = config or PrefillConfig()
    if length == 0:
        final = jnp.zeros((b, h, p, n), F32) if initial_state is None else initial_state.astype(F32)
        return jnp.zeros((b, 0, h, p), out_dtype), final
    pp, nn = padded_dim(p), padded_dim(n)
    x = pad_axis(x, 3, pp)
    B, C = pad_axis(B, 3, nn), pad_axis(C, 3, nn)
    if initial_state is not None:
        initial_state = pad_axis(pad_axis(initial_state.astype(F32), 2, pp), 3, nn)
    dt_args = dict(bias=dt_bias, softplus=bool(dt_softplus), limit=limit)

    local, dt_rows, decay_rows = local_states(x, dt, A, B, chunk, cfg, **dt_args)
    states_in, final = pass_states(local, decay_rows, initial_state, chunk, cfg, operand_dtype(x.dtype))
    y = chunk_outputs(x, B, C, D, dt_rows, decay_rows, states_in, chunk, cfg, out_dtype)
    if pp != p:
        y = y[..., :p]
    if (pp, nn) != (p, n):
        final = final[:, :, :p, :n]
    return y, final


def _check_out_dtype(out_dtype: object) -> jnp.dtype:
    try:
        dtype = jnp.dtype(out_dtype)
    except TypeError:
        raise TypeError(f"ssd_prefill: out_dtype must be a floating-point dtype, got {out_dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"ssd_prefill: out_dtype must be a floating-point dtype (e.g. float32, bfloat16), got {dtype}")
    return dtype


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


# ---------------------------------------------------------------------------------------------- kernels 1 and 2: states


def local_states(x, dt, A, B, chunk, cfg: PrefillConfig, *, bias, softplus, limit):
    """Each chunk's state from a zero state (b, c, h, p, n), float32, and dt and the in-chunk decay cumsum (b, h, L').

    One program per (batch x chunk, head, block of the state); the dt bias is not passed at all when absent.
    """
    b, length, h, p = x.shape
    g, n = B.shape[2:]
    group = h // g
    n_chunks = pl.cdiv(length, chunk)
    bp, bn = _state_block_p(cfg.block_p, b * n_chunks * h, p), min(cfg.block_n, n)
    n_blocks = n // bn
    kernel = functools.partial(
        _local_state_kernel,
        length=length,
        chunk=chunk,
        block_k=min(_by_dtype(cfg.block_k, x.dtype, 128, 64), chunk),
        op_dtype=operand_dtype(x.dtype),
        has_bias=bias is not None,
        softplus=softplus,
        limit=limit,
    )
    bc = lambda i: (i // n_chunks, i % n_chunks)  # (batch, chunk) of the first grid axis
    in_specs = [
        pl.BlockSpec((None, chunk, None, bp), lambda i, j, k: (*bc(i), j, k // n_blocks)),  # x
        pl.BlockSpec((None, chunk, None), lambda i, j, k: (*bc(i), j)),  # dt
        pl.BlockSpec((None,), lambda i, j, k: (j,)),  # A
        pl.BlockSpec((None, chunk, None, bn), lambda i, j, k: (*bc(i), j // group, k % n_blocks)),  # B
    ]
    args = [x, dt, A, B]
    if bias is not None:
        in_specs.append(pl.BlockSpec((None,), lambda i, j, k: (j,)))
        args.append(bias.astype(F32))
    rows = pl.BlockSpec((None, None, chunk), lambda i, j, k: (bc(i)[0], j, bc(i)[1]))
    return _call.call(
        kernel,
        name="ssd_chunk_local_states",
        grid=(b * n_chunks, h, (p // bp) * n_blocks),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, bp, bn), lambda i, j, k: (*bc(i), j, k // n_blocks, k % n_blocks)),
            rows,  # dt
            rows,  # decay cumsum
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, n_chunks, h, p, n), F32),
            *[jax.ShapeDtypeStruct((b, h, n_chunks * chunk), F32)] * 2,
        ],
        num_warps=_warps(cfg.state_warps, x.dtype),
        num_stages=cfg.state_stages,
    )(*args)


def _warps(warps: int | None, dtype: jnp.dtype) -> int:
    return _by_dtype(warps, dtype, 4, 8)


def _by_dtype(value: int | None, dtype: jnp.dtype, sixteen_bit: int, float32: int) -> int:
    """A launch parameter left unset: its default for the kernels' operand dtype."""
    if value is not None:
        return value
    return sixteen_bit if operand_dtype(dtype) != F32 else float32


def _state_block_p(block_p: int | None, programs: int, p: int, min_programs: int = 128) -> int:
    """The local-state programs' p-block. Unset: p itself (one program per chunk and head) unless that leaves fewer
    than about one program per SM (short sequences at batch 1), then halved down to 16. On an H200 at h-tiny dims
    and 8k tokens (1,536 programs), halving anyway (block_p=32) was 1.15x slower."""
    if block_p is not None:
        return min(block_p, p)
    bp = p
    while bp > 16 and programs * (p // bp) < min_programs:
        bp //= 2
    return bp


def _local_state_kernel(*refs, length, chunk, block_k, op_dtype, has_bias, softplus, limit):
    """One chunk's rows folded into a zero state, `block_k` rows per step, and the chunk's dt and s rows."""
    refs = list(refs)
    x_ref, dt_ref, A_ref, B_ref = (refs.pop(0) for _ in range(4))
    bias = refs.pop(0)[...].astype(F32) if has_bias else None
    local_ref, dt_out_ref, decay_out_ref = refs
    A = A_ref[...].astype(F32)
    chunk_start = (pl.program_id(0) % pl.cdiv(length, chunk)) * chunk
    writes_rows = pl.program_id(2) == 0  # the state blocks of a head share dt and s; one of them writes them

    def step(j, carry):
        """The state over rows [j block_k, (j + 1) block_k), `offset` the decay cumsum before them."""
        state, offset = carry
        rows = pl.ds(j * block_k, block_k)
        valid = chunk_start + j * block_k + jnp.arange(block_k) < length
        dt = pltriton.load(dt_ref.at[rows], mask=valid, other=0.0)
        dt = jnp.where(valid, process_dt(dt, bias, softplus, limit), 0.0)
        local = jnp.cumsum(dt * A)  # cumulative log-decay inside the step, <= 0
        total = jnp.sum(dt * A)

        @pl.when(writes_rows)
        def _():
            dt_out_ref[rows] = dt
            decay_out_ref[rows] = offset + local

        x = pltriton.load(x_ref.at[rows, :], mask=valid[:, None], other=0.0).astype(F32)
        Bk = pltriton.load(B_ref.at[rows, :], mask=valid[:, None], other=0.0).astype(op_dtype)
        weight = jnp.exp(jnp.minimum(total - local, 0.0)) * dt  # decay from each row to the step's end, times dt
        contribution = dot((x * weight[:, None]).astype(op_dtype), Bk, trans_a=True)  # (bp, bn)
        return jnp.exp(jnp.minimum(total, 0.0)) * state + contribution, offset + total

    zero = jnp.zeros(local_ref.shape, F32), jnp.zeros((), F32)
    local_ref[...], _ = jax.lax.fori_loop(0, chunk // block_k, step, zero)


def pass_states(local, decay_rows, initial, chunk, cfg: PrefillConfig, op_dtype):
    """The states entering each chunk (b, c, h, p, n) in `op_dtype`, and the final state (b, h, p, n) in float32,
    from the chunk-local states: entering_{c+1} = exp(S_c) * entering_c + local_c, S_c the chunk's total log-decay
    (the last entry of its decay cumsum row: padded rows add nothing). One program per (batch, head, block of
    `cfg.pass_block` values of the flattened (p, n) state) walks the chunks in order."""
    b, n_chunks, h, p, n = local.shape
    size = p * n
    block = min(cfg.pass_block, size)
    kernel = functools.partial(_pass_kernel, chunk=chunk, has_initial=initial is not None)
    flat = pl.BlockSpec((None, None, block), lambda i, j, k: (i, j, k))
    chunks = pl.BlockSpec((None, n_chunks, None, block), lambda i, j, k: (i, 0, j, k))
    in_specs = [chunks, pl.BlockSpec((None, None, n_chunks * chunk), lambda i, j, k: (i, j, 0))]
    args = [local.reshape(b, n_chunks, h, size), decay_rows]
    if initial is not None:
        in_specs.append(flat)
        args.append(initial.reshape(b, h, size))
    states_in, final = _call.call(
        kernel,
        name="ssd_pass_states",
        grid=(b, h, size // block),
        in_specs=in_specs,
        out_specs=[chunks, flat],
        out_shape=[
            jax.ShapeDtypeStruct((b, n_chunks, h, size), op_dtype),
            jax.ShapeDtypeStruct((b, h, size), F32),
        ],
        num_warps=4,
        num_stages=1,
    )(*args)
    return states_in.reshape(b, n_chunks, h, p, n), final.reshape(b, h, p, n)


def _pass_kernel(*refs, chunk, has_initial):
    local_ref, decay_ref = refs[:2]
    init_ref = refs[2] if has_initial else None
    states_ref, final_ref = refs[-2:]

    def step(c, carry):
        state, local = carry  # `local`: chunk c's, loaded one step ahead so the load overlaps the step before
        states_ref[c] = state.astype(states_ref.dtype)
        # Clamped: on the GPU an index past the block reads past it (interpret mode would clamp it silently).
        following = local_ref[jnp.minimum(c + 1, local_ref.shape[0] - 1)]
        total = decay_ref[c * chunk + chunk - 1]
        return jnp.exp(jnp.minimum(total, 0.0)) * state + local, following

    initial = init_ref[...].astype(F32) if has_initial else jnp.zeros(final_ref.shape, F32)
    final_ref[...], _ = jax.lax.fori_loop(0, local_ref.shape[0], step, (initial, local_ref[0]))


# ---------------------------------------------------------------------------------------------- kernel 3: outputs


def _index(j: int) -> Array:
    """A static index as a traced scalar of the default int type: Pallas's interpreter discharges masked loads and
    stores only for array (not Python int) indices mixed with slices."""
    return (pl.program_id(0) * 0 + j).astype(jax.dtypes.canonicalize_dtype(jnp.int_))


def _divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, min(n, max(k, 1)) + 1) if n % d == 0)


def chunk_outputs(x, B, C, D, dt_rows, decay_rows, states_in, chunk, cfg: PrefillConfig, out_dtype):
    """y (b, L, h, p): inter-chunk term from the entering states, causal diagonal term, D skip."""
    b, length, h, p = x.shape
    g, n = B.shape[2:]
    hb = _divisor_at_most(h // g, cfg.heads_per_program)
    groups_per_block = h // g // hb  # head blocks per group
    n_chunks = states_in.shape[1]
    bm = min(cfg.block_m, chunk)
    per_chunk = chunk // bm
    bc = lambda i: (i // n_chunks, i % n_chunks)  # (batch, chunk) of the first grid axis
    kernel = functools.partial(_chunk_output_kernel, length=length, chunk=chunk, op_dtype=operand_dtype(x.dtype))
    group_rows = pl.BlockSpec((None, chunk, None, n), lambda i, j, m: (*bc(i), j // groups_per_block, 0))
    head_rows = pl.BlockSpec((None, hb, chunk), lambda i, j, m: (bc(i)[0], j, bc(i)[1]))
    (y,) = _call.call(
        kernel,
        name="ssd_chunk_outputs",
        grid=(b * n_chunks, h // hb, per_chunk),
        in_specs=[
            pl.BlockSpec((None, chunk, hb, p), lambda i, j, m: (*bc(i), j, 0)),  # x
            group_rows,  # B
            group_rows,  # C
            pl.BlockSpec((hb,), lambda i, j, m: (j,)),  # D
            head_rows,  # dt
            head_rows,  # decay cumsum
            pl.BlockSpec((None, None, hb, p, n), lambda i, j, m: (*bc(i), j, 0, 0)),  # entering states
        ],
        out_specs=[pl.BlockSpec((None, bm, hb, p), lambda i, j, m: (bc(i)[0], bc(i)[1] * per_chunk + m, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, length, h, p), out_dtype)],
        num_warps=_warps(cfg.output_warps, x.dtype),
        num_stages=_by_dtype(cfg.output_stages, x.dtype, 3, 2),
    )(x, B, C, D, dt_rows, decay_rows, states_in)
    return y


def _chunk_output_kernel(x_ref, B_ref, C_ref, D_ref, dt_ref, decay_ref, state_ref, y_ref, *, length, chunk, op_dtype):
    bm, heads = y_ref.shape[:2]
    m = pl.program_id(2)
    chunk_start = (pl.program_id(0) % pl.cdiv(length, chunk)) * chunk
    rows = pl.ds(m * bm, bm)
    row_ids = m * bm + jnp.arange(bm)
    row_valid = chunk_start + row_ids < length
    C_m = pltriton.load(C_ref.at[rows, :], mask=row_valid[:, None], other=0.0).astype(op_dtype)
    decay_m = [decay_ref[j, rows] for j in range(heads)]
    head = [_index(j) for j in range(heads)]  # traced at the top level: loop bodies cannot call program_id here

    # Inter-chunk: the state entering the chunk, read out by C and decayed to each row.
    from_state = tuple(
        dot(C_m, state_ref[j].astype(op_dtype), trans_b=True) * jnp.exp(jnp.minimum(decay_m[j], 0.0))[:, None]
        for j in range(heads)
    )

    def diagonal_block(k, accs):
        """Rows m, columns k of the diagonal block: C_m B_k^T (shared by the heads) decayed per head, times x_k."""
        cols = pl.ds(k * bm, bm)
        col_ids = k * bm + jnp.arange(bm)
        col_valid = chunk_start + col_ids < length
        B_k = pltriton.load(B_ref.at[cols, :], mask=col_valid[:, None], other=0.0).astype(op_dtype)
        scores = dot(C_m, B_k, trans_b=True)  # (bm, bm)
        causal = row_ids[:, None] >= col_ids[None, :]
        out = []
        for j in range(heads):
            x_k = pltriton.load(x_ref.at[cols, head[j], :], mask=col_valid[:, None], other=0.0).astype(op_dtype)
            decay = jnp.exp(jnp.minimum(decay_m[j][:, None] - decay_ref[j, cols][None, :], 0.0))
            weights = jnp.where(causal, scores * decay * dt_ref[j, cols][None, :], 0.0)
            out.append(accs[j] + dot(weights.astype(op_dtype), x_k))
        return tuple(out)

    ys = jax.lax.fori_loop(0, m + 1, diagonal_block, from_state)
    for j in range(heads):
        x_m = pltriton.load(x_ref.at[rows, head[j], :], mask=row_valid[:, None], other=0.0).astype(F32)
        y = ys[j] + D_ref[j].astype(F32) * x_m
        pltriton.store(y_ref.at[:, head[j], :], y.astype(y_ref.dtype), mask=row_valid[:, None])
