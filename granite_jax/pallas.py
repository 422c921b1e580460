"""The "pallas" backend: `pallas_kernels`' Triton kernels as the model's SSD, its one-token step, the Mamba mixer's
whole decode step and decode attention over the KV cache (`Runtime(ssd="pallas")`, NVIDIA GPUs; elsewhere they raise
`pallas_kernels.PallasUnavailableError` when traced, except inside the package's test modes). Forward only:
differentiate with the "xla" SSD."""

from __future__ import annotations

import pallas_kernels
from granite_jax import model, ops
from granite_jax.ssd import ssd, ssd_step


def _prefill(reference, x, dt, A, B, C, D, *, chunk_size: int, initial_state=None):
    return pallas_kernels.ssd_prefill(x, dt, A, B, C, D, chunk_size=chunk_size, initial_state=initial_state)


def _decode(reference, state, x, dt, A, B, C, D):
    return pallas_kernels.ssd_decode(state, x, dt, A, B, C, D)


def _mix(reference, mixer, zxbcdt, token_mask, state, slot):
    """One token per row: conv, time steps, state update, D x and the gate in one kernel that updates the ring and the
    state in place (`pallas_kernels.mamba_step`), then the gated norm, whose statistic spans a group's heads."""
    cfg = mixer.cfg
    takes = pallas_kernels.takes_mamba_step(cfg.mamba_d_head, cfg.mamba_d_state) and zxbcdt.dtype == mixer.dtype
    if state is None or zxbcdt.shape[1] != 1 or mixer.blocks != 1 or not takes:  # the kernel reads transformers' order
        return reference(mixer, zxbcdt, token_mask, state, slot)
    bias = None if mixer.conv_bias is None else mixer.conv_bias[...]
    vectors = (mixer.dt_bias[...], mixer.A_log[...], mixer.D[...])
    mask = None if token_mask is None else token_mask[:, 0]
    gated, ring, ssm = pallas_kernels.mamba_step(
        zxbcdt[:, 0], state.conv, slot, mixer.conv_weight[...], bias, *vectors, state.ssm,
        groups=cfg.mamba_n_groups, dt_limit=cfg.time_step_limit, token_mask=mask,
    )  # fmt: skip
    y = model.group_rms_norm(gated[:, None], mixer.norm.weight[...], cfg.mamba_n_groups, cfg.rms_norm_eps, mixer.dtype)
    return y, model.MambaState(ring, ssm)


def _attend(reference, q, cache, pos, scale: float, block: int | None = None):
    """One query per row: flash-decoding over the filled slots (`pallas_kernels.decode_attention`), two launches where
    the plain body loops over blocks of keys."""
    if q.shape[1] != 1 or not pallas_kernels.takes_decode_attention(q.shape[-1], cache.k.shape[2]):
        return reference(q, cache, pos, scale, block)
    return pallas_kernels.decode_attention(q[:, 0], cache.k, cache.v, pos.pad, pos.query_slots[0], scale)[:, None]


ops.register("pallas", ssd, _prefill)
ops.register("pallas", ssd_step, _decode)
ops.register("pallas", model.MambaMixer.mix, _mix, covers=(ssd_step,))
ops.register("pallas", model.attend_cache, _attend)
