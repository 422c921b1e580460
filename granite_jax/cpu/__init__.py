"""CPU kernels for the memory-bound parts of decoding, where XLA:CPU leaves bandwidth unused: the "cpu" backend of
`granite_jax.ops`, used by default where JAX runs on an x86-64 CPU with AVX2 and FMA.

A decode step multiplies 1-16 rows of activations by every weight matrix, once per token: it is bound by reading the
weights. The kernels (C++ under `csrc/`, XLA FFI custom calls, float32 arithmetic on float32 or bfloat16 operands):

- the product with a weight: one row by a matrix-vector kernel on W as it is; 2-16 rows by a panel kernel on a copy
  of W in panels of eight rows (`packing`), where XLA:CPU's library GEMM reaches a third of the bandwidth. bfloat16
  weights are widened in registers, so float32 activations on them compute what the float32 model of those weights
  computes, from half the bytes;
- the experts' products: each chosen expert read in place, once for all the rows that chose it (XLA gathers the
  chosen experts into a copy first);
- the Mamba mixer between its projections for one token (conv, time steps, state update, gated norm) in one call,
  the state updated in place; and the SSD state update alone where that step is not fused;
- attention of one query token over a KV cache, each (row, KV head)'s keys and values read once;
- greedy sampling in one pass per row, and the embedding lookup of a bfloat16 table without widening it.

The sources are compiled with the system C++ compiler on first use and cached (`build`). Without a compiler, on another
CPU or platform, or with ``GRANITE_JAX_CPU_KERNELS=0``, the model runs plain JAX: slower, the same results up to
rounding. The kernels are for inference; differentiate with ``Runtime(kernels=False)``.
"""

from granite_jax import ops
from granite_jax.cpu import backend
from granite_jax.cpu.build import available, panels_use_avx512, unavailable_reason
from granite_jax.cpu.packing import MAX_ROWS, MIN_ROWS

__all__ = ["MAX_ROWS", "MIN_ROWS", "available", "describe", "panels_use_avx512", "unavailable_reason"]


def describe() -> str:
    """What runs the decode products and the rest here (for records)."""
    reason = unavailable_reason()
    if reason is not None:
        return f"XLA ({reason})"
    products = f"float32/bfloat16 products of 1 row, and of {MIN_ROWS}-{MAX_ROWS} rows on packed weights"
    if panels_use_avx512():
        products += " (AVX-512)"
    return (
        f"{products}; expert products; Mamba decoding step and state update; decode attention; "
        "greedy sampling; bfloat16 embedding lookup"
    )


backend.register()
ops.backend(backend.NAME).available = unavailable_reason
ops.backend(backend.NAME).describe = describe
ops.backend(backend.NAME).widens_weights = True
