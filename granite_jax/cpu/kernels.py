"""The kernels' XLA FFI calls, one function each: float32 arithmetic on float32 or bfloat16 operands, outputs in
float32. Each kernel's contract is in its source under `csrc/`; `backend` decides which shapes and dtypes reach them.
They have no differentiation rules: they are for inference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from granite_jax.cpu import build

Array = jax.Array
F32 = jnp.float32


def _call(target: str, out, *args, aliases: dict[int, int] | None = None, **attributes):
    reason = build.unavailable_reason()  # builds and registers the targets on first use
    if reason is not None:
        raise RuntimeError(f"granite_jax.cpu: {target} cannot run here ({reason})")
    call = jax.ffi.ffi_call(target, out, input_output_aliases=aliases, vmap_method="sequential")
    return call(*args, **attributes)


def matvec(x: Array, w: Array) -> Array:
    """One row x (..., K) by w (N, K)^T, w read as it is: (..., N)."""
    out = jax.ShapeDtypeStruct((*x.shape[:-1], w.shape[0]), F32)
    return _call("granite_matvec", out, x.astype(F32), w)


def panels(x: Array, packed: Array, n: int) -> Array:
    """2-16 rows x (..., K) by the (N, K) matrix whose panels are `packed` (`packing.pack`): (..., n)."""
    out = jax.ShapeDtypeStruct((*x.shape[:-1], n), F32)
    return _call("granite_small_matmul", out, x.astype(F32), packed)


def widen(x: Array, w: Array) -> Array:
    """bfloat16 w as float32, computed only once x (not read) exists: XLA:CPU would otherwise run every weight's
    conversion at a step's start, a float32 copy of all of them alive at once."""
    return _call("granite_widen", jax.ShapeDtypeStruct(w.shape, F32), x, w)


def take_rows(table: Array, ids: Array) -> Array:
    """table[ids] (..., H) in float32 for a (V, H) bfloat16 table, rows of NaN for ids outside [0, V)."""
    out = jax.ShapeDtypeStruct((*ids.shape, table.shape[1]), F32)
    return _call("granite_take_rows", out, ids.astype(jnp.int32), table)


def expert_rows(x: Array, w: Array, experts: Array) -> Array:
    """y[r] = x[r] @ w[experts[r]], x (R, K), w (E, K, N): each chosen expert read once for all its rows."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), F32)
    return _call("granite_expert_matvec", out, x.astype(F32), w, experts.astype(jnp.int32))


def ssm_update(state: Array, decay: Array, dtx: Array, B: Array, C: Array) -> tuple[Array, Array]:
    """state <- decay * state + dtx B^T (in place), and y = state C: state (b, h, p, n), decay (b, h), dtx (b, h, p),
    B and C (b, g, n). Returns (new state, y)."""
    outs = (jax.ShapeDtypeStruct(state.shape, F32), jax.ShapeDtypeStruct(dtx.shape, F32))
    return _call("granite_ssm_update_f32", outs, state, decay, dtx, B, C, aliases={0: 0})


def mamba_step(
    zxbcdt: Array,
    mask: Array,
    ring: Array,
    slot: Array,
    conv_weight: Array,
    conv_bias: Array,
    dt_bias: Array,
    A_log: Array,
    D: Array,
    norm_weight: Array,
    state: Array,
    *,
    time_step_limit: tuple[float, float],
    eps: float,
) -> tuple[Array, Array, Array]:
    """The Mamba-2 mixer between its projections for one token per row, the conv ring and the state updated in place:
    (y (b, 1, d_inner), ring, state). mask (b, 1) bool: the real tokens."""
    b = zxbcdt.shape[0]
    y = jax.ShapeDtypeStruct((b, 1, state.shape[1] * state.shape[2]), F32)
    outs = (y, jax.ShapeDtypeStruct(ring.shape, F32), jax.ShapeDtypeStruct(state.shape, F32))
    lo, hi = time_step_limit
    weights = (conv_weight, conv_bias, dt_bias, A_log, D, norm_weight)
    args = (zxbcdt, mask, ring, jnp.asarray(slot, jnp.int32), *weights, state)
    floats = dict(lo=np.float32(lo), hi=np.float32(hi), eps=np.float32(eps))
    return _call("granite_mamba_step", outs, *args, aliases={2: 1, 10: 2}, **floats)


def decode_attention(q: Array, k: Array, v: Array, pad: Array, slot: Array, scale: float) -> Array:
    """One query token per row, q (b, kv, rep, d), over k and v (b, kv, S, d): row b attends its slots [pad[b], slot].
    A row with no slot in range gives zeros."""
    out = jax.ShapeDtypeStruct(q.shape, F32)
    slot = jnp.asarray(slot, jnp.int32)
    return _call("granite_decode_attention", out, q, k, v, pad.astype(jnp.int32), slot, scale=np.float32(scale))


def greedy(logits: Array) -> Array:
    """The index (b,) int32 of each row's largest logit in (b, V) float32: the first of equal ones, the first NaN."""
    return _call("granite_greedy", jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32), logits)
