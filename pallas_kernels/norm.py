"""RMSNorm of rows as one Pallas (Triton) kernel: the statistic and its use in one launch.

The contract is `granite_jax.model.rms_norm`: per row of x (R, D) and group of D / groups channels,

    y = (weight * (x / sqrt(mean(x^2) + eps)).astype(dtype)).astype(dtype)

in float32 up to the casts. XLA runs a norm as two kernels, the row's sum of squares and then the multiply (it does
not fuse a reduction into the use of its result); in a decode step of one row per sequence both are a few kilobytes
and their cost is their launches. One program per (row, group) reads the group in chunks of a power of two, held in
registers between the statistic and its use.

`residual_rms_norm` also does the residual add before a layer's second norm, x + update * multiplier, which XLA would
run as a third kernel once the norm is not its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _call
from pallas_kernels._common import F32, Array, pow2_divisor

MAX_CHUNK = 2048  # channels a program holds at once


def norm_chunk(group: int) -> int:
    """The chunk a group of `group` channels is read in: the largest power of two dividing it, at most MAX_CHUNK."""
    return pow2_divisor(group, MAX_CHUNK)


def takes_rms_norm(dim: int, groups: int = 1) -> bool:
    """Whether `rms_norm` runs these dims: groups dividing the channels into chunks of at least 16."""
    return groups >= 1 and dim % groups == 0 and norm_chunk(dim // groups) >= 16


def rms_norm(x: Array, weight: Array, eps: float, *, groups: int = 1, dtype=None, num_warps: int = 4) -> Array:
    """x (R, D), weight (D,) -> (R, D) in `dtype` (default: x's), one RMS statistic per row and group."""
    R, D = x.shape
    if weight.shape != (D,):
        raise ValueError(f"rms_norm: weight must be ({D},) for x {x.shape}, got {weight.shape}")
    if not takes_rms_norm(D, groups):
        raise ValueError(f"rms_norm: {groups} groups of {D} channels must split into chunks of 16 or more")
    dtype = jnp.dtype(dtype or x.dtype)
    group = D // groups
    kernel = functools.partial(_norm_kernel, group=group, chunk=norm_chunk(group), eps=float(eps), dtype=dtype)
    return _call.call(
        kernel,
        name="rms_norm",
        grid=(R, groups),
        in_specs=[pl.BlockSpec((None, D), lambda i, g: (i, 0)), pl.BlockSpec((D,), lambda i, g: (0,))],
        out_specs=[pl.BlockSpec((None, D), lambda i, g: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((R, D), dtype)],
        num_warps=num_warps,
        num_stages=1,
    )(x, weight)[0]


def residual_rms_norm(
    x: Array, update: Array, multiplier: float, weight: Array, eps: float, *, num_warps: int = 4
) -> tuple[Array, Array]:
    """x and update (R, D), weight (D,) -> (x + update * multiplier, its RMSNorm), both in x's dtype: the residual
    add and the norm after it in one launch (the contract of `granite_jax.model.residual_rms_norm`)."""
    R, D = x.shape
    if update.shape != x.shape or weight.shape != (D,):
        raise ValueError(f"residual_rms_norm: update {update.shape} and weight {weight.shape} must be {x.shape} and "
                         f"({D},)")  # fmt: skip
    if not takes_rms_norm(D):
        raise ValueError(f"residual_rms_norm: {D} channels must split into chunks of 16 or more")
    kernel = functools.partial(_residual_norm_kernel, chunk=norm_chunk(D), multiplier=float(multiplier), eps=float(eps))
    rows = pl.BlockSpec((None, D), lambda i: (i, 0))
    out = jax.ShapeDtypeStruct((R, D), x.dtype)
    return tuple(
        _call.call(
            kernel,
            name="residual_rms_norm",
            grid=(R,),
            in_specs=[rows, rows, pl.BlockSpec((D,), lambda i: (0,))],
            out_specs=[rows, rows],
            out_shape=[out, out],
            num_warps=num_warps,
            num_stages=1,
        )(x, update, weight)
    )


def _norm_kernel(x_ref, w_ref, y_ref, *, group, chunk, eps, dtype):
    start = pl.program_id(1) * group
    spans = [pl.ds(start + c * chunk, chunk) for c in range(group // chunk)]
    _normalize([x_ref[span].astype(F32) for span in spans], w_ref, y_ref, spans, eps, dtype)


def _residual_norm_kernel(x_ref, u_ref, w_ref, x_out_ref, y_ref, *, chunk, multiplier, eps):
    dtype = x_out_ref.dtype  # the model's: the update is rounded to it, then the sum, as in plain JAX
    spans = [pl.ds(c * chunk, chunk) for c in range(x_ref.shape[0] // chunk)]
    stream = []
    for span in spans:
        update = (u_ref[span].astype(F32) * multiplier).astype(dtype).astype(F32)
        x = (x_ref[span].astype(F32) + update).astype(dtype)
        x_out_ref[span] = x
        stream.append(x.astype(F32))
    _normalize(stream, w_ref, y_ref, spans, eps, dtype)


def _normalize(chunks: list[Array], w_ref, y_ref, spans: list, eps: float, dtype) -> None:
    """y = weight * (x / rms(x)) rounded to `dtype`, over one group held as `chunks` (float32) at `spans`."""
    total = sum(jnp.sum(jnp.square(chunk)) for chunk in chunks)
    scale = jax.lax.rsqrt(total / (len(chunks) * chunks[0].shape[0]) + eps)
    for chunk, span in zip(chunks, spans):
        normed = (chunk * scale).astype(dtype).astype(F32)
        y_ref[span] = (w_ref[span].astype(F32) * normed).astype(y_ref.dtype)
