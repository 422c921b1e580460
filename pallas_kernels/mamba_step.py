"""One decode step of a Mamba-2 mixer between its projections, as one Pallas (Triton) kernel.

The contract is `granite_jax.model.MambaMixer.mix` for one token with a state, up to the gated norm's statistic:
from in_proj's output row [z | x B C | dt] (transformers' layout) it computes, per head,

    xBC   = silu(conv over the ring's K-1 last inputs and this one)        (the conv step; `model.conv_step`)
    dt    = clip(softplus(dt + dt_bias), dt_limit),  a = exp(-exp(A_log) dt)
    state <- a * state + dt * x (outer) B                                  (the SSD step; `ssd.ssd_step`)
    y      = state @ C + D * x
    gated  = y * silu(z)

and writes the token's conv input into the ring at slot mod K. The norm of `gated` (one RMS statistic per group of
heads, across programs) is left to the caller: its reduction spans every head of a group, which one program per head
cannot see.

One program per (batch row, head, block of state rows). The whole step is one launch where the model's plain body is
eleven (slices, the conv, dt's softplus and clip, A, the SSD step, the gate), and the state and the ring are updated
in place: they are inputs aliased to outputs (`input_output_aliases`), so under donation (the Generator's decode step)
XLA writes neither anew. A program reads its head's rows of the state once and writes them once: the step's floor.

Numerics follow the model's: the conv and everything after it in float32, the conv's output rounded to the input's
dtype (the model's dtype, in which the model's SSD takes x, B and C), the state float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _call
from pallas_kernels._common import F32, Array, check_dt_limit, process_dt
from pallas_kernels.decode import DecodeConfig


def takes_mamba_step(head_dim: int, state_dim: int) -> bool:
    """Whether `mamba_step` runs these dims: Triton's blocks are powers of two, and the kernel loads a head's rows and
    a group's B and C whole (no padding: that would copy the state)."""
    return all(d > 0 and d & (d - 1) == 0 for d in (head_dim, state_dim))


def mamba_step(
    zxbcdt: Array,
    ring: Array,
    slot: Array | int,
    conv_weight: Array,
    conv_bias: Array | None,
    dt_bias: Array,
    A_log: Array,
    D: Array,
    state: Array,
    *,
    groups: int,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    token_mask: Array | None = None,
    config: DecodeConfig | None = None,
) -> tuple[Array, Array, Array]:
    """One token through the mixer between its projections, but the norm.

    zxbcdt (b, d_inner + conv_dim + h): in_proj's output [z | x B C | dt], d_inner = h p, conv_dim = d_inner + 2 g n.
    ring (b, K, conv_dim): the conv's inputs, slot t's at t mod K (`model.MambaState.conv`). slot: this token's.
    conv_weight (K, conv_dim), conv_bias (conv_dim,) or None; dt_bias, A_log, D (h,); state (b, h, p, n) float32.
    token_mask (b,): False where the row's token is padding, whose conv output is zeroed as the model zeroes it.

    Returns (gated (b, d_inner) float32, the ring with this token's input, the new state). `takes_mamba_step` says
    which dims it runs.
    """
    b, K, conv_dim = ring.shape
    h, (_, _, p, n) = dt_bias.shape[0], state.shape
    _check_shapes(zxbcdt, ring, conv_weight, conv_bias, dt_bias, A_log, D, state, groups)
    if not takes_mamba_step(p, n):
        raise ValueError(f"mamba_step: head_dim {p} and state_dim {n} must be powers of two")
    limit = check_dt_limit("mamba_step", dt_limit)
    if config is not None and not isinstance(config, DecodeConfig):
        raise TypeError(f"mamba_step: config must be a DecodeConfig or None, got {type(config).__name__}")
    cfg = config or DecodeConfig()
    bp = min(cfg.block_p, p)
    width = zxbcdt.shape[1]
    bias = jnp.zeros((conv_dim,), F32) if conv_bias is None else conv_bias
    mask = jnp.ones((b,), jnp.bool_) if token_mask is None else token_mask  # read as it is: a cast is a launch
    slot = jnp.asarray(slot, jnp.int32).reshape(1)
    kernel = functools.partial(_step_kernel, heads=h, groups=groups, head_dim=p, state_dim=n, limit=limit)
    head = pl.BlockSpec((None,), lambda i, j, k: (j,))
    whole = lambda *shape: pl.BlockSpec(shape, lambda i, j, k: (0,) * len(shape))  # noqa: E731
    ring_rows = pl.BlockSpec((None, K, conv_dim), lambda i, j, k: (i, 0, 0))
    state_block = pl.BlockSpec((None, None, bp, n), lambda i, j, k: (i, j, k, 0))
    gated, ring, state = _call.call(
        kernel,
        name="mamba_step",
        grid=(b, h, p // bp),
        in_specs=[
            pl.BlockSpec((None, width), lambda i, j, k: (i, 0)),  # the row [z | x B C | dt]
            pl.BlockSpec((None, None), lambda i, j, k: (i, 2 * h * p + 2 * groups * n + j)),  # its head's dt
            ring_rows,
            pl.BlockSpec((None,), lambda i, j, k: (0,)),  # slot
            whole(K, conv_dim),
            whole(conv_dim),
            head,  # dt_bias
            head,  # A_log
            head,  # D
            pl.BlockSpec((None,), lambda i, j, k: (i,)),  # token mask
            state_block,
        ],
        out_specs=[pl.BlockSpec((None, bp), lambda i, j, k: (i, j * (p // bp) + k)), ring_rows, state_block],
        out_shape=[
            jax.ShapeDtypeStruct((b, h * p), F32),
            jax.ShapeDtypeStruct(ring.shape, ring.dtype),
            jax.ShapeDtypeStruct(state.shape, F32),
        ],
        input_output_aliases={2: 1, 10: 2},
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )(zxbcdt, zxbcdt, ring, slot, conv_weight, bias, dt_bias, A_log, D, mask, state.astype(F32))
    return gated, ring, state


def _check_shapes(zxbcdt, ring, conv_weight, conv_bias, dt_bias, A_log, D, state, groups) -> None:
    if ring.ndim != 3 or state.ndim != 4:
        raise ValueError(f"mamba_step: ring must be (b, K, conv_dim) and state (b, h, p, n); got {ring.shape}, "
                         f"{state.shape}")  # fmt: skip
    b, K, conv_dim = ring.shape
    _, h, p, n = state.shape
    if groups < 1 or h % groups:
        raise ValueError(f"mamba_step: groups={groups} must divide the head count {h}")
    if state.shape[0] != b or conv_dim != h * p + 2 * groups * n:
        raise ValueError(f"mamba_step: ring {ring.shape} must be (b, K, h p + 2 g n) for state {state.shape}, "
                         f"g={groups}")  # fmt: skip
    if zxbcdt.shape != (b, h * p + conv_dim + h):
        raise ValueError(f"mamba_step: zxbcdt must be (b, d_inner + conv_dim + h) = {(b, h * p + conv_dim + h)}, "
                         f"got {zxbcdt.shape}")  # fmt: skip
    if conv_weight.shape != (K, conv_dim) or (conv_bias is not None and conv_bias.shape != (conv_dim,)):
        bias = None if conv_bias is None else conv_bias.shape
        raise ValueError(f"mamba_step: conv weight {conv_weight.shape} and bias {bias} must be {(K, conv_dim)} and "
                         f"{(conv_dim,)}")  # fmt: skip
    for name, t in (("dt_bias", dt_bias), ("A_log", A_log), ("D", D)):
        if t.shape != (h,):
            raise ValueError(f"mamba_step: {name} must be (h,) = ({h},), got {t.shape}")


def _step_kernel(row_ref, dt_ref, ring_ref, slot_ref, w_ref, bias_ref, dt_bias_ref, A_log_ref, D_ref, mask_ref,
                 state_ref, gated_ref, new_ring_ref, new_state_ref, *, heads, groups, head_dim, state_dim,
                 limit):  # fmt: skip
    j, k = pl.program_id(1), pl.program_id(2)
    bp = state_ref.shape[0]
    hp, gn = heads * head_dim, groups * state_dim
    group = j // (heads // groups)
    slot = slot_ref[...]
    K = ring_ref.shape[0]
    dtype = row_ref.dtype
    real = mask_ref[...]

    def conv(channel: Array, size: int) -> tuple[Array, Array]:
        """This token's conv input on channels [channel, channel + size) of x B C, and silu(conv), rounded as the
        model rounds the SSD's inputs. Taps oldest first, the bias last, as `model.weighted_taps` sums them."""
        cur = row_ref[pl.ds(hp + channel, size)]
        cur_tap = cur.astype(new_ring_ref.dtype).astype(dtype)  # the model reads it back from the ring
        # The K-1 inputs before this one; the ring's slot mod K, which this step overwrites, is not among them, so
        # reads and the writes of other programs never meet.
        taps = [ring_ref[(slot + 1 + t) % K, pl.ds(channel, size)].astype(dtype) for t in range(K - 1)]
        out = None
        for t, tap in enumerate([*taps, cur_tap]):
            term = tap.astype(F32) * w_ref[t, pl.ds(channel, size)].astype(F32)
            out = term if out is None else out + term
        out = out + bias_ref[pl.ds(channel, size)].astype(F32)
        return cur, jnp.where(real, jax.nn.silu(out), 0.0).astype(dtype).astype(F32)

    rows = j * head_dim + k * bp
    x_in, x = conv(rows, bp)
    B_in, B = conv(hp + group * state_dim, state_dim)
    C_in, C = conv(hp + gn + group * state_dim, state_dim)
    here = slot % K
    new_ring_ref[here, pl.ds(rows, bp)] = x_in.astype(new_ring_ref.dtype)

    @pl.when((j % (heads // groups) == 0) & (k == 0))  # one program writes its group's B and C inputs
    def _():
        new_ring_ref[here, pl.ds(hp + group * state_dim, state_dim)] = B_in.astype(new_ring_ref.dtype)
        new_ring_ref[here, pl.ds(hp + gn + group * state_dim, state_dim)] = C_in.astype(new_ring_ref.dtype)

    dt = process_dt(dt_ref[...], dt_bias_ref[...].astype(F32), True, limit)
    decay = jnp.exp(dt * -jnp.exp(A_log_ref[...].astype(F32)))
    state = decay * state_ref[...] + (dt * x)[:, None] * B[None, :]
    new_state_ref[...] = state
    y = jnp.sum(state * C[None, :], axis=1) + D_ref[...].astype(F32) * x
    z = row_ref[pl.ds(rows, bp)].astype(F32)
    gated_ref[...] = y * jax.nn.silu(z)
