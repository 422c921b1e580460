"""Decoding's routed experts as two Pallas (Triton) kernels that read each row's expert in place.

The contract is `granite_jax.model.experts_swiglu` for a few rows (decoding: each token's k chosen experts): row r
goes through expert e = experts[r],

    h_r = silu(x_r @ W_in[e][:, gate]) * (x_r @ W_in[e][:, up])        (the SwiGLU, F channels)
    y_r = h_r @ W_out[e]

`experts_up` computes h, the gate and up products and the SwiGLU in one launch; `experts_down` computes y. One
program per (row, block of output channels) reads its block of the row's expert where it lies in the stacked weights
(E, in, out), indexed by the expert id it loads: no gathered copy of the chosen matrices, which the plain body's
`w[experts]` writes and reads again inside XLA's fusion, and no kernel for the SwiGLU between the products. Products
accumulate in float32 over blocks of the input channels and are rounded to the rows' dtype, as the plain body's are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _call
from pallas_kernels._common import F32, Array

BLOCK_IN, BLOCK_OUT = 128, 16  # input channels per step, output channels per program: ~200 programs at batch 1


def takes_experts(hidden: int, intermediate: int) -> bool:
    """Whether the expert kernels run these dims: both multiples of the blocks."""
    return hidden % BLOCK_IN == 0 and hidden % BLOCK_OUT == 0 and intermediate % BLOCK_IN == 0


def experts_up(x: Array, w_in: Array, experts: Array) -> Array:
    """x (N, H), w_in (E, H, 2F) [gate | up], experts (N, k) -> silu(gate) * up (N k, F) in x's dtype, row n k + j
    for token n's j-th expert (each token read in place for each of its experts: no repeated copy)."""
    (N, H), F2 = x.shape, w_in.shape[2]
    F, k = F2 // 2, experts.shape[-1]
    if w_in.ndim != 3 or w_in.shape[1] != H or F2 % 2 or experts.shape != (N, k) or not takes_experts(H, F):
        raise ValueError(f"experts_up: x {x.shape}, w_in {w_in.shape}, experts {experts.shape}: expected (N, H), "
                         f"(E, H, 2F) and (N, k) with H and F multiples of {BLOCK_IN}")  # fmt: skip
    kernel = functools.partial(_up_kernel, intermediate=F)
    return _products(kernel, "experts_up", x, w_in, experts.reshape(-1), F, per_row=k)


def experts_down(h: Array, w_out: Array, experts: Array) -> Array:
    """h (R, F), w_out (E, F, H), experts (R,) -> h_r @ w_out[experts[r]] (R, H) in h's dtype."""
    (R, F), H = h.shape, w_out.shape[2]
    if w_out.ndim != 3 or w_out.shape[1] != F or experts.shape != (R,) or not takes_experts(H, F):
        raise ValueError(f"experts_down: h {h.shape}, w_out {w_out.shape}, experts {experts.shape}: expected (R, F), "
                         f"(E, F, H) and (R,) with H and F multiples of {BLOCK_IN}")  # fmt: skip
    return _products(_down_kernel, "experts_down", h, w_out, experts, H)


def _products(kernel, name: str, x: Array, w: Array, experts: Array, out: int, per_row: int = 1) -> Array:
    """Row r of the result: x's row r // per_row times w[experts[r]], `out` channels."""
    R = experts.shape[0]
    return _call.call(
        kernel,
        name=name,
        grid=(R, out // BLOCK_OUT),
        in_specs=[
            pl.BlockSpec((None, x.shape[1]), lambda r, n: (r // per_row, 0)),
            pl.BlockSpec(w.shape, lambda r, n: (0, 0, 0)),  # the stacked experts, read where they lie
            pl.BlockSpec((None,), lambda r, n: (r,)),
        ],
        out_specs=[pl.BlockSpec((None, BLOCK_OUT), lambda r, n: (r, n))],
        out_shape=[jax.ShapeDtypeStruct((R, out), x.dtype)],
        num_warps=4,
        num_stages=2,
    )(x, w, experts.astype(jnp.int32))[0]


def _product(x_ref, w_ref, expert, columns: int) -> Array:
    """x_r @ w[expert][:, columns : columns + BLOCK_OUT] in float32, BLOCK_IN input channels a step."""
    total = None
    for c in range(x_ref.shape[0] // BLOCK_IN):
        rows = pl.ds(c * BLOCK_IN, BLOCK_IN)
        part = jnp.sum(x_ref[rows].astype(F32)[:, None] * w_ref[expert, rows, pl.ds(columns, BLOCK_OUT)].astype(F32),
                       axis=0)  # fmt: skip
        total = part if total is None else total + part
    return total


def _up_kernel(x_ref, w_ref, experts_ref, h_ref, *, intermediate):
    expert, columns = experts_ref[...], pl.program_id(1) * BLOCK_OUT
    dtype = h_ref.dtype
    gate = _product(x_ref, w_ref, expert, columns).astype(dtype).astype(F32)
    up = _product(x_ref, w_ref, expert, intermediate + columns).astype(dtype).astype(F32)
    h_ref[...] = (jax.nn.silu(gate) * up).astype(dtype)


def _down_kernel(h_ref, w_ref, experts_ref, y_ref):
    y_ref[...] = _product(h_ref, w_ref, experts_ref[...], pl.program_id(1) * BLOCK_OUT).astype(y_ref.dtype)
