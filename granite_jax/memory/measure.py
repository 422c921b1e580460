"""Device memory of a generation run, measured part by part on the device JAX runs on, to hold `plan.predict` to.

The run is the one `plan.predict` describes: `sessions` random prompts of `prefill_chunk` tokens (at most the context)
prefilled in one call for all sessions, then a few decode steps, with a cache of exactly `context` KV slots
(`Generator(max_cache_len=context)`). Each part is the growth of the memory in use across the step that makes it:

- weights: creating (or loading) the model;
- cache (KV cache and Mamba states together): allocating the generator's zeroed cache;
- activations: the peak during the prefill and the decode steps, above the memory in use before them.

What is counted depends on the platform:
- GPU: the allocator's own statistics (`memory_stats()`: bytes_in_use, peak_bytes_in_use), exact. The peak cannot be
  reset, so activations are unknown (None) when a peak reached earlier (compilation's autotuning, a larger run) is
  not exceeded.
- CPU: the process's resident memory (Linux: VmRSS, and VmHWM reset through /proc/self/clear_refs), after returning
  the allocator's free pages to the system (malloc_trim). Compilation happens before the baselines are taken, so the
  compiled programs and compilation's own memory are not counted; the weights' figure includes whatever their
  creation leaves behind (e.g. small programs compiled for random initialisation, warmed up first for random
  weights) and the allocator's overhead. Pages touched by Python objects during the run (small) are counted; pages
  allocated but never written are not (a GPU allocator counts them).
Arrays a kernel backend derives from the weights (`--kernels`: the CPU kernels' packed panels) are made before the
baselines and reported apart, as `prepared`, by their sizes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from granite_jax.errors import InputError
from granite_jax.generation import Generator
from granite_jax.generation.layout import bucket_length
from granite_jax.generation.steps import DEVICE_STOPS
from granite_jax.model import Granite
from granite_jax.sampling import SamplingConfig

DECODE_STEPS = 3  # decode steps after the prefill's token (at most a decode chunk): a token's buffers, not a segment's


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Bytes measured for each part (None: not measurable here); `how` says what was read."""

    weights: int | None
    cache: int | None  # KV cache and Mamba states
    activations: int | None
    prepared: int  # arrays the kernel backends derived from the weights (0 with kernels off)
    context: int
    sessions: int
    prompt_tokens: int
    decode_steps: int
    platform: str
    how: str

    @property
    def total(self) -> int | None:
        parts = (self.weights, self.cache, self.activations)
        return None if None in parts else sum(parts) + self.prepared

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"total": self.total}


class Meter:
    """Memory in use and its peak since `reset_peak`, on the default device."""

    how = ""

    def in_use(self) -> int:
        raise NotImplementedError

    def peak(self) -> int | None:
        raise NotImplementedError

    def reset_peak(self) -> None:
        raise NotImplementedError


class RssMeter(Meter):
    """The process's resident memory (Linux), after handing free heap pages back to the system."""

    how = "peak RSS (VmHWM) above the RSS before, after malloc_trim; compilation excluded"

    def __init__(self):
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
            open("/proc/self/clear_refs", "w").close()
        except OSError as e:
            raise InputError(f"--measure on the CPU needs Linux's /proc/self and glibc ({e})") from None

    def in_use(self) -> int:
        gc.collect()
        self._trim(0)
        return _status_kb("VmRSS") * 1024

    def peak(self) -> int | None:
        return _status_kb("VmHWM") * 1024

    def reset_peak(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS


class DeviceMeter(Meter):
    """The accelerator allocator's statistics."""

    how = "memory_stats(): bytes_in_use, peak_bytes_in_use (exact)"

    def __init__(self):
        self.device = jax.local_devices()[0]
        self._peak_before = 0
        if not self._stats():
            raise InputError(f"--measure: {self.device.platform} device {self.device} reports no memory statistics")

    def _stats(self) -> dict[str, int]:
        try:
            return self.device.memory_stats() or {}
        except Exception:  # backends without memory statistics
            return {}

    def in_use(self) -> int:
        gc.collect()
        return int(self._stats()["bytes_in_use"])

    def reset_peak(self) -> None:
        self._peak_before = int(self._stats().get("peak_bytes_in_use", 0))

    def peak(self) -> int | None:
        """The peak since reset_peak, or None when it did not rise above the peak reached before (unknown)."""
        peak = int(self._stats().get("peak_bytes_in_use", 0))
        return peak if peak > self._peak_before else None


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise InputError(f"--measure: /proc/self/status has no {field}")


def meter() -> Meter:
    """The meter of the default device: the allocator's statistics on an accelerator, resident memory on a CPU."""
    return RssMeter() if jax.default_backend() == "cpu" else DeviceMeter()


def measure_weights(make_model: Callable[[], Granite], m: Meter) -> tuple[Granite, int]:
    """The model `make_model()` returns, and the memory its creation added."""
    before = m.in_use()
    model = make_model()
    jax.block_until_ready(jax.tree.leaves(model))
    return model, m.in_use() - before


def measure_run(
    model: Granite,
    m: Meter,
    *,
    context: int,
    sessions: int,
    prefill_chunk: int = 512,
    decode_steps: int = DECODE_STEPS,
    seed: int = 0,
) -> Measurement:
    """Measure the cache and the activations of one prefill segment for `sessions` rows and `decode_steps` decode
    steps, with `context` KV slots per row; the weights are not measured here (None)."""
    gen = Generator(model=model, tokenizer=None, prefill_chunk=prefill_chunk, max_cache_len=context)
    prompt_len = min(prefill_chunk, context)
    room = context - bucket_length(prompt_len, prefill_chunk)  # the decode steps the cache has slots for
    steps = max(0, min(decode_steps, gen.decode_chunk, room))
    prompts = np.random.default_rng(seed).integers(0, model.cfg.vocab_size, (sessions, prompt_len)).tolist()
    layout = gen.layout([prompt_len] * sessions, steps + 1)
    params = SamplingConfig(max_new_tokens=steps + 1).device_params()
    gen.compile("prefill", layout)
    if steps:
        gen.compile("decode_chunk", layout, gen.decode_chunk)
    prepared = gen.prepared(layout.batch_size)
    tokens = layout.tokens(prompts, 0)

    before_cache = m.in_use()
    cache = gen.steps.cache(layout.batch_size, layout.cache_len, layout.pad)
    jax.block_until_ready(cache)
    before_run = m.in_use()
    m.reset_peak()
    for start in layout.segments():
        segment = tokens[:, start : start + layout.segment_len]
        _, ids, cache = gen.steps.prefill(prepared, cache, segment, params, np.int32(0))
    if steps:
        live, stops = np.ones(sessions, bool), np.full(DEVICE_STOPS, -1, np.int32)  # no stop id: every step runs
        ids = gen.steps.decode_chunk(
            prepared, cache, ids, live, params, stops, np.int32(1), np.int32(steps), chunk=gen.decode_chunk
        )
    jax.block_until_ready(ids)
    peak = m.peak()
    return Measurement(
        weights=None,
        cache=before_run - before_cache,
        activations=None if peak is None else peak - before_run,
        prepared=gen.prepared_bytes,
        context=context,
        sessions=sessions,
        prompt_tokens=prompt_len,
        decode_steps=steps,
        platform=jax.default_backend(),
        how=m.how,
    )


def measure_runs(
    make_model: Callable[[], Granite],
    runs: Sequence[tuple[int, int]],
    *,
    prefill_chunk: int = 512,
    decode_steps: int = DECODE_STEPS,
    warm_up: Callable[[], Any] | None = None,
) -> list[Measurement]:
    """Measure each (context, sessions) of `runs` on the default device with the model `make_model()` makes (its
    weights measured once, after `warm_up()` if given, whose result is dropped)."""
    if warm_up is not None:
        warm_up()  # its model is dropped at once
    m = meter()
    model, weights = measure_weights(make_model, m)
    found = []
    for context, sessions in runs:
        run = measure_run(
            model, m, context=context, sessions=sessions, prefill_chunk=prefill_chunk, decode_steps=decode_steps
        )
        found.append(dataclasses.replace(run, weights=weights))
    return found
