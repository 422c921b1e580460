"""GPU check and benchmark of the SSD implementations at Granite-4.0-H-Tiny dims (one prepared run, < 10 minutes).

    python benchmarks/gpu_ssd.py --out benchmarks/results/gpu_ssd-$(date +%F)-h200.json

1. Checks the Pallas kernels against the XLA path on the GPU: `ssd_prefill` vs `ssd_chunked` (float32, HIGHEST
   precision) on normal and fast-decaying heads, `ssd_decode` vs `ssd_step`.
2. Times the SSD forward at h-tiny dims (48 heads x 64, state 128, one group, chunk 256, batch 1) for each L in
   --lengths: "naive" (broadcast-sum einsums; left out unless --skip says otherwise, its XLA compilation is too slow
   on GPUs), "rewritten" (the naive code through `rewriter.rewrite`, up to --naive-max-len, skipped when the rewriter
   is not importable), "xla" (einsum chunked, float32 at HIGHEST precision, as the model runs it), "xla_bf16" (the
   same with bfloat16 operands and float32 accumulation: XLA's fastest form, on tensor cores), "pallas" (this package,
   float32 y as the model uses it) and "pallas_y16" (y in the input dtype, the traffic the roofline assumes). Calls
   are timed in back-to-back batches. The kernels' speed-ups are given against "xla" and against the faster of the
   two XLA forms.
3. Times one whole Mamba layer (`granite_jax.model.MambaMixer`, in_proj -> conv -> SSD -> gated norm -> out_proj) with
   each SSD implementation, and the decode update at a few batch sizes.
   The Pallas prefill's three kernels (chunk-local states, the pass over chunks, outputs) are also timed apart
   (--no-split leaves that out).
4. Optionally (--sweep) times a few `PrefillConfig` tilings of the Pallas prefill at one length.

Every timing prints time, achieved TFLOP/s and GB/s, and the fraction of the ceilings (H200 by default: 4.8 TB/s,
990 dense bf16 TFLOP/s), where FLOPs are the useful matmul work (causal half of the diagonal blocks) and bytes are the
minimum HBM traffic (inputs read once, outputs written once). The floor is max(bytes / bandwidth, FLOPs / peak).
`--smoke` runs everything at tiny sizes on CPU, the kernels interpreted, to check the script itself. `--once` only
calls the Pallas prefill twice, a workload for a profiler (`ncu`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Run from a plain checkout (no install): the packages live beside benchmarks/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H200 = dict(peak_tflops=990.0, peak_gbs=4800.0)
H_TINY = dict(h=48, p=64, g=1, n=128, chunk=256)
SMOKE = dict(h=4, p=16, g=1, n=16, chunk=16)
SWEEP = [  # around the defaults; the first entry is the defaults
    dict(),
    dict(block_k=64),
    dict(block_k=256),
    dict(block_k=32),
    dict(state_warps=8),
    dict(pass_block=4096),
    dict(output_warps=8),
    dict(output_stages=1),  # 32 KB of shared memory, 168 registers: 3 programs per SM where the default fits 2
    dict(output_stages=2),
    dict(output_stages=4),
    dict(block_m=128, output_warps=8),
    dict(heads_per_program=2),
]


# ---------------------------------------------------------------------------------------------- counting


@dataclasses.dataclass(frozen=True)
class Dims:
    b: int
    L: int
    h: int
    p: int
    g: int
    n: int
    chunk: int


def ssd_flops(d: Dims) -> float:
    """Useful SSD matmul FLOPs: chunk states, state -> output, causal half of the diagonal blocks, C B^T per group."""
    states = 2 * d.b * d.L * d.h * d.p * d.n
    from_states = 2 * d.b * d.L * d.h * d.p * d.n
    diagonal = d.b * d.L * d.chunk * d.h * d.p
    scores = 2 * d.b * d.L * d.chunk * d.g * d.n
    return float(states + from_states + diagonal + scores)


def ssd_bytes(d: Dims, in_bytes: int, y_bytes: int) -> float:
    """Minimum HBM traffic: x, dt, B, C read once, y and the final float32 state written once."""
    reads = d.b * d.L * (d.h * d.p + d.h + 2 * d.g * d.n) * in_bytes
    writes = d.b * d.L * d.h * d.p * y_bytes + d.b * d.h * d.p * d.n * 4
    return float(reads + writes)


def layer_flops(cfg, d: Dims) -> float:
    """One Mamba layer: in_proj, depthwise conv, SSD, out_proj."""
    tokens = d.b * d.L
    proj = 2 * tokens * cfg.hidden_size * (cfg.mamba_in_proj_dim + cfg.mamba_d_inner)
    conv = 2 * tokens * cfg.mamba_conv_dim * cfg.mamba_d_conv
    return float(proj + conv) + ssd_flops(d)


def layer_bytes(cfg, d: Dims, act_bytes: int) -> float:
    """Weights once, the layer input and output once."""
    weights = cfg.hidden_size * (cfg.mamba_in_proj_dim + cfg.mamba_d_inner) * act_bytes
    return float(weights + 2 * d.b * d.L * cfg.hidden_size * act_bytes)


# ---------------------------------------------------------------------------------------------- timing


@dataclasses.dataclass(frozen=True)
class Timing:
    median: float  # seconds per call
    best: float
    first_call: float  # compile + one run


_DEADLINE = [math.inf]  # perf_counter() after which the remaining measurements are skipped


def out_of_time() -> bool:
    return time.perf_counter() > _DEADLINE[0]


def time_fn(fn: Callable, *args, min_seconds: float, max_reps: int = 200) -> Timing:
    """Compile and run once, then time batches of back-to-back calls for about `min_seconds`.

    A batch enqueues enough calls for ~10 ms of work before it waits, so that the host's dispatch overlaps the device's
    work and a kernel of a few microseconds is not timed as the round trip of one launch.
    """
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    per_batch = max(1, min(100, int(0.01 / max(once, 1e-6))))
    batches = 1 if once > 1.0 else max(3, min(max_reps, int(min_seconds / max(once * per_batch, 1e-6))))
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(per_batch):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / per_batch)
    return Timing(statistics.median(times), min(times), first)


def record(kind: str, name: str, timing: Timing, flops: float, nbytes: float, ceilings: dict, **extra) -> dict:
    seconds = timing.median
    floor = max(nbytes / (ceilings["peak_gbs"] * 1e9), flops / (ceilings["peak_tflops"] * 1e12))
    rec = dict(
        kind=kind,
        impl=name,
        us=seconds * 1e6,
        best_us=timing.best * 1e6,
        first_call_s=timing.first_call,
        tflops=flops / seconds / 1e12,
        gbs=nbytes / seconds / 1e9,
        frac_peak_flops=flops / seconds / (ceilings["peak_tflops"] * 1e12),
        frac_peak_bw=nbytes / seconds / (ceilings["peak_gbs"] * 1e9),
        floor_us=floor * 1e6,
        x_floor=seconds / floor,
        **extra,
    )
    print(
        f"  {kind:7s} {name:30s} {rec['us']:10.1f} us  {rec['tflops']:7.2f} TFLOP/s ({rec['frac_peak_flops']:6.1%})  "
        f"{rec['gbs']:8.1f} GB/s ({rec['frac_peak_bw']:6.1%})  {rec['x_floor']:6.2f}x floor ({rec['floor_us']:.1f} us)",
        flush=True,
    )
    return rec


def skipped(kind: str, name: str, **extra) -> dict:
    print(f"  {kind:7s} {name:30s} skipped (time budget)", flush=True)
    return dict(kind=kind, impl=name, skipped="time budget", **extra)


def failure(kind: str, name: str, error: BaseException, **extra) -> dict:
    text = f"{type(error).__name__}: {error}"
    print(f"  {kind:7s} {name:30s} FAILED {text[:300]}", flush=True)
    return dict(kind=kind, impl=name, error=text[:4000], **extra)


# ---------------------------------------------------------------------------------------------- inputs


def ssd_inputs(d: Dims, dtype, *, seed: int = 0, fast_decay: bool = False):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)
    dt = np.logaddexp(normal(d.b, d.L, d.h) + (3.0 if fast_decay else -1.0), 0.0)
    A = -np.exp(rng.uniform(0.0, 2.5, d.h) if fast_decay else rng.uniform(-3.0, 0.5, d.h))
    cast = lambda t: jnp.asarray(t, dtype)
    return (
        cast(normal(d.b, d.L, d.h, d.p)),
        cast(dt),
        jnp.asarray(A, jnp.float32),
        cast(normal(d.b, d.L, d.g, d.n)),
        cast(normal(d.b, d.L, d.g, d.n)),
        jnp.asarray(normal(d.h)),
    )


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return math.inf
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


# ---------------------------------------------------------------------------------------------- implementations


def ssd_variants(chunk: int, *, naive: bool) -> dict[str, Callable]:
    """name -> jitted fn(x, dt, A, B, C, D) -> (y, final state)."""
    import pallas_kernels
    from granite_jax.ssd import ssd_chunked, ssd_chunked_naive

    variants: dict[str, Callable] = {}
    if naive:
        variants["naive"] = jax.jit(functools.partial(ssd_chunked_naive, chunk_size=chunk))
        rewritten = rewritten_naive(chunk)
        if rewritten is not None:
            variants["rewritten"] = rewritten
    variants["xla"] = jax.jit(functools.partial(ssd_chunked, chunk_size=chunk))
    variants["xla_bf16"] = jax.jit(functools.partial(ssd_chunked, chunk_size=chunk, operand_dtype=jnp.bfloat16))
    variants["pallas"] = jax.jit(functools.partial(pallas_kernels.ssd_prefill, chunk_size=chunk))

    def pallas_y16(x, dt, A, B, C, D):
        return pallas_kernels.ssd_prefill(x, dt, A, B, C, D, chunk_size=chunk, out_dtype=x.dtype)

    variants["pallas_y16"] = jax.jit(pallas_y16)
    return variants


def rewritten_naive(chunk: int) -> Callable | None:
    try:
        import rewriter
    except ImportError as e:
        print(f"  (rewriter not importable, skipping 'rewritten': {e})")
        return None
    from granite_jax.ssd import ssd_chunked_naive

    fast = rewriter.rewrite(ssd_chunked_naive)
    return jax.jit(lambda x, dt, A, B, C, D: fast(x, dt, A, B, C, D, chunk_size=chunk))


# ---------------------------------------------------------------------------------------------- sections


def check_kernels(d: Dims, dtype, tolerance: float) -> list[dict]:
    """Pallas vs the XLA path on this device: prefill (normal and fast decay, with an initial state) and decode."""
    import pallas_kernels
    from granite_jax import ops
    from granite_jax.ops import Runtime
    from granite_jax.ssd import ssd_chunked, ssd_step

    print(f"check: pallas vs xla at L={d.L}, {jnp.dtype(dtype).name}, tolerance {tolerance:g} (max-abs / max)")
    results = []
    reference = jax.jit(functools.partial(ssd_chunked, chunk_size=d.chunk))  # HIGHEST-precision einsums
    prefill = jax.jit(functools.partial(pallas_kernels.ssd_prefill, chunk_size=d.chunk))  # one compile for both cases
    for fast in (False, True):
        x, dt, A, B, C, D = ssd_inputs(d, dtype, seed=1, fast_decay=fast)
        s0 = jnp.asarray(np.random.default_rng(2).standard_normal((d.b, d.h, d.p, d.n), np.float32))
        y_ref, s_ref = reference(x, dt, A, B, C, D, initial_state=s0)
        y, s = prefill(x, dt, A, B, C, D, initial_state=s0)
        errs = dict(y=rel_err(y, y_ref), state=rel_err(s, s_ref))
        results.append(dict(kind="check", impl="prefill", fast_decay=fast, **errs, ok=max(errs.values()) < tolerance))
        print(f"  prefill fast_decay={fast}: y {errs['y']:.2e}, state {errs['state']:.2e}")
    x, dt, A, B, C, D = ssd_inputs(dataclasses.replace(d, L=1), dtype, seed=3)
    state = jnp.asarray(np.random.default_rng(4).standard_normal((d.b, d.h, d.p, d.n), np.float32))
    xla_step = jax.jit(ops.under(Runtime(kernels=False), ssd_step))  # XLA's, not a platform kernel (smoke run's CPU)
    y_ref, s_ref = xla_step(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
    y, s = jax.jit(pallas_kernels.ssd_decode)(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
    errs = dict(y=rel_err(y, y_ref), state=rel_err(s, s_ref))
    results.append(dict(kind="check", impl="decode", **errs, ok=max(errs.values()) < 1e-4))
    print(f"  decode: y {errs['y']:.2e}, state {errs['state']:.2e}")
    return results


def bench_ssd(d: Dims, dtype, ceilings: dict, min_seconds: float, naive: bool, skip=frozenset()) -> list[dict]:
    print(f"ssd: L={d.L} b={d.b} h={d.h} p={d.p} g={d.g} n={d.n} chunk={d.chunk} {jnp.dtype(dtype).name}")
    args = ssd_inputs(d, dtype)
    in_bytes = jnp.dtype(dtype).itemsize
    flops = ssd_flops(d)
    results = []
    for name, fn in ssd_variants(d.chunk, naive=naive).items():
        if name in skip:
            continue
        if out_of_time():
            results.append(skipped("ssd", name, L=d.L))
            continue
        nbytes = ssd_bytes(d, in_bytes, in_bytes if name == "pallas_y16" else 4)
        try:
            timing = time_fn(fn, *args, min_seconds=min_seconds)
            results.append(record("ssd", name, timing, flops, nbytes, ceilings, L=d.L))
        except Exception as e:  # noqa: BLE001 - one failing variant must not stop the run
            results.append(failure("ssd", name, e, L=d.L))
    return results


def bench_split(d: Dims, dtype, min_seconds: float) -> list[dict]:
    """The Pallas prefill's three kernels timed apart: chunk-local states, the pass over chunks, and the outputs (the
    module's private stages, called as `ssd_prefill` calls them, with the default tiling)."""
    import pallas_kernels.prefill as prefill

    print(f"split: the Pallas prefill's kernels at L={d.L}")
    x, dt, A, B, C, D = ssd_inputs(d, dtype)
    cfg, chunk = prefill.PrefillConfig(), prefill.kernel_chunk(d.chunk)
    dt_args = dict(bias=None, softplus=False, limit=(0.0, math.inf))
    local_fn = jax.jit(lambda x, dt, A, B: prefill.local_states(x, dt, A, B, chunk, cfg, **dt_args))
    pass_fn = jax.jit(
        lambda local, rows: prefill.pass_states(local, rows, None, chunk, cfg, prefill.operand_dtype(x.dtype))
    )
    outputs = jax.jit(lambda *args: prefill.chunk_outputs(*args, chunk, cfg, jnp.float32))
    results, times = [], {}
    try:
        local, dt_rows, decay_rows = local_fn(x, dt, A, B)
        states_in, _ = pass_fn(local, decay_rows)
        for name, fn, args in (
            ("local", local_fn, (x, dt, A, B)),
            ("pass", pass_fn, (local, decay_rows)),
            ("outputs", outputs, (x, B, C, D, dt_rows, decay_rows, states_in)),
        ):
            if out_of_time():
                results.append(skipped("split", f"pallas_{name}", L=d.L))
                continue
            timing = time_fn(fn, *args, min_seconds=min_seconds)
            times[name] = timing.median
            rec = dict(kind="split", impl=f"pallas_{name}", L=d.L, us=timing.median * 1e6, best_us=timing.best * 1e6)
            results.append(rec | dict(first_call_s=timing.first_call))
            print(f"  split   {'pallas_' + name:30s} {rec['us']:10.1f} us", flush=True)
    except Exception as e:  # noqa: BLE001
        results.append(failure("split", "pallas", e, L=d.L))
    if len(times) == 3:
        shares = ", ".join(f"{name} {t / sum(times.values()):.0%}" for name, t in times.items())
        print(f"  split   shares of the three: {shares}", flush=True)
    return results


def bench_sweep(d: Dims, dtype, ceilings: dict, min_seconds: float) -> list[dict]:
    import pallas_kernels

    print(f"sweep: PrefillConfig tilings at L={d.L}")
    args = ssd_inputs(d, dtype)
    in_bytes = jnp.dtype(dtype).itemsize
    results = []
    for overrides in SWEEP:
        config = pallas_kernels.PrefillConfig(**overrides)
        name = ",".join(f"{k}={v}" for k, v in overrides.items()) or "default"
        fn = jax.jit(functools.partial(pallas_kernels.ssd_prefill, chunk_size=d.chunk, config=config))
        extra = dict(L=d.L, config=dataclasses.asdict(config))
        if out_of_time():
            results.append(skipped("sweep", name, **extra))
            continue
        try:
            timing = time_fn(fn, *args, min_seconds=min_seconds)
            results.append(record("sweep", name, timing, ssd_flops(d), ssd_bytes(d, in_bytes, 4), ceilings, **extra))
        except Exception as e:  # noqa: BLE001
            results.append(failure("sweep", name, e, **extra))
    return results


def mamba_config(smoke: bool):
    from granite_jax.config import ModelConfig

    if smoke:
        return ModelConfig(
            vocab_size=64, hidden_size=32, layer_types=("mamba",), num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=32, shared_intermediate_size=32, num_local_experts=0, num_experts_per_tok=0,
            mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16,
        )  # fmt: skip
    try:
        from granite_jax.presets import released_config

        return released_config("granite-4.0-h-tiny")
    except ImportError:
        return ModelConfig(
            vocab_size=100352, hidden_size=1536, layer_types=("mamba",), num_attention_heads=12,
            num_key_value_heads=4, head_dim=128, intermediate_size=512, shared_intermediate_size=1024,
            num_local_experts=64, num_experts_per_tok=6, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128,
            mamba_chunk_size=256,
        )  # fmt: skip


def layer_fn(cfg, dtype, impl: str) -> tuple[Callable, Any]:
    """A jitted fn(params, x) -> y running one MambaMixer with the SSD `impl` ("rewritten": the naive one through
    `rewriter.rewrite`), and its parameters. Plain JAX besides the SSD: no platform kernels."""
    from flax import nnx

    from granite_jax.model import MambaMixer
    from granite_jax.ops import Runtime, using

    mixer = MambaMixer(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(mixer)
    runtime = Runtime(ssd="naive" if impl == "rewritten" else impl, kernels=False)

    def run(params, x):
        with using(runtime):
            out = nnx.merge(graphdef, params)(x)
        return out[0] if isinstance(out, tuple) else out

    if impl == "rewritten":
        import rewriter

        run = rewriter.rewrite(run)
    return jax.jit(run), params


def bench_layer(
    d: Dims, dtype, ceilings: dict, min_seconds: float, smoke: bool, naive: bool, skip=frozenset()
) -> list[dict]:
    print(f"mamba layer: L={d.L} b={d.b}")
    impls = [i for i in (["naive", "rewritten"] if naive else []) + ["xla", "pallas"] if i not in skip]
    act_bytes = jnp.dtype(dtype).itemsize
    results = []
    for impl in impls:
        if out_of_time():
            results.append(skipped("layer", impl, L=d.L))
            continue
        try:
            cfg = mamba_config(smoke)
            fn, params = layer_fn(cfg, dtype, impl)
            x = jnp.asarray(np.random.default_rng(5).standard_normal((d.b, d.L, cfg.hidden_size), np.float32), dtype)
            timing = time_fn(fn, params, x, min_seconds=min_seconds)
            flops, nbytes = layer_flops(cfg, d), layer_bytes(cfg, d, act_bytes)
            results.append(record("layer", impl, timing, flops, nbytes, ceilings, L=d.L))
        except ImportError as e:
            print(f"  layer   {impl:30s} skipped ({e})")
        except Exception as e:  # noqa: BLE001
            results.append(failure("layer", impl, e, L=d.L))
    return results


def call_once(d: Dims, dtype) -> None:
    """Compile the Pallas prefill (default tiling, float32 y) and call it twice: a workload for a profiler."""
    import pallas_kernels

    fn = jax.jit(functools.partial(pallas_kernels.ssd_prefill, chunk_size=d.chunk))
    args = ssd_inputs(d, dtype)
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    print(f"once: pallas prefill at L={d.L} b={d.b} {jnp.dtype(dtype).name}, called twice", flush=True)


def time_decode(step: Callable, state_shape: tuple, args: tuple, min_seconds: float) -> Timing:
    """Time `state = step(state, *args)[1]` with the state donated, as a decode loop runs it: batches of 20 chained
    steps, waiting once per batch (see `time_fn`)."""
    state = jnp.zeros(state_shape, jnp.float32)
    start = time.perf_counter()
    state = jax.block_until_ready(step(state, *args)[1])
    first = time.perf_counter() - start
    times = []
    deadline = time.perf_counter() + min_seconds
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
        start = time.perf_counter()
        for _ in range(20):
            state = step(state, *args)[1]
        jax.block_until_ready(state)
        times.append((time.perf_counter() - start) / 20)
    return Timing(statistics.median(times), min(times), first)


def bench_decode(d: Dims, dtype, batches: list[int], min_seconds: float, ceilings: dict) -> list[dict]:
    import pallas_kernels
    from granite_jax import ops
    from granite_jax.ops import Runtime
    from granite_jax.ssd import ssd_step

    print("decode: one-token state update")
    results = []
    for b in batches:
        x, dt, A, B, C, D = ssd_inputs(dataclasses.replace(d, b=b, L=1), dtype)
        args = (x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
        nbytes = 2 * b * d.h * d.p * d.n * 4  # the float32 state read and written
        flops = 4 * b * d.h * d.p * d.n
        steps = {
            "xla": jax.jit(ops.under(Runtime(kernels=False), ssd_step), donate_argnums=0),  # XLA's, no platform kernel
            "pallas": jax.jit(pallas_kernels.ssd_decode, donate_argnums=0),
        }
        for name, step in steps.items():
            if out_of_time():
                results.append(skipped("decode", name, batch=b))
                continue
            try:
                timing = time_decode(step, (b, d.h, d.p, d.n), args, min_seconds)
                results.append(record("decode", name, timing, flops, nbytes, ceilings, batch=b))
            except Exception as e:  # noqa: BLE001
                results.append(failure("decode", name, e, batch=b))
    return results


# ---------------------------------------------------------------------------------------------- main


IMPLS = ("naive", "rewritten", "xla", "xla_bf16", "pallas", "pallas_y16")  # what --skip may name
LENGTHS = "2048,8192,32768"  # --lengths' default (--smoke times SMOKE_LENGTHS instead)
SMOKE_LENGTHS = [40, 100]


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawTextHelpFormatter):
    """Help texts as written (line breaks kept), and every flag's default."""


def implementations(text: str) -> frozenset[str]:
    """argparse type: comma-separated names from IMPLS ('' for none)."""
    names = frozenset(filter(None, text.split(",")))
    if unknown := sorted(names - set(IMPLS)):
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)} (choose from {', '.join(IMPLS)})")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from granite_jax.cli import ArgumentParser, output_file_problem, positive_float, positive_int, positive_ints

    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_Formatter)
    p.add_argument(
        "--lengths",
        type=positive_ints,
        default=argparse.SUPPRESS,  # absent unless given: --smoke refuses it
        help=f"comma-separated L for the SSD and layer timings; not with --smoke, which times L = 40 and 100 "
        f"(default: {LENGTHS})",
    )
    p.add_argument("--batch", type=positive_int, default=1, help="batch size of the SSD, layer and sweep timings")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="x, B, C, dt dtype")
    p.add_argument("--naive-max-len", type=int, default=8192, help="time naive/rewritten only up to this L")
    p.add_argument(
        "--skip",
        type=implementations,
        default="naive",
        help=f"comma-separated implementations to leave out ({', '.join(IMPLS)}; '' for none).\n"
        "naive by default: XLA's GPU compilation of it takes more than 5 minutes at L=2048 (H200)",
    )
    p.add_argument("--budget-seconds", type=float, default=540, help="skip what is left after this many seconds")
    p.add_argument("--no-layer", action="store_true", help="skip the whole-Mamba-layer timings")
    p.add_argument("--no-split", action="store_true", help="skip timing the Pallas prefill's three kernels apart")
    p.add_argument("--sweep", action="store_true", help="also time a few PrefillConfig tilings at --sweep-len")
    p.add_argument(
        "--sweep-len", type=positive_int, default=8192, help="L of the --sweep timings (--smoke always uses 40)"
    )
    p.add_argument(
        "--decode-batches", type=positive_ints, default="1,64", help="batch sizes for the decode update timings"
    )
    p.add_argument("--min-seconds", type=float, default=0.3, help="timing budget per measurement")
    p.add_argument(
        "--peak-tflops", type=positive_float, default=H200["peak_tflops"], help="dense bf16 ceiling (H200: 990)"
    )
    p.add_argument("--peak-gbs", type=positive_float, default=H200["peak_gbs"], help="HBM ceiling in GB/s (H200: 4800)")
    p.add_argument("--out", help="write the JSON results here (also printed at the end), and the PNG chart beside it")
    p.add_argument("--smoke", action="store_true", help="tiny dims on CPU with interpreted kernels (script check)")
    p.add_argument("--replot", metavar="JSON", help="only draw the PNG of an earlier run's JSON (beside it); no GPU")
    p.add_argument(
        "--once",
        action="store_true",
        help="only compile the Pallas prefill at the first --lengths and call it twice, for a profiler:\n"
        "ncu --kernel-name regex:ssd --launch-count 3 ... python benchmarks/gpu_ssd.py --once --lengths 8192\n"
        "(with XLA_PYTHON_CLIENT_PREALLOCATE=false, or ncu saves and restores the preallocated memory per replay)",
    )
    args = p.parse_args(argv)
    if args.smoke and "lengths" in vars(args):
        p.error("--lengths does not apply with --smoke (it times L = 40 and 100)")
    args.lengths = vars(args).get("lengths") or positive_ints(LENGTHS)
    if not args.replot and (problem := output_file_problem("--out", args.out, make_dir=True)) is not None:
        p.error(problem)
    return args


def environment() -> dict:
    dev = jax.devices()[0]
    return dict(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        device_kind=dev.device_kind,
        platform=dev.platform,
        device_count=jax.device_count(),
        jax=jax.__version__,
        python=sys.version.split()[0],
    )


def speedups(results: list[dict]) -> list[dict]:
    """pallas (and pallas_y16) against xla, measured side by side: xla time / kernel time per section and size; and
    against the faster of "xla" and "xla_bf16" where both were timed."""
    timed = {(r["kind"], r.get("L", r.get("batch")), r["impl"]): r["us"] for r in results if "us" in r}
    rows = []
    for (kind, size, impl), us in timed.items():
        xla = timed.get((kind, size, "xla"))
        if impl.startswith("pallas") and xla is not None:
            row = dict(kind=kind, size=size, impl=impl, xla_us=xla, us=us, speedup_vs_xla=xla / us)
            line = f"  {kind:7s} {'L' if kind != 'decode' else 'batch'}={size:<6} {impl:12s} {xla / us:6.2f}x xla"
            if (bf16 := timed.get((kind, size, "xla_bf16"))) is not None:
                row |= dict(xla_bf16_us=bf16, speedup_vs_best_xla=min(xla, bf16) / us)
                line += f", {min(xla, bf16) / us:6.2f}x the faster xla"
            rows.append(row)
            print(line)
    return rows


def plot(summary: dict, path: str) -> None:
    """Time per call against L, log-log, per implementation: the SSD and one whole Mamba layer, with the floor."""
    from granite_jax.experiments.common import matplotlib_pyplot

    plt = matplotlib_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, kind, name in zip(axes, ("ssd", "layer"), ("SSD", "one Mamba layer")):
        rows = [r for r in summary["results"] if r["kind"] == kind and "us" in r]
        for impl in dict.fromkeys(r["impl"] for r in rows):
            ax.plot(*zip(*sorted((r["L"], r["us"]) for r in rows if r["impl"] == impl)), marker="o", label=impl)
        floors = {}
        for r in rows:
            floors[r["L"]] = min(floors.get(r["L"], math.inf), r["floor_us"])
        if floors:
            ax.plot(*zip(*sorted(floors.items())), "k--", label="floor (HBM or FLOPs)")
        ax.set(yscale="log", xlabel="sequence length L", ylabel="microseconds per call", title=name)
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        if rows:  # (--no-layer: an empty panel, without a legend)
            ax.legend(fontsize=8)
    env = summary["environment"]
    title = f"{env['device_kind']}, {env['date']}, {summary['dtype']} inputs, batch {summary['batch']}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def png_path(out: str) -> str:
    return os.path.splitext(out)[0] + ".png"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        return replot(args.replot)
    dtype = jnp.dtype(args.dtype)
    ceilings = dict(peak_tflops=args.peak_tflops, peak_gbs=args.peak_gbs)
    env = environment()
    print(json.dumps(env))
    if env["platform"] != "gpu" and not args.smoke:
        print("no GPU: run with --smoke to check the script on CPU", file=sys.stderr)
        return 2
    dims = SMOKE if args.smoke else H_TINY
    lengths = SMOKE_LENGTHS if args.smoke else args.lengths
    if args.once:
        with _interpret() if args.smoke else contextlib.nullcontext():
            call_once(Dims(b=args.batch, L=lengths[0], **dims), dtype)
        return 0
    skip = args.skip
    started = time.perf_counter()
    _DEADLINE[0] = started + args.budget_seconds
    results: list[dict] = []
    context = _interpret() if args.smoke else contextlib.nullcontext()
    with context:
        d0 = Dims(b=args.batch, L=min(lengths), **dims)
        try:
            checks = check_kernels(d0, dtype, 2e-2 if dtype == jnp.bfloat16 else 1e-3)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            checks = [failure("check", "kernels", e)]
        results += checks
        for L in lengths:
            d = Dims(b=args.batch, L=L, **dims)
            naive = L <= args.naive_max_len
            results += bench_ssd(d, dtype, ceilings, args.min_seconds, naive, skip)
            if "pallas" not in skip and not args.no_split:
                results += bench_split(d, dtype, args.min_seconds)
            if not args.no_layer:
                results += bench_layer(d, dtype, ceilings, args.min_seconds, args.smoke, naive, skip)
        results += bench_decode(Dims(b=1, L=1, **dims), dtype, args.decode_batches, args.min_seconds, ceilings)
        if args.sweep:
            sweep_dims = Dims(b=args.batch, L=40 if args.smoke else args.sweep_len, **dims)
            results += bench_sweep(sweep_dims, dtype, ceilings, args.min_seconds)
    print("speed-ups against xla (same run):")
    summary = dict(
        speedups=speedups(results),
        environment=env,
        ceilings=ceilings,
        dims=dims,
        dtype=args.dtype,
        batch=args.batch,
        wall_seconds=time.perf_counter() - started,
        checks_ok=all(r.get("ok", False) for r in checks),
        results=results,
    )
    text = json.dumps(summary, indent=1)
    print(text)  # first: the numbers survive even if the file cannot be written
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.out}")
        try:
            plot(summary, png_path(args.out))
            print(f"wrote {png_path(args.out)}")
        except Exception as e:  # noqa: BLE001 - the measurements are saved; a missing plot must not fail the run
            print(f"no plot ({type(e).__name__}: {e}); draw it later with --replot {args.out}", file=sys.stderr)
    return 0 if summary["checks_ok"] else 1


def replot(path: str) -> int:
    try:
        with open(path) as f:
            summary = json.load(f)
        plot(summary, png_path(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"--replot {path}: cannot draw it ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    print(f"wrote {png_path(path)}")
    return 0


def _interpret():
    import pallas_kernels

    return pallas_kernels.interpret_mode()


if __name__ == "__main__":
    sys.exit(main())
