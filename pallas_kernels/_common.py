"""Pieces shared by the prefill and decode kernels: the dt preprocessing, operand dtypes and shape helpers."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._call import interpreting

Array = jax.Array
F32 = jnp.float32
SOFTPLUS_THRESHOLD = 20.0  # softplus(t) == t in float32 above this, as in torch and the reference kernels


def check_int(where: str, value: object, *, minimum: int, power_of_two: bool = False) -> int:
    """`value` as an int: an integer (not a bool or a float) >= `minimum`, and a power of two if asked."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{where}={value!r}: must be an int, got {type(value).__name__}")
    value = int(value)
    if value < minimum or (power_of_two and value & (value - 1)):
        kind = "a power of two" if power_of_two else "an int"
        raise ValueError(f"{where}={value}: must be {kind} >= {minimum}")
    return value


def check_dt_limit(fn: str, limit: object) -> tuple[float, float]:
    """`dt_limit` as (low, high) floats: two real numbers, not NaN, low <= high (either may be infinite)."""
    try:
        lo, hi = limit  # type: ignore[misc]
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: dt_limit must be a pair (low, high), got {limit!r}") from None
    for value in (lo, hi):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(f"{fn}: dt_limit must be two real numbers, got {limit!r}")
        if math.isnan(value):
            raise ValueError(f"{fn}: dt_limit={limit!r}: NaN is not a limit")
    if lo > hi:
        raise ValueError(f"{fn}: dt_limit=({lo}, {hi}): low must be <= high")
    return float(lo), float(hi)


def process_dt(dt: Array, bias: Array | None, softplus: bool, limit: tuple[float, float]) -> Array:
    """dt (+ bias), softplus (identity above 20), clamped to `limit`; float32. Runs inside kernels."""
    dt = dt.astype(F32)
    if bias is not None:
        dt = dt + bias
    if softplus:
        dt = jnp.where(dt > SOFTPLUS_THRESHOLD, dt, jnp.log1p(jnp.exp(jnp.minimum(dt, SOFTPLUS_THRESHOLD))))
    lo, hi = limit
    if lo != -math.inf:
        dt = jnp.maximum(dt, lo)
    if hi != math.inf:
        dt = jnp.minimum(dt, hi)
    return dt


def operand_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """Matmul operand dtype: 16-bit inputs stay 16-bit (tensor cores, fp32 accumulation), everything else float32."""
    return dtype if dtype in (jnp.bfloat16, jnp.float16) else F32


def dot_precision(op_dtype: jnp.dtype) -> lax.Precision | lax.DotAlgorithmPreset | None:
    """Precision of float32 matmuls: three TF32 tensor-core products on the GPU (Triton's TF32x3, close to float32
    accuracy; exact float32 `tt.dot` has no tensor cores and spills badly), exact float32 when interpreted on CPU
    (XLA:CPU has no TF32x3). 16-bit operands: the default (tensor cores, float32 accumulation)."""
    if op_dtype != F32:
        return None
    return lax.Precision.HIGHEST if interpreting() else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def dot(a: Array, b: Array, *, trans_a: bool = False, trans_b: bool = False) -> Array:
    """2-D matmul with float32 accumulation (Triton `tt.dot`), optionally contracting a's rows or b's columns."""
    contract = ((0 if trans_a else 1,), (1 if trans_b else 0,))
    return lax.dot_general(a, b, (contract, ((), ())), precision=dot_precision(a.dtype), preferred_element_type=F32)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two dividing n, at most `cap`: the chunk a dimension is read in without a ragged end."""
    return min(n & -n, cap)


def padded_dim(n: int) -> int:
    """Head or state dims the kernels accept: a power of two, at least 16 (Triton `tt.dot` needs M, N, K >= 16)."""
    return max(16, next_pow2(n))


def pad_axis(t: Array, axis: int, size: int) -> Array:
    """Zero-pad `axis` of t up to `size` (no-op when already that size)."""
    if t.shape[axis] == size:
        return t
    widths = [(0, 0)] * t.ndim
    widths[axis] = (0, size - t.shape[axis])
    return jnp.pad(t, widths)
