"""The "pallas" backend: `pallas_kernels`' Triton kernels as the model's SSD and one-token SSD step
(`Runtime(ssd="pallas")`, NVIDIA GPUs; elsewhere they raise `pallas_kernels.PallasUnavailableError` when traced,
except inside the package's test modes). Forward only: differentiate with the "xla" SSD."""

from __future__ import annotations

import pallas_kernels
from granite_jax import ops
from granite_jax.ssd import ssd, ssd_step


def _prefill(reference, x, dt, A, B, C, D, *, chunk_size: int, initial_state=None):
    return pallas_kernels.ssd_prefill(x, dt, A, B, C, D, chunk_size=chunk_size, initial_state=initial_state)


def _decode(reference, state, x, dt, A, B, C, D):
    return pallas_kernels.ssd_decode(state, x, dt, A, B, C, D)


ops.register("pallas", ssd, _prefill)
ops.register("pallas", ssd_step, _decode)
