"""Throughput: prefill and decode tokens per second of granite-jax, against transformers on the same weights.

For each batch size, greedy generation of exactly `workload.new_tokens` tokens from random prompts of
`workload.seq_len` tokens; the measurement is `granite_jax.compare.speed` (the one `python -m granite_jax.compare`
prints): granite-jax through `Generator.measure` (compilation excluded and reported apart), transformers through
`model.generate` with per-token timestamps. Best of `measure.repeats` runs after a warm-up.

With `measure.floor_probe_mib` > 0 it also measures the memory bandwidth (`memory_bandwidth`, before and after the
speed runs, best of both: on a shared machine one probe can land on a busy moment and lower the floor) and reports the
batch-1 decode floor: one decode step reads every weight it uses once (all parameters but the routed experts the
token is not sent to), so tokens/s <= bandwidth / those bytes.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from granite_jax import compare, cpu_kernels
from granite_jax.experiments.common import (
    ExperimentError,
    Result,
    matplotlib_pyplot,
    model_spec,
    model_summary,
    set_torch_threads,
)


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
        pair = compare.load_pair(spec, dtype=w.dtype, ssd_impl=w.ssd_impl)
    else:
        pair = compare.Pair(spec.load(dtype=w.dtype, ssd_impl=w.ssd_impl), None, w.dtype, spec.describe())
    bandwidth = memory_bandwidth(m.floor_probe_mib << 20) if m.floor_probe_mib > 0 else None
    speeds = []
    for batch in (bar := tqdm(batch_sizes, desc="throughput", unit="batch")):
        bar.set_postfix_str(f"batch {batch}")
        speeds += compare.speed(pair, (batch,), w.seq_len, w.new_tokens, m.repeats)
    rows = [flat_row(s) for s in speeds]
    summary = summarize(rows)
    if bandwidth is not None:
        bandwidth = best_bandwidth(bandwidth, memory_bandwidth(m.floor_probe_mib << 20))
        floor = decode_floor(pair.jax, bandwidth)
        summary |= floor
        for row in rows:
            if row["batch"] == 1:
                row["jax_decode_vs_floor"] = row["jax_decode_tok_s"] / floor["decode_floor_tok_s"]
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
            "in `bandwidth_gb_s` (summary), measured in the same run.",
        ],
        plots={"throughput.png": lambda path: plot(speeds, spec.describe(), path)},
        model=dict(source=spec.describe(), **model_summary(pair.jax)),
        workload=dict(
            batch_sizes=batch_sizes, seq_len=w.seq_len, new_tokens=w.new_tokens, dtype=w.dtype, ssd_impl=w.ssd_impl
        ),
    )


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """Read bandwidth in GB/s over `nbytes` of float32, best of `repeats` runs of each probe: a numpy sum, a numpy
    (BLAS) matrix-vector product, an XLA sum, and XLA matrix-vector products with the matrix (in, out) and (out, in),
    the latter being the decode step's own access pattern (`model.Linear`), and where the CPU kernels run, their
    matrix-vector product (batch-1 decode's). Each spreads over all cores if it can."""
    cols = 8192
    rows = max(nbytes // 4 // cols, 1)
    nbytes = rows * cols * 4
    host = np.ones((rows, cols), np.float32)
    host_vector = np.ones(cols, np.float32)
    flat = jnp.ones(rows * cols, jnp.float32)
    in_out = jnp.ones((cols, rows), jnp.float32)
    out_in = jnp.ones((rows, cols), jnp.float32)
    vector = jnp.ones((1, cols), jnp.float32)
    total, matvec = jax.jit(jnp.sum), jax.jit(jnp.matmul)
    matvec_rows = jax.jit(lambda v, w: jax.lax.dot_general(v, w, (((1,), (1,)), ((), ()))))
    probes = {
        "numpy_sum": lambda: host.sum(),
        "numpy_matvec": lambda: host @ host_vector,
        "xla_sum": lambda: total(flat).block_until_ready(),
        "xla_matvec": lambda: matvec(vector, in_out).block_until_ready(),
        "xla_matvec_rows": lambda: matvec_rows(vector, out_in).block_until_ready(),
    }
    if cpu_kernels.uses_matvec(vector, out_in):
        kernel = jax.jit(cpu_kernels.linear)
        probes["kernel_matvec"] = lambda: kernel(vector, out_in).block_until_ready()
    best = dict.fromkeys(probes, math.inf)
    for probe in probes.values():  # warm up: compile, page in
        probe()
    for _ in range(repeats):
        for name, probe in probes.items():
            t = time.perf_counter()
            probe()
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: nbytes / seconds / 1e9 for name, seconds in best.items()}


def best_bandwidth(*probes: dict[str, float]) -> dict[str, float]:
    """The best of several `memory_bandwidth` runs, probe by probe."""
    return {name: max(p[name] for p in probes) for name in probes[0]}


def decode_floor(model, bandwidth: dict[str, float]) -> dict[str, Any]:
    """The batch-1 decode bound: every weight a token uses is read once per token, at the best bandwidth measured.

    A token uses every parameter except the routed experts it is not sent to: of each MoE layer's experts only
    `num_experts_per_tok` of `num_local_experts` are read (`model.MoE` gathers the chosen ones when decoding).
    """
    cfg = model.cfg
    param_bytes = read_bytes = 0
    for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        nbytes = x.size * x.dtype.itemsize
        keys = [str(getattr(k, "key", k)) for k in path]
        routed = "block_sparse_moe" in keys and ("input_linear" in keys or "output_linear" in keys)
        param_bytes += nbytes
        read_bytes += nbytes * cfg.num_experts_per_tok / cfg.num_local_experts if routed else nbytes
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
