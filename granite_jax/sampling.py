"""Sampling options and the on-device token sampler.

`SamplingConfig` is a frozen dataclass validated on construction. `sample_tokens` turns a batch of next-token logits
into token ids inside the jitted prefill/decode step, so only the chosen ids (b,) ever reach the host.

The sampler avoids sorting the vocabulary (a 100K-entry sort costs ~35 ms per row on a small CPU, more than the
weights of a small model take to stream): the top-k and top-p cut-offs are found by bisection over the
order-preserving integer image of the float32 logits (32 passes of compare-and-sum, exact), and the draw is an
inverse-CDF lookup, first over blocks of the vocabulary and then inside the chosen block, from one uniform per row.
Temperature, top-k and top-p are traced scalars: changing them never recompiles. They may also be one value a row
(`SamplingConfig.row_params`): a server's batch holds requests with their own options and their own random streams,
each row drawing what it would draw alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from granite_jax import ops
from granite_jax.errors import GenerationError

Array = jax.Array
_BLOCK = 256  # vocabulary block size of the two-level inverse-CDF draw
_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How tokens are chosen and when generation stops.

    temperature: 0 = greedy (argmax); > 0 divides the logits before sampling.
    top_k: keep the k most likely tokens (0 = no limit). top_p: keep the smallest set of most likely tokens whose
    probability reaches top_p (1 = no limit); applied after top_k, as in transformers.
    seed: the same seed, prompts and options give the same tokens. top_k, top_p and seed other than their defaults
    need temperature > 0: greedy decoding would ignore them, so they are refused.
    max_new_tokens: at most this many tokens per prompt.
    stop_token_ids: stop a sequence when it produces one of these ids (kept in `token_ids`, not in the text);
    None = the model's `eos_token_id`, () = never stop on a token.
    stop_strings: stop a sequence once its text contains one of these (the text is cut before it).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        temperature, top_p, top_k, seed, n = self.temperature, self.top_p, self.top_k, self.seed, self.max_new_tokens
        _check(
            _is_number(temperature) and temperature >= 0,
            f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}",
        )
        _check(_is_number(top_p) and 0 < top_p <= 1, f"top_p must be a number in (0, 1], got {top_p!r}")
        _check(np.float32(top_p) > 0, f"top_p={top_p!r} is 0 as a float32 (the sampler's precision): it keeps nothing")
        _check(is_int(top_k) and top_k >= 0, f"top_k must be an integer >= 0, got {top_k!r}")
        _check(top_k <= _INT_MAX, f"top_k must be below 2**31, got {top_k!r}")
        _check(is_int(seed) and 0 <= seed < 2**32, f"seed must be an integer in [0, 2**32), got {seed!r}")
        _check(is_int(n) and n >= 1, f"max_new_tokens must be an integer >= 1, got {n!r}")
        for name, neutral in (("top_k", 0), ("top_p", 1.0), ("seed", 0)):  # what greedy decoding would ignore
            value = getattr(self, name)
            _check(
                temperature > 0 or value == neutral,
                f"{name}={value!r} needs temperature > 0: greedy decoding (temperature 0) takes the most likely token",
            )
        for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("seed", int)):
            object.__setattr__(self, name, kind(getattr(self, name)))  # numpy scalars as Python numbers
        object.__setattr__(self, "max_new_tokens", int(n))
        if self.stop_token_ids is not None:
            ids = _as_tuple(self.stop_token_ids, "stop_token_ids")
            bad = [i for i in ids if not (is_int(i) and i >= 0)]
            _check(not bad, f"stop_token_ids must be integers >= 0, got {bad[0]!r}" if bad else "")
            object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        strings = _as_tuple(self.stop_strings, "stop_strings")
        bad = [s for s in strings if not (isinstance(s, str) and s)]
        _check(not bad, f"stop_strings must be non-empty strings, got {bad[0]!r}" if bad else "")
        for i, s in enumerate(strings):
            check_utf8(f"stop_strings[{i}]", s)
        object.__setattr__(self, "stop_strings", strings)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def replace(self, **changes) -> SamplingConfig:
        return dataclasses.replace(self, **changes)

    def device_params(self) -> SamplerParams:
        """The traced part of the options, as passed to `sample_tokens`."""
        return SamplerParams(
            temperature=jnp.asarray(self.temperature, jnp.float32),
            top_k=jnp.asarray(self.top_k, jnp.int32),
            top_p=jnp.asarray(self.top_p, jnp.float32),
            key=jax.random.key_data(jax.random.key(self.seed)),
        )

    @staticmethod
    def row_params(configs: Sequence[SamplingConfig]) -> SamplerParams:
        """One row of options a config, as numpy arrays (b,) (keys (b, 2)): each row samples as it would alone,
        with `step` (b,) its own token index."""
        return SamplerParams(
            temperature=np.asarray([c.temperature for c in configs], np.float32),
            top_k=np.asarray([c.top_k for c in configs], np.int32),
            top_p=np.asarray([c.top_p for c in configs], np.float32),
            key=np.stack([_key_data(c.seed) for c in configs]),
        )


@functools.lru_cache(maxsize=4096)  # bounded: a server sees a fresh random seed with most sampling requests
def _key_data(seed: int) -> np.ndarray:
    return np.asarray(jax.random.key_data(jax.random.key(seed)))


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise GenerationError(message)


def is_int(x) -> bool:
    """A Python or numpy integer, not a bool (what sampling options and token ids accept)."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def _is_number(x) -> bool:  # finite Python or numpy reals, not bools
    return (is_int(x) or isinstance(x, float | np.floating)) and math.isfinite(x)


def check_utf8(name: str, text: str) -> None:
    """GenerationError if `text` holds a lone surrogate: bytes from argv or a file that were not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GenerationError(f"{name} is not valid UTF-8 text (at character {e.start})") from None


def _as_tuple(x, name: str) -> tuple:
    if isinstance(x, str | bytes) or not isinstance(x, Sequence):
        raise GenerationError(f"{name} must be a list or tuple, got {x!r}")
    return tuple(x)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerParams:
    temperature: Array  # () float32, or (b,) one a row; 0 = greedy
    top_k: Array  # () or (b,) int32; 0 = off
    top_p: Array  # () or (b,) float32; 1 = off
    key: Array  # raw key data of jax.random.key(seed), or (b, ...) one a row


# ---------------------------------------------------------------------------------------------- the sampler


def sample_tokens(logits: Array, params: SamplerParams, step: Array) -> Array:
    """Token ids (b,) from logits (b, V). `step` (the index of the token being produced) varies the random draw.
    Options one a row (`SamplingConfig.row_params`) take `step` (b,) too: each row draws from its own key, as a
    batch of one with that key draws."""
    logits = logits.astype(jnp.float32)
    sampling = params.temperature > 0
    if params.temperature.ndim == 0:
        return lax.cond(sampling, lambda: _sample(logits, params, step), lambda: greedy_tokens(logits))
    greedy = greedy_tokens(logits)
    drawn = lax.cond(jnp.any(sampling), lambda: _sample(logits, params, step), lambda: greedy)
    return jnp.where(sampling, drawn, greedy)


@ops.replaceable
def greedy_tokens(logits: Array) -> Array:
    """jnp.argmax over the last axis (the first maximum; the first NaN if any) as int32, in two plain reductions:
    XLA:CPU runs argmax's (value, index) reduction 3-3.5x slower."""
    keys = jnp.where(jnp.isnan(logits), _INT_MAX, ordered_keys(logits))  # integers: XLA's float max may skip a NaN
    index = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(keys == jnp.max(keys, axis=-1, keepdims=True), index, logits.shape[-1]), axis=-1)


def _sample(logits: Array, params: SamplerParams, step: Array) -> Array:
    # Shifted before scaling, so the most likely token is exactly 0 (weight exp(0) = 1) however small T is; `l / T`
    # alone, recomputed in two fusions, could differ enough at T ~ 1e-10 to leave every weight 0.
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)  # greedy rows of a batch: any
    scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature[..., None]
    keep = filter_mask(scaled, params.top_k, params.top_p)
    if params.temperature.ndim == 0:
        u = _uniforms(params.key, step, logits.shape[0])
    else:  # a row's draw is the first of a batch of one's
        u = jax.vmap(lambda key, step: _uniforms(key, step, 1)[0])(params.key, step)
    return draw(scaled, keep, u)


def _uniforms(key_data: Array, step: Array, n: int) -> Array:
    return jax.random.uniform(jax.random.fold_in(jax.random.wrap_key_data(key_data), step), (n,), jnp.float32)


def filter_mask(logits: Array, top_k: Array, top_p: Array) -> Array:
    """(b, V) True for the tokens top-k then top-p keep (ties at a cut-off are kept). top_k and top_p: () or (b,)."""
    keys = ordered_keys(logits)
    b = logits.shape[0]
    floor = jnp.full((b,), _INT_MIN, jnp.int32)
    k_floor = _floor_where(top_k > 0, lambda: _top_k_floor(keys, top_k), floor)
    probs = jax.nn.softmax(jnp.where(keys >= k_floor[:, None], logits, -jnp.inf), axis=-1)
    p_floor = _floor_where(top_p < 1, lambda: _top_p_floor(keys, probs, top_p), floor)
    return keys >= jnp.maximum(k_floor, p_floor)[:, None]


def _floor_where(on: Array, cut: Callable[[], Array], floor: Array) -> Array:
    """The rows' cut-off where `on` (() or (b,)), else `floor`; the bisection skipped when no row needs it."""
    return lax.cond(jnp.any(on), lambda: jnp.where(on, cut(), floor), lambda: floor)


def ordered_keys(x: Array) -> Array:
    """int32 keys with the order of the float32 values (IEEE bits, negative values' magnitude bits flipped)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(_INT_MAX), bits)


def _largest_key_where(keys: Array, ok) -> Array:
    """Per row, the largest int32 t with ok(t) (b,) -> bool, for ok monotone (true up to some t)."""
    b = keys.shape[0]

    def halve(_, bounds):
        lo, hi = bounds  # ok(lo) holds; the answer is in [lo, hi]
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1) + ((lo ^ hi) & 1)  # ceil((lo + hi) / 2) without overflow
        good = ok(mid)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

    lo, _ = lax.fori_loop(0, 32, halve, (jnp.full((b,), _INT_MIN, jnp.int32), jnp.full((b,), _INT_MAX, jnp.int32)))
    return lo


def _top_k_floor(keys: Array, k: Array) -> Array:
    """Largest key t with at least k tokens >= t: the k-th largest key."""
    return _largest_key_where(keys, lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k)


def _top_p_floor(keys: Array, probs: Array, p: Array) -> Array:
    """Largest key t whose tokens >= t hold at least probability p: the smallest top set reaching p."""
    p = jnp.minimum(p, jnp.sum(probs, axis=-1))  # the mass as summed here may round just below 1
    return _largest_key_where(keys, lambda t: jnp.sum(jnp.where(keys >= t[:, None], probs, 0.0), axis=-1) >= p)


def draw(logits: Array, keep: Array, u: Array) -> Array:
    """Inverse-CDF draw of one token per row from softmax(logits) restricted to `keep`, with u (b,) in [0, 1)."""
    b, V = logits.shape
    nb = -(-V // _BLOCK)
    weights = jnp.where(keep, jnp.exp(logits - jnp.max(jnp.where(keep, logits, -jnp.inf), -1, keepdims=True)), 0.0)
    weights = jnp.pad(weights, ((0, 0), (0, nb * _BLOCK - V))).reshape(b, nb, _BLOCK)
    block_weights = jnp.sum(weights, -1)  # (b, nb)
    block_cum = jnp.cumsum(block_weights, -1)
    target = u * block_cum[:, -1]
    block = _first_above(block_cum, target, _last_positive(block_weights))
    before = jnp.where(block > 0, jnp.take_along_axis(block_cum, jnp.maximum(block - 1, 0)[:, None], -1)[:, 0], 0.0)
    inner = jnp.take_along_axis(weights, block[:, None, None], 1)[:, 0]  # (b, BLOCK)
    index = _first_above(jnp.cumsum(inner, -1), target - before, _last_positive(inner))
    return (block * _BLOCK + index).astype(jnp.int32)


def _last_positive(w: Array) -> Array:
    """Index of the last entry > 0 per row (0 if none)."""
    idx = jnp.arange(w.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(w > 0, idx, 0), axis=-1)


def _first_above(cum: Array, target: Array, last: Array) -> Array:
    """First index whose cumulative weight exceeds target, never past `last` (guards float round-off)."""
    return jnp.minimum(jnp.sum(cum <= target[:, None], -1).astype(jnp.int32), last)
