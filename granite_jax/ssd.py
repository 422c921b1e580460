"""Mamba-2 state-space duality (SSD): the recurrence and its chunked forms.

Every implementation computes, per head, with the discretised decay a_t = exp(dt_t * A):

    state_t = a_t * state_{t-1} + dt_t * x_t (outer) B_t          state: (p, n)
    y_t     = state_t @ C_t + D * x_t

Shapes: x (b, L, h, p); dt (b, L, h) after softplus and clamp; A, D (h,); B, C (b, L, g, n) with head i reading
group i // (h // g); state (b, h, p, n) in float32.

- `ssd_step` is the one-token recurrence (decode) and `ssd_reference` scans it: the definition, used as the float64
  oracle in tests and by the kernels' tests.
- `ssd_chunked` is the chunked algorithm (Mamba-2 paper §6, `ssd_minimal.py`) with einsum contractions and a scan
  across chunk boundaries: `ssd`, the model's, unless its `ops.Runtime` chooses another ("naive", "pallas").
- `ssd_chunked_naive` is the same algorithm as transformers' historical `torch_forward` wrote it, every contraction a
  broadcast product followed by a sum (sites S1-S6, docs/rewriter.md): `Runtime(ssd="naive")`, the rewriter's input.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from granite_jax import ops

Array = jax.Array
_HIGHEST = lax.Precision.HIGHEST


@ops.replaceable
def ssd(
    x: Array,
    dt: Array,
    A: Array,
    B: Array,
    C: Array,
    D: Array,
    *,
    chunk_size: int,
    initial_state: Array | None = None,
) -> tuple[Array, Array]:
    """Chunked SSD scan. Returns y (b, L, h, p) and the final state (b, h, p, n) in float32 (float64 for float64
    inputs): `ssd_chunked` unless the runtime chooses another implementation (`ops.Runtime.ssd`).

    Shapes and `chunk_size` (a positive int) are checked at trace time, by each implementation: ValueError naming
    the argument."""
    return ssd_chunked(x, dt, A, B, C, D, chunk_size=chunk_size, initial_state=initial_state)


def check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")


def check_shapes(x, dt, A, B, C, D, state=None, *, step: bool = False) -> None:
    """ValueError naming the first argument whose (static) shape does not fit the others'; see the module docstring.

    `step`: the one-token shapes of `ssd_step` (no L axis), where `state` is required."""
    axes = ("b",) if step else ("b", "L")
    x_shape, B_shape = jnp.shape(x), jnp.shape(B)
    _check_rank("x", x_shape, (*axes, "h", "p"))
    _check_rank("B", B_shape, (*axes, "g", "n"))
    lead, (h, p), (g, n) = x_shape[: len(axes)], x_shape[len(axes) :], B_shape[len(axes) :]
    widths = [jnp.shape(t)[-1] for t in (B, C, state) if t is not None and jnp.ndim(t)]
    n = max(widths, key=widths.count)  # the state width most of B, C, state agree on: the odd one out is named
    expected = {
        "dt": ((*axes, "h"), (*lead, h)),
        "A": (("h",), (h,)),
        "B": ((*axes, "g", "n"), (*lead, g, n)),
        "C": ((*axes, "g", "n"), (*lead, g, n)),
        "D": (("h",), (h,)),
        "state" if step else "initial_state": (("b", "h", "p", "n"), (lead[0], h, p, n)),
    }
    given = dict(dt=dt, A=A, B=B, C=C, D=D, state=state, initial_state=state)
    for name, (names, shape) in expected.items():
        if (step or given[name] is not None) and jnp.shape(given[name]) != shape:
            raise ValueError(f"{name}: expected shape ({', '.join(names)}) = {shape}, got {jnp.shape(given[name])}")
    if not g or h % g:
        raise ValueError(f"B, C: their g={g} groups do not divide x's h={h} heads")


def _check_rank(name: str, shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    if len(shape) != len(names):
        raise ValueError(f"{name}: expected shape ({', '.join(names)}), got {shape}")


# ---------------------------------------------------------------------------------------------- the recurrence


@ops.replaceable
def ssd_step(state: Array, x: Array, dt: Array, A: Array, B: Array, C: Array, D: Array) -> tuple[Array, Array]:
    """One token: state (b, h, p, n), x (b, h, p), dt (b, h), B and C (b, g, n). Returns (y (b, h, p), new state).

    In float32 (float64 if the state or x is). Shapes are checked at trace time (ValueError naming the argument).
    """
    check_shapes(x, dt, A, B, C, D, state, step=True)
    dtype = jnp.result_type(state.dtype, x.dtype, jnp.float32)
    state, x, dt, A, B, C, D = (t.astype(dtype) for t in (state, x, dt, A, B, C, D))
    h, g = state.shape[1], B.shape[1]
    Bh, Ch = (jnp.repeat(t, h // g, axis=1) for t in (B, C))
    dtx = dt[..., None] * x
    state = state * jnp.exp(dt * A)[:, :, None, None] + jnp.einsum("bhp,bhn->bhpn", dtx, Bh, precision=_HIGHEST)
    y = jnp.einsum("bhpn,bhn->bhp", state, Ch, precision=_HIGHEST)
    return y + D[:, None] * x, state


def ssd_reference(
    x: Array, dt: Array, A: Array, B: Array, C: Array, D: Array, *, initial_state: Array | None = None
) -> tuple[Array, Array]:
    """The recurrence scanned token by token, in the inputs' precision (float64 inputs give a float64 oracle)."""
    check_shapes(x, dt, A, B, C, D, initial_state)
    b, _, h, p = x.shape
    n = B.shape[-1]
    dtype = jnp.result_type(x.dtype, jnp.float32)
    state = jnp.zeros((b, h, p, n), dtype) if initial_state is None else initial_state.astype(dtype)

    def step(state, inputs):
        xt, dtt, Bt, Ct = inputs
        Bh = jnp.repeat(Bt, h // Bt.shape[1], axis=1).astype(dtype)
        Ch = jnp.repeat(Ct, h // Ct.shape[1], axis=1).astype(dtype)
        state = state * jnp.exp(dtt * A)[:, :, None, None] + (dtt[:, :, None] * xt)[..., None] * Bh[:, :, None, :]
        return state, (state * Ch[:, :, None, :]).sum(-1) + D[:, None] * xt

    xs = tuple(jnp.moveaxis(t.astype(dtype), 1, 0) for t in (x, dt, B, C))
    state, ys = lax.scan(step, state, xs)
    return jnp.moveaxis(ys, 0, 1), state


# ---------------------------------------------------------------------------------------------- chunked: shared


def segsum(a: Array) -> Array:
    """out[..., i, j] = a[..., j+1] + ... + a[..., i] for i >= j, -inf above the diagonal.

    Each entry sums only its own segment rather than being a difference of cumsums, so long chunks of fast-decaying
    heads keep their precision (transformers' `segment_sum`). In blocks of `_segment_block(t)` positions: a segment
    inside one block is summed directly (`_segsum_direct`); one spanning blocks is the sum of three partial sums (the
    tail of its first block, the totals of the whole blocks between, the head of its last block), so no large sums
    are subtracted. O(t^2 * block) work instead of the direct form's O(t^3), which at h-tiny's 256-token chunks cost
    more FLOPs than the rest of the SSD.
    """
    t = a.shape[-1]
    bs = _segment_block(t)
    if bs is None:
        return _segsum_direct(a)
    nb, batch = t // bs, a.shape[:-1]
    blocks = a.reshape(*batch, nb, bs)
    ones = jnp.ones((bs, bs), a.dtype)
    head = jnp.einsum("...Bu,uv->...Bv", blocks, jnp.triu(ones), precision=_HIGHEST)  # a[B, 0..v]
    tail = jnp.einsum("...Bu,vu->...Bv", blocks, jnp.triu(ones, 1), precision=_HIGHEST)  # a[B, v+1..bs-1]
    totals = _segsum_direct(blocks.sum(-1))  # [I-1, J] = totals of blocks J+1..I-1
    between = jnp.concatenate([jnp.zeros((*batch, 1, nb), a.dtype), totals[..., :-1, :]], -2)
    across = head[..., :, :, None, None] + between[..., :, None, :, None] + tail[..., None, None, :, :]  # (I, v, J, u)
    within = _segsum_direct(blocks)  # (..., B, v, u)
    same_block = jnp.eye(nb, dtype=bool)[:, None, :, None]
    within = jnp.broadcast_to(within[..., :, :, None, :], (*batch, nb, bs, nb, bs))  # indexed by I, v, (any J), u
    out = jnp.where(same_block, within, across).reshape(*batch, t, t)
    return jnp.where(jnp.tril(jnp.ones((t, t), bool)), out, -jnp.inf)


def _segment_block(t: int) -> int | None:
    """Block length for `segsum` over t positions; None: sum directly.

    Directly below 128 positions, where the product is cheap: at 64 positions the blocked form is ~10% slower per SSD
    call, at 256 ~22% faster.
    """
    return 16 if t >= 128 and t % 16 == 0 else None


def _segsum_direct(a: Array) -> Array:
    """`segsum` as a product with a lower-triangular matrix of ones: O(t^3), every entry a direct sum.

    As a product because XLA:CPU lowers a cumsum over the chunk axis to a reduce-window, ~10% slower in a 512-token
    prefill of the h-350m shape.
    """
    t = a.shape[-1]
    strictly_lower = jnp.tril(jnp.ones((t, t), bool), -1)
    masked = jnp.where(strictly_lower, a[..., :, None], 0.0)  # masked[..., k, j] = a[k] for k > j
    ones = jnp.tril(jnp.ones((t, t), a.dtype))  # ones[i, k] = 1 for k <= i
    sums = jnp.einsum("ik,...kj->...ij", ones, masked, precision=_HIGHEST)
    return jnp.where(jnp.tril(jnp.ones((t, t), bool)), sums, -jnp.inf)


def _to_chunks(t: Array, chunk_size: int) -> Array:
    """(b, L, ...) -> (b, c, l, ...), zero-padding L up to a multiple of the chunk."""
    pad = -t.shape[1] % chunk_size
    t = jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
    return t.reshape(t.shape[0], -1, chunk_size, *t.shape[2:])


def _discretise(x: Array, dt: Array, A: Array, chunk_size: int) -> tuple[Array, Array]:
    """x * dt as (b, c, l, h, p) and the per-chunk cumulative log-decay cumsum(A * dt) as (b, h, c, l), in float32
    (float64 for float64 inputs)."""
    dtype = jnp.result_type(x.dtype, dt.dtype, jnp.float32)  # float64 inputs stay float64
    xdt = _to_chunks(x.astype(dtype) * dt.astype(dtype)[..., None], chunk_size)
    a = _to_chunks(A.astype(dtype) * dt.astype(dtype), chunk_size)  # (b, c, l, h)
    return xdt, jnp.moveaxis(a, 3, 1)


def _finish(y: Array, x: Array, D: Array, length: int) -> Array:
    """(b, c, l, h, p) -> (b, L, h, p), plus the D skip connection."""
    y = y.reshape(y.shape[0], -1, *y.shape[3:])[:, :length]
    return y + D.astype(y.dtype)[:, None] * x.astype(y.dtype)


def _initial(initial_state: Array | None, like: Array) -> Array:
    return jnp.zeros_like(like) if initial_state is None else initial_state.astype(like.dtype)


# ---------------------------------------------------------------------------------------------- chunked: einsum


def ssd_chunked(
    x: Array,
    dt: Array,
    A: Array,
    B: Array,
    C: Array,
    D: Array,
    *,
    chunk_size: int,
    initial_state: Array | None = None,
    operand_dtype: Any = None,
) -> tuple[Array, Array]:
    """Chunked SSD with dot_general contractions; G = C.B is computed once per group, not per head.

    operand_dtype: None multiplies in float32 at `Precision.HIGHEST`; jnp.bfloat16 rounds each contraction's operands to
    bfloat16 and accumulates in float32, as tensor cores do (and the Pallas kernels): XLA's fastest form on a GPU."""
    check_chunk_size(chunk_size)
    check_shapes(x, dt, A, B, C, D, initial_state)
    b, length, h, p = x.shape
    g, n = B.shape[2:]
    r = h // g
    xdt, a = _discretise(x, dt, A, chunk_size)
    c = xdt.shape[1]
    xdt = xdt.reshape(b, c, chunk_size, g, r, p)
    a = a.reshape(b, g, r, c, chunk_size)
    Bc, Cc = (_to_chunks(t.astype(xdt.dtype), chunk_size) for t in (B, C))  # (b, c, l, g, n)
    a_cs = jnp.cumsum(a, axis=-1)
    ein = functools.partial(_contract, operand_dtype=operand_dtype)

    # Intra-chunk (diagonal blocks): attention-like scores C.B masked by the decay between positions.
    G = ein("bclgn,bcsgn->bgcls", Cc, Bc)
    M = G[:, :, None] * jnp.exp(segsum(a))  # (b, g, r, c, l, s)
    y_diag = ein("bgrcls,bcsgrp->bclgrp", M, xdt)

    # Each chunk's contribution to the state at its end, then the recurrence across chunk boundaries: a scan over
    # chunks, O(c) (the paper's chunk-decay matrix, as in ssd_chunked_naive's S5, is O(c^2) and ~5x slower on CPU).
    decay_to_end = jnp.exp(a_cs[..., -1:] - a_cs)  # (b, g, r, c, l)
    chunk_states = ein("bclgn,bgrcl,bclgrp->bcgrpn", Bc, decay_to_end, xdt)
    init = _initial(initial_state, jnp.zeros((b, h, p, n), xdt.dtype)).reshape(b, g, r, p, n)

    def next_chunk(state, inputs):  # state at a chunk's start -> state at its end
        contribution, decay = inputs
        return state * decay[..., None, None] + contribution, state

    chunk_decay = jnp.moveaxis(jnp.exp(a_cs[..., -1]), -1, 0)  # (c, b, g, r): decay across each whole chunk
    final_state, starts = lax.scan(next_chunk, init, (jnp.moveaxis(chunk_states, 1, 0), chunk_decay), unroll=8)
    states = jnp.moveaxis(starts, 0, 1)  # (b, c, g, r, p, n): the state entering each chunk
    final_state = final_state.reshape(b, h, p, n)

    # Inter-chunk (off-diagonal blocks): each chunk's start state read out by C, decayed to each position.
    y_off = ein("bclgn,bcgrpn,bgrcl->bclgrp", Cc, states, jnp.exp(a_cs))
    y = (y_diag + y_off).reshape(b, c, chunk_size, h, p)
    return _finish(y, x, D, length), final_state


def _contract(spec: str, *operands: Array, operand_dtype: Any = None) -> Array:
    if operand_dtype is None:
        return jnp.einsum(spec, *operands, precision=_HIGHEST)
    cast = (o.astype(operand_dtype) for o in operands)
    return jnp.einsum(spec, *cast, preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------- chunked: naive


def ssd_chunked_naive(
    x: Array, dt: Array, A: Array, B: Array, C: Array, D: Array, *, chunk_size: int, initial_state: Array | None = None
) -> tuple[Array, Array]:
    """The chunked SSD as transformers' `torch_forward` wrote it before einsums: broadcast products plus sums.

    Kept deliberately unoptimised (it materialises e.g. a (b, c, l, s, h, n) product for G) as the input of the
    `rewriter` package. Site names (S1-S6) follow docs/rewriter.md.
    """
    check_chunk_size(chunk_size)
    check_shapes(x, dt, A, B, C, D, initial_state)
    b, length, h, p = x.shape
    g, n = B.shape[2:]
    xdt, a = _discretise(x, dt, A, chunk_size)  # (b, c, l, h, p), (b, h, c, l)
    Bc, Cc = (_to_chunks(jnp.repeat(t.astype(xdt.dtype), h // g, axis=2), chunk_size) for t in (B, C))
    a_cs = jnp.cumsum(a, axis=-1)
    L = jnp.exp(segsum(a))  # (b, h, c, l, s)

    G = (Cc[:, :, :, None, :, :] * Bc[:, :, None, :, :, :]).sum(-1)  # S1: (b, c, l, s, h)
    M = (G[..., None] * jnp.transpose(L, (0, 2, 3, 4, 1))[..., None]).sum(-1)  # S2: sum over a unit axis
    y_diag = (M[..., None] * xdt[:, :, None]).sum(3)  # S3: (b, c, l, h, p)

    decay_states = jnp.exp(a_cs[:, :, :, -1:] - a_cs)  # (b, h, c, l)
    B_decay = Bc * jnp.transpose(decay_states, (0, 2, 3, 1))[..., None]
    states = (B_decay[..., None, :] * xdt[..., None]).sum(2)  # S4: (b, c, h, p, n)

    init = _initial(initial_state, states[:, 0])
    states = jnp.concatenate([init[:, None], states], axis=1)
    decay_chunk = jnp.exp(segsum(jnp.pad(a_cs[:, :, :, -1], [(0, 0), (0, 0), (1, 0)])))  # (b, h, z, s)
    decay_chunk = jnp.transpose(decay_chunk, (0, 3, 2, 1))  # (b, s, z, h)
    new_states = (decay_chunk[..., None, None] * states[:, :, None]).sum(1)  # S5: (b, z, h, p, n)
    states, final_state = new_states[:, :-1], new_states[:, -1]

    C_times_states = Cc[..., None, :] * states[:, :, None]  # S6: (b, c, l, h, p, n)
    y_off = C_times_states.sum(-1) * jnp.transpose(jnp.exp(a_cs), (0, 2, 3, 1))[..., None]
    return _finish(y_diag + y_off, x, D, length), final_state


def _naive(reference, x, dt, A, B, C, D, *, chunk_size: int, initial_state: Array | None = None):
    return ssd_chunked_naive(x, dt, A, B, C, D, chunk_size=chunk_size, initial_state=initial_state)


ops.register("naive", ssd, _naive)  # ops.Runtime(ssd="naive"): the rewriter's input inside the model
