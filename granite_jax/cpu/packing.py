"""Panels: the layout in which the panel kernel streams a weight for products of 2-16 rows, and the CPU backend's
copies of a model's weights in it (`prepare`).

A decode step of 2-16 rows multiplies them by every weight matrix. XLA:CPU runs such products as library GEMMs at a
third of the memory bandwidth; the panel kernel streams each weight once from panels of eight rows. The copies
double the memory those weights take, so they are made only for such steps, once per model, and only where they fit
in half the free memory unless `Runtime.pack_weights` says otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref

import jax
import jax.numpy as jnp
from flax import nnx

from granite_jax.system import available_memory

Array = jax.Array
LANES = 8  # rows of w per panel: one AVX2 vector of float32
MIN_ROWS, MAX_ROWS = 2, 16  # rows the panel kernel takes; more (prefill) are XLA's, one is the matrix-vector kernel's
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

log = logging.getLogger(__name__)


@jax.jit  # one fused copy per weight shape: eagerly, the pad and the transpose copy separately
def pack(w: Array) -> Array:
    """w (N, K) in panels (ceil(N / 8), K, 8): panel[p, k, c] = w[8p + c, k], zero rows past N."""
    n, k = w.shape
    rows = -(-n // LANES) * LANES
    w = jnp.pad(w, ((0, rows - n), (0, 0)))
    return w.reshape(rows // LANES, LANES, k).transpose(0, 2, 1)


def unpack(packed: Array, n: int) -> Array:
    """The (n, K) matrix of `pack`'s panels."""
    return packed.transpose(0, 2, 1).reshape(-1, packed.shape[1])[:n]


def streamed_weights(model) -> dict[str, Array]:
    """The weights `model.linear` multiplies by, by parameter path: every `Linear`'s, and a tied output embedding."""
    from granite_jax.model import Linear

    found = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear):
            found[".".join(map(str, (*path, "weight")))] = node.weight[...]
    if model.lm_head is None:
        found["embed_tokens.embedding"] = model.embed_tokens.embedding[...]
    return found


@dataclasses.dataclass
class _Copies:
    sources: list[weakref.ref]  # the weights the panels were made from: a model given new weights is packed again
    pack_weights: bool | None  # the runtime's choice they were made under: another choice decides again
    panels: dict[str, Array]  # {} where packing was declined

    def still_for(self, model, weights: dict[str, Array]) -> bool:
        same = len(self.sources) == len(weights) and all(r() is w for r, w in zip(self.sources, weights.values()))
        return same and self.pack_weights == model.runtime.pack_weights


_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Copies


def prepare(model, rows: int) -> dict[str, Array]:
    """The panels of `model`'s streamed weights for decode steps of `rows` rows ({} where none are used), made on the
    first call and kept with the model, as is a decision not to make them (the memory is not probed again)."""
    if not MIN_ROWS <= rows <= MAX_ROWS or model.runtime.pack_weights is False:
        return {}
    weights = streamed_weights(model)
    if not {jnp.dtype(model.dtype), *(w.dtype for w in weights.values())} <= set(KERNEL_DTYPES):
        return {}
    copies = _COPIES.get(model)
    if copies is None or not copies.still_for(model, weights):
        panels = {path: pack(w) for path, w in weights.items()} if _fits(model, weights) else {}
        copies = _Copies([weakref.ref(w) for w in weights.values()], model.runtime.pack_weights, panels)
        _COPIES[model] = copies
    return copies.panels


def _fits(model, weights: dict[str, Array]) -> bool:
    if model.runtime.pack_weights:
        return True
    needed = sum(w.nbytes for w in weights.values())
    available = available_memory()
    if available is not None and needed > available // 2:
        log.warning(
            "granite_jax: not packing the weights for decoding (%.1f GB; %.1f GB of memory available): decode steps of "
            "2-16 sequences use XLA's slower products (Runtime(pack_weights=True) packs anyway)",
            needed / 1e9,
            available / 1e9,
        )
        return False
    return True
