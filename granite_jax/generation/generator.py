"""The `Generator`: a model and tokenizer loaded once, generating for one prompt or a batch, many times.

How a request runs:
- Prompts are tokenized (optionally through the chat template), right-aligned in a batch (left padding) and
  prefilled in segments of at most `prefill_chunk` tokens, each one call of the prefill step (`steps`).
- Each decode call runs up to `decode_chunk` steps in a loop on the device, which ends early once every row has
  sampled a stop token id: the host's dispatch is paid once per chunk, not per token, and streamed text arrives a
  chunk at a time. Only the new ids reach the host.
- Shapes are bucketed (`layout`), so compilation is bounded; each shape is compiled before the timers start.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from granite_jax import ops, sharding
from granite_jax.checkpoint import (
    AUTO,
    NO_MODEL_MESSAGE,
    WEIGHT_DTYPES,
    default_model_dir,
    dtype_name,
    load_model,
    load_tokenizer,
)
from granite_jax.errors import GenerationError, InputError
from granite_jax.generation.layout import BatchLayout, plan
from granite_jax.generation.prompts import PromptEncoder, Prompts
from granite_jax.generation.steps import Steps, device_stops
from granite_jax.generation.stream import RowStream
from granite_jax.model import Granite, with_runtime
from granite_jax.model import weight_dtype as weight_dtype_of
from granite_jax.ops import Runtime
from granite_jax.sampling import SamplerParams, SamplingConfig, is_int
from granite_jax.system import free_memory

StreamCallback = Callable[[int, str], None]  # (row, new text)
DECODE_CHUNK = 4  # default decode steps per call: batch 1 on 2 CPU cores 1.03-1.12x one call per token


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock timing of one batch. Compilation is excluded (done ahead of time) and reported apart."""

    batch_size: int
    prompt_tokens: int  # real prompt tokens over the batch (padding excluded)
    padded_prompt_len: int  # the bucketed prompt length every row was padded to
    cache_len: int  # KV-cache slots
    prefill_s: float  # prompt in, first token on the host
    decode_steps: int  # decode steps run after the first token
    decode_tokens: int  # tokens produced by those steps for rows still generating
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


class Generator:
    """A model and tokenizer loaded once, with compiled prefill and decode steps reused across `generate` calls.

    model_dir: a Hugging Face or orbax checkpoint directory (`checkpoint.load_model`). dtype: the arithmetic's
    ("float32", "bfloat16", "float16"; None: float32). weight_dtype: the weights' (None: dtype; "auto", the default:
    bfloat16 for float32 arithmetic on a bfloat16 checkpoint where a kernel backend widens it in registers, see
    `checkpoint.dtypes`). runtime: the SSD implementation and kernels (`ops.Runtime`; None: the default, or a given
    model's own).
    model, tokenizer: use these instead of loading from model_dir. The model runs as it is: a dtype or weight_dtype
    other than its own is refused (they choose how a checkpoint is loaded).
    prefill_chunk: longest prompt segment run in one call (bounds prefill memory).
    min_cache_len: KV slots of the smallest cache bucket. max_cache_len: if set, every request uses exactly this many
    KV slots (one decode compilation per batch size) and longer requests are rejected.
    decode_chunk: decode steps per call (1: one call per token). progress: a progress bar while the weights load.
    mesh: a `jax.sharding.Mesh` to run over (`granite_jax.sharding`): the weights are placed in their shards (loaded
    straight into them), the caches too, and batches must be a multiple of its "data" axis. Over a mesh only the
    platform backends written in plain JAX run (`ops.PARTITIONABLE`: the GPU's; XLA cannot partition the CPU kernels'
    custom calls), and the Pallas SSD is refused.
    The weights are taken once: a Generator over a model whose weights change afterwards keeps the old ones.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike | None = None,
        *,
        dtype: Any = None,
        weight_dtype: Any = AUTO,
        runtime: Runtime | None = None,
        prefill_chunk: int = 512,
        min_cache_len: int = 1024,
        max_cache_len: int | None = None,
        decode_chunk: int = DECODE_CHUNK,
        progress: bool = False,
        model: Granite | None = None,
        tokenizer: Any = None,
        mesh: Mesh | None = None,
    ):
        _check_options(runtime, prefill_chunk, min_cache_len, max_cache_len, decode_chunk)
        runtime = _runtime_over(mesh, runtime, model)
        if model is None:
            model_dir = model_dir if model_dir is not None else default_model_dir()
            if model_dir is None:
                raise GenerationError(NO_MODEL_MESSAGE)
            model = load_model(
                model_dir,
                dtype=dtype or "float32",
                weight_dtype=weight_dtype,
                runtime=runtime,
                progress=progress,
                mesh=mesh,
            )
        else:
            _check_given_model(model, dtype, weight_dtype)
            if mesh is not None and model.runtime.mesh != mesh:  # a model loaded over this mesh is in its shards
                model = sharding.shard_model(model, mesh)
            if runtime is not None and runtime != model.runtime:
                model = with_runtime(model, runtime)
        self.model_dir = None if model_dir is None else os.fspath(model_dir)
        if tokenizer is None and model_dir is not None:
            tokenizer = load_tokenizer(model_dir)
        self.model, self.cfg, self.tokenizer = model, model.cfg, tokenizer
        self.prompts = PromptEncoder(tokenizer, self.cfg.vocab_size, self.model_dir)
        self.prefill_chunk, self.min_cache_len, self.decode_chunk = map(
            int, (prefill_chunk, min_cache_len, decode_chunk)
        )
        self.max_cache_len = None if max_cache_len is None else int(max_cache_len)
        self.steps = Steps(model)
        self.compilations: collections.Counter[str] = collections.Counter()  # "prefill" / "decode" -> shapes compiled
        self._compiled: set[tuple] = set()
        self._prepared: dict[int, ops.Prepared] = {}  # by batch size
        self.last_timing: Timing | None = None

    @property
    def mesh(self) -> Mesh | None:
        """The mesh the model runs over (its runtime's), None on one device."""
        return self.model.runtime.mesh

    @property
    def weight_dtype(self) -> str | list[str]:
        """The dtype name the model's weights are in."""
        return weight_dtype_of(self.model)

    @property
    def prepared_bytes(self) -> int:
        """Memory the kernel backends added for the steps run so far (the CPU kernels' packed weights)."""
        arrays = {id(a): a for p in self._prepared.values() for d in p.values() for a in d.values()}
        return sum(a.nbytes for a in arrays.values())

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
        texts, prompt_ids = self.prompts.encode(prompts, chat=chat, system=system)
        if sampling.stop_strings and self.tokenizer is None:
            raise GenerationError("stop_strings need a tokenizer, and this model directory has none")
        layout = self.layout([len(ids) for ids in prompt_ids], sampling.max_new_tokens)
        stop_ids = frozenset(self.cfg.eos_token_id if sampling.stop_token_ids is None else sampling.stop_token_ids)
        if sampling.stop_token_ids is not None:  # (the config's eos ids may lie past the vocabulary: they never occur)
            self.prompts.check_vocab("stop token id", sorted(sampling.stop_token_ids))
        cut = layout.max_new_tokens < sampling.max_new_tokens  # a RoPE model's last position
        rows = [
            RowStream(i, self.tokenizer, stop_ids, sampling.stop_strings, stream_callback, cut)
            for i in range(layout.batch_size)
        ]
        self.last_timing = timing = self._run(prompt_ids, layout, sampling, rows)
        return [
            Result(text, tuple(ids), tuple(row.ids), row.text, row.finish_reason, timing)
            for text, ids, row in zip(texts, prompt_ids, rows)
        ]

    def layout(self, lengths: list[int], max_new_tokens: int) -> BatchLayout:
        """Padding and cache sizes for prompts of these lengths; rejects prompts too long for the model, and a cache
        larger than the memory free on the device, before it is allocated."""
        limits = dict(prefill_chunk=self.prefill_chunk, min_cache_len=self.min_cache_len)
        layout = plan(lengths, max_new_tokens, self.cfg, **limits, max_cache_len=self.max_cache_len)
        rows = 0 if self.mesh is None else self.mesh.shape.get("data", 1)
        if rows and layout.batch_size % rows:
            raise GenerationError(
                f"{layout.batch_size} prompt(s) over a mesh whose 'data' axis has {rows} devices: give a multiple of "
                f"{rows} prompts"
            )
        cache = self.steps.abstract_cache(layout.batch_size, layout.cache_len)
        need, free = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)), free_memory()
        if free is not None and need > free:
            raise GenerationError(
                f"the cache for {layout.batch_size} sequence(s) of up to {layout.cache_len} tokens needs "
                f"{need / 1e9:.1f} GB, more than the {free / 1e9:.1f} GB free: lower max_new_tokens (or "
                "max_cache_len), or shorten the prompts"
            )
        return layout

    def prepared(self, batch: int) -> ops.Prepared:
        """What the kernel backends derive from the weights for steps of `batch` rows (made on first need)."""
        if batch not in self._prepared:
            self._prepared[batch] = ops.prepare(self.model, batch)
        return self._prepared[batch]

    def compile(self, kind: str, layout: BatchLayout, chunk: int | None = None) -> None:
        """Compile step `kind` ("prefill", "decode", "decode_chunk") for this layout, once (counted in
        `compilations`: "prefill" or "decode")."""
        b = layout.batch_size
        key = (kind, b, layout.segment_len if kind == "prefill" else 1, layout.cache_len, chunk)
        if key not in self._compiled:
            shapes = dict(tokens=layout.segment_len if kind == "prefill" else 1, chunk=chunk)
            self.steps.compile(kind, self.prepared(b), b, layout.cache_len, **shapes)
            self._compiled.add(key)
            self.compilations["prefill" if kind == "prefill" else "decode"] += 1

    def prefill(self, prompt_ids: list[list[int]], layout: BatchLayout, params: SamplerParams):
        """Prefill the prompts segment by segment: (last-position logits (b, V), first tokens (b,), cache)."""
        prepared = self.prepared(layout.batch_size)
        pad_id = self.cfg.pad_token_id if self.cfg.pad_token_id is not None else 0
        tokens = layout.tokens(prompt_ids, pad_id)
        cache = self.steps.cache(layout.batch_size, layout.cache_len, layout.pad)
        for start in layout.segments():
            segment = tokens[:, start : start + layout.segment_len]
            logits, first, cache = self.steps.prefill(prepared, cache, segment, params, np.int32(0))
        return logits, first, cache

    def _run(self, prompt_ids, layout: BatchLayout, sampling: SamplingConfig, rows: list[RowStream]) -> Timing:
        params = sampling.device_params()
        chunk, b = self.decode_chunk, layout.batch_size
        t0 = time.perf_counter()
        self.compile("prefill", layout)
        stops = jnp.asarray(device_stops(rows[0].stop_ids))  # on the device once, not copied at every call
        prepared = self.prepared(b)
        t1 = time.perf_counter()
        _, tokens, cache = self.prefill(prompt_ids, layout, params)
        _push(rows, np.asarray(tokens))
        live = np.asarray([not row.done for row in rows])
        t2 = time.perf_counter()
        # The decode step compiles once the first tokens are out: a stream shows them without waiting for it.
        if layout.max_new_tokens > 1:
            self.compile("decode_chunk", layout, chunk)
        compiled = time.perf_counter()
        # One sequence: each call is queued before the ids of the one ahead of it are read, so that the host's work
        # (dispatch, detokenizing) overlaps steps bound by memory; a call queued after the last row's stop token runs
        # no step. A batch: each call's ids are read before the next is queued, which keeps the host off the cores
        # the batch's arithmetic needs.
        overlap = b == 1
        totals = [0, 0]  # steps run, tokens pushed

        def read(ids, ran) -> None:
            totals[0] += int(ran)
            totals[1] += _push_steps(rows, ids, ran)

        queued, in_flight = 0, None  # steps asked for; the call whose ids are not read yet
        while queued + 1 < layout.max_new_tokens and not all(row.done for row in rows):
            count, step = min(chunk, layout.max_new_tokens - 1 - queued), np.int32(queued + 1)
            ids, ran, tokens, live, cache = self.steps.decode_chunk(
                prepared, cache, tokens, live, params, stops, step, np.int32(count), chunk=chunk
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
        t3 = time.perf_counter()
        for row in rows:
            row.finish()
        return Timing(
            batch_size=b,
            prompt_tokens=sum(layout.lengths),
            padded_prompt_len=layout.padded_len,
            cache_len=layout.cache_len,
            prefill_s=t2 - t1,
            decode_steps=totals[0],
            decode_tokens=totals[1],
            decode_s=t3 - compiled,
            compile_s=(t1 - t0) + (compiled - t2),
        )


def _push_steps(rows: list[RowStream], ids, count) -> int:
    """Pushes the first `count` steps' ids (steps, b), step by step, until every row is done."""
    produced = 0
    for step_ids in np.asarray(ids)[: int(count)]:
        if all(row.done for row in rows):
            break
        produced += _push(rows, step_ids)
    return produced


def _push(rows: list[RowStream], tokens: np.ndarray) -> int:
    live = [row for row in rows if not row.done]
    for row in live:
        row.push(int(tokens[row.row]))
    return len(live)


def _check_options(runtime, prefill_chunk, min_cache_len, max_cache_len, decode_chunk) -> None:
    if runtime is not None and not isinstance(runtime, Runtime):
        raise GenerationError(f"runtime must be a granite_jax.Runtime or None, got {type(runtime).__name__}")
    is_size = lambda v: is_int(v) and v >= 1  # noqa: E731
    sizes = (("prefill_chunk", prefill_chunk), ("min_cache_len", min_cache_len), ("decode_chunk", decode_chunk))
    for name, value in sizes:
        if not is_size(value):
            raise GenerationError(f"{name} must be an integer >= 1, got {value!r}")
    if max_cache_len is not None and not is_size(max_cache_len):
        raise GenerationError(f"max_cache_len must be an integer >= 1 or None, got {max_cache_len!r}")


def _runtime_over(mesh: Mesh | None, runtime: Runtime | None, model: Granite | None) -> Runtime | None:
    """The runtime to run over `mesh` (its backends: `Runtime.backends`); the Pallas SSD refused: XLA's partitioner
    cannot split a custom call, it would gather the operands whole onto each device."""
    if mesh is None:
        return runtime
    runtime = runtime or (model.runtime if model is not None else Runtime())
    if runtime.ssd == "pallas":
        raise GenerationError("the Pallas SSD does not run over a mesh: use ssd 'xla' (--ssd-impl xla)")
    return runtime.replace(mesh=mesh)


def _check_given_model(model: Granite, dtype: Any, weights: Any) -> None:
    """dtype and weight_dtype choose how a checkpoint is loaded; a model given as it is must not contradict them."""
    try:
        dtype = None if dtype is None else dtype_name("dtype", dtype)
        weights = weights if weights in (AUTO, None) else dtype_name("weight_dtype", weights, WEIGHT_DTYPES)
    except InputError as e:
        raise GenerationError(str(e)) from None
    computes, stored = jnp.dtype(model.dtype).name, weight_dtype_of(model)
    if dtype is not None and dtype != computes:
        raise GenerationError(f"dtype={dtype!r}, but the model given computes in {computes} (dtype applies to loading)")
    if weights not in (AUTO, None) and weights != stored:
        raise GenerationError(
            f"weight_dtype={weights!r}, but the model given holds {stored} weights (it applies to loading)"
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


def generate(model_dir: str | os.PathLike, prompt: Prompts, **kwargs: Any) -> Result | list[Result]:
    """Load a model and generate once: a `Result` for one text prompt, a list for a batch.

    Keyword arguments go to `Generator` (dtype, runtime, prefill_chunk, ...) or to `Generator.generate` (sampling
    options, chat, system, stream_callback).
    """
    init_keys = set(inspect.signature(Generator).parameters) - {"model_dir", "model", "tokenizer"}
    generator = Generator(model_dir, **{k: v for k, v in kwargs.items() if k in init_keys})
    results = generator.generate(prompt, **{k: v for k, v in kwargs.items() if k not in init_keys})
    single = isinstance(prompt, str) or (len(prompt) > 0 and all(is_int(t) for t in prompt))
    return results[0] if single else results
