"""One-token SSD state update (decode) as a Pallas (Triton) kernel, updating the state in place.

Same contract as `granite_jax.ssd.ssd_step`: per head, with a = exp(dt * A),

    state <- a * state + dt * x (outer) B          (p, n), float32
    y      = state @ C + D * x

One program per (batch, head, block of p rows of the state). The state is input 0 and output 1 of the kernel, aliased
with `input_output_aliases`, so under `jax.jit(..., donate_argnums=...)` of the state (or inside a jitted decode loop
that carries it) XLA updates it in place; without donation XLA first copies it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _call
from pallas_kernels._common import F32, Array, check_dt_limit, check_int, pad_axis, padded_dim, process_dt


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiling and launch parameters of the decode kernels (`ssd_decode`, `mamba_step`)."""

    block_p: int = 16  # state rows per program
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        check_int("DecodeConfig.block_p", self.block_p, minimum=1, power_of_two=True)
        for name in ("num_warps", "num_stages"):
            check_int(f"DecodeConfig.{name}", getattr(self, name), minimum=1)


def ssd_decode(
    state: Array,
    x: Array,
    dt: Array,
    A: Array,
    B: Array,
    C: Array,
    D: Array,
    *,
    dt_bias: Array | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    config: DecodeConfig | None = None,
) -> tuple[Array, Array]:
    """One token: state (b, h, p, n) float32, x (b, h, p), dt (b, h), A and D (h,), B and C (b, g, n).

    dt is raw when `dt_bias`/`dt_softplus`/`dt_limit` say so (softplus(dt + dt_bias) clamped to dt_limit, applied in
    the kernel), else already processed. Returns (y (b, h, p) float32, new state (b, h, p, n) float32).
    """
    _check_shapes(state, x, dt, A, B, C, D, dt_bias)
    limit = check_dt_limit("ssd_decode", dt_limit)
    if config is not None and not isinstance(config, DecodeConfig):
        raise TypeError(f"ssd_decode: config must be a DecodeConfig or None, got {type(config).__name__}")
    b, h, p = x.shape
    g, n = B.shape[1:]
    cfg = config or DecodeConfig()
    pp, nn = padded_dim(p), padded_dim(n)
    padded = (pp, nn) != (p, n)
    state = pad_axis(pad_axis(state.astype(F32), 2, pp), 3, nn)
    x = pad_axis(x, 2, pp)
    B, C = pad_axis(B, 2, nn), pad_axis(C, 2, nn)
    bias = jnp.zeros((h,), F32) if dt_bias is None else dt_bias.astype(F32)
    bp = min(cfg.block_p, pp)
    group = h // g
    kernel = functools.partial(_decode_kernel, softplus=bool(dt_softplus), limit=limit)
    scalar = pl.BlockSpec((None,), lambda i, j, k: (j,))
    state_block = pl.BlockSpec((None, None, bp, nn), lambda i, j, k: (i, j, k, 0))
    y, state = _call.call(
        kernel,
        name="ssd_decode",
        grid=(b, h, pp // bp),
        in_specs=[
            state_block,
            pl.BlockSpec((None, None, bp), lambda i, j, k: (i, j, k)),  # x
            pl.BlockSpec((None, None), lambda i, j, k: (i, j)),  # dt
            scalar,  # A
            scalar,  # dt_bias
            pl.BlockSpec((None, None, nn), lambda i, j, k: (i, j // group, 0)),  # B
            pl.BlockSpec((None, None, nn), lambda i, j, k: (i, j // group, 0)),  # C
            scalar,  # D
        ],
        out_specs=[pl.BlockSpec((None, None, bp), lambda i, j, k: (i, j, k)), state_block],
        out_shape=[jax.ShapeDtypeStruct((b, h, pp), F32), jax.ShapeDtypeStruct(state.shape, F32)],
        input_output_aliases={0: 1},
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )(state, x, dt, A, bias, B, C, D)
    if padded:
        y, state = y[..., :p], state[:, :, :p, :n]
    return y, state


def _check_shapes(state, x, dt, A, B, C, D, dt_bias) -> None:
    if x.ndim != 3:
        raise ValueError(f"ssd_decode: x must be (b, h, p), got shape {x.shape}")
    b, h, p = x.shape
    if B.ndim != 3 or B.shape[0] != b or C.shape != B.shape:
        raise ValueError(f"ssd_decode: B and C must be (b, g, n) with b={b}; got {B.shape}, {C.shape}")
    g, n = B.shape[1:]
    if g == 0 or h % g:
        raise ValueError(f"ssd_decode: the group count g={g} must divide the head count h={h}")
    if state.shape != (b, h, p, n):
        raise ValueError(f"ssd_decode: state must be (b, h, p, n) = {(b, h, p, n)}, got {state.shape}")
    if dt.shape != (b, h):
        raise ValueError(f"ssd_decode: dt must be (b, h) = {(b, h)}, got {dt.shape}")
    for name, t in (("A", A), ("D", D)) + ((("dt_bias", dt_bias),) if dt_bias is not None else ()):
        if t.shape != (h,):
            raise ValueError(f"ssd_decode: {name} must be (h,) = ({h},), got {t.shape}")


def _decode_kernel(state_ref, x_ref, dt_ref, A_ref, bias_ref, B_ref, C_ref, D_ref, y_ref, new_state_ref, *, softplus,
                   limit):  # fmt: skip
    dt = process_dt(dt_ref[...], bias_ref[...].astype(F32), softplus, limit)
    decay = jnp.exp(jnp.minimum(dt * A_ref[...].astype(F32), 0.0))
    x = x_ref[...].astype(F32)
    state = decay * state_ref[...] + (dt * x)[:, None] * B_ref[...].astype(F32)[None, :]
    new_state_ref[...] = state
    y_ref[...] = jnp.sum(state * C_ref[...].astype(F32)[None, :], axis=1) + D_ref[...].astype(F32) * x
