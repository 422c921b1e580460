"""Rewrite: the naive SSD, the same code through `rewriter.rewrite`, and the einsum SSD ("xla") across lengths.

The measurement is the rewriter's benchmark, `benchmarks/rewrite_ssd.py` (`bench_length`: compile each variant ahead
of time, record XLA's temporary memory and compile time, check against "xla", time interleaved repetitions, skip the
naive SSD where one call would take too long), run at the Mamba dimensions of the experiment's model (heads, head
dim, state, groups, chunk size; no weights are read). This module only maps the config onto it and tabulates.
"""

from __future__ import annotations

import importlib.util
import math
import os
import types
from typing import Any

from tqdm.auto import tqdm

from granite_jax.config import ModelConfig
from granite_jax.experiments.common import ExperimentError, Result, load_config_of, matplotlib_pyplot, sweep_lengths

VARIANTS = ("naive", "rewritten", "xla")
BENCHMARK = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def benchmark_module():
    """benchmarks/rewrite_ssd.py, the single implementation of this measurement (a script, so loaded by path)."""
    path = os.path.join(BENCHMARK, "rewrite_ssd.py")
    if not os.path.isfile(path):
        raise ExperimentError(f"{path}: the rewriter benchmark is missing (the rewrite experiment runs it)")
    spec = importlib.util.spec_from_file_location("rewrite_ssd_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark_args(cfg: ModelConfig, workload, measure) -> types.SimpleNamespace:
    """The benchmark's command-line arguments for this model's Mamba dimensions and the experiment's workload."""
    return types.SimpleNamespace(
        batch=workload.batch,
        heads=cfg.mamba_n_heads,
        head_dim=cfg.mamba_d_head,
        state=cfg.mamba_d_state,
        groups=cfg.mamba_n_groups,
        chunk=cfg.mamba_chunk_size,
        reps=measure.repeats,
        naive_reps=min(measure.repeats, measure.naive_repeats),
        max_naive_seconds=measure.max_naive_seconds,
    )


def run(config) -> Result:
    w, m = config.workload, config.measure
    if w.dtype != "float32":
        raise ExperimentError("workload.dtype: the rewrite benchmark runs the SSD in float32 only")
    if w.weight_dtype not in (None, "float32"):
        raise ExperimentError("workload.weight_dtype: the rewrite benchmark runs the SSD alone, with no weights")
    cfg = load_config_of(config)
    bench = benchmark_module()
    args = benchmark_args(cfg, w, m)
    lengths = sweep_lengths(w.seq_lens, w.seq_len)
    functions = bench.functions(args.chunk)
    results, naive_per_token = [], None
    with tqdm(total=len(lengths) * (2 * args.reps + args.naive_reps), desc="rewrite", unit="call") as bar:
        for length in lengths:
            bar.set_postfix_str(f"seq_len {length}")
            result = bench.bench_length(args, length, functions, naive_per_token, bar)
            result["ratios"] = bench.ratios(result)
            if "min_s" in result["impls"]["naive"]:
                naive_per_token = result["impls"]["naive"]["min_s"] / length
            results.append(result)
    rows = [row(r, name) for r in results for name in VARIANTS]
    dims = f"{args.heads} heads x {args.head_dim}, state {args.state}, {args.groups} group(s), chunk {args.chunk}"
    return Result(
        title=f"Rewrite: naive vs rewritten vs xla SSD (batch {w.batch}, float32, {dims})",
        rows=rows,
        columns=["seq_len", "variant", "median_ms", "min_ms", "temp_mib", "compile_s", "rel_diff_vs_xla", "note"],
        summary=summarize(results),
        notes=[
            "naive: `ssd_chunked_naive` (broadcast products + sums, as transformers' torch_forward wrote it); "
            "rewritten: the same function through `rewriter.rewrite`; xla: `ssd_chunked` (einsum contractions).",
            "Measured by benchmarks/rewrite_ssd.py `bench_length`: median/min of interleaved calls, temp_mib = XLA "
            "`memory_analysis().temp_size_in_bytes`; rel_diff = max |y - y_xla| / max |y_xla|.",
            f"rewriter sites at seq_len {lengths[-1]}: " + "; ".join(results[-1]["sites"]),
        ],
        plots={"rewrite.png": lambda path: plot(rows, dims, path)},
        model=dict(source=f"SSD of {config.model.checkpoint or config.model.name}", mamba_dims=dims),
        workload=dict(batch=w.batch, seq_lens=lengths, dtype="float32"),
    )


def row(result: dict[str, Any], name: str) -> dict[str, Any]:
    rec = result["impls"][name]
    return dict(
        seq_len=result["L"],
        variant=name,
        median_ms=1e3 * rec["median_s"] if "median_s" in rec else math.nan,
        min_ms=1e3 * rec["min_s"] if "min_s" in rec else math.nan,
        temp_mib=rec["temp_bytes"] / 2**20 if "temp_bytes" in rec else math.nan,
        compile_s=rec.get("compile_s", math.nan),
        rel_diff_vs_xla=rec.get("rel_diff_vs_xla", math.nan),
        note=rec.get("skipped", ""),
    )


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    last = results[-1]
    impls = last["impls"]
    out = dict(seq_len=last["L"], **{f"{k}_at_longest": v for k, v in last["ratios"].items()})
    for name in VARIANTS:
        if "temp_bytes" in impls[name]:
            out[f"{name}_temp_mib_at_longest"] = impls[name]["temp_bytes"] / 2**20
    out["sites_rewritten"] = sum(s.startswith("rewritten") for s in last["sites"])
    out["sites_total"] = len(last["sites"])
    return out


def plot(rows: list[dict[str, Any]], dims: str, path: str) -> None:
    plt = matplotlib_pyplot()
    fig, (t_ax, m_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, style in zip(VARIANTS, ("o-", "s-", "^-")):
        mine = [r for r in rows if r["variant"] == name]
        n = [r["seq_len"] for r in mine]
        t_ax.plot(n, [r["median_ms"] for r in mine], style, label=name)
        m_ax.plot(n, [r["temp_mib"] for r in mine], style, label=name)
    lengths = sorted({r["seq_len"] for r in rows})
    for ax, ylabel, title in ((t_ax, "ms (median)", "SSD time"), (m_ax, "MiB", "compiled temporaries")):
        ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel=ylabel)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(dims, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
