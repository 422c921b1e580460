"""The "gpu" backend (`Runtime(kernels=True)` on a GPU, or `platform="gpu"` when compiling for one without it): XLA
formulations that suit a GPU better than the model's plain ones. Plain JAX, so it runs and is tested anywhere.

- `expert_linear` for many rows (prefill, where `grouped_is_faster`): a grouped product on tensor cores. XLA's GPU
  compiler turns the plain body's `lax.ragged_dot` into a dense product of every row with every expert (64x the work of
  h-tiny's prefill). Here the rows, sorted by expert, are laid out in blocks of `block` rows, each block one expert's
  (a group's last block padded with zero rows), and multiplied block by block with their expert's matrix: one batched
  GEMM, as MegaBlocks' block-sparse products do (Gale et al. 2023). There are at most ceil(R / block) + E blocks, so
  the shapes are static.
- `scaled_linear` (float8 weights): tensor cores' float8 GEMM. The activations are quantized to float8 per row as the
  product runs (scale max|x| / 448, as the released FP8 checkpoints' "dynamic, per token" activations are), multiplied
  with the float8 weights accumulating in float32, and each output rescaled by its row's and its channel's scales:
  x @ (s_w w)^T = s_x s_w (x / s_x) @ w^T. XLA lowers a float8 x float8 dot to cuBLASLt's FP8 GEMM on Hopper.

`COMPILER_OPTIONS`: the XLA options the Generator compiles its steps with on a GPU (every kernel inside CUDA graphs).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array, lax

from granite_jax import model, ops

# XLA options for the programs the project compiles for a GPU (the Generator's steps, the deviceless report). A decode
# step of h-tiny is some 700 small kernels: launched one by one from the host they cost more than they compute, so
# every one of them goes into a CUDA graph (an XLA command buffer). XLA leaves out of graphs the kernels of control
# flow (the step's greedy-or-sampled conditional; the on-device decode loop) unless CONDITIONAL and WHILE are listed,
# which CUDA's conditional graph nodes run, and any run of fewer than `xla_gpu_graph_min_graph_size` kernels (the
# greedy branch's four).
COMMAND_BUFFER = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "DYNAMIC_SLICE_FUSION", "CONDITIONAL",
                  "WHILE")  # fmt: skip
COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ",".join(COMMAND_BUFFER), "xla_gpu_graph_min_graph_size": 1}
MIN_BLOCK, MAX_BLOCK = 16, 512  # rows per block: a tensor-core tile's worth at least, and enough to reuse a weight
BYTES_PER_S, FLOPS_PER_S = 4.8e12, 989e12  # an H200's HBM and dense bfloat16 rates, to choose between products


def grouped_is_faster(rows: int, w_shape: tuple[int, int, int], itemsize: int) -> bool:
    """Whether the grouped product of `rows` rows with experts `w_shape` (E, K, N) is predicted faster than the plain
    body's `ragged_dot`, which XLA's GPU compiler multiplies densely: every row by all E experts (2 E R K N FLOPs,
    every matrix read once). The grouped one multiplies ceil(R / block) + E blocks of `block` rows, each with its
    expert's matrix gathered, written and read again (3 passes over blocks x K x N). Each costs the larger of its
    bytes and FLOPs at an H200's rates: h-tiny's and h-small's decode at batch 64 (384 and 640 rows, 6 and 9 an
    expert) stay dense, their prefills of 512 tokens and more are grouped. (Reading each expert's matrix once, as a
    grouped GEMM kernel would, beats both at decode: not written yet.)"""
    E, K, N = w_shape
    block = block_rows(rows, E)
    blocks = -(-rows // block) + E
    dense = max(2.0 * E * rows * K * N / FLOPS_PER_S, (E * K * N + rows * (K + N)) * itemsize / BYTES_PER_S)
    grouped = max(2.0 * blocks * block * K * N / FLOPS_PER_S, 3.0 * blocks * K * N * itemsize / BYTES_PER_S)
    return grouped < dense


def block_rows(rows: int, experts: int) -> int:
    """Rows per block: the power of two nearest above the rows an expert gets on average, within [16, 512], so that
    padding costs at most one block per expert while a block still reuses its weights across many rows."""
    mean = max(1, -(-rows // experts))
    return min(MAX_BLOCK, max(MIN_BLOCK, 1 << (mean - 1).bit_length()))


def grouped_expert_linear(x: Array, w: Array, experts: Array, block: int | None = None) -> Array:
    """y[r] = x[r] @ w[experts[r]] (x (R, K), w (E, K, N), experts (R,) -> (R, N) in x's dtype) as one batched product
    over blocks of rows that share an expert."""
    (R, K), E = x.shape, w.shape[0]
    block = block or block_rows(R, E)
    n_blocks = -(-R // block) + E
    order = jnp.argsort(experts, stable=True)
    sorted_experts = experts[order]
    sizes = jnp.bincount(experts, length=E)
    padded = -(-sizes // block) * block  # each group rounded up to whole blocks
    starts, padded_starts = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded
    slot = padded_starts[sorted_experts] + jnp.arange(R) - starts[sorted_experts]  # a sorted row's place in the blocks
    # Rows move by gathers only: a zero-filled buffer scattered into depends on nothing, so XLA allocates every
    # layer's up front and holds them all (gigabytes at 8 prefill rows of 512 tokens).
    source = jnp.full((n_blocks * block,), R, jnp.int32).at[slot].set(order.astype(jnp.int32), unique_indices=True)
    blocks = jnp.take(x, source, axis=0, mode="fill", fill_value=0)  # padding slots point past the rows: zeros
    block_expert = jnp.searchsorted(
        jnp.cumsum(padded), jnp.arange(n_blocks) * block, side="right", method="compare_all"
    )
    weights = w[jnp.minimum(block_expert, E - 1)].astype(x.dtype)  # blocks past the last group hold zeros
    y = jnp.einsum("bik,bkn->bin", blocks.reshape(n_blocks, block, K), weights).reshape(n_blocks * block, -1)
    place = jnp.zeros((R,), jnp.int32).at[order].set(slot.astype(jnp.int32), unique_indices=True)  # row -> slot
    return jnp.take(y, place, axis=0)


def float8_linear(x: Array, w: Array, scale: Array) -> Array:
    """x (..., K) @ (scale[:, None] * w)^T for a float8 w (N, K), with x quantized to float8 per row."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    row_scale = jnp.where(amax > 0, amax / model.FLOAT8_MAX, 1.0)
    q = (x32 / row_scale).astype(w.dtype)
    y = lax.dot_general(q, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * row_scale * scale).astype(x.dtype)


def _scaled_linear(reference, x: Array, w: Array, scale: Array) -> Array:
    if not model.is_float8(w.dtype) or x.dtype == jnp.float32:  # float32 arithmetic asks for the plain widening
        return reference(x, w, scale)
    return float8_linear(x, w, scale)


def takes_grouped(rows: int, w_shape: tuple[int, int, int], itemsize: int) -> bool:
    """Whether this backend's `expert_linear` runs the grouped product: past the rows the plain body gathers the
    chosen experts' matrices for (decoding), where `grouped_is_faster`."""
    return rows > model.GATHER_ROWS and grouped_is_faster(rows, w_shape, itemsize)


def _expert_linear(reference, x: Array, w: Array, experts: Array) -> Array:
    if not takes_grouped(x.shape[0], w.shape, jnp.dtype(x.dtype).itemsize):
        return reference(x, w, experts)  # the chosen experts gathered, or the dense product
    return grouped_expert_linear(x, w, experts)


ops.backend("gpu").describe = lambda: "grouped expert products; float8 GEMMs"
ops.register("gpu", model.expert_linear, _expert_linear)
ops.register("gpu", model.scaled_linear, _scaled_linear)
