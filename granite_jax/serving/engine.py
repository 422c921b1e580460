"""Continuous batching: requests join and leave a running decode batch one token step at a time.

One thread runs the device. Each turn of its loop:
1. takes cancellations (a slot is freed at once) and admits waiting requests while slots are free;
2. prefills admitted prompts in pieces, each in its own one-row cache, for about as long as a decode step takes
   while rows are decoding (so a new prompt delays the running ones' next token by about one step), to the end when
   none is; then the sequence joins the batch (`rows.insert`);
3. runs one decode step for every row, each with its own sampling options and random stream
   (`SamplingConfig.row_params`), and pushes each row's token to its request, which stops on its own.

A prompt's last tokens are not prefilled but fed to its row by the decode steps, one a step, as a generated token
would be: the last one always (its logits come from the decode step, the only place tokens are sampled), and, while
other rows are decoding, a tail shorter than `feed_below` tokens: a decode step costs about the same with or without
those rows, so short tails ride along instead of costing prefill calls of their own.

Shapes are bucketed so that joining never compiles: the batch has a power-of-two number of rows (grown when full,
shrunk when at most half is used), and a prefill piece is a power of two of tokens (pieces of n tokens run as the
binary digits of n: exact, no padding). `warmup` compiles every bucket before serving. The rows share one clock
(`rows`). Prompts that begin like earlier ones start from a snapshot (`prefix`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from granite_jax.errors import GenerationError
from granite_jax.generation import Generator
from granite_jax.generation.layout import next_power_of_two
from granite_jax.generation.stream import RowStream
from granite_jax.model import Cache
from granite_jax.sampling import SamplingConfig, is_int
from granite_jax.serving import rows
from granite_jax.serving.prefix import PrefixCache

MIN_RECLOCK = 64  # slots before every row that a decode step may read rather than move the rows
FINISH_REASONS = {"stop_token": "stop", "stop_string": "stop", "length": "length", "max_position": "length"}


class Overloaded(Exception):
    """Every slot is busy and the waiting queue is full: try again later."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a request ended. finish_reason: "stop", "length", "cancelled" or "error" (then `error` says why)."""

    finish_reason: str
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens taken from the prefix cache
    error: str | None = None
    logprobs: tuple[float, ...] | None = None  # of each token, if the request asked for them


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt's token ids and how to sample them. `on_text(delta)` is called once a generated token, with the text
    it adds (empty while a character is incomplete or the text could begin a stop string), then `on_done(outcome)`
    once. Both are called from the engine's thread: hand them over to another thread's loop, do not block in them."""

    ids: list[int]
    sampling: SamplingConfig
    on_text: Callable[[str], None]
    on_done: Callable[[Outcome], None]
    logprobs: bool = False  # keep each token's log-probability
    # The engine's, as the request runs:
    stream: RowStream | None = None
    token_logprobs: list[float] = dataclasses.field(default_factory=list)
    pending_text: list[str] = dataclasses.field(default_factory=list)  # the current token's text, for on_text
    cached_tokens: int = 0
    cancelled: bool = False

    def finish(self, reason: str, error: str | None = None) -> None:
        text, ids = ("", ()) if self.stream is None else (self.stream.text, tuple(self.stream.ids))
        logprobs = tuple(self.token_logprobs) if self.logprobs else None
        self.on_done(Outcome(reason, text, ids, len(self.ids), self.cached_tokens, error, logprobs))


@dataclasses.dataclass
class _Prefill:
    request: Request
    cache: Cache  # one row, its own clock
    done: int  # prompt tokens in the cache
    cuts: list[int]  # where to take prefix snapshots


@dataclasses.dataclass
class _Row:
    request: Request
    start: int  # the slot of its first token
    feed: collections.deque[int]  # prompt tokens still to be fed, one a decode step
    consumed: int  # prompt tokens in the state
    cuts: list[int]  # prefix snapshots still to take, at these prompt lengths
    drawn: int = 0  # tokens generated (the index of the next one's random draw)


def buckets(limit: int) -> list[int]:
    """Powers of two below `limit`, then `limit`."""
    return sorted({min(1 << i, limit) for i in range(limit.bit_length() + 1)})


def piece_length(remaining: int, budget: int) -> int:
    """The next prefill piece: the largest power of two within both (a prefill compiles once per power of two)."""
    return 1 << (min(remaining, budget).bit_length() - 1)


class Engine:
    """A Generator's model serving requests by continuous batching (see the module's docstring).

    max_batch: decode slots (rows). max_context: the longest prompt plus completion a request may have.
    prefill_chunk: longest prefill piece when no row is decoding; prefill_budget: while some are. feed_below: while
    rows are decoding, prompt tails shorter than this are fed by decode steps instead of prefilled. max_queue:
    requests waiting for a slot, beyond which `submit` raises Overloaded. prefix_cache_bytes: memory for prefix
    snapshots (0: no prefix caching). room: KV slots beyond max_context (None: a quarter of it, at least 64), which
    bounds how often the rows move back along the clock (`rows.reclock`).
    """

    def __init__(
        self,
        generator: Generator,
        *,
        max_batch: int = 8,
        max_context: int = 4096,
        prefill_chunk: int = 256,
        prefill_budget: int = 32,
        feed_below: int = 16,
        max_queue: int = 64,
        prefix_cache_bytes: int = 1 << 30,
        room: int | None = None,
    ):
        sizes = dict(max_batch=max_batch, max_context=max_context, prefill_chunk=prefill_chunk)
        sizes |= dict(prefill_budget=prefill_budget, feed_below=feed_below)
        for name, value in sizes.items():
            if not (is_int(value) and value >= 1):
                raise GenerationError(f"{name} must be an integer >= 1, got {value!r}")
        if not (is_int(max_queue) and max_queue >= 0):
            raise GenerationError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.generator, self.cfg = generator, generator.cfg
        self.max_batch, self.max_context, self.max_queue = int(max_batch), int(max_context), int(max_queue)
        self.prefill_chunk, self.prefill_budget = int(prefill_chunk), int(min(prefill_budget, prefill_chunk))
        self.feed_below = int(feed_below)
        if self.cfg.rope_theta is not None and self.max_context > self.cfg.max_position_embeddings:
            raise GenerationError(
                f"max_context={self.max_context} is past this RoPE model's max_position_embeddings="
                f"{self.cfg.max_position_embeddings}"
            )
        has_kv = any(kind == "attention" for kind in self.cfg.layer_types)
        room = max(64, self.max_context // 4) if room is None else int(room)
        self.kv_slots = self.max_context + room if has_kv else 0
        self.prefix = PrefixCache(prefix_cache_bytes)
        self.buckets = buckets(self.max_batch)
        self._lock, self._wake = threading.Lock(), threading.Condition(threading.Lock())
        self._waiting: collections.deque[Request] = collections.deque()
        self._prefills: collections.deque[_Prefill] = collections.deque()
        self._running, self._thread = False, None
        self.counters: collections.Counter[str] = collections.Counter()
        self.step_seconds = 0.0  # a decode step's time (moving average): the prefill's share of a turn
        self._piece_seconds: dict[int, float] = {}  # a prefill piece's time by its length (moving averages)
        self._reset_batch(self.buckets[0])

    # ------------------------------------------------------------------------------------------------ requests

    def check(self, ids: list[int], sampling: SamplingConfig) -> None:
        """GenerationError when a prompt and its completion do not fit max_context."""
        total = len(ids) + sampling.max_new_tokens
        if total > self.max_context:
            raise GenerationError(
                f"the prompt ({len(ids)} tokens) plus max_tokens ({sampling.max_new_tokens}) is {total} tokens, more "
                f"than this server's context of {self.max_context}"
            )

    def submit(self, request: Request) -> None:
        """Queue a request (GenerationError if it cannot fit, Overloaded if the queue is full)."""
        self.check(request.ids, request.sampling)
        with self._lock:
            busy = len(self._waiting) + len(self._prefills) + self.active
            if busy >= self.max_batch + self.max_queue:
                raise Overloaded(f"{self.max_batch} slots busy and {self.max_queue} requests waiting")
            self._waiting.append(request)
        self._notify()

    def cancel(self, request: Request) -> None:
        """Stop a request (from any thread); its slot is freed at the engine's next turn and it ends "cancelled"."""
        request.cancelled = True
        self._notify()

    @property
    def active(self) -> int:
        return sum(r is not None for r in self.slots)

    def stats(self) -> dict[str, Any]:
        return {
            "active": self.active,
            "waiting": len(self._waiting),
            "prefilling": len(self._prefills),
            "rows": len(self.slots),
            "prefix_cache": self.prefix.stats.as_dict() | {"bytes": self.prefix.bytes},
            **self.counters,
        }

    # ------------------------------------------------------------------------------------------------ the thread

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="granite-jax-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Cancel what is left and end the thread."""
        with self._lock:
            for request in [*self._waiting, *(p.request for p in self._prefills)]:
                request.cancelled = True
            for row in filter(None, self.slots):
                row.request.cancelled = True
        self._notify()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._busy() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.01)
        self._running = False
        self._notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def _busy(self) -> bool:
        return bool(self._waiting or self._prefills or self.active)

    def _loop(self) -> None:
        while self._running:
            if not self._busy():
                with self._wake:
                    self._wake.wait(0.05)
                continue
            self.turn()

    def turn(self) -> None:
        """One turn of the loop: cancellations, admissions, prefill pieces, a decode step."""
        self._take_cancellations()
        self._admit()
        self._prefill_for_a_step()
        if self.active:
            self._decode_step()
        elif len(self.slots) > self.buckets[0] and not self._prefills:
            self._resize(self.buckets[0])

    def _take_cancellations(self) -> None:
        with self._lock:
            gone = [r for r in self._waiting if r.cancelled]
            for r in gone:
                self._waiting.remove(r)
        for r in gone:
            r.finish("cancelled")
        for job in [p for p in self._prefills if p.request.cancelled]:
            self._prefills.remove(job)
            self.counters["cancelled"] += 1
            job.request.finish("cancelled")
        for index, row in enumerate(self.slots):
            if row is not None and row.request.cancelled:
                self._free(index, "cancelled")
        self.counters["cancelled"] += len(gone)

    def _admit(self) -> None:
        with self._lock:
            while self._waiting and self.active + len(self._prefills) < self.max_batch:
                request = self._waiting.popleft()
                try:
                    self._prefills.append(self._start_prefill(request))
                except Exception as e:  # noqa: BLE001 - the request fails, the server goes on
                    self._fail(request, e)

    # ------------------------------------------------------------------------------------------------ prefill

    def _start_prefill(self, request: Request) -> _Prefill:
        ids = request.ids
        done, snapshot = self.prefix.lookup(ids) if self.prefix.enabled else (0, None)
        if snapshot is None:
            cache = self.generator.steps.cache(1, self.kv_slots, np.zeros((1,), np.int32))
        else:
            cache = rows.untrimmed(snapshot, self.kv_slots)
        request.cached_tokens = done
        request.stream = self._row_stream(request)
        return _Prefill(request, cache, done, self.prefix.cut_points(ids, done))

    def _prefill_for_a_step(self) -> None:
        """Prefill pieces for about a decode step's time while rows are decoding (at least one piece, and no piece
        predicted to end past the step's time after the first), or until every admitted prompt has joined when none
        is."""
        start = time.perf_counter()
        ran = False
        while self._prefills:
            job = self._prefills[0]
            try:
                n = self._next_piece(job)
                if n and ran and self.active:
                    predicted = self._piece_seconds.get(n, self.step_seconds)
                    if time.perf_counter() - start + predicted > self.step_seconds:
                        return
                if n:
                    self._run_piece(job, n)
                    ran = True
                else:
                    self._prefills.popleft()
                    self._join(job)
            except Exception as e:  # noqa: BLE001 - the request fails, the server goes on
                self._prefills.popleft()
                self._fail(job.request, e)

    def _next_piece(self, job: _Prefill) -> int:
        """The length of the job's next piece: a power of two up to the next snapshot point or to the prompt's last
        token; 0 when the rest is for the decode steps to feed."""
        ids = job.request.ids
        target = next((c for c in job.cuts if c > job.done), len(ids) - 1)
        remaining = target - job.done
        if target == len(ids) - 1 and (remaining == 0 or (self.active and remaining < self.feed_below)):
            return 0
        return piece_length(remaining, self.prefill_budget if self.active else self.prefill_chunk)

    def _run_piece(self, job: _Prefill, n: int) -> None:
        ids, started = job.request.ids, time.perf_counter()
        tokens = np.asarray([ids[job.done : job.done + n]], np.int32)
        job.cache = self.prefill(job.cache, tokens)
        jax.block_until_ready(job.cache.index)
        seconds = time.perf_counter() - started
        self._piece_seconds[n] = 0.8 * self._piece_seconds.get(n, seconds) + 0.2 * seconds
        job.done += n
        self.counters["prefill_tokens"] += n
        if job.done in job.cuts:
            self.prefix.add(ids[: job.done], rows.trimmed(job.cache, _kv_bucket(job.done, self.kv_slots)))

    def prefill(self, cache: Cache, tokens: np.ndarray) -> Cache:
        """One prefill piece (1, n) of one row's prompt: the cache after it."""
        greedy, step = self._greedy_row, np.zeros((1,), np.int32)
        return self.generator.steps.prefill(self.generator.prepared(1), cache, tokens, greedy, step)[2]

    def _row_stream(self, request: Request) -> RowStream:
        stops = self.cfg.eos_token_id if request.sampling.stop_token_ids is None else request.sampling.stop_token_ids
        return RowStream(
            0, self.generator.tokenizer, frozenset(stops), request.sampling.stop_strings,
            lambda _, text: request.pending_text.append(text),
        )  # fmt: skip

    def _join(self, job: _Prefill) -> None:
        """The prefilled sequence takes a row; the rest of its prompt is fed by the decode steps."""
        request, length = job.request, job.done
        # Rows move later if the newcomer's first slot would be before slot 0; an empty batch's clock starts again at
        # the newcomer's length, since attention reads every slot up to the clock.
        if self.clock < length or (self.clock > length and not self.active):
            self._reclock(self.clock - length)
        if None not in self.slots:
            self._resize(next(b for b in self.buckets if b > len(self.slots)))
        index = self.slots.index(None)
        self.cache = rows.insert(self.cache, job.cache, np.int32(index))
        feed = collections.deque(request.ids[length:])
        cuts = [c for c in job.cuts if c > length]
        self.slots[index] = _Row(request, self.clock - length, feed, length, cuts)
        self.inputs[index] = feed.popleft()
        self._params = None

    # ------------------------------------------------------------------------------------------------ decode

    def _decode_step(self) -> None:
        # Attention reads every slot up to the clock, the ones before the oldest row's first too: once those are
        # half of them (or the cache is full), the rows move back to slot 0, one copy of the KV cache.
        oldest = min(row.start for row in self.slots if row is not None)
        if self.kv_slots and (self.clock + 1 > self.kv_slots or oldest > max(self.clock // 2, MIN_RECLOCK)):
            self._reclock(oldest)
        if self._params is None:
            configs = [SamplingConfig() if row is None else row.request.sampling for row in self.slots]
            self._params = jax.device_put(SamplingConfig.row_params(configs))
        drawn = np.asarray([0 if row is None else row.drawn for row in self.slots], np.int32)
        prepared = self.generator.prepared(len(self.slots))
        started = time.perf_counter()
        try:
            logits, tokens, self.cache = self.generator.steps.decode(
                prepared, self.cache, self.inputs.copy(), self._params, drawn
            )
            ids = np.asarray(tokens)
            wanted = any(row is not None and row.request.logprobs and not row.feed for row in self.slots)
            logprobs = np.asarray(rows.chosen_logprobs(logits, tokens)) if wanted else None
        except Exception as e:  # noqa: BLE001 - every row's step failed: they end, the server goes on
            for index, row in enumerate(self.slots):
                if row is not None:
                    self.slots[index] = None
                    self._fail(row.request, e)
            self._reset_batch(len(self.slots))
            return
        seconds = time.perf_counter() - started
        self.step_seconds = seconds if not self.step_seconds else 0.8 * self.step_seconds + 0.2 * seconds
        self.clock += 1
        self.counters["decode_steps"] += 1
        for index, row in enumerate(self.slots):
            if row is not None:
                self._advance(index, row, int(ids[index]), None if logprobs is None else float(logprobs[index]))
        if self.active <= len(self.slots) // 2 and not self._waiting and not self._prefills:
            self._resize(next(b for b in self.buckets if b >= self.active))

    def _advance(self, index: int, row: _Row, token: int, logprob: float | None) -> None:
        """After a step: a row still reading its prompt takes its next prompt token (the sampled one is not its);
        a generating row's token goes to its request, and is its next input unless the request has finished."""
        if row.feed:
            row.consumed += 1
            if row.consumed in row.cuts:
                snapshot = rows.extracted(self.cache, np.int32(index), np.int32(row.start))
                slots = _kv_bucket(row.consumed, self.kv_slots)
                self.prefix.add(row.request.ids[: row.consumed], rows.trimmed(snapshot, slots))
                self.counters["row_snapshots"] += 1
            self.inputs[index] = row.feed.popleft()
            self.counters["fed_tokens"] += 1
            return
        self.counters["decode_tokens"] += 1
        row.drawn += 1
        if row.request.logprobs:
            row.request.token_logprobs.append(logprob)
        if self._push(row.request, token):
            self._free(index, None)
        else:
            self.inputs[index] = token

    def _push(self, request: Request, token: int) -> bool:
        """Give a request its next token; True when it has finished (stop, or its max_tokens reached)."""
        stream = request.stream
        stream.push(token)
        finished = stream.done or len(stream.ids) >= request.sampling.max_new_tokens
        if finished:
            stream.finish()
        request.on_text("".join(request.pending_text))
        request.pending_text.clear()
        if finished:
            request.finish(FINISH_REASONS[stream.finish_reason])
        return finished

    def _free(self, index: int, reason: str | None) -> None:
        row, self.slots[index], self.inputs[index] = self.slots[index], None, 0
        self._params = None
        if reason is not None:
            self.counters[reason] += 1
            row.request.finish(reason)

    def _fail(self, request: Request, error: Exception) -> None:
        self.counters["errors"] += 1
        request.finish("error", f"{type(error).__name__}: {error}")

    # ------------------------------------------------------------------------------------------------ the batch

    def _reset_batch(self, size: int) -> None:
        steps = self.generator.steps
        self.cache = steps.cache(size, self.kv_slots, np.zeros((size,), np.int32))
        self.slots: list[_Row | None] = [None] * size
        self.inputs = np.zeros(size, np.int32)  # each row's next input token
        self.clock, self._params = 0, None
        self._greedy_row = jax.device_put(SamplingConfig.row_params([SamplingConfig()]))

    def _reclock(self, shift: int) -> None:
        self.cache = rows.reclock(self.cache, np.int32(shift))
        self.clock -= shift
        for row in filter(None, self.slots):
            row.start -= shift
        self.counters["reclocks"] += 1

    def _resize(self, size: int) -> None:
        """The batch as `size` rows: the rows in use first (in order), then empty ones."""
        used = [index for index, row in enumerate(self.slots) if row is not None]
        self.cache = rows.take_rows(self.cache, np.asarray(used + [-1] * (size - len(used)), np.int32))
        self.slots = [self.slots[i] for i in used] + [None] * (size - len(used))
        self.inputs = np.concatenate([self.inputs[used], np.zeros(size - len(used), np.int32)])
        self._params = None
        self.counters["resizes"] += 1

    # ------------------------------------------------------------------------------------------------ warm-up

    def warmup(self) -> None:
        """Compile every shape serving can meet: each batch bucket's decode step and row moves, each prefill piece,
        each snapshot size (so that no request waits for a compilation)."""
        one = self.generator.steps.cache(1, self.kv_slots, np.zeros((1,), np.int32))
        n = 1
        while n <= min(self.prefill_chunk, self.max_context):
            one = rows.reclock(self.prefill(one, np.zeros((1, n), np.int32)), np.int32(n))  # back to slot 0
            n *= 2
        for size in self.buckets:
            self._reset_batch(size)
            self.cache = rows.insert(self.cache, one, np.int32(0))
            params = jax.device_put(SamplingConfig.row_params([SamplingConfig()] * size))
            zeros = np.zeros(size, np.int32)
            logits, tokens, self.cache = self.generator.steps.decode(
                self.generator.prepared(size), self.cache, zeros, params, zeros
            )
            rows.chosen_logprobs(logits, tokens)
            self.cache = rows.reclock(self.cache, np.int32(0))
            rows.extracted(self.cache, np.int32(0), np.int32(0))
            for other in self.buckets:
                rows.take_rows(self.cache, np.full((other,), -1, np.int32))
        if self.prefix.enabled:
            for slots in buckets(self.kv_slots) if self.kv_slots else [0]:
                rows.untrimmed(rows.trimmed(one, slots), self.kv_slots)
        jax.block_until_ready(self.cache)
        self._reset_batch(self.buckets[0])


def _kv_bucket(n: int, slots: int) -> int:
    """KV slots a snapshot of n tokens keeps: the next power of two, within the cache."""
    return min(next_power_of_two(max(n, 1)), slots)
