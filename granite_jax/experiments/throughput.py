"""Throughput: prefill and decode tokens per second of granite-jax, against transformers on the same weights.

For each batch size, greedy generation of exactly `workload.new_tokens` tokens from random prompts of
`workload.seq_len` tokens; the measurement is `granite_jax.compare.speed` (the one `python -m granite_jax.compare`
prints): granite-jax through `compare.measure` (compilation excluded and reported apart), transformers through
`model.generate` with per-token timestamps. Best of `measure.repeats` runs after a warm-up.

With `measure.floor_probe_mib` > 0 it also measures the memory bandwidth (`memory_bandwidth`, before and after the
speed runs, best of both: on a shared machine one probe can land on a busy moment and lower the floor) and reports the
batch-1 decode floor: one decode step reads every weight it uses once (all parameters but the routed experts the
token is not sent to), so tokens/s <= bandwidth / those bytes. That bandwidth is a burst, the best of many single
reads; with batch 1 among the batch sizes, `paired_floor` also sets batch-1 decode between two sustained reads of the
same bytes, `measure.floor_pairs` times: the floor of the moment it ran.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from granite_jax import compare, ops
from granite_jax.experiments.common import (
    ExperimentError,
    Result,
    matplotlib_pyplot,
    model_spec,
    model_summary,
    set_torch_threads,
)
from granite_jax.model import linear
from granite_jax.ops import Runtime


def run(config) -> Result:
    w, m = config.workload, config.measure
    if w.rewriter:
        raise ExperimentError(
            "workload.rewriter: the throughput experiment runs the Generator's own compiled steps, which do not go "
            "through the rewriter; use the rewrite or scaling experiment for rewritten code"
        )
    batch_sizes = tuple(w.batch_sizes or (w.batch,))
    if any(not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ExperimentError(f"workload.batch_sizes must be positive integers, got {batch_sizes}")
    if w.new_tokens < 2:
        raise ExperimentError("workload.new_tokens must be >= 2 to time decoding")
    spec = model_spec(config)
    set_torch_threads(m.get("torch_threads"), "measure.torch_threads")
    if m.transformers:
        pair = compare.load_workload_pair(spec, w)
    else:
        model = spec.load(dtype=w.dtype, weight_dtype=w.weight_dtype, ssd_impl=w.ssd_impl, mesh=w.mesh)
        pair = compare.Pair(model, None, w.dtype, spec.describe())
    bandwidth = memory_bandwidth(m.floor_probe_mib << 20) if m.floor_probe_mib > 0 else None
    speeds = []
    for batch in (bar := tqdm(batch_sizes, desc="throughput", unit="batch", disable=None)):
        bar.set_postfix_str(f"batch {batch}")
        speeds += compare.speed(pair, (batch,), w.seq_len, w.new_tokens, m.repeats)
    rows = [flat_row(s) for s in speeds]
    summary = summarize(rows)
    plots = {"throughput.png": lambda path: plot(speeds, spec.describe(), path)}
    if bandwidth is not None:
        bandwidth = best_bandwidth(bandwidth, memory_bandwidth(m.floor_probe_mib << 20))
        floor = decode_floor(pair.jax, bandwidth)
        summary |= floor
        for row in rows:
            if row["batch"] == 1:
                row["jax_decode_vs_floor"] = row["jax_decode_tok_s"] / floor["decode_floor_tok_s"]
        if 1 in batch_sizes and m.floor_pairs > 0:
            paired = paired_floor(
                pair.generator,
                floor["bytes_read_per_token"],
                w.seq_len,
                w.new_tokens,
                m.floor_pairs,
                m.floor_probe_mib << 20,
            )
            headline = ("decode_vs_sustained_floor", "decode_vs_sustained_floor_min", "decode_vs_pooled_floor")
            summary |= {f"paired_{k}": v for k, v in paired.items() if k not in headline}
            summary |= {k: paired[k] for k in headline}
            plots["floor_pairs.png"] = functools.partial(
                plot_pairs, paired, floor["bytes_read_per_token"], max(bandwidth.values()), spec.describe()
            )
    return Result(
        title=f"Throughput: prefill and decode tokens/s ({w.dtype}, prompt {w.seq_len}, {w.new_tokens} new tokens)",
        rows=rows,
        summary=summary,
        notes=[
            "prefill: prompt in, first token on the host; decode: the remaining tokens of every row over the "
            "remaining time. Best of measure.repeats runs after a warm-up; granite-jax compilation excluded "
            "(jax_compile_s).",
            "speedup = granite-jax tokens/s / transformers tokens/s.",
            "decode floor (batch 1) = memory bandwidth / bytes read per token; bandwidth = the fastest of the probes "
            "in `bandwidth_gb_s` (summary), measured in the same run: the best single 1 GiB read (burst).",
            "decode_vs_sustained_floor (summary, with batch 1): over measure.floor_pairs pairs, each a batch-1 run "
            "between two sustained reads of the bytes its decode read (the decode-pattern probes), the median of "
            f"decode / floor over the steady pairs, those whose two reads agree within {STEADY_WITHIN:.0%} (the "
            "floor: their mean); decode_vs_sustained_floor_min: the lowest; decode_vs_pooled_floor: every pair "
            "pooled, with no threshold (all decode tokens over their seconds against all read bytes over theirs); "
            "paired_*: each pair; floor_pairs.png: the pairs over time.",
        ],
        plots=plots,
        model=dict(source=spec.describe(), **model_summary(pair.jax)),
        workload=dict(
            batch_sizes=batch_sizes,
            seq_len=w.seq_len,
            new_tokens=w.new_tokens,
            dtype=w.dtype,
            weight_dtype=w.weight_dtype or w.dtype,
            ssd_impl=w.ssd_impl,
            torch_device=str(pair.hf.device) if pair.hf is not None else None,
        ),
    )


DECODE_PATTERN = ("xla_matvec_rows", "kernel_matvec")  # the probes that read W (N, K) as batch-1 decode does
_SUM, _MATMUL = jax.jit(jnp.sum), jax.jit(jnp.matmul)


# The model's x W^T (`model.linear`): plain JAX (XLA's product), and with the platform's kernels (on a CPU with the
# CPU kernels, one row is their matrix-vector kernel on W as it is).
_DOT, _KERNEL = jax.jit(ops.under(Runtime(kernels=False), linear)), jax.jit(ops.under(Runtime(), linear))


def cpu_kernels_run() -> bool:
    """Whether the optional CPU kernels (`granite_jax.cpu`) are installed and run here."""
    try:
        from granite_jax import cpu
    except ImportError:
        return False
    return cpu.available()


def bandwidth_probes(nbytes: int = 1 << 30, names: tuple[str, ...] | None = None) -> tuple[int, dict[str, Callable]]:
    """(bytes each probe reads, {name: probe}): reads of a float32 buffer of about `nbytes` (8192 columns): a numpy
    sum, a numpy (BLAS) matrix-vector product, an XLA sum, XLA matrix-vector products with the matrix (in, out) and
    (out, in), the latter being the decode step's own access pattern (`model.linear`), and where the CPU kernels run,
    their matrix-vector product (batch-1 decode's). Each spreads over all cores if it can. `names`: only these. A buffer
    is allocated by the first call of a probe that reads it (call each once untimed), and shared by the probes of its
    layout."""
    cols = 8192
    rows = max(nbytes // 4 // cols, 1)
    vector, host_vector = jnp.ones((1, cols), jnp.float32), np.ones(cols, np.float32)
    # Buffers on first use (a probe's warm-up call), one per layout.
    host = functools.cache(lambda: np.ones((rows, cols), np.float32))
    flat = functools.cache(lambda: jnp.ones(rows * cols, jnp.float32))
    in_out = functools.cache(lambda: jnp.ones((cols, rows), jnp.float32))
    out_in = functools.cache(lambda: jnp.ones((rows, cols), jnp.float32))
    probes = dict(
        numpy_sum=lambda: host().sum(),
        numpy_matvec=lambda: host() @ host_vector,
        xla_sum=lambda: _SUM(flat()).block_until_ready(),
        xla_matvec=lambda: _MATMUL(vector, in_out()).block_until_ready(),
        xla_matvec_rows=lambda: _DOT(vector, out_in()).block_until_ready(),
    )
    if cpu_kernels_run():  # one float32 row by a float32 matrix: the matrix-vector kernel
        probes["kernel_matvec"] = lambda: _KERNEL(vector, out_in()).block_until_ready()
    chosen = probes if names is None else {name: probe for name, probe in probes.items() if name in names}
    return rows * cols * 4, chosen


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """Burst read bandwidth in GB/s: the best of `repeats` single reads by each of `bandwidth_probes`."""
    nbytes, probes = bandwidth_probes(nbytes)
    best = dict.fromkeys(probes, math.inf)
    for probe in probes.values():  # warm up: compile, page in
        probe()
    for _ in range(repeats):
        for name, probe in probes.items():
            t = time.perf_counter()
            probe()
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: nbytes / seconds / 1e9 for name, seconds in best.items()}


def sustained_bandwidth(total_bytes: int, nbytes: int = 1 << 30) -> dict[str, float]:
    """Sustained read bandwidth in GB/s of each decode-pattern probe (`DECODE_PATTERN`): ceil(total_bytes / nbytes)
    reads of its buffer back to back, timed together: the traffic of a decode run, over about the same time."""
    nbytes, probes = bandwidth_probes(nbytes, DECODE_PATTERN)
    passes = max(1, math.ceil(total_bytes / nbytes))
    out = {}
    for name, probe in probes.items():
        probe()  # warm up: compile, page in
        t = time.perf_counter()
        for _ in range(passes):
            probe()
        out[name] = passes * nbytes / (time.perf_counter() - t) / 1e9
    return out


STEADY_WITHIN = 0.10  # a pair is steady when its two reads' bandwidths differ by at most this fraction


def paired_floor(
    generator, read_bytes: int, prompt_len: int, new_tokens: int, pairs: int = 3, nbytes: int = 1 << 30
) -> dict[str, Any]:
    """Batch-1 decode against a weights-read floor measured at the same moment, `pairs` times.

    Each pair brackets one greedy run (`compare.measure`, after a warm-up) between two `sustained_bandwidth` reads
    of the bytes such a run's decode reads (tokens x `read_bytes`), so both sides read the same bytes over about the
    same seconds. A shared host's bandwidth can move between levels for seconds at a time, and a run's floor is then
    only known when it did not move across the pair: a pair is *steady* when the two reads agree within
    `STEADY_WITHIN`. Its floor is their mean (the best probe of each).

    Returns per-pair lists (seconds since the first pair began, decode and floor tokens/s, their ratio, each read's
    GB/s per probe, steady or not), the median and the lowest ratio over the steady pairs (`decode_vs_sustained_floor`,
    `decode_vs_sustained_floor_min`; None when no pair was steady), and the number of steady pairs. Without a
    threshold, `decode_vs_pooled_floor` pools every pair: all the runs' decode tokens over their seconds, against all
    the reads' bytes over their seconds (`pooled_floor_tok_s`, each read by its best probe). Both sides then average
    the same stretch of the host's levels, weighted by time; a pair whose level moved counts, as it ran.
    """
    warm = compare.measure(generator, 1, prompt_len, new_tokens)
    run_bytes = warm.decode_tokens * read_bytes
    keys = ("seconds", "decode_tok_s", "sustained_floor_tok_s", "decode_vs_sustained_floors", "steady")
    out: dict[str, Any] = {k: [] for k in (*keys, "sustained_gb_s_before", "sustained_gb_s_after")}
    start = time.perf_counter()
    for i in range(pairs):
        out["seconds"].append(time.perf_counter() - start)
        before = sustained_bandwidth(run_bytes, nbytes)
        t = compare.measure(generator, 1, prompt_len, new_tokens, seed=i + 1)
        after = sustained_bandwidth(run_bytes, nbytes)
        low, high = sorted((max(before.values()), max(after.values())))
        floor = (low + high) / 2 * 1e9 / read_bytes
        out["decode_tok_s"].append(t.decode_tokens_per_s)
        out["sustained_floor_tok_s"].append(floor)
        out["decode_vs_sustained_floors"].append(t.decode_tokens_per_s / floor)
        out["steady"].append(low >= (1 - STEADY_WITHIN) * high)
        out["sustained_gb_s_before"].append(before)
        out["sustained_gb_s_after"].append(after)
    steady = [r for r, ok in zip(out["decode_vs_sustained_floors"], out["steady"], strict=True) if ok]
    out["steady_pairs"] = len(steady)
    out["decode_vs_sustained_floor"] = float(np.median(steady)) if steady else None
    out["decode_vs_sustained_floor_min"] = min(steady) if steady else None
    # Every run decodes the same tokens and every read reads the same bytes: totals over totals are harmonic means.
    reads = [max(r.values()) for r in (*out["sustained_gb_s_before"], *out["sustained_gb_s_after"])]
    out["pooled_floor_tok_s"] = statistics.harmonic_mean(reads) * 1e9 / read_bytes
    out["decode_vs_pooled_floor"] = statistics.harmonic_mean(out["decode_tok_s"]) / out["pooled_floor_tok_s"]
    return out


def best_bandwidth(*probes: dict[str, float]) -> dict[str, float]:
    """The best of several `memory_bandwidth` runs, probe by probe."""
    return {name: max(p[name] for p in probes) for name in probes[0]}


def parameter_sizes(model) -> dict[str, int]:
    """Parameters and their bytes, split into the routed experts' (each token reads `num_experts_per_tok` of
    `num_local_experts` of them) and the rest: {dense_params, dense_bytes, routed_params, routed_bytes}. `model` may be
    abstract (`model.abstract_model`)."""
    sizes = dict.fromkeys(("dense_params", "dense_bytes", "routed_params", "routed_bytes"), 0)
    for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        keys = [str(getattr(k, "key", k)) for k in path]
        part = (
            "routed" if "block_sparse_moe" in keys and ("input_linear" in keys or "output_linear" in keys) else "dense"
        )
        sizes[f"{part}_params"] += int(x.size)
        sizes[f"{part}_bytes"] += int(x.size) * jnp.dtype(x.dtype).itemsize
    return sizes


def decode_floor(model, bandwidth: dict[str, float]) -> dict[str, Any]:
    """The batch-1 decode bound: every weight a token uses is read once per token, at the best bandwidth measured.

    A token uses every parameter except the routed experts it is not sent to: of each MoE layer's experts only
    `num_experts_per_tok` of `num_local_experts` are read (`model.MoE` gathers the chosen ones when decoding).
    """
    cfg = model.cfg
    sizes = parameter_sizes(model)
    param_bytes = sizes["dense_bytes"] + sizes["routed_bytes"]
    read_bytes = sizes["dense_bytes"] + sizes["routed_bytes"] * cfg.num_experts_per_tok / max(cfg.num_local_experts, 1)
    best = max(bandwidth.values())
    return dict(
        param_bytes=int(param_bytes),
        bytes_read_per_token=int(read_bytes),
        bandwidth_gb_s=bandwidth,
        decode_floor_tok_s=best * 1e9 / read_bytes,
    )


def flat_row(s: dict[str, Any]) -> dict[str, Any]:
    row = dict(
        batch=s["batch"],
        jax_prefill_tok_s=s["jax"]["prefill_tokens_per_s"],
        jax_decode_tok_s=s["jax"]["decode_tokens_per_s"],
        jax_compile_s=s["jax"]["compile_s"],
    )
    if "hf" in s:
        row |= dict(
            hf_prefill_tok_s=s["hf"]["prefill_tokens_per_s"],
            hf_decode_tok_s=s["hf"]["decode_tokens_per_s"],
            prefill_speedup=s["prefill_speedup"],
            decode_speedup=s["decode_speedup"],
        )
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in rows:
        for key in ("jax_prefill_tok_s", "jax_decode_tok_s", "prefill_speedup", "decode_speedup"):
            if key in row:
                out[f"{key}_batch{row['batch']}"] = row[key]
    return out


def plot(speeds: list[dict[str, Any]], source: str, path: str) -> None:
    plt = matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(speeds), 4.2))
    compare.plot_speed(ax, speeds)
    ax.set_title(f"tokens/s, {source}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_pairs(paired: dict[str, Any], read_bytes: int, burst_gb_s: float, source: str, path: str) -> None:
    """The `paired_floor` pairs over time: left, the GB/s batch-1 decode read beside the reads before and after it
    (and the burst bandwidth); right, each pair's decode / floor against the 80% line, unsteady pairs hollow."""
    plt = matplotlib_pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    t = np.asarray(paired["seconds"])
    reads = [[max(p.values()) for p in paired[f"sustained_gb_s_{side}"]] for side in ("before", "after")]
    left.plot(t, np.asarray(paired["decode_tok_s"]) * read_bytes / 1e9, "o-", label="batch-1 decode")
    left.plot(t, reads[0], "v", label="sustained read before")
    left.plot(t, reads[1], "^", label="sustained read after")
    left.axhline(burst_gb_s, ls="--", c="gray", lw=1, label="burst floor's bandwidth (best single read)")
    left.set(xlabel="seconds since the first pair", ylabel="GB/s of weights read", ylim=(0, None))
    left.legend(fontsize=8)
    steady = np.asarray(paired["steady"], bool)
    ratio = np.asarray(paired["decode_vs_sustained_floors"]) * 100
    right.plot(t[steady], ratio[steady], "o", c="C0", label=f"steady pair (reads within {STEADY_WITHIN:.0%})")
    right.plot(t[~steady], ratio[~steady], "o", mfc="none", c="C0", label="the host's bandwidth moved")
    right.axhline(80, ls="--", c="C3", lw=1, label="goal: 80%")
    top = max(110, 1.05 * max(ratio, default=0))  # a pair whose level moved can exceed 100%
    right.set(xlabel="seconds since the first pair", ylabel="decode / floor of the moment (%)", ylim=(0, top))
    right.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"batch-1 decode against the weights-read floor, {source}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
