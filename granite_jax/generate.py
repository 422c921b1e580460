"""Text generation with granite-jax: a `Generator` that loads once and generates many times, and a CLI.

    python -m granite_jax.generate --model DIR --prompt "Hello"          # streams the reply
    python -m granite_jax.generate --model DIR --prompt a --prompt b --json

How a request runs (`Generator.generate`):
- Prompts are tokenized (optionally through the chat template), right-aligned in a batch of `bucket_length` slots
  (left padding: `pad[b]` slots before row b's first token) and prefilled in segments of at most `prefill_chunk`
  tokens. Each segment is one call of a jitted `forward` that carries the conv, SSM and KV state in the `Cache`.
- The decode step forwards one token per row, samples on device and returns the cache (donated, so the KV cache is
  updated in place) and the new ids (b,), the only thing copied to the host. A jitted call runs `decode_chunk` steps
  (default 4) in a loop on device, which ends early once every row has sampled a stop token id, so that the host's
  dispatch (~2.5 ms for ~440 buffers) costs once per chunk, not per token; streamed text arrives a chunk at a time.
- Shapes are bucketed so that compilation is bounded: prompt lengths round up to powers of two (>= 16) up to
  `prefill_chunk`, then to multiples of it; KV-cache lengths round up to `min_cache_len`, powers of two, then
  multiples of 16384. The decode step therefore compiles once per (batch size, cache bucket): once per batch size
  for every request whose padded prompt plus `max_new_tokens` fits `min_cache_len`, or always with a fixed
  `max_cache_len`. Executables are compiled ahead of time, before the timers start; `compilations` counts them.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import inspect
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from granite_jax import cli, cpu_kernels
from granite_jax.config import ATTENTION, SSD_IMPLS, ConfigError, ModelConfig
from granite_jax.model import (
    Cache,
    Granite,
    abstract_model,
    pack_for_decoding,
    packable,
    packing_bytes,
    with_ssd_impl,
)
from granite_jax.model import weight_dtype as weight_dtype_of
from granite_jax.params import AUTO, DTYPES, CheckpointError, auto_weight_dtype, checked_dtype, load_model, model_dtypes
from granite_jax.sampling import GenerationError, SamplerParams, SamplingConfig, check_utf8, is_int, sample_tokens

__all__ = ["GenerationError", "Generator", "Result", "SamplingConfig", "Timing", "generate", "main"]

log = logging.getLogger(__name__)
MIN_PROMPT_BUCKET = 16
LARGE_CACHE_STEP = 16384
StreamCallback = Callable[[int, str], None]  # (row, new text)
Prompts = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


# ---------------------------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock timing of one batch. Compilation is excluded (done ahead of time) and reported apart."""

    batch_size: int
    prompt_tokens: int  # real prompt tokens over the batch (padding excluded)
    padded_prompt_len: int  # the bucketed prompt length every row was padded to
    cache_len: int  # KV-cache slots
    prefill_s: float  # prompt in, first token on the host
    decode_steps: int  # decode-step calls after the first token
    decode_tokens: int  # tokens produced by those calls for rows still generating
    decode_s: float
    compile_s: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 and self.decode_tokens else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }


@dataclasses.dataclass(frozen=True)
class Result:
    """One prompt's generation. `token_ids` include a final stop token; `text` excludes it and any stop string."""

    prompt: str | None  # None for pre-tokenized prompts
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "stop_token" | "stop_string" | "length" | "max_position" (a RoPE model's last position)
    timing: Timing  # of the whole batch this prompt ran in

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "prompt_tokens": len(self.prompt_ids),
            "generated_tokens": len(self.token_ids),
            "finish_reason": self.finish_reason,
        }


# ---------------------------------------------------------------------------------------------- shapes


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


def _should_pack(model: Granite, pack_weights: bool | None) -> bool:
    if pack_weights is False or not cpu_kernels.available() or not packable(model):
        return False
    if pack_weights:
        return True
    needed = packing_bytes(model)
    available = available_memory()
    if available is not None and needed > available // 2:
        log.warning(
            "granite_jax: not packing the weights for decoding (%.1f GB; %.1f GB of memory available): "
            "decode steps of 2-16 sequences use XLA's slower products (pack_weights=True packs anyway)",
            needed / 1e9,
            available / 1e9,
        )
        return False
    return True


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux's MemAvailable), or None where unknown."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_memory() -> int | None:
    """Bytes free on the default device: an accelerator's memory statistics, else the host's `available_memory`."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # backends without memory statistics
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return available_memory()


# ---------------------------------------------------------------------------------------------- jitted steps


def _split(model: Granite) -> tuple[Any, Any, list]:
    # The steps take the weights as a flat list: flattening the nnx State costs ~2 ms per call, a list ~0.3 ms.
    graphdef, state = nnx.split(model)
    weights, treedef = jax.tree.flatten(state)
    return graphdef, treedef, weights


def _prefill_segment(graphdef, treedef, weights, cache: Cache, tokens, params: SamplerParams, step):
    """Forward one prompt segment (b, T) from the cache; sample from the last position's logits."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))
    logits, cache, _ = model.forward(tokens, cache=cache, last_only=True)
    logits = logits[:, -1].astype(jnp.float32)
    return logits, sample_tokens(logits, params, step), cache


def _decode_step(graphdef, treedef, weights, cache: Cache, tokens, params: SamplerParams, step):
    """Forward one token per row (b,) and sample the next ones."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))
    logits, cache, _ = model.forward(tokens[:, None], cache=cache)
    logits = logits[:, 0].astype(jnp.float32)
    return logits, sample_tokens(logits, params, step), cache


DECODE_CHUNK = 4  # default decode steps per call (h-350m on 2 cores: batch 1 1.03-1.12x, batch 8 1.065x 1 per call)
DEVICE_STOPS = 16  # stop token ids a decode call checks on device (with more, the host alone stops the rows)


def _decode_steps(
    graphdef, treedef, weights, cache: Cache, tokens, live, params: SamplerParams, stops, step, count, *, chunk: int
):
    """Up to `count` (<= chunk) decode steps from `tokens` (b,) at token index `step`, while some row is `live` (b,):
    a row stops being live once it samples one of `stops` (-1: none). Returns the ids (chunk, b) (zero past the steps
    run), the number of steps run, the last ids, `live` after them and the cache. Each step is `_decode_step` with its
    own index, so sampling draws as one call per token does."""

    def running(carry):
        i, live = carry[0], carry[3]
        return (i < count) & jnp.any(live)

    def body(carry):
        i, cache, tokens, live, out = carry
        _, tokens, cache = _decode_step(graphdef, treedef, weights, cache, tokens, params, step + i)
        live = live & ~jnp.any(tokens[:, None] == stops[None, :], axis=-1)
        return i + 1, cache, tokens, live, out.at[i].set(tokens)

    out = jnp.zeros((chunk, tokens.shape[0]), jnp.int32)
    ran, cache, tokens, live, out = lax.while_loop(running, body, (jnp.int32(0), cache, tokens, live, out))
    return out, ran, tokens, live, cache


def _device_stops(stop_ids) -> np.ndarray:
    """The stop ids a decode call checks, padded with -1 to DEVICE_STOPS (none if there are more)."""
    ids = sorted(stop_ids) if len(stop_ids) <= DEVICE_STOPS else []
    return np.asarray(ids + [-1] * (DEVICE_STOPS - len(ids)), np.int32)


def abstract_steps(
    cfg: ModelConfig,
    *,
    batch: int,
    prompt_len: int,
    cache_len: int,
    dtype: Any,
    weight_dtype: Any,
    sampling: SamplingConfig | None = None,
) -> dict[str, tuple[Callable, tuple]]:
    """The Generator's prefill and decode steps for the model `cfg`, with shape-only weights and arguments:
    {"prefill": (fn, args), "decode": (fn, args)}, the cache being args[1], for compiling without running (deviceless
    GPU compiles, kernel counts)."""
    graphdef, treedef, weights = _split(abstract_model(cfg, dtype=dtype, param_dtype=weight_dtype))
    cache = jax.eval_shape(lambda: Cache.init(cfg, batch, cache_len, dtype))
    params = jax.eval_shape((sampling or SamplingConfig()).device_params)
    S = jax.ShapeDtypeStruct
    step, prompt, token = S((), jnp.int32), S((batch, prompt_len), jnp.int32), S((batch,), jnp.int32)
    return dict(
        prefill=(functools.partial(_prefill_segment, graphdef, treedef), (weights, cache, prompt, params, step)),
        decode=(functools.partial(_decode_step, graphdef, treedef), (weights, cache, token, params, step)),
    )


# ---------------------------------------------------------------------------------------------- text and stops


class _RowStream:
    """One row's generated tokens: incremental detokenization, stop token/string detection, streamed text."""

    def __init__(self, row: int, tokenizer, stop_ids, stop_strings: tuple[str, ...], callback, at_max_position=False):
        self.row, self.tokenizer, self.stop_ids, self.stop_strings = row, tokenizer, stop_ids, stop_strings
        self.callback = callback
        self.length_reason = "max_position" if at_max_position else "length"
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of text already streamed
        self._prefix, self._read = 0, 0  # incremental-decode offsets into ids
        self.finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> None:
        self.ids.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop_token"
        elif self.tokenizer is not None:
            self._append_text()
        self._stream()

    def finish(self) -> None:
        """Mark the row finished by length (if still running), settle the final text and stream the rest."""
        if self.finish_reason is None:
            self.finish_reason = self.length_reason
        if self.tokenizer is not None:
            ids = self.ids[:-1] if self.finish_reason == "stop_token" else self.ids
            self.text = _cut_at_stop(self._decode(ids), self.stop_strings)
        self._stream(final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _append_text(self) -> None:
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        start = len(self.text)
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        if self.stop_strings:
            window = max(map(len, self.stop_strings))
            cut = _cut_at_stop(self.text, self.stop_strings, start=max(0, start - window + 1))
            if len(cut) < len(self.text):
                self.text, self.finish_reason = cut, "stop_string"

    def _stream(self, final: bool = False) -> None:
        if self.callback is None:
            return
        end = len(self.text) if final or self.done else len(self.text) - _held_back(self.text, self.stop_strings)
        if end > self.emitted:
            self.callback(self.row, self.text[self.emitted : end])
            self.emitted = end


def _cut_at_stop(text: str, stop_strings: Sequence[str], start: int = 0) -> str:
    hits = [i for s in stop_strings if (i := text.find(s, start)) >= 0]
    return text[: min(hits)] if hits else text


def _held_back(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest tail of text that could begin a stop string (not streamed until resolved)."""
    return max(
        (k for s in stop_strings for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), default=0
    )


# ---------------------------------------------------------------------------------------------- the generator


def default_model_dir() -> str | None:
    """The checkpoint shipped with the package, if any (none ships yet)."""
    path = os.path.join(os.path.dirname(__file__), "checkpoints", "default")
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


NO_MODEL_MESSAGE = (
    "no model given and granite-jax does not ship a checkpoint yet: pass --model DIR "
    "(a Hugging Face GraniteMoeHybrid checkpoint directory with config.json, safetensors and tokenizer files)"
)


def load_tokenizer(model_dir: str | os.PathLike):
    """transformers' AutoTokenizer from the checkpoint directory (local files only), or None if it has none."""
    d = os.fspath(model_dir)
    if not any(os.path.isfile(os.path.join(d, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(d, local_files_only=True)
    except Exception as e:  # transformers raises many types for broken tokenizer or config files
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{d}: cannot load the tokenizer ({type(e).__name__}: {first})") from None


class Generator:
    """A model and tokenizer loaded once, with compiled prefill/decode steps reused across `generate` calls.

    dtype: activation and parameter dtype ("float32", "bfloat16", "float16"; None: float32). weight_dtype: keep the
    weights in this dtype instead (None: dtype). "bfloat16" with dtype "float32" computes in float32 on the bfloat16
    values: for a bfloat16 checkpoint (the released ones are), the float32 model's results (the values are exactly
    representable; on CPUs the kernels widen them in registers) at half its weight memory and about half its batch-1
    decode traffic.
    "auto" (the default): that when dtype is "float32", the checkpoint stores bfloat16 and the CPU kernels run
    (`params.auto_weight_dtype`), else dtype. `weight_dtype` then names the dtype the weights were loaded in.
    ssd_impl: "xla", "naive", "pallas" (None: "xla").
    model, tokenizer: use these instead of loading from model_dir. The model runs as it is: a dtype or weight_dtype
    other than its own is refused (they choose how a checkpoint is loaded), and an ssd_impl is applied to it.
    prefill_chunk: longest prompt segment run in one call (bounds prefill memory).
    min_cache_len: KV slots of the smallest cache bucket. max_cache_len: if set, every request uses exactly this many
    KV slots (one decode compilation per batch size) and longer requests are rejected.
    decode_chunk: decode steps per call (a loop on device that ends once every row has sampled a stop token id): the
    host's per-call work is paid once per chunk, and streamed text arrives a chunk at a time (1: one call per token).
    pack_weights: before the first decode step of 2-16 sequences, give the model's float32 or bfloat16 projections a
    copy in the layout that such steps stream on CPUs (`model.pack_for_decoding`: 1.5-2.9x XLA's products in float32,
    twice the memory for those weights; batch 1 and prefill never use it). None: when the CPU kernels are available and
    the copy fits in half the available memory; False: never; True: whenever the kernels are available. `packed_bytes`
    says what was added. The weights are taken once: a Generator over a model whose weights change afterwards keeps
    the old ones.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike | None = None,
        *,
        dtype: str | None = None,
        weight_dtype: str | None = AUTO,
        ssd_impl: str | None = None,
        prefill_chunk: int = 512,
        min_cache_len: int = 1024,
        max_cache_len: int | None = None,
        decode_chunk: int = DECODE_CHUNK,
        progress: bool = False,
        pack_weights: bool | None = None,
        model: Granite | None = None,
        tokenizer: Any = None,
    ):
        given_dtype = None if dtype is None else _dtype_name("dtype", dtype)  # names from here on
        dtype = given_dtype or "float32"
        weight_dtype = weight_dtype if weight_dtype in (AUTO, None) else _dtype_name("weight_dtype", weight_dtype)
        if ssd_impl is not None and ssd_impl not in SSD_IMPLS:
            raise GenerationError(f"ssd_impl must be one of {', '.join(SSD_IMPLS)}, got {ssd_impl!r}")
        _check_sizes(prefill_chunk, min_cache_len, max_cache_len, pack_weights, decode_chunk)
        if model is None:
            model_dir = model_dir if model_dir is not None else default_model_dir()
            if model_dir is None:
                raise GenerationError(NO_MODEL_MESSAGE)
            weights = auto_weight_dtype(model_dir, dtype) if weight_dtype == AUTO else weight_dtype
            model = load_model(model_dir, **model_dtypes(dtype, weights), ssd_impl=ssd_impl or "xla", progress=progress)
        else:
            _check_given_model(model, given_dtype, weight_dtype)
            if ssd_impl is not None and ssd_impl != model.cfg.ssd_impl:
                model = with_ssd_impl(model, ssd_impl)
        self.model_dir = None if model_dir is None else os.fspath(model_dir)
        self.model = model
        self.cfg: ModelConfig = model.cfg
        self.tokenizer = tokenizer if tokenizer is not None or model_dir is None else load_tokenizer(model_dir)
        # plain ints (numpy ints are accepted): they reach BatchLayout, Timing and its JSON
        self.prefill_chunk, self.min_cache_len, self.decode_chunk = (
            int(prefill_chunk),
            int(min_cache_len),
            int(decode_chunk),
        )
        self.max_cache_len = None if max_cache_len is None else int(max_cache_len)
        self.pack_weights, self.packed_bytes = pack_weights, 0
        self._views = {False: _split(model)}  # True: with the packed copies, made by `_view` when first needed
        self.compilations: collections.Counter[str] = collections.Counter()  # "prefill" / "decode" -> count
        self._executables: dict[tuple, Any] = {}
        self._abstract_caches: dict[tuple[int, int], Cache] = {}
        self.last_timing: Timing | None = None

    # ------------------------------------------------------------------ public API

    @property
    def weight_dtype(self) -> str | list[str]:
        """The dtype name the model's weights are in (`model.weight_dtype`)."""
        return weight_dtype_of(self.model)

    def generate(
        self,
        prompts: Prompts,
        sampling: SamplingConfig | None = None,
        *,
        chat: bool = False,
        system: str | None = None,
        stream_callback: StreamCallback | None = None,
        **sampling_options: Any,
    ) -> list[Result]:
        """Generate for one prompt or a batch: strings, or token ids (a list of ints, or a list of lists).

        Sampling options come from `sampling` and/or keyword arguments (`max_new_tokens=`, `temperature=`, ...).
        `chat` applies the tokenizer's chat template (with `system` as the system message).
        `stream_callback(row, text)` receives each row's text as it is produced.
        """
        sampling = _sampling_config(sampling, sampling_options)
        if stream_callback is not None and not callable(stream_callback):
            raise GenerationError(f"stream_callback must be callable, got {type(stream_callback).__name__}")
        texts, prompt_ids = self.encode(prompts, chat=chat, system=system)
        if sampling.stop_strings and self.tokenizer is None:
            raise GenerationError("stop_strings need a tokenizer, and this model directory has none")
        layout = self.layout([len(ids) for ids in prompt_ids], sampling.max_new_tokens)
        stop_ids = frozenset(self.cfg.eos_token_id if sampling.stop_token_ids is None else sampling.stop_token_ids)
        if sampling.stop_token_ids is not None:  # (the config's eos ids may lie past the vocabulary: they never occur)
            self._check_vocab("stop token id", sorted(sampling.stop_token_ids))
        # A RoPE model stops at max_position_embeddings (`layout`): such a row ends by "max_position", not "length".
        cut = layout.max_new_tokens < sampling.max_new_tokens
        rows = [
            _RowStream(i, self.tokenizer, stop_ids, sampling.stop_strings, stream_callback, cut)
            for i in range(layout.batch_size)
        ]
        timing = self._run(prompt_ids, layout, sampling, rows)
        self.last_timing = timing
        return [
            Result(text, tuple(ids), tuple(row.ids), row.text, row.finish_reason, timing)
            for text, ids, row in zip(texts, prompt_ids, rows)
        ]

    def encode(
        self, prompts: Prompts, *, chat: bool = False, system: str | None = None
    ) -> tuple[list[str | None], list[list[int]]]:
        """(prompt texts or None, token ids) of a prompt or batch, validated."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence | np.ndarray) or isinstance(prompts, bytes | bytearray):
            raise GenerationError(
                f"prompts must be a string, token ids, or a list of either; got {type(prompts).__name__}"
            )
        if system is not None and not isinstance(system, str):
            raise GenerationError(f"system must be a string or None, got {type(system).__name__}")
        prompts = list(prompts)
        if not prompts:
            raise GenerationError("no prompts given")
        if all(is_int(p) for p in prompts):
            prompts = [prompts]  # one pre-tokenized prompt
        if all(isinstance(p, str) for p in prompts):
            return prompts, [self._tokenize(i, p, chat, system) for i, p in enumerate(prompts)]
        if chat:
            raise GenerationError("chat=True needs text prompts, not token ids")
        ids = [self._check_ids(i, p) for i, p in enumerate(prompts)]
        return [None] * len(ids), ids

    def layout(self, lengths: Sequence[int], max_new_tokens: int) -> BatchLayout:
        """Padding and cache sizes for prompts of these lengths; rejects prompts too long for the model."""
        cfg, longest = self.cfg, max(lengths)
        if cfg.rope_theta is not None:
            limit = cfg.max_position_embeddings
            if longest > limit:
                raise GenerationError(
                    f"prompt of {longest} tokens is longer than max_position_embeddings={limit} of this RoPE model"
                )
            max_new_tokens = min(max_new_tokens, limit - longest + 1)  # the last token is sampled, never fed
        padded = bucket_length(longest, self.prefill_chunk)
        need = padded + max_new_tokens - 1  # the last sampled token is never written to the cache
        if not has_attention(cfg):
            cache_len = 0
        elif self.max_cache_len is not None:
            if need > self.max_cache_len:
                raise GenerationError(
                    f"prompt ({longest} tokens, padded to {padded}) plus max_new_tokens={max_new_tokens} needs "
                    f"{need} KV-cache slots, more than max_cache_len={self.max_cache_len}"
                )
            cache_len = self.max_cache_len
        else:
            cache_len = cache_bucket(need, self.min_cache_len)
        segment = padded if padded <= self.prefill_chunk else self.prefill_chunk
        layout = BatchLayout(tuple(lengths), padded, segment, cache_len, max_new_tokens)
        self._check_cache_fits(layout)
        return layout

    def _check_cache_fits(self, layout: BatchLayout) -> None:
        """A cache (KV slots, conv and SSM states) larger than the memory free on the device is refused before it
        is allocated."""
        need = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(self._abstract_cache(layout)))
        free = free_memory()
        if free is not None and need > free:
            raise GenerationError(
                f"the cache for {layout.batch_size} sequence(s) of up to {layout.cache_len} tokens needs "
                f"{need / 1e9:.1f} GB, more than the {free / 1e9:.1f} GB free: lower max_new_tokens (or "
                "max_cache_len), or shorten the prompts"
            )

    def prefill(self, prompts: Prompts, sampling: SamplingConfig | None = None) -> tuple[jax.Array, jax.Array, Cache]:
        """Prefill prompts (in segments of `prefill_chunk`): (last-position logits (b, V), first tokens (b,), cache)."""
        sampling = sampling or SamplingConfig()
        _, prompt_ids = self.encode(prompts)
        layout = self.layout([len(ids) for ids in prompt_ids], sampling.max_new_tokens)
        return self._prefill(prompt_ids, layout, sampling.device_params())

    def teacher_forced_logits(self, prompts: Prompts, continuation: Sequence[Sequence[int]]) -> np.ndarray:
        """Logits (b, 1 + N, V) predicting each token of `continuation` (b, N), fed through the decode step.

        Entry 0 comes from the prefill's last position, entry i from the decode step that consumed continuation
        token i - 1: the same positions a full forward over prompt + continuation scores.
        """
        _, prompt_ids = self.encode(prompts)
        rows = [self._check_continuation(i, ids) for i, ids in enumerate(continuation)]
        if len(rows) != len(prompt_ids) or len({len(r) for r in rows}) != 1:
            raise GenerationError(
                f"continuation: expected {len(prompt_ids)} row(s) of one length, got lengths {[len(r) for r in rows]}"
            )
        forced = np.asarray(rows, np.int32)
        layout = self.layout([len(ids) for ids in prompt_ids], forced.shape[1] + 1)
        params = SamplingConfig().device_params()
        decode = self._compile_decode(layout, params)
        logits, _, cache = self._prefill(prompt_ids, layout, params)
        out = [np.asarray(logits)]
        for i in range(forced.shape[1]):
            logits, _, cache = decode(cache, forced[:, i], params, np.int32(i + 1))
            out.append(np.asarray(logits))
        return np.stack(out, axis=1)

    def measure(self, batch_size: int, prompt_len: int, new_tokens: int, seed: int = 0) -> Timing:
        """Greedy generation of exactly `new_tokens` tokens for `batch_size` random prompts of `prompt_len` tokens."""
        rng = np.random.default_rng(seed)
        prompts = rng.integers(0, self.cfg.vocab_size, (batch_size, prompt_len)).tolist()
        sampling = SamplingConfig(max_new_tokens=new_tokens, stop_token_ids=())
        return self.generate(prompts, sampling)[0].timing

    # ------------------------------------------------------------------ internals

    def _tokenize(self, index: int, prompt: str, chat: bool, system: str | None) -> list[int]:
        if not prompt:
            raise GenerationError(f"prompt {index + 1} is empty")
        for name, text in ((f"prompt {index + 1}", prompt), ("the system message", system or "")):
            check_utf8(name, text)
        if self.tokenizer is None:
            where = f"{self.model_dir}: no tokenizer files (tokenizer.json / tokenizer_config.json)"
            raise GenerationError(f"{where if self.model_dir else 'no tokenizer was given'}; pass token ids")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise GenerationError(f"{self.model_dir}: the tokenizer has no chat template")
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise GenerationError(f"prompt {index + 1} is empty after tokenization")
        hint = ": the tokenizer files do not match this checkpoint"
        self._check_vocab(f"prompt {index + 1}: the tokenizer gave token id", ids, hint)
        return list(ids)

    def _check_ids(self, index: int, ids) -> list[int]:
        if isinstance(ids, str) or not isinstance(ids, Sequence | np.ndarray):
            raise GenerationError("prompts must be all strings or all lists of token ids")
        ids = [int(i) for i in ids] if all(is_int(i) for i in ids) else None
        if ids is None:
            raise GenerationError(f"prompt {index + 1}: token ids must be integers")
        if not ids:
            raise GenerationError(f"prompt {index + 1} is empty")
        self._check_vocab(f"prompt {index + 1}: token id", ids)
        return ids

    def _check_continuation(self, index: int, ids) -> list[int]:
        if isinstance(ids, str) or not isinstance(ids, Sequence | np.ndarray) or not all(is_int(i) for i in ids):
            raise GenerationError(f"continuation row {index + 1}: expected a list of integer token ids, got {ids!r}")
        ids = [int(i) for i in ids]
        self._check_vocab(f"continuation row {index + 1}: token id", ids)
        return ids

    def _check_vocab(self, what: str, ids: Sequence[int], hint: str = "") -> None:
        if bad := [i for i in ids if not 0 <= i < self.cfg.vocab_size]:
            raise GenerationError(f"{what} {bad[0]} is outside [0, vocab_size={self.cfg.vocab_size}){hint}")

    def _view(self, packed: bool) -> tuple[Any, Any, list]:
        """(graphdef, treedef, weights) of the model for the jitted steps; packed: with `pack_for_decoding`'s copies
        (made here on first use, when `pack_weights` and the memory allow; else the plain view)."""
        if packed and packed not in self._views:
            if _should_pack(self.model, self.pack_weights):
                self.packed_bytes = pack_for_decoding(self.model)
                self._views[True] = _split(self.model)
            else:
                self._views[True] = self._views[False]
        return self._views[packed]

    def _executable(self, kind: str, key: tuple, fn, *args, model: bool = True, packed: bool = False):
        """The AOT-compiled `fn` for these argument shapes (compiled on first use; counted in `compilations`).

        With `model`, fn starts with (graphdef, treedef, weights, cache, ...): the returned callable has the model
        (`_view(packed)`) bound, takes (cache, ...) and donates the cache.
        """
        full_key = (kind, *key)
        if full_key not in self._executables:
            if model:
                graphdef, treedef, weights = self._view(packed)
                jitted = jax.jit(functools.partial(fn, graphdef, treedef), donate_argnums=(1,))
                compiled = jitted.lower(weights, *args).compile()
                self._executables[full_key] = functools.partial(compiled, weights)
            else:
                self._executables[full_key] = jax.jit(fn).lower(*args).compile()
            self.compilations[kind] += 1
        return self._executables[full_key]

    def _compile_cache(self, layout: BatchLayout):
        """Allocates a zeroed cache for this layout from pad (b,) (compiled, so no eager per-array dispatch)."""
        init = functools.partial(Cache.init, self.cfg, layout.batch_size, layout.cache_len, self.model.dtype)
        pad = jax.ShapeDtypeStruct((layout.batch_size,), jnp.int32)
        return self._executable("cache", (layout.batch_size, layout.cache_len), init, pad, model=False)

    def _abstract_cache(self, layout: BatchLayout) -> Cache:
        # Traced once per shape: tracing Cache.init took ~12 ms, twice per generate() call.
        key = (layout.batch_size, layout.cache_len)
        if key not in self._abstract_caches:
            init = functools.partial(Cache.init, self.cfg, *key, self.model.dtype)
            self._abstract_caches[key] = jax.eval_shape(init, jax.ShapeDtypeStruct((layout.batch_size,), jnp.int32))
        return self._abstract_caches[key]

    def _compile_prefill(self, layout: BatchLayout, params: SamplerParams):
        b, t = layout.batch_size, layout.segment_len
        tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)
        step = jax.ShapeDtypeStruct((), jnp.int32)
        cache = self._abstract_cache(layout)
        return self._executable("prefill", (b, t, layout.cache_len), _prefill_segment, cache, tokens, params, step)

    def _compile_decode(self, layout: BatchLayout, params: SamplerParams, chunk: int | None = None):
        """`_decode_steps` (cache, tokens, live, params, stops, step, count) -> (ids, steps run, tokens, live, cache)
        for `chunk` steps per call; chunk None: one `_decode_step` (cache, tokens, params, step) -> (logits, tokens,
        cache)."""
        b = layout.batch_size
        tokens = jax.ShapeDtypeStruct((b,), jnp.int32)
        step = jax.ShapeDtypeStruct((), jnp.int32)
        cache = self._abstract_cache(layout)
        packed = cpu_kernels.MIN_ROWS <= b <= cpu_kernels.MAX_ROWS  # the products the packed copies are for
        key = (b, layout.cache_len, chunk)
        if chunk is None:
            return self._executable("decode", key, _decode_step, cache, tokens, params, step, packed=packed)
        live = jax.ShapeDtypeStruct((b,), jnp.bool_)
        stops = jax.ShapeDtypeStruct((DEVICE_STOPS,), jnp.int32)
        fn = functools.partial(_decode_steps, chunk=chunk)
        return self._executable("decode", key, fn, cache, tokens, live, params, stops, step, step, packed=packed)

    def _prefill(self, prompt_ids, layout: BatchLayout, params: SamplerParams):
        run = self._compile_prefill(layout, params)
        pad_id = self.cfg.pad_token_id if self.cfg.pad_token_id is not None else 0
        tokens = layout.tokens(prompt_ids, pad_id)
        cache = self._compile_cache(layout)(layout.pad)
        step = np.int32(0)
        for start in range(0, layout.padded_len, layout.segment_len):
            segment = tokens[:, start : start + layout.segment_len]
            logits, first, cache = run(cache, segment, params, step)
        return logits, first, cache

    def _run(self, prompt_ids, layout: BatchLayout, sampling: SamplingConfig, rows: list[_RowStream]) -> Timing:
        params = sampling.device_params()
        t0 = time.perf_counter()
        self._compile_cache(layout)
        self._compile_prefill(layout, params)
        # One sequence: each call is queued before the ids of the one ahead of it are read, so that the host's work
        # (dispatching ~440 buffers takes 2-4 ms here, then detokenizing) overlaps steps bound by memory; a call queued
        # after the last row's stop token runs no step. A batch: each call's ids are read before the next is queued,
        # which keeps the host off the cores the batch's arithmetic needs (overlapped, batch 8 was 0.94x the speed on
        # 2 cores; docs/generation.md).
        overlap = layout.batch_size == 1
        chunk = self.decode_chunk
        decode = self._compile_decode(layout, params, chunk) if layout.max_new_tokens > 1 else None
        stops = jnp.asarray(_device_stops(rows[0].stop_ids))  # on the device once, not copied at every call
        t1 = time.perf_counter()
        _, tokens, cache = self._prefill(prompt_ids, layout, params)
        self._push(rows, np.asarray(tokens))
        live = np.asarray([not row.done for row in rows])
        t2 = time.perf_counter()
        totals = [0, 0]  # steps run, tokens pushed

        def read(ids, ran) -> None:
            totals[0] += int(ran)
            totals[1] += self._push_steps(rows, ids, ran)

        queued, in_flight = 0, None  # steps asked for; the call whose ids are not read yet
        while queued + 1 < layout.max_new_tokens and not all(row.done for row in rows):
            count = min(chunk, layout.max_new_tokens - 1 - queued)
            ids, ran, tokens, live, cache = decode(
                cache, tokens, live, params, stops, np.int32(queued + 1), np.int32(count)
            )
            queued += count
            if in_flight is not None:
                read(*in_flight)
            in_flight = ids, ran
            if not overlap:
                read(*in_flight)
                in_flight = None
        if in_flight is not None:
            read(*in_flight)
        steps, produced = totals
        t3 = time.perf_counter()
        for row in rows:
            row.finish()
        return Timing(
            batch_size=layout.batch_size,
            prompt_tokens=sum(layout.lengths),
            padded_prompt_len=layout.padded_len,
            cache_len=layout.cache_len,
            prefill_s=t2 - t1,
            decode_steps=steps,
            decode_tokens=produced,
            decode_s=t3 - t2,
            compile_s=t1 - t0,
        )

    @classmethod
    def _push_steps(cls, rows: list[_RowStream], ids, count) -> int:
        """Pushes the first `count` steps' ids (steps, b), step by step, until every row is done."""
        produced = 0
        for step_ids in np.asarray(ids)[: int(count)]:
            if all(row.done for row in rows):
                break
            produced += cls._push(rows, step_ids)
        return produced

    @staticmethod
    def _push(rows: list[_RowStream], tokens: np.ndarray) -> int:
        live = [row for row in rows if not row.done]
        for row in live:
            row.push(int(tokens[row.row]))
        return len(live)


def has_attention(cfg: ModelConfig) -> bool:
    return ATTENTION in cfg.layer_types


def _dtype_name(name: str, value: Any) -> str:
    """A dtype argument (a name, or a jnp/np dtype) as its name; GenerationError naming `name` otherwise."""
    try:
        return jnp.dtype(checked_dtype(name, value)).name
    except ValueError:
        choices = ("auto, None or " if name == "weight_dtype" else "") + "one of " + ", ".join(DTYPES)
        raise GenerationError(f"{name} must be {choices}, got {value!r}") from None


def _check_sizes(prefill_chunk, min_cache_len, max_cache_len, pack_weights, decode_chunk) -> None:
    is_size = lambda v: is_int(v) and v >= 1
    sizes = (("prefill_chunk", prefill_chunk), ("min_cache_len", min_cache_len), ("decode_chunk", decode_chunk))
    for name, value in sizes:
        if not is_size(value):
            raise GenerationError(f"{name} must be an integer >= 1, got {value!r}")
    if max_cache_len is not None and not is_size(max_cache_len):
        raise GenerationError(f"max_cache_len must be an integer >= 1 or None, got {max_cache_len!r}")
    if pack_weights is not None and not isinstance(pack_weights, bool):
        raise GenerationError(f"pack_weights must be None, True or False, got {pack_weights!r}")


def _check_given_model(model: Granite, dtype: str | None, weight_dtype: str | None) -> None:
    """dtype and weight_dtype choose how a checkpoint is loaded; a model given as it is must not contradict them."""
    computes, stored = jnp.dtype(model.dtype).name, weight_dtype_of(model)
    if dtype is not None and dtype != computes:
        raise GenerationError(f"dtype={dtype!r}, but the model given computes in {computes} (dtype applies to loading)")
    if weight_dtype not in (AUTO, None) and weight_dtype != stored:
        raise GenerationError(
            f"weight_dtype={weight_dtype!r}, but the model given holds {stored} weights (it applies to loading)"
        )


def _sampling_config(sampling: SamplingConfig | None, options: dict[str, Any]) -> SamplingConfig:
    if sampling is not None and not isinstance(sampling, SamplingConfig):
        raise GenerationError(f"sampling must be a SamplingConfig (or None), got {type(sampling).__name__}")
    try:
        if sampling is None:
            return SamplingConfig(**options)
        return sampling.replace(**options) if options else sampling
    except TypeError as e:  # an unknown keyword
        raise GenerationError(f"unknown sampling option ({e})") from None


def generate(model_dir: str | os.PathLike | None, prompt: Prompts, **kwargs: Any) -> Result | list[Result]:
    """Load a model and generate once: a `Result` for one text prompt, a list for a batch.

    Keyword arguments go to `Generator` (dtype, ssd_impl, prefill_chunk, ...) or to `Generator.generate`
    (sampling options, chat, system, stream_callback).
    """
    init_keys = set(inspect.signature(Generator).parameters) - {"model_dir", "model", "tokenizer"}
    generator = Generator(model_dir, **{k: v for k, v in kwargs.items() if k in init_keys})
    results = generator.generate(prompt, **{k: v for k, v in kwargs.items() if k not in init_keys})
    single = isinstance(prompt, str) or (len(prompt) > 0 and all(is_int(t) for t in prompt))
    return results[0] if single else results


# ---------------------------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m granite_jax.generate",
        description="Generate text with a Granite 4.0 (GraniteMoeHybrid) checkpoint in JAX. "
        "Prompts come from --prompt, --prompt-file or, if neither is given, standard input (one prompt). "
        "Several prompts run as one left-padded batch; each stops on its own.",
        epilog="Examples:\n"
        '  python -m granite_jax.generate --model ckpt/granite-4.0-h-350m --prompt "The capital of France is"\n'
        '  python -m granite_jax.generate --model DIR --chat --system "Be brief." --prompt "Why is the sky blue?"\n'
        "  python -m granite_jax.generate --model DIR --prompt-file prompts.txt --temperature 0.7 --top-p 0.9 --json\n"
        "  echo 'Once upon a time' | python -m granite_jax.generate --model DIR --max-new-tokens 64\n\n"
        "Exit status: 0 on success, 2 on invalid input (bad flag value, missing model, prompt too long, ...).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    io = p.add_argument_group("model and prompts")
    io.add_argument(
        "--model",
        metavar="DIR",
        help="checkpoint directory: a Hugging Face GraniteMoeHybrid checkpoint (config.json, *.safetensors) with its "
        "tokenizer files, or its orbax conversion (python -m granite_jax.convert); the tokenizer is loaded with "
        "transformers' AutoTokenizer from local files only. "
        "Required until a checkpoint ships with granite-jax.",
    )
    io.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt; repeat for a batch")
    io.add_argument(
        "--prompt-file",
        action="append",
        default=[],
        metavar="FILE",
        help="a UTF-8 file with one prompt per line (blank lines are skipped); repeatable. "
        "For one multi-line prompt, pipe it on standard input instead.",
    )
    io.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the tokenizer's chat template (with the assistant turn opened)",
    )
    io.add_argument("--system", metavar="TEXT", help="system message for --chat")
    s = p.add_argument_group("sampling and stopping")
    s.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens to generate per prompt (128)")
    s.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default); > 0 samples softmax(l/T)"
    )
    s.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely tokens (0 = all)")
    s.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="sample among the fewest most likely tokens with probability >= P, in (0, 1] (1 = all)",
    )
    s.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same output (0)")
    s.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop a sequence at this string, matched in the decoded text without special tokens (repeatable; "
        "for a special token use --stop-token-id)",
    )
    s.add_argument(
        "--stop-token-id",
        type=int,
        action="append",
        default=None,
        metavar="ID",
        help="stop a sequence at this token id (repeatable); replaces the model's eos_token_id",
    )
    s.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at eos_token_id (always --max-new-tokens, or up to max_position_embeddings on a RoPE model)",
    )
    r = p.add_argument_group("runtime")
    r.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="arithmetic dtype, and the weights' unless --weight-dtype says otherwise (float32)",
    )
    r.add_argument(
        "--weight-dtype",
        choices=[AUTO, *DTYPES],
        default=AUTO,
        help="keep the weights in this dtype instead of --dtype. With --dtype float32, bfloat16 computes in float32 on "
        "the bfloat16 values: for a bfloat16 checkpoint (the released ones are) the float32 results at half the "
        "weight memory, and faster batch-1 decoding on CPUs. auto: bfloat16 when --dtype is float32, the "
        "checkpoint stores bfloat16 and the CPU kernels run, else --dtype (auto)",
    )
    r.add_argument(
        "--ssd-impl",
        choices=SSD_IMPLS,
        default="xla",
        help="Mamba-2 SSD implementation (xla). pallas: Triton kernels for NVIDIA GPUs, 4.7x xla's SSD at 8k tokens "
        "with --dtype bfloat16 on an H200, but slower with float32 (docs/kernels.md)",
    )
    r.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        metavar="N",
        help="longest prompt segment processed at once; longer prompts are prefilled in segments that carry the "
        "conv, SSM and KV state, so prefill memory is bounded by the segment (512)",
    )
    r.add_argument(
        "--decode-chunk",
        type=cli.positive_int,
        default=DECODE_CHUNK,
        metavar="N",
        help="decode steps per compiled call, a loop on the device that ends once every prompt has produced a stop "
        f"token: the host's per-call work is paid once per N tokens, and streamed text arrives N tokens at a time "
        f"({DECODE_CHUNK}; 1: one call per token)",
    )
    r.add_argument(
        "--no-pack-weights",
        dest="pack_weights",
        action="store_false",
        default=None,
        help="do not copy the float32 or bfloat16 weights into the layout that CPU decode steps of 2-16 prompts stream "
        "(saves memory equal to the weights; those steps then run slower products: 1.5-2.9x in float32). Default: "
        "copy, before the first such step, when the CPU kernels are available and it fits in half the free memory",
    )
    r.add_argument(
        "--max-cache-len",
        type=int,
        default=None,
        metavar="N",
        help="fixed number of KV-cache slots (padded prompt + new tokens must fit); default: sized per request "
        "in buckets (>= 1024)",
    )
    o = p.add_argument_group("output")
    stream = o.add_mutually_exclusive_group()
    stream.add_argument(
        "--stream",
        dest="stream",
        action="store_true",
        default=None,
        help="print tokens as they are produced (default for a single prompt without --json)",
    )
    stream.add_argument("--no-stream", dest="stream", action="store_false", help="print each text when it is done")
    o.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document: texts, token ids, finish reasons and prefill/decode tokens per second",
    )
    o.add_argument("--quiet", action="store_true", help="no progress bar and no timing line on stderr")
    return p


def _read_text(path: str | None) -> str:
    """A file's (or, for None, standard input's) text, strictly UTF-8."""
    where = "standard input" if path is None else path
    try:
        data = sys.stdin.buffer.read() if path is None else open(path, "rb").read()
    except OSError as e:
        raise GenerationError(f"{where}: cannot read ({e.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GenerationError(f"{where}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def _collect_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    for path in args.prompt_file:
        prompts += [line for line in _read_text(path).splitlines() if line.strip()]
    if not args.prompt and not args.prompt_file:
        if sys.stdin is None or sys.stdin.isatty():
            raise GenerationError("no prompt: pass --prompt TEXT, --prompt-file FILE or text on standard input")
        text = _read_text(None)
        prompts = [text[:-1] if text.endswith("\n") else text]
    if not prompts:
        raise GenerationError("no prompt: the prompt files are empty")
    empty = [i + 1 for i, prompt in enumerate(prompts) if not prompt]
    if empty:  # found before the model load (Generator checks again, for the Python API)
        raise GenerationError(f"prompt {empty[0]} is empty")
    return prompts


def _sampling_from_args(args: argparse.Namespace) -> SamplingConfig:
    stop_ids = () if args.ignore_eos else None
    if args.stop_token_id is not None:
        stop_ids = tuple(args.stop_token_id)
    return SamplingConfig(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=stop_ids,
        stop_strings=tuple(args.stop),
    )


def _timing_line(t: Timing) -> str:
    return (
        f"prefill: {t.prompt_tokens} tokens in {t.prefill_s:.3f} s ({t.prefill_tokens_per_s:.1f} tok/s); "
        f"decode: {t.decode_tokens} tokens in {t.decode_s:.3f} s ({t.decode_tokens_per_s:.1f} tok/s); "
        f"compile: {t.compile_s:.1f} s"
    )


def _check_flag_combinations(args: argparse.Namespace) -> None:
    if args.stream and args.json:
        raise GenerationError("--stream and --json exclude each other: --json prints one JSON document at the end")
    if args.system is not None and not args.chat:
        raise GenerationError("--system needs --chat (the system prompt goes into the chat template)")
    if args.ssd_impl == "pallas":
        import pallas_kernels

        try:
            pallas_kernels.check_available()
        except pallas_kernels.PallasUnavailableError as e:
            raise GenerationError(f"--ssd-impl: {e}") from None


def run_cli(args: argparse.Namespace) -> int:
    _check_flag_combinations(args)  # validate flags before the (slow) model load
    sampling = _sampling_from_args(args)
    if args.model is None and default_model_dir() is None:
        raise GenerationError(NO_MODEL_MESSAGE)
    if args.model is not None and not os.path.isdir(args.model):
        raise GenerationError(f"{args.model}: model directory not found")
    prompts = _collect_prompts(args)
    generator = Generator(
        args.model,
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        ssd_impl=args.ssd_impl,
        prefill_chunk=args.prefill_chunk,
        decode_chunk=args.decode_chunk,
        max_cache_len=args.max_cache_len,
        progress=not args.quiet and not args.json,
        pack_weights=args.pack_weights,
    )
    stream = args.stream if args.stream is not None else (len(prompts) == 1 and not args.json)
    results = generator.generate(
        prompts,
        sampling,
        chat=args.chat,
        system=args.system,
        stream_callback=_printer(len(prompts)) if stream else None,
    )
    timing = results[0].timing
    if args.json:
        doc = {
            "model": args.model,
            "dtype": args.dtype,
            "weight_dtype": generator.weight_dtype,
            "sampling": dataclasses.asdict(sampling),
            "results": [r.as_dict() for r in results],
            "prefill_tokens_per_s": timing.prefill_tokens_per_s,
            "decode_tokens_per_s": timing.decode_tokens_per_s,
            "timing": timing.as_dict(),
        }
        print(json.dumps(_json_safe(doc), indent=2, ensure_ascii=False))
    elif stream:
        print(flush=True)
    elif len(results) == 1:
        print(results[0].text)
    else:
        for i, r in enumerate(results):
            print(f"=== prompt {i + 1} ({r.finish_reason}) ===\n{r.text}")
    if not args.quiet and not args.json:
        print(_timing_line(timing), file=sys.stderr)
    return 0


def _printer(n_prompts: int) -> StreamCallback:
    """Streaming output: a single prompt's text as is; for a batch, one `[row] 'piece'` line per piece."""
    if n_prompts == 1:
        return lambda row, text: print(text, end="", flush=True)
    return lambda row, text: print(f"[{row + 1}] {text!r}", flush=True)


def _json_safe(x):
    """NaN/inf (e.g. decode tokens/s with a single new token) become null, as JSON has no NaN."""
    if isinstance(x, float):
        return x if np.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_cli(args)
    except (GenerationError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
