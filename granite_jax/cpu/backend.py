"""The "cpu" backend: which kernel takes each op, for the shapes and dtypes it handles; the plain-JAX op otherwise.

Every kernel goes through `lax.platform_dependent`, so that a function traced here and lowered for another platform
(a deviceless GPU compile, an export) carries the plain-JAX op there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from granite_jax import model, ops, sampling, ssd
from granite_jax.cpu import kernels, packing
from granite_jax.cpu.packing import KERNEL_DTYPES, MAX_ROWS, MIN_ROWS

Array = jax.Array
NAME = "cpu"
CPU_CHUNK = 64  # the SSD's chunk on CPUs: the intra-chunk work grows as L * chunk, and 64 runs ~2.8x faster than 256


def _on_cpu(reference, kernel, *args):
    return lax.platform_dependent(*args, cpu=kernel, default=reference)


def _kernel_dtypes(*arrays: Array) -> bool:
    return all(a.dtype in KERNEL_DTYPES for a in arrays)


def linear(reference, x: Array, w: Array) -> Array:
    """One row: the matrix-vector kernel on w as it is. 2-16 rows of a step given panels (`packing.prepare`): the
    panel kernel. Otherwise XLA's product, a bfloat16 w widened for float32 x right where it is used."""
    rows = math.prod(x.shape[:-1])
    if not (_kernel_dtypes(x, w) and w.ndim == 2):
        return reference(x, w)
    if rows == 1:
        return _on_cpu(reference, lambda x, w: kernels.matvec(x, w).astype(x.dtype), x, w)
    panels = ops.companion(w, NAME)
    if panels is not None and MIN_ROWS <= rows <= MAX_ROWS:
        n = w.shape[0]
        kernel = lambda x, w, p: kernels.panels(x, p, n).astype(x.dtype)  # noqa: E731
        return _on_cpu(lambda x, w, p: reference(x, w), kernel, x, w, panels)
    if w.dtype == jnp.bfloat16 and x.dtype == jnp.float32:
        return _on_cpu(reference, lambda x, w: reference(x, kernels.widen(x, w)), x, w)
    return reference(x, w)


def expert_linear(reference, x: Array, w: Array, experts: Array) -> Array:
    """Any number of rows: each chosen expert read in place, once for all the rows that chose it."""
    if not (x.ndim == 2 and w.ndim == 3 and _kernel_dtypes(x, w)):
        return reference(x, w, experts)
    kernel = lambda x, w, e: kernels.expert_rows(x, w, e).astype(x.dtype)  # noqa: E731
    return _on_cpu(reference, kernel, x, w, experts)


def embedding_rows(reference, table: Array, ids: Array) -> Array:
    """A bfloat16 table read by a kernel: XLA:CPU widens the whole table to gather from it, and a loop of decode steps
    hoists that out of its body, a float32 copy of the table per call."""
    if table.dtype != jnp.bfloat16:
        return reference(table, ids)
    return _on_cpu(reference, kernels.take_rows, table, ids)


def mamba_mix(reference, mixer, zxbcdt: Array, token_mask: Array | None, state, slot) -> tuple[Array, object]:
    """One token per row: conv, SiLU, time steps, state update, D x and the gated norm in one kernel call that updates
    the conv ring and the state in place (XLA runs about ten small fusions per layer around the state update)."""
    weights = [mixer.conv_weight, mixer.conv_bias, mixer.dt_bias, mixer.A_log, mixer.D, mixer.norm.weight]
    weights = [w[...] for w in weights if w is not None]
    if mixer.blocks != 1 or not _takes_mamba_step(zxbcdt, state, weights):  # the kernel reads transformers' order
        return reference(mixer, zxbcdt, token_mask, state, slot)
    b, cfg = zxbcdt.shape[0], mixer.cfg
    mask = jnp.ones((b, 1), jnp.bool_) if token_mask is None else token_mask
    conv_weight = mixer.conv_weight[...]
    bias = jnp.zeros(conv_weight.shape[1:], conv_weight.dtype) if mixer.conv_bias is None else mixer.conv_bias[...]
    rest = (mixer.dt_bias[...], mixer.A_log[...], mixer.D[...], mixer.norm.weight[...])

    def kernel(zxbcdt, mask, ring, ssm, slot):
        limits = dict(time_step_limit=cfg.time_step_limit, eps=cfg.rms_norm_eps)
        y, ring, ssm = kernels.mamba_step(zxbcdt, mask, ring, slot, conv_weight, bias, *rest, ssm, **limits)
        return y, model.MambaState(ring, ssm)

    def xla(zxbcdt, mask, ring, ssm, slot):
        return reference(mixer, zxbcdt, token_mask, model.MambaState(ring, ssm), slot)

    return _on_cpu(xla, kernel, zxbcdt, mask, state.conv, state.ssm, jnp.asarray(slot, jnp.int32))


def _takes_mamba_step(zxbcdt: Array, state, weights: list[Array]) -> bool:
    if state is None or zxbcdt.shape[1] != 1 or state.conv.shape[1] > 16:
        return False
    floats = all(t.dtype == jnp.float32 for t in (zxbcdt, state.conv, state.ssm))
    return floats and len({w.dtype for w in weights}) == 1 and _kernel_dtypes(weights[0])


def attend_cache(reference, q: Array, cache, pos, scale: float, block: int | None = None) -> Array:
    """One query per row (decoding): each (row, KV head)'s keys and values read once, in order, for all the queries of
    its group (XLA runs the online-softmax blocks as a loop of small fusions)."""
    k, v = cache.k, cache.v
    one_query = q.ndim == 5 and q.shape[1] == 1 and k.shape == v.shape
    if not (one_query and q.dtype == jnp.float32 and k.dtype == v.dtype and _kernel_dtypes(k)):
        return reference(q, cache, pos, scale, block)

    def kernel(q, k, v, pad, slots):
        return kernels.decode_attention(q[:, 0], k, v, pad, slots[0], scale)[:, None]

    def xla(q, k, v, pad, slots):
        return reference(q, model.KVState(k, v), model.Positions(slots, pad), scale, block)

    return _on_cpu(xla, kernel, q, k, v, pos.pad, pos.query_slots)


def greedy_tokens(reference, logits: Array) -> Array:
    """One pass per row (XLA's two reductions read the logits twice)."""
    if not (logits.ndim == 2 and logits.dtype == jnp.float32 and 0 < logits.shape[1] < 2**31):
        return reference(logits)
    return _on_cpu(reference, kernels.greedy, logits)


def chunked_ssd(reference, x, dt, A, B, C, D, *, chunk_size: int, initial_state=None):
    """The "xla" SSD in chunks of at most `CPU_CHUNK` on CPUs: the same result up to rounding (the chunk only sets where
    the quadratic intra-chunk form hands over to the state recurrence). Other platforms keep the config's chunk."""
    ssd.check_chunk_size(chunk_size)
    if chunk_size <= CPU_CHUNK:
        return reference(x, dt, A, B, C, D, chunk_size=chunk_size, initial_state=initial_state)

    def chunked(chunk):
        return lambda *args: reference(*args, chunk_size=chunk, initial_state=initial_state)

    return _on_cpu(chunked(chunk_size), chunked(CPU_CHUNK), x, dt, A, B, C, D)


def ssd_step(reference, state: Array, x: Array, dt: Array, A: Array, B: Array, C: Array, D: Array):
    """float32: the state update reads and writes each state slab once, in place (XLA reads the state twice)."""
    if not all(t.dtype == jnp.float32 for t in (state, x, dt, A, B, C, D)):
        return reference(state, x, dt, A, B, C, D)
    ssd.check_shapes(x, dt, A, B, C, D, state, step=True)

    def kernel(state, x, dt, A, B, C, D):
        state, y = kernels.ssm_update(state, jnp.exp(dt * A), dt[..., None] * x, B, C)
        return y + D[:, None] * x, state

    return _on_cpu(reference, kernel, state, x, dt, A, B, C, D)


def register() -> None:
    for op, impl in (
        (model.linear, linear),
        (model.expert_linear, expert_linear),
        (model.embedding_rows, embedding_rows),
        (model.attend_cache, attend_cache),
        (sampling.greedy_tokens, greedy_tokens),
        (ssd.ssd, chunked_ssd),
        (ssd.ssd_step, ssd_step),
    ):
        ops.register(NAME, op, impl)
    ops.register(NAME, model.MambaMixer.mix, mamba_mix, covers=(ssd.ssd_step,))
    found = ops.backend(NAME)
    found.prepare = packing.prepare
