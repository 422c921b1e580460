"""The decode batch's cache, one sequence a row, all rows on one clock: moving sequences in, out and along it.

The model's `Cache` has one write index for every row and a count of empty slots before each row's first token
(`pad`): the layout of a left-padded batch. A server's rows hold sequences that started at different times, and each
keeps that layout: a sequence of n tokens joining at index I sits in slots [I - n, I), its pad I - n. Nothing in the
model changes, and every backend (CPU kernels, Pallas, meshes) runs the server's steps as it runs the Generator's.

The clock only advances, so every row is moved back by the same number of slots (`reclock`) when it reaches the end
of the KV cache, or when the slots before the oldest row's first are half of those up to the clock (attention in a
decode step reads every slot up to the clock): the oldest row then starts at slot 0. A row of at most `max_context`
tokens always fits after it, since the KV cache holds max_context plus some room. The move is one copy of the KV
cache, which a hybrid keeps in 1 layer in 10. Mamba states do not depend on the slot, except the conv's ring of recent
inputs, indexed by slot modulo its width: it turns with the slots. So a step's attention reads at most twice the
longest row's slots; the Mamba layers, nine in ten of a Granite 4.0 hybrid, cost the same at any length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from granite_jax.model import Cache, KVState, MambaState

Array = jax.Array


def _moved(state: MambaState | KVState, shift: Array) -> MambaState | KVState:
    """A layer's state with every slot s moved to s + shift (the KV rows and the conv ring turned)."""
    if isinstance(state, MambaState):
        return MambaState(jnp.roll(state.conv, shift, axis=1), state.ssm)
    return KVState(jnp.roll(state.k, shift, axis=2), jnp.roll(state.v, shift, axis=2))


@functools.partial(jax.jit, donate_argnums=0)
def reclock(cache: Cache, shift: Array) -> Cache:
    """Every row moved `shift` slots earlier (later if negative): its tokens keep their order and positions (pad moves
    with them), so the next token lands at index - shift. Slots wrapped around lie outside every row."""
    layers = tuple(_moved(state, -shift) for state in cache.layers)
    return Cache(layers, cache.pad - shift, cache.index - shift)


@functools.partial(jax.jit, donate_argnums=0)
def insert(cache: Cache, sequence: Cache, row: Array) -> Cache:
    """Row `row` of the batch's `cache` replaced by the one-row `sequence` (its own cache, its tokens in slots
    [sequence.pad, sequence.index)), moved onto the batch's clock: its last token just before `cache.index`.
    Needs cache.index >= sequence.index - sequence.pad (`Engine` reclocks first)."""
    shift = cache.index - sequence.index
    layers = []
    for big, small in zip(cache.layers, sequence.layers):
        small = _moved(small, shift)
        layers.append(jax.tree.map(lambda b, s: b.at[row].set(s[0]), big, small))
    return Cache(tuple(layers), cache.pad.at[row].set(sequence.pad[0] + shift), cache.index)


@jax.jit
def take_rows(cache: Cache, index: Array) -> Cache:
    """The batch as len(index) rows: row i is the old row index[i], or empty for -1 (zero state, no slot in it)."""
    source = jnp.where(index >= 0, index, cache.pad.shape[0])  # past the rows: filled (a negative one would wrap)
    taken = jax.tree.map(lambda x: jnp.take(x, source, axis=0, mode="fill", fill_value=0), cache.layers)
    pad = jnp.where(index >= 0, jnp.take(cache.pad, source, mode="fill", fill_value=0), cache.index)
    return Cache(taken, pad, cache.index)


@jax.jit
def extracted(cache: Cache, row: Array, start: Array) -> Cache:
    """Row `row` of the batch (its first token at slot `start`) as a one-row cache on its own clock: its tokens in
    slots [0, index), as a prefill leaves them (for a prefix snapshot)."""
    one = jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, row, 1, axis=0), cache.layers)
    layers = tuple(_moved(state, -start) for state in one)
    return Cache(layers, jnp.zeros((1,), jnp.int32), cache.index - start)


@functools.partial(jax.jit, static_argnums=1)
def trimmed(cache: Cache, slots: int) -> Cache:
    """A copy of a one-row cache keeping the first `slots` KV slots (a prefix snapshot: fresh buffers, so that
    donating `cache` to the next step leaves it intact)."""
    layers = tuple(
        MambaState(jnp.copy(s.conv), jnp.copy(s.ssm))
        if isinstance(s, MambaState)
        else KVState(s.k[:, :, :slots], s.v[:, :, :slots])
        for s in cache.layers
    )
    return Cache(layers, jnp.copy(cache.pad), jnp.copy(cache.index))


@functools.partial(jax.jit, static_argnums=1)
def untrimmed(snapshot: Cache, slots: int) -> Cache:
    """`trimmed`'s inverse: a cache of `slots` KV slots to run on from the snapshot (fresh buffers)."""

    def grow(x: Array) -> Array:
        return jnp.pad(x, ((0, 0), (0, 0), (0, slots - x.shape[2]), (0, 0)))

    layers = tuple(
        MambaState(jnp.copy(s.conv), jnp.copy(s.ssm)) if isinstance(s, MambaState) else KVState(grow(s.k), grow(s.v))
        for s in snapshot.layers
    )
    return Cache(layers, jnp.copy(snapshot.pad), jnp.copy(snapshot.index))


@jax.jit
def chosen_logprobs(logits: Array, tokens: Array) -> Array:
    """log softmax(logits)[token] per row (b,): the model's own distribution, before any sampling option."""
    logits = logits.astype(jnp.float32)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
