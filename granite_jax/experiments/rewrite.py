"""Rewrite: the naive SSD, the same code through `rewriter.rewrite`, and the einsum SSD ("xla") across lengths.

The measurement (`bench_length`, also run by `benchmarks/rewrite_ssd.py`): compile each variant ahead of time,
record XLA's temporary memory, FLOP count and compile time, check against "xla", time interleaved repetitions (so
background load hits all three alike), and skip the naive SSD where one call would take too long. The experiment runs
it at the Mamba dimensions of its model (heads, head dim, state, groups, chunk size; no weights are read) and
tabulates.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import rewriter
from granite_jax.config import ModelConfig
from granite_jax.experiments.common import ExperimentError, Result, load_config_of, matplotlib_pyplot, sweep_lengths
from granite_jax.ssd import ssd_chunked, ssd_chunked_naive
from granite_jax.system import available_memory

VARIANTS = ("naive", "rewritten", "xla")


@dataclasses.dataclass(frozen=True)
class Setup:
    """What `bench_length` measures: the SSD's dimensions, and how many timed calls of each variant per length."""

    batch: int = 1
    heads: int = 48
    head_dim: int = 64
    state: int = 128
    groups: int = 1
    chunk: int = 256
    reps: int = 7  # timed calls of the rewritten and xla SSDs per length
    naive_reps: int = 2  # of the naive SSD (at most reps)
    max_naive_seconds: float = 300.0  # skip the naive SSD where one call is predicted (linearly in L) to take longer

    def describe(self) -> str:
        return f"{self.heads} heads x {self.head_dim}, state {self.state}, {self.groups} group(s), chunk {self.chunk}"


def setup_for(cfg: ModelConfig, workload, measure) -> Setup:
    """The measurement at this model's Mamba dimensions, for the experiment's workload."""
    return Setup(
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


def inputs(setup: Setup, length: int) -> tuple[jax.Array, ...]:
    """The SSD's (x, dt, A, B, C, D) for `length` tokens, float32, drawn under the seed `length`."""
    rng = np.random.default_rng(length)
    b, h, p, g, n = setup.batch, setup.heads, setup.head_dim, setup.groups, setup.state
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    dt = jnp.asarray(rng.uniform(0.001, 0.1, (b, length, h)), jnp.float32)
    A = -jnp.asarray(rng.uniform(1.0, 16.0, (h,)), jnp.float32)
    return f32(b, length, h, p), dt, A, f32(b, length, g, n), f32(b, length, g, n), f32(h)


def functions(chunk: int) -> dict[str, jax.stages.Wrapped]:
    """The three variants, jitted: `ssd_chunked_naive`, the same through `rewriter.rewrite`, and `ssd_chunked`."""
    naive = functools.partial(ssd_chunked_naive, chunk_size=chunk)
    return {
        "naive": jax.jit(naive),
        "rewritten": jax.jit(rewriter.rewrite(naive)),
        "xla": jax.jit(functools.partial(ssd_chunked, chunk_size=chunk)),
    }


def timed(compiled, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - start


def bench_length(setup: Setup, length: int, fns: dict, naive_per_token: float | None, bar=None) -> dict[str, Any]:
    """Compile all three variants at `length` tokens, check them against "xla", then time them interleaved.

    `naive_per_token`: seconds per token of the naive SSD at a shorter length (None: not measured), to skip it where
    a call would take longer than `setup.max_naive_seconds`. `bar`: a progress bar, updated once per timed call.
    Returns {"L", "impls": {variant: compile_s, temp_bytes, xla_flops, *_diff_vs_xla, min_s, median_s, times_s or
    skipped}, "sites": the rewriter's sites}."""
    xs = inputs(setup, length)
    result: dict[str, Any] = {"L": length, "impls": {}}
    compiled = {}
    for name in VARIANTS:
        record = result["impls"][name] = {}
        if name == "naive" and naive_per_token is not None:
            predicted = naive_per_token * length
            if predicted > setup.max_naive_seconds:
                record["skipped"] = f"predicted {predicted:.0f} s per call (linear in L) > max_naive_seconds"
                continue
        start = time.perf_counter()
        compiled[name] = fns[name].lower(*xs).compile()
        record["compile_s"] = time.perf_counter() - start
        record["temp_bytes"] = int(compiled[name].memory_analysis().temp_size_in_bytes)
        record["xla_flops"] = float((compiled[name].cost_analysis() or {}).get("flops", float("nan")))
        if record["temp_bytes"] > 0.8 * (available_memory() or 1 << 62):
            record["skipped"] = f"needs {record['temp_bytes'] / 2**30:.1f} GiB temporaries, more than is free"
            del compiled[name]
    outs = {name: jax.block_until_ready(c(*xs)) for name, c in compiled.items()}  # warm-up, and correctness
    for name, out in outs.items():
        scale = float(jnp.abs(outs["xla"][0]).max())
        result["impls"][name]["max_abs_diff_vs_xla"] = float(jnp.abs(out[0] - outs["xla"][0]).max())
        result["impls"][name]["rel_diff_vs_xla"] = result["impls"][name]["max_abs_diff_vs_xla"] / scale
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for rep in range(setup.reps):
        for name, c in compiled.items():
            if name == "naive" and rep >= setup.naive_reps:
                continue
            times[name].append(timed(c, xs))
            if bar is not None:
                bar.update(1)
    for name, ts in times.items():
        result["impls"][name] |= {"min_s": min(ts), "median_s": statistics.median(ts), "times_s": ts}
    report = rewriter.analyze(fns["naive"], *xs)
    result["sites"] = [f"{s.status}: {s.spec} ({s.reason or 'dot_general'})" for s in report.sites]
    return result


def ratios(result: dict[str, Any]) -> dict[str, float]:
    """Speed ratios of one length's variants: naive / rewritten, rewritten / xla (min, median, and paired median)."""
    impls = result["impls"]
    out = {}
    if "min_s" in impls["naive"]:
        out["naive_over_rewritten"] = impls["naive"]["min_s"] / impls["rewritten"]["min_s"]
    out["rewritten_over_xla"] = impls["rewritten"]["min_s"] / impls["xla"]["min_s"]
    out["rewritten_over_xla_median"] = impls["rewritten"]["median_s"] / impls["xla"]["median_s"]
    # calls of the two alternate, so each pair saw about the same background load
    pairs = [r / x for r, x in zip(impls["rewritten"]["times_s"], impls["xla"]["times_s"])]
    out["rewritten_over_xla_paired_median"] = statistics.median(pairs)
    return out


def measure_lengths(setup: Setup, lengths: list[int], bar=None) -> list[dict[str, Any]]:
    """`bench_length` at each length, shortest first (the naive SSD's time at one predicts the next), with `ratios`."""
    fns = functions(setup.chunk)
    results, naive_per_token = [], None
    for length in sorted(lengths):
        if bar is not None:
            bar.set_postfix_str(f"seq_len {length}")
        result = bench_length(setup, length, fns, naive_per_token, bar)
        result["ratios"] = ratios(result)
        if "min_s" in result["impls"]["naive"]:
            naive_per_token = result["impls"]["naive"]["min_s"] / length
        results.append(result)
    return results


def calls(setup: Setup, lengths: list[int]) -> int:
    """Timed calls `measure_lengths` makes (a progress bar's total)."""
    return len(lengths) * (2 * setup.reps + min(setup.reps, setup.naive_reps))


def run(config) -> Result:
    w, m = config.workload, config.measure
    if w.dtype != "float32":
        raise ExperimentError("workload.dtype: the rewrite benchmark runs the SSD in float32 only")
    if w.weight_dtype not in (None, "float32"):
        raise ExperimentError("workload.weight_dtype: the rewrite benchmark runs the SSD alone, with no weights")
    setup = setup_for(load_config_of(config), w, m)
    lengths = sweep_lengths(w.seq_lens, w.seq_len)
    with tqdm(total=calls(setup, lengths), desc="rewrite", unit="call", disable=None) as bar:
        results = measure_lengths(setup, lengths, bar)
    rows = [row(r, name) for r in results for name in VARIANTS]
    dims = setup.describe()
    return Result(
        title=f"Rewrite: naive vs rewritten vs xla SSD (batch {w.batch}, float32, {dims})",
        rows=rows,
        columns=["seq_len", "variant", "median_ms", "min_ms", "temp_mib", "compile_s", "rel_diff_vs_xla", "note"],
        summary=summarize(results),
        notes=[
            "naive: `ssd_chunked_naive` (broadcast products + sums, as transformers' torch_forward wrote it); "
            "rewritten: the same function through `rewriter.rewrite`; xla: `ssd_chunked` (einsum contractions).",
            "Measured by `granite_jax.experiments.rewrite.bench_length` (benchmarks/rewrite_ssd.py's too): median/min "
            "of interleaved calls, temp_mib = XLA `memory_analysis().temp_size_in_bytes`; rel_diff = max |y - y_xla| "
            "/ max |y_xla|.",
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
