"""CPU kernels for the memory-bound parts of a decode step, where XLA:CPU leaves bandwidth unused.

- `linear`: y = x W^T for the few rows of a decode step. Decoding multiplies 1-16 rows of activations by every weight
  matrix, once per token: the step is bound by reading the weights. XLA:CPU runs 2-16 rows as library GEMMs at a third
  of the memory bandwidth, and one row at 80-85% of it where rows are short (K = 768) (docs/generation.md); in
  bfloat16 it converts every weight and reaches a few percent of it. Float32 and bfloat16 products of one row, on W as
  it is, and of 2-16 rows, on W's panels (`pack`), go to `csrc/small_matmul.cc`, which streams W once (bfloat16
  weights widened to float32 in registers, float32 arithmetic). x and W may differ: float32 activations on bfloat16
  weights compute what the float32 model of those weights computes, from half the bytes.
- `cast_at_use`: bfloat16 weights widened for XLA's float32 products of many rows (prefill), each right before its
  product (XLA would convert them all at a step's start, a float32 copy of the model alive at once).
- `expert_linear`: y[r] = x[r] W[e[r]] for the (token, expert) rows of a mixture-of-experts layer, W the stacked
  experts (E, K, N). XLA gathers the chosen experts into a copy first (slowly: the gather was most of an h-tiny decode
  step), or, for many rows, runs expert-aligned blocks of padded rows; the kernel reads each chosen expert in place,
  once for all the rows that chose it.
- `ssm_update`: the Mamba-2 state update of one token, state <- decay * state + dt x B^T, and y = state C. XLA runs it
  as an update that reads and writes the state and a product that reads it again; `csrc/ssm_update.cc` reads and
  writes each state slab once (the state is the largest thing a batched decode step touches after the weights).
- `mamba_step`: a Mamba-2 mixer's decoding step between its projections (conv, SiLU, time steps, the state update,
  the gated norm) in one call, where XLA ran about ten small fusions per layer around the state update.
- `decode_attention`: one query token per row over the filled slots of a KV cache (`model.attend_cache` when
  decoding). XLA runs the model's online-softmax blocks as a loop of small fusions; `csrc/decode_attention.cc` reads
  each (row, KV head)'s keys and values once, in order, for all the queries of the group.

All are XLA FFI custom calls for x86-64 CPUs with AVX2 and FMA, compiled into one library with the system C++
compiler on first use and cached (``$GRANITE_JAX_CACHE_DIR`` or ``~/.cache/granite_jax``); on CPUs with AVX-512F
the panel kernel also uses it (``GRANITE_JAX_CPU_AVX512=0`` declines). Without a compiler, on
another CPU, or with ``GRANITE_JAX_CPU_KERNELS=0``, every call is XLA's; `unavailable_reason()` says why. They are not
built where JAX's default backend is not the CPU; where they are, `lax.platform_dependent` still lowers XLA's version
for any other platform (so a function exported for several platforms carries both, and its CPU branch needs this
module's targets registered where it is loaded).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array

MIN_ROWS, MAX_ROWS = 2, 16  # rows for the kernel on packed weights; more (prefill) are left to XLA
GATHER_ROWS = 64  # up to this many rows, XLA's `expert_linear` gathers the chosen experts' matrices
LANES = 8  # rows of w per panel of `pack`: one AVX2 vector of float32
TARGET = "granite_small_matmul"
MATVEC_TARGET = "granite_matvec"
EXPERT_TARGET = "granite_expert_matvec"
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # the products' kernels (float32 arithmetic)
WIDEN_TARGET = "granite_widen"
TAKE_TARGET = "granite_take_rows"
GREEDY_TARGET = "granite_greedy"
SSM_TARGET = "granite_ssm_update_f32"
MAMBA_TARGET = "granite_mamba_step"
ATTENTION_TARGET = "granite_decode_attention"
SOURCES = tuple(
    Path(__file__).parent / "csrc" / name
    for name in ("small_matmul.cc", "ssm_update.cc", "decode_attention.cc", "greedy.cc")
)
HEADERS = (Path(__file__).parent / "csrc" / "parallel.h",)
FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC")
AVX512_FLAGS = ("-mavx512f",)  # added where the CPU has AVX-512F: the panel kernel then takes four panels at once

log = logging.getLogger(__name__)


def dot(x: Array, w: Array) -> Array:
    """x (..., K) contracted with w (N, K) over K: (..., N), by XLA."""
    return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


@jax.jit  # one fused copy per weight shape: eagerly, the pad and the transpose copy separately (2-4x slower)
def pack(w: Array) -> Array:
    """w (N, K) in the kernel's panel layout (ceil(N / 8), K, 8): panel[p, k, c] = w[8p + c, k], zero rows past N.

    A copy: `linear` streams it for the products of decoding and keeps w for everything else (see `Linear`).
    """
    n, k = w.shape
    rows = -(-n // LANES) * LANES
    w = jnp.pad(w, ((0, rows - n), (0, 0)))
    return w.reshape(rows // LANES, LANES, k).transpose(0, 2, 1)


def unpack(packed: Array, n: int) -> Array:
    """The (n, K) matrix of `pack`'s panels."""
    return packed.transpose(0, 2, 1).reshape(-1, packed.shape[1])[:n]


def linear(x: Array, w: Array, packed: Array | None = None) -> Array:
    """x (..., K) @ w (N, K)^T -> (..., N) in x's dtype. On CPUs with the kernels, x and w each float32 or bfloat16
    (float32 arithmetic on w's values, rounded to x's dtype at the end): one row by the matrix-vector kernel on w;
    MIN_ROWS..MAX_ROWS rows, given w's panels (`pack(w)`), by the panel kernel. Otherwise XLA, on w cast to x's dtype
    (so bfloat16 weights under float32 activations give the products of their float32 values either way)."""
    # The kernels are chosen when lowering: on every platform but the CPU, XLA's product with w.
    if uses_matvec(x, w):
        return lax.platform_dependent(x, w, cpu=_matvec, default=_xla_dot)
    if packed is None or not uses_kernel(x, packed):
        return _xla_dot(x, w)
    n = w.shape[0]
    return lax.platform_dependent(
        x, w, packed, cpu=lambda x, w, p: _kernel(x, p, n), default=lambda x, w, p: _xla_dot(x, w)
    )


def _xla_dot(x: Array, w: Array) -> Array:
    return dot(x, cast_at_use(w, x))


def _tangent_dot(x: Array, w: Array) -> Array:  # for the JVPs: XLA's cast, which JAX can transpose (`_widen` it cannot)
    return dot(x, w.astype(x.dtype))


def cast_at_use(w: Array, x: Array) -> Array:
    """w in x's dtype for a product with x. Left to schedule a step's weight conversions, XLA:CPU runs them all at the
    step's start, alive at once: a float32 copy of every bfloat16 weight in temporary memory (1 GB for h-350m's
    prefill; an optimization barrier does not survive its passes). On CPUs with the kernels, bfloat16 weights are
    widened by a kernel that takes x as an (unread) operand, so that each conversion waits for its product's input."""
    if w.dtype == x.dtype:
        return w
    if w.dtype == jnp.bfloat16 and x.dtype == jnp.float32 and available():
        return lax.platform_dependent(x, w, cpu=_widen, default=lambda x, w: w.astype(x.dtype))
    return w.astype(x.dtype)


@jax.custom_jvp
def _widen(x: Array, w: Array) -> Array:
    return jax.ffi.ffi_call(WIDEN_TARGET, jax.ShapeDtypeStruct(w.shape, jnp.float32), vmap_method="sequential")(x, w)


@_widen.defjvp
def _widen_jvp(primals, tangents):  # linear in w, constant in x
    return _widen(*primals), tangents[1].astype(jnp.float32)


def take_rows(table: Array, ids: Array) -> Array:
    """table[ids] in float32 for a (V, H) table and integer ids (...): (..., H), rows of NaN for ids outside [0, V).
    On CPUs with the kernels a bfloat16 table is read by a kernel: XLA:CPU widens the whole table to gather from it,
    which a loop of decode steps hoists out of its body, a float32 copy of the table per call."""
    ids = ids.astype(jnp.int32)
    if table.dtype == jnp.bfloat16 and available():
        return lax.platform_dependent(table, ids, cpu=_take_kernel, default=_take_xla)
    return _take_xla(table, ids)


def _take_xla(table: Array, ids: Array) -> Array:
    ids = jnp.where(ids < 0, table.shape[0], ids)  # past the end: `take` would wrap negative ids around (-1: last row)
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan).astype(jnp.float32)


@jax.custom_jvp
def _take_kernel(table: Array, ids: Array) -> Array:
    out = jax.ShapeDtypeStruct((*ids.shape, table.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TAKE_TARGET, out, vmap_method="sequential")(ids, table)


@_take_kernel.defjvp
def _take_kernel_jvp(primals, tangents):  # linear in the table: XLA's gather of its tangent, which JAX can transpose
    table, ids = primals
    return _take_kernel(table, ids), _take_xla(tangents[0], ids)


def expert_linear(x: Array, w: Array, experts: Array) -> Array:
    """x (R, K) rows each through its expert's matrix: y[r] = x[r] @ w[experts[r]], w (E, K, N), experts (R,) int ->
    (R, N) in x's dtype. On CPUs with the kernels, x and w each float32 or bfloat16 (float32 arithmetic), each
    chosen expert is read in place, once for all its rows; otherwise XLA: a gather of the chosen experts (then a cast
    to x's dtype) for up to `GATHER_ROWS` rows, and expert-aligned blocks (`_expert_blocks`) for more. Expert ids
    outside [0, E) are an error in the kernel (XLA's gather would clamp them)."""
    if uses_expert_kernel(x, w):
        return lax.platform_dependent(x, w, experts, cpu=_expert_kernel, default=_expert_xla)
    return _expert_xla(x, w, experts)


def uses_expert_kernel(x: Array, w: Array) -> bool:
    """Whether `expert_linear(x, w, experts)` runs the kernel when lowered for a CPU."""
    return x.ndim == 2 and w.ndim == 3 and _kernel_dtypes(x, w) and available()


def _expert_xla(x: Array, w: Array, experts: Array) -> Array:
    if x.shape[0] <= GATHER_ROWS:
        return jnp.einsum("rk,rkn->rn", x, w[experts].astype(x.dtype))  # only the chosen experts are cast
    return _expert_blocks(x, w, experts)


def _expert_blocks(x: Array, w: Array, experts: Array, block: int = 32) -> Array:
    """`expert_linear` by XLA for many rows, without the gather's (R, K, N) copy: the rows sorted by expert, each
    expert's group padded to whole blocks of `block` rows, and every block through its one expert's matrix
    (megablocks' layout; padding adds at most one partial block per expert)."""
    (R, K), (E, _, N) = x.shape, w.shape
    experts = jnp.asarray(experts)
    order = jnp.argsort(experts, stable=True)
    sorted_experts = experts[order]
    sizes = jnp.bincount(experts, length=E)
    padded_sizes = -(-sizes // block) * block
    padded_ends = jnp.cumsum(padded_sizes)
    rank = jnp.arange(R) - (jnp.cumsum(sizes) - sizes)[sorted_experts]  # position within the expert's group
    slots = jnp.zeros(R, jnp.int32).at[order].set((padded_ends - padded_sizes)[sorted_experts] + rank)
    num_blocks = -(-R // block) + min(E, R)
    padded = jnp.zeros((num_blocks * block, K), x.dtype).at[slots].set(x, unique_indices=True)
    block_experts = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(num_blocks) * block, side="right"), E - 1)
    used_blocks = padded_ends[-1] // block

    def compute(b, out):
        rows = lax.dynamic_slice_in_dim(padded, b * block, block)
        return lax.dynamic_update_slice_in_dim(out, rows @ w[block_experts[b]].astype(x.dtype), b * block, 0)

    def run_block(b, out):  # trailing blocks past the last expert's group are padding: skipped, left zero
        return lax.cond(b < used_blocks, compute, lambda b, out: out, b, out)

    # A static trip count (a scan, so that it stays reverse-differentiable), with the work of unused blocks skipped.
    out = lax.fori_loop(0, num_blocks, run_block, jnp.zeros((num_blocks * block, N), x.dtype))
    return out[slots]


@jax.custom_jvp
def _expert_kernel(x: Array, w: Array, experts: Array) -> Array:
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32)
    call = jax.ffi.ffi_call(EXPERT_TARGET, out, vmap_method="sequential")
    return call(x.astype(jnp.float32), w, experts.astype(jnp.int32)).astype(x.dtype)


@_expert_kernel.defjvp
def _expert_kernel_jvp(primals, tangents):  # bilinear in (x, w): XLA's version, so that JAX can transpose it
    (x, w, experts), (dx, dw, _) = primals, tangents
    return _expert_kernel(x, w, experts), _expert_xla(dx, w, experts) + _expert_xla(x, dw, experts)


def uses_matvec(x: Array, w: Array) -> bool:
    """Whether `linear(x, w)` runs the matrix-vector kernel when lowered for a CPU."""
    return math.prod(x.shape[:-1]) == 1 and w.ndim == 2 and _kernel_dtypes(x, w) and available()


def _kernel_dtypes(x: Array, w: Array) -> bool:
    return x.dtype in KERNEL_DTYPES and w.dtype in KERNEL_DTYPES


def uses_kernel(x: Array, packed: Array) -> bool:
    """Whether `linear(x, w, packed)` runs the kernel when lowered for a CPU."""
    rows = math.prod(x.shape[:-1])
    return (
        _kernel_dtypes(x, packed)
        and MIN_ROWS <= rows <= MAX_ROWS
        and packed.ndim == 3
        and packed.shape[2] == LANES
        and available()
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _kernel(x: Array, packed: Array, n: int) -> Array:
    out = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x.astype(jnp.float32), packed).astype(x.dtype)


@jax.custom_jvp
def _matvec(x: Array, w: Array) -> Array:
    out = jax.ShapeDtypeStruct((*x.shape[:-1], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(MATVEC_TARGET, out, vmap_method="sequential")(x.astype(jnp.float32), w).astype(x.dtype)


@_matvec.defjvp
def _matvec_jvp(primals, tangents):  # bilinear, written with XLA products so that JAX can transpose it
    (x, w), (dx, dw) = primals, tangents
    return _matvec(x, w), _tangent_dot(dx, w) + _tangent_dot(x, dw)


@_kernel.defjvp
def _kernel_jvp(n, primals, tangents):
    # The product is bilinear; its tangent is written with XLA products, which JAX can transpose (gradients).
    (x, packed), (dx, dpacked) = primals, tangents
    return _kernel(x, packed, n), _tangent_dot(dx, unpack(packed, n)) + _tangent_dot(x, unpack(dpacked, n))


def ssm_update(state: Array, decay: Array, dtx: Array, B: Array, C: Array) -> tuple[Array, Array]:
    """The state update of one token of the Mamba-2 recurrence (`ssd.ssd_step` adds D x and calls this).

    state (b, h, p, n), decay (b, h), dtx = dt * x (b, h, p), B and C (b, g, n) with g dividing h. Returns the new
    state and y = new_state . C (b, h, p). All float32 on a CPU: the kernel (updating the state buffer in place);
    otherwise XLA.
    """
    if not all(t.dtype == jnp.float32 for t in (state, decay, dtx, B, C)) or not available():
        return _ssm_update_xla(state, decay, dtx, B, C)
    return lax.platform_dependent(state, decay, dtx, B, C, cpu=_ssm_kernel, default=_ssm_update_xla)


def _ssm_update_xla(state: Array, decay: Array, dtx: Array, B: Array, C: Array) -> tuple[Array, Array]:
    h, g = state.shape[1], B.shape[1]
    Bh, Ch = (jnp.repeat(t, h // g, axis=1) for t in (B, C))
    state = state * decay[:, :, None, None] + jnp.einsum("bhp,bhn->bhpn", dtx, Bh, precision=lax.Precision.HIGHEST)
    return state, jnp.einsum("bhpn,bhn->bhp", state, Ch, precision=lax.Precision.HIGHEST)


@jax.custom_jvp
def _ssm_kernel(state: Array, decay: Array, dtx: Array, B: Array, C: Array) -> tuple[Array, Array]:
    outs = (jax.ShapeDtypeStruct(state.shape, jnp.float32), jax.ShapeDtypeStruct(dtx.shape, jnp.float32))
    call = jax.ffi.ffi_call(SSM_TARGET, outs, input_output_aliases={0: 0}, vmap_method="sequential")
    return call(state, decay, dtx, B, C)


@_ssm_kernel.defjvp
def _ssm_kernel_jvp(primals, tangents):  # the tangent of XLA's version, so that JAX can transpose it (gradients)
    return _ssm_kernel(*primals), jax.jvp(_ssm_update_xla, primals, tangents)[1]


def mamba_step(
    zxbcdt: Array,
    token_mask: Array | None,
    ring: Array,
    slot: Array | int,
    weights: tuple,
    state: Array,
    time_step_limit: tuple[float, float],
    eps: float,
    reference: Callable[..., tuple[Array, Array, Array]],
) -> tuple[Array, Array, Array]:
    """`model.mixer_middle` for one token per row: zxbcdt (b, 1, d_inner + conv_dim + h) after the conv ring (b, K,
    conv_dim) and the state (b, h, p, n) -> (y (b, 1, d_inner), ring, state). weights: (conv weight, conv bias or
    None, dt_bias, A_log, D, norm weight) (`model.MambaWeights`); token_mask (b, 1) or None (all real).
    `reference(zxbcdt, token_mask, ring, slot, weights, state)` is XLA's version, which also gives the kernel's tangent.
    On CPUs with the kernels, float32 activations, ring and state and float32 or bfloat16 weights of one dtype: one
    kernel call (`csrc/ssm_update.cc`, float32 arithmetic) that updates the ring and the state in place; otherwise
    `reference`."""
    args = (zxbcdt, token_mask, ring, slot, weights, state)
    if not uses_mamba_kernel(zxbcdt, ring, state, weights):
        return reference(*args)
    lo, hi = time_step_limit
    kernel = functools.partial(_mamba_kernel, float(lo), float(hi), float(eps), reference)
    return lax.platform_dependent(*args, cpu=kernel, default=reference)


def uses_mamba_kernel(zxbcdt: Array, ring: Array, state: Array, weights: tuple) -> bool:
    """Whether `mamba_step` runs the kernel when lowered for a CPU."""
    present = [w for w in weights if w is not None]
    shapes = zxbcdt.ndim == 3 and zxbcdt.shape[1] == 1 and ring.ndim == 3 and ring.shape[1] <= 16 and state.ndim == 4
    floats = all(t.dtype == jnp.float32 for t in (zxbcdt, ring, state))
    one_dtype = len({w.dtype for w in present}) == 1 and present[0].dtype in KERNEL_DTYPES
    return shapes and floats and one_dtype and available()


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _mamba_kernel(lo, hi, eps, reference, zxbcdt, token_mask, ring, slot, weights, state):
    b = zxbcdt.shape[0]
    mask = jnp.ones((b, 1), jnp.bool_) if token_mask is None else token_mask
    conv_weight, conv_bias, *rest = weights
    bias = jnp.zeros(conv_weight.shape[1:], conv_weight.dtype) if conv_bias is None else conv_bias
    y = jax.ShapeDtypeStruct((b, 1, state.shape[1] * state.shape[2]), jnp.float32)
    outs = (y, jax.ShapeDtypeStruct(ring.shape, jnp.float32), jax.ShapeDtypeStruct(state.shape, jnp.float32))
    call = jax.ffi.ffi_call(MAMBA_TARGET, outs, input_output_aliases={2: 1, 10: 2}, vmap_method="sequential")
    floats = dict(lo=np.float32(lo), hi=np.float32(hi), eps=np.float32(eps))
    return call(zxbcdt, mask, ring, jnp.asarray(slot, jnp.int32), conv_weight, bias, *rest, state, **floats)


@_mamba_kernel.defjvp
def _mamba_kernel_jvp(lo, hi, eps, reference, primals, tangents):  # XLA's tangent, which JAX can transpose
    return _mamba_kernel(lo, hi, eps, reference, *primals), jax.jvp(reference, primals, tangents)[1]


def decode_attention(
    q: Array, k: Array, v: Array, pad: Array, slot: Array, scale: float, reference: Callable[..., Array]
) -> Array:
    """Attention of one query token per row over a KV cache: q (b, 1, kv, rep, d), k and v (b, kv, S, d), each row b
    attending its slots [pad[b], slot] (slot: the query's own, a scalar) with scores scale * q . k. Returns
    (b, 1, kv, rep, d) in q's dtype. On CPUs with the kernels, float32 q on float32 or bfloat16 k and v: the kernel
    (float32 arithmetic; a row with no slot in range gives zeros, which decoding never asks for); otherwise
    `reference(q, k, v, pad, slot)`, XLA's version with the same signature (`model.attend_cache`'s blocks), which also
    gives the kernel's tangent."""
    if not uses_attention_kernel(q, k, v):
        return reference(q, k, v, pad, slot)
    kernel = functools.partial(_attention_kernel, float(scale), reference)
    return lax.platform_dependent(q, k, v, pad, slot, cpu=kernel, default=reference)


def greedy(logits: Array, reference: Callable[[Array], Array]) -> Array:
    """The index (b,) int32 of each row's largest logit in (b, V) float32, the first of equal ones, the first NaN where
    a row has one: on CPUs with the kernels one pass per row (a kernel), otherwise `reference(logits)`, XLA's version
    (`sampling.greedy_tokens`' two reductions)."""
    if not (logits.ndim == 2 and logits.dtype == jnp.float32 and 0 < logits.shape[1] < 2**31 and available()):
        return reference(logits)
    kernel = jax.ffi.ffi_call(
        GREEDY_TARGET, jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32), vmap_method="sequential"
    )
    return lax.platform_dependent(logits, cpu=kernel, default=reference)


def uses_attention_kernel(q: Array, k: Array, v: Array) -> bool:
    """Whether `decode_attention(q, k, v, ...)` runs the kernel when lowered for a CPU."""
    shapes = q.ndim == 5 and q.shape[1] == 1 and k.ndim == 4 and k.shape == v.shape
    return shapes and q.dtype == jnp.float32 and k.dtype == v.dtype and k.dtype in KERNEL_DTYPES and available()


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _attention_kernel(scale: float, reference, q: Array, k: Array, v: Array, pad: Array, slot: Array) -> Array:
    call = jax.ffi.ffi_call(
        ATTENTION_TARGET, jax.ShapeDtypeStruct(q[:, 0].shape, jnp.float32), vmap_method="sequential"
    )
    out = call(q[:, 0], k, v, pad.astype(jnp.int32), jnp.asarray(slot, jnp.int32), scale=np.float32(scale))
    return out[:, None]


@_attention_kernel.defjvp
def _attention_kernel_jvp(scale, reference, primals, tangents):  # XLA's tangent, which JAX can transpose
    return _attention_kernel(scale, reference, *primals), jax.jvp(reference, primals, tangents)[1]


def available() -> bool:
    """Whether `linear`, `ssm_update` and the others can use the kernels here (compiles and loads them on the first
    call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why the kernels are not used (None when they are)."""
    return _load()


def describe() -> str:
    """What runs the decode products, the expert products, the Mamba state update and decoding step, decode attention,
    greedy sampling and the bfloat16 embedding lookup on CPUs here (for records)."""
    reason = _load()
    if reason is not None:
        return f"XLA ({reason})"
    products = f"float32/bfloat16 products of 1 row, and of {MIN_ROWS}-{MAX_ROWS} rows on packed weights"
    if panels_use_avx512():
        products += " (AVX-512)"
    return (
        f"cpu_kernels: {products}; expert products (decode and prefill); Mamba state update and decoding step; "
        "decode attention; greedy sampling; bfloat16 embedding lookup"
    )


def panels_use_avx512() -> bool:
    """Whether the loaded library's panel kernel takes its AVX-512 path (False where the kernels are not used)."""
    return _load() is None and bool(_LIBRARY[0].granite_panels_avx512())


_LOCK = threading.Lock()
_LIBRARY: list[ctypes.CDLL] = []  # the loaded library, once built


def _load() -> str | None:
    with _LOCK:  # one build and one registration even when threads trace at once
        return _build_and_register()


@functools.cache
def _build_and_register() -> str | None:
    reason = _unsupported()
    if reason is not None:
        log.info("granite_jax.cpu_kernels: using XLA (%s)", reason)
        return reason
    try:
        try:
            library = ctypes.CDLL(str(_compiled_library(_flags())))
        except subprocess.CalledProcessError as e:  # a compiler without AVX-512: the AVX2 build
            if _flags() == FLAGS:
                raise
            detail = (e.stderr or "").strip().splitlines()[-1:]
            log.warning("granite_jax.cpu_kernels: the AVX-512 build failed (%s); building for AVX2", *detail or ["?"])
            library = ctypes.CDLL(str(_compiled_library(FLAGS)))
        targets = (TARGET, MATVEC_TARGET, EXPERT_TARGET, WIDEN_TARGET, TAKE_TARGET, GREEDY_TARGET, SSM_TARGET)
        for target in (*targets, MAMBA_TARGET, ATTENTION_TARGET):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
        _LIBRARY.append(library)
    except (OSError, subprocess.CalledProcessError, AttributeError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
        reason = f"could not build or load {_names()}: {detail[-1] if detail else type(e).__name__}"
        log.warning("granite_jax.cpu_kernels: using XLA (%s)", reason)  # expected to work here: say so
    return reason


def _unsupported() -> str | None:
    if os.environ.get("GRANITE_JAX_CPU_KERNELS", "1") == "0":
        return "disabled by GRANITE_JAX_CPU_KERNELS=0"
    if jax.default_backend() != "cpu":
        return f"JAX's default backend is {jax.default_backend()}, not cpu"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux on x86-64, this is {platform.system()} on {platform.machine()}"
    flags = _cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return "the CPU lacks AVX2 or FMA"
    if _compiler() is None:
        return "no C++ compiler (set CXX, or install g++)"
    return None


def cpuinfo(field: str) -> str | None:
    """The first value of `field` ("flags", "model name", ...) in Linux's /proc/cpuinfo; None elsewhere or if absent."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            return value.strip()
    return None


def _cpu_flags() -> set[str]:
    return set((cpuinfo("flags") or "").split())


def _uses_avx512() -> bool:
    """Whether the library is built with `AVX512_FLAGS`: the CPU has AVX-512F, and GRANITE_JAX_CPU_AVX512 is not 0."""
    return "avx512f" in _cpu_flags() and os.environ.get("GRANITE_JAX_CPU_AVX512", "1") != "0"


def _flags() -> tuple[str, ...]:
    return FLAGS + AVX512_FLAGS if _uses_avx512() else FLAGS


def _compiler() -> str | None:
    return next(filter(None, (shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++"))), None)


def cache_dir() -> Path:
    return Path(os.environ.get("GRANITE_JAX_CACHE_DIR") or Path.home() / ".cache" / "granite_jax")


def _names() -> str:
    return " + ".join(source.name for source in SOURCES)


def _run_compiler(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _compiled_library(flags: tuple[str, ...]) -> Path:
    """The kernels' shared library, compiled once per (sources, flags, compiler, jaxlib) and reused."""
    compiler = _compiler()
    include = jax.ffi.include_dir()
    texts = [source.read_text() for source in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, *flags, str(compiler), jax.__version__, include]).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("granite_jax.cpu_kernels: compiling %s -> %s", _names(), target)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # then an atomic rename: safe with parallel builds
        built = Path(tmp) / target.name
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        # One compiler per source at once (each spends most of its time parsing the FFI headers), then one link.
        compiles = [[compiler, *flags, "-c", f"-I{include}", str(s), "-o", str(o)] for s, o in zip(SOURCES, objects)]
        with ThreadPoolExecutor(max_workers=max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
            list(pool.map(_run_compiler, compiles))
        _run_compiler([compiler, *flags, *map(str, objects), "-o", str(built)])
        os.replace(built, target)
    return target
