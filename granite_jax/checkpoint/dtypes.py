"""The dtype policy: the dtypes a model computes and keeps its weights in, by name, and what "auto" means.

A model computes in `dtype` (activations) and keeps its weights in `weight_dtype`, by default the same. Weights in
bfloat16 under float32 arithmetic compute what the float32 model of those values computes; where a kernel backend
widens bfloat16 weights in registers (`ops.Backend.widens_weights`: the CPU kernels) that costs half the memory and
about half the batch-1 decode traffic. So weight dtype "auto" is bfloat16 when computing in float32 on a checkpoint
stored in bfloat16 (the released ones are) where such a backend runs, and `dtype` otherwise: elsewhere XLA widens the
weights before their products and may hold a float32 copy of them all at once.

Weight dtype "float8" keeps the matrices in float8 (e4m3) with one scale per output channel and the rest in bfloat16
(`model.FLOAT8`); it is a storage format, not an arithmetic one. A float8 checkpoint loads as float8 under "auto".
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from granite_jax import ops
from granite_jax.errors import InputError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}  # the names commands take
WEIGHT_DTYPES = DTYPES | {"float8": jnp.float8_e4m3fn}
FLOAT8_NAME = "float8"
AUTO = "auto"


def dtype_name(name: str, value: Any, names: dict[str, Any] = DTYPES) -> str:
    """`value` (a name in `names`, or the jnp/np dtype of one) as its name; InputError naming `name` otherwise."""
    if isinstance(value, str) and value == FLOAT8_NAME and FLOAT8_NAME in names:
        return FLOAT8_NAME
    try:
        found = None if value is None or isinstance(value, bool) else jnp.dtype(value).name
    except (TypeError, ValueError):
        found = None
    found = FLOAT8_NAME if found == jnp.dtype(WEIGHT_DTYPES[FLOAT8_NAME]).name and FLOAT8_NAME in names else found
    if found not in names:
        weights_only = value == FLOAT8_NAME
        also = " (float8 is a format for weights: compute in bfloat16 over float8 weights)" if weights_only else ""
        raise InputError(f"{name} must be one of {', '.join(names)}, got {value!r}{also}")
    return found


def weight_dtype_name(dtype: str, weight_dtype: Any, stored: str | None, runtime: ops.Runtime) -> str:
    """The weights' dtype name: `weight_dtype` (a name or dtype; None: `dtype`; "auto": see the module docstring)
    for a model computing in `dtype` (a name) from a checkpoint storing `stored` (None: mixed or unknown)."""
    if weight_dtype is None:
        return dtype
    if isinstance(weight_dtype, str) and weight_dtype == AUTO:
        if stored == FLOAT8_NAME:
            return FLOAT8_NAME
        narrow = dtype == "float32" and stored == "bfloat16" and ops.widens_weights(runtime)
        return "bfloat16" if narrow else dtype
    return dtype_name("weight_dtype", weight_dtype, WEIGHT_DTYPES)
