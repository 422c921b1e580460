"""Prefix caching of hybrid state: a prompt that begins like an earlier one starts from that prefix's saved state.

A Mamba layer's state after n tokens cannot be cut out of the state after more tokens, so a prefix is reusable only
where a snapshot was taken: the whole one-row cache (every Mamba layer's conv ring and SSM state, and the attention
layers' KV rows up to n) at the moment the prefill reached n. Snapshots are taken where a later prompt is likely to
branch, to the token:
- one token before a prompt's end: a repeated prompt, or a conversation's next turn, which extends the last prompt,
  reruns one token (the logits of the last one are needed anyway);
- where a prompt parts from an earlier one it shares a prefix with (the longest common prefix with the recent prompts):
  a shared system prompt or few-shot preamble is found when its second user arrives, and every later one hits it.

The prefill runs in pieces of any length (`Engine`), so a snapshot costs no recomputation and no padding, and a hit
is exact to the token: no block granularity (vLLM's hybrid prefix caching hits only in blocks of 528+ tokens).
Memory is bounded by bytes: least recently used snapshots go first. A snapshot's size is the sequence's constant
Mamba state plus its KV rows (trimmed to the next power of two of its length).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from granite_jax.model import Cache

REMEMBERED_PROMPTS = 256  # recent prompts compared with a new one to find where they part


@dataclasses.dataclass
class Stats:
    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    snapshots: int = 0
    evictions: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class PrefixCache:
    """Snapshots of one-row caches keyed by the token ids they hold, at most `budget_bytes` of them (LRU)."""

    def __init__(self, budget_bytes: int, min_tokens: int = 1):
        self.budget_bytes, self.min_tokens = int(budget_bytes), int(min_tokens)
        self._snapshots: collections.OrderedDict[tuple[int, ...], tuple[Cache, int]] = collections.OrderedDict()
        self._lengths: collections.Counter[int] = collections.Counter()  # snapshot lengths held, to look up by
        self._prompts: collections.OrderedDict[tuple[int, ...], None] = collections.OrderedDict()
        self.bytes = 0
        self.stats = Stats()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def lookup(self, ids: Sequence[int]) -> tuple[int, Cache | None]:
        """The longest snapshot holding a proper prefix of `ids` (at least one token is left to run): (its length,
        the snapshot), or (0, None)."""
        self.stats.lookups += 1
        for n in sorted((n for n in self._lengths if n < len(ids)), reverse=True):
            key = tuple(ids[:n])
            if key in self._snapshots:
                self._snapshots.move_to_end(key)
                self.stats.hits += 1
                self.stats.tokens_reused += n
                return n, self._snapshots[key][0]
        return 0, None

    def cut_points(self, ids: Sequence[int], start: int) -> list[int]:
        """Where the prefill of `ids` (from `start`, a hit's length) should take snapshots, and remember the prompt:
        where it parts from the recent prompt it shares most with, and one token before its end."""
        if not self.enabled:
            return []
        ids = tuple(ids)
        points = {len(ids) - 1, min(self._shared_prefix(ids), len(ids) - 1)}
        self._prompts[ids] = None
        self._prompts.move_to_end(ids)
        while len(self._prompts) > REMEMBERED_PROMPTS:
            self._prompts.popitem(last=False)
        return sorted(p for p in points if p > start and p >= self.min_tokens and (ids[:p] not in self._snapshots))

    def _shared_prefix(self, ids: tuple[int, ...]) -> int:
        new, best = np.asarray(ids), 0
        for prompt in self._prompts:
            n = min(len(prompt), len(ids))
            differ = np.flatnonzero(np.asarray(prompt[:n]) != new[:n])
            best = max(best, int(differ[0]) if differ.size else n)
        return best

    def add(self, ids: Sequence[int], snapshot: Cache) -> None:
        """Keep `snapshot`, the state after `ids`; drop the least recently used ones past the budget."""
        key = tuple(ids)
        size = sum(x.nbytes for x in jax.tree.leaves(snapshot))
        if key in self._snapshots or size > self.budget_bytes:
            return
        self._snapshots[key] = (snapshot, size)
        self._lengths[len(key)] += 1
        self.bytes += size
        self.stats.snapshots += 1
        while self.bytes > self.budget_bytes:
            old, (_, old_size) = self._snapshots.popitem(last=False)
            self.bytes -= old_size
            self._lengths[len(old)] -= 1
            if not self._lengths[len(old)]:
                del self._lengths[len(old)]
            self.stats.evictions += 1
