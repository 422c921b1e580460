"""Where a batch of prompts sits in the cache, and the shape buckets that bound compilation.

Prompt lengths round up to powers of two (>= 16) up to `prefill_chunk`, then to multiples of it; KV-cache lengths
round up to `min_cache_len`, powers of two, then multiples of 16384. The decode step therefore compiles once per
(batch size, cache bucket): once per batch size for every request whose padded prompt plus `max_new_tokens` fits
`min_cache_len`, or always with a fixed `max_cache_len`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from granite_jax.config import ATTENTION, ModelConfig
from granite_jax.errors import GenerationError

MIN_PROMPT_BUCKET = 16
LARGE_CACHE_STEP = 16384


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def bucket_length(n: int, prefill_chunk: int) -> int:
    """Padded prompt length: a power of two >= 16 up to prefill_chunk, then a multiple of prefill_chunk."""
    if n <= prefill_chunk:
        return min(prefill_chunk, max(MIN_PROMPT_BUCKET, next_power_of_two(n)))
    return round_up(n, prefill_chunk)


def cache_bucket(n: int, minimum: int) -> int:
    """KV-cache slots for n: `minimum`, else a power of two up to 16384, else a multiple of 16384."""
    if n <= minimum:
        return minimum
    return next_power_of_two(n) if n <= LARGE_CACHE_STEP else round_up(n, LARGE_CACHE_STEP)


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Where a batch of prompts sits: right-aligned in `padded_len` slots, then `max_new_tokens` decode slots."""

    lengths: tuple[int, ...]
    padded_len: int
    segment_len: int  # prefill segment: padded_len, or prefill_chunk when the prompt is longer
    cache_len: int  # KV slots (0 for a model without attention layers)
    max_new_tokens: int

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def pad(self) -> np.ndarray:
        return self.padded_len - np.asarray(self.lengths, np.int32)

    def tokens(self, prompts: Sequence[Sequence[int]], pad_id: int) -> np.ndarray:
        out = np.full((self.batch_size, self.padded_len), pad_id, np.int32)
        for row, ids in enumerate(prompts):
            out[row, self.padded_len - len(ids) :] = ids
        return out

    def segments(self) -> range:
        """The first slot of each prefill segment."""
        return range(0, self.padded_len, self.segment_len)


def plan(
    lengths: Sequence[int],
    max_new_tokens: int,
    cfg: ModelConfig,
    *,
    prefill_chunk: int,
    min_cache_len: int,
    max_cache_len: int | None,
) -> BatchLayout:
    """The layout of prompts of these lengths; GenerationError for prompts too long for the model or the cache."""
    longest = max(lengths)
    if cfg.rope_theta is not None:  # a RoPE model stops at max_position_embeddings: the last token is sampled, not fed
        limit = cfg.max_position_embeddings
        if longest > limit:
            raise GenerationError(
                f"prompt of {longest} tokens is longer than max_position_embeddings={limit} of this RoPE model"
            )
        max_new_tokens = min(max_new_tokens, limit - longest + 1)
    padded = bucket_length(longest, prefill_chunk)
    need = padded + max_new_tokens - 1  # the last sampled token is never written to the cache
    if ATTENTION not in cfg.layer_types:
        cache_len = 0
    elif max_cache_len is not None:
        if need > max_cache_len:
            raise GenerationError(
                f"prompt ({longest} tokens, padded to {padded}) plus max_new_tokens={max_new_tokens} needs "
                f"{need} KV-cache slots, more than max_cache_len={max_cache_len}"
            )
        cache_len = max_cache_len
    else:
        cache_len = cache_bucket(need, min_cache_len)
    segment = min(padded, prefill_chunk)
    return BatchLayout(tuple(lengths), padded, segment, cache_len, max_new_tokens)
