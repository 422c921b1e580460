"""The MoE router's top-k, alone or with the router's product, as one Pallas (Triton) kernel.

The contract is `granite_jax.model.top_experts` (`lax.top_k`): per row of router logits (N, E), the k largest in
descending order and their experts, the lower expert first among equals. One program per row finds them by k rounds
of max-and-remove over the row held in registers (k is 6-10 and E 32-72 in the released models): one launch where
XLA's top-k on a GPU is two. E must be a power of two (`takes_top_k`).

`route` also computes the logits, the router's product x @ w^T of the row (H channels, a few kilobytes of w per
expert): one launch where XLA's product and top-k are three.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _call
from pallas_kernels._common import F32, Array, pow2_divisor

ROUTE_CHUNK = 128  # hidden channels of the router read at once: (E, 128) in registers


def takes_top_k(experts: int) -> bool:
    """Whether `top_k` runs this many experts: a power of two, as a row is one Triton block (h-tiny's 64; not
    h-small's 72, whose block would read past each row)."""
    return experts >= 1 and experts & (experts - 1) == 0


def top_k(logits: Array, k: int) -> tuple[Array, Array]:
    """logits (N, E) -> (values (N, k) float32, indices (N, k) int32), as `lax.top_k` on float32 logits."""
    N, E = logits.shape
    if not takes_top_k(E) or not 1 <= k <= E:
        raise ValueError(f"top_k: k={k} of {E} experts: k must be in [1, E] and E a power of two")
    kernel = functools.partial(_top_k_kernel, k=k)
    row = lambda width: pl.BlockSpec((None, width), lambda i: (i, 0))  # noqa: E731
    return tuple(
        _call.call(
            kernel,
            name="top_k",
            grid=(N,),
            in_specs=[row(E)],
            out_specs=[row(k), row(k)],
            out_shape=[jax.ShapeDtypeStruct((N, k), F32), jax.ShapeDtypeStruct((N, k), jnp.int32)],
            num_warps=1,
            num_stages=1,
        )(logits)
    )


def route(x: Array, w: Array, k: int) -> tuple[Array, Array]:
    """x (N, H) @ w (E, H)^T in x's dtype, widened to float32, and its top k: (values (N, k) float32, indices (N, k)
    int32), the contract of `granite_jax.model.route`. `takes_route` says which dims it runs."""
    (N, H), E = x.shape, w.shape[0]
    if w.shape != (E, H) or not takes_route(H, E) or not 1 <= k <= E:
        raise ValueError(f"route: x {x.shape}, w {w.shape}, k={k}: w must be (E, H) with E a power of two, H a "
                         f"multiple of 16 and k in [1, E]")  # fmt: skip
    kernel = functools.partial(_route_kernel, chunk=pow2_divisor(H, ROUTE_CHUNK), k=k)
    return tuple(
        _call.call(
            kernel,
            name="route",
            grid=(N,),
            in_specs=[pl.BlockSpec((None, H), lambda i: (i, 0)), pl.BlockSpec((E, H), lambda i: (0, 0))],
            out_specs=[pl.BlockSpec((None, k), lambda i: (i, 0))] * 2,
            out_shape=[jax.ShapeDtypeStruct((N, k), F32), jax.ShapeDtypeStruct((N, k), jnp.int32)],
            num_warps=4,
            num_stages=1,
        )(x, w)
    )


def takes_route(hidden: int, experts: int) -> bool:
    """Whether `route` runs these dims: `takes_top_k`'s experts, and the hidden size in chunks of at least 16."""
    return takes_top_k(experts) and pow2_divisor(hidden, ROUTE_CHUNK) >= 16


def _route_kernel(x_ref, w_ref, values_ref, indices_ref, *, chunk, k):
    logits = None
    for c in range(x_ref.shape[0] // chunk):  # (E, chunk) of the router at a time, in registers
        span = pl.ds(c * chunk, chunk)
        part = jnp.sum(w_ref[:, span].astype(F32) * x_ref[span].astype(F32)[None, :], axis=1)
        logits = part if logits is None else logits + part
    _select(logits.astype(x_ref.dtype).astype(F32), values_ref, indices_ref, k)  # the product in x's dtype, widened


def _top_k_kernel(logits_ref, values_ref, indices_ref, *, k):
    _select(logits_ref[...].astype(F32), values_ref, indices_ref, k)


def _select(row: Array, values_ref, indices_ref, k: int) -> None:
    """The k largest of `row`, largest first, the lower lane among equals."""
    width = row.shape[0]
    lanes = lax.broadcasted_iota(jnp.int32, (width,), 0)
    available = lanes >= 0
    for t in range(k):
        best = jnp.max(jnp.where(available, row, -jnp.inf))
        chosen = jnp.min(jnp.where(available & (row == best), lanes, width))
        values_ref[t] = best
        indices_ref[t] = chosen
        available = available & (lanes != chosen)
