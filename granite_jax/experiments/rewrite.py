"""Rewrite: the naive SSD, the same code through `rewriter.rewrite`, and the einsum SSD ("xla") across lengths.

At each sequence length each variant is compiled ahead of time on random inputs with the Mamba dimensions of the
model config (heads, head dim, state size, groups, chunk size): XLA's memory analysis of the executable gives the
temporaries it needs, and the median wall-clock of `workload.batch` rows gives the time. Each output is checked
against the "xla" variant. The rewriter's own report (sites rewritten, intermediates removed) is recorded too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from granite_jax.config import ModelConfig
from granite_jax.experiments.common import (
    DTYPES,
    Result,
    compiled_memory,
    load_config_of,
    matplotlib_pyplot,
    sweep_lengths,
    time_call,
)
from granite_jax.ssd import ssd_chunked, ssd_chunked_naive

VARIANTS = ("naive", "rewritten", "xla")


def ssd_variants(chunk_size: int) -> dict[str, Callable]:
    """The three SSD functions compared, each (x, dt, A, B, C, D) -> (y, final state)."""
    import rewriter

    naive = functools.partial(ssd_chunked_naive, chunk_size=chunk_size)
    return dict(
        naive=naive, rewritten=rewriter.rewrite(naive), xla=functools.partial(ssd_chunked, chunk_size=chunk_size)
    )


def ssd_inputs(cfg: ModelConfig, batch: int, length: int, dtype, seed: int = 0) -> tuple[jax.Array, ...]:
    """Random SSD inputs of the model's Mamba shape: x (b, L, h, p), dt (b, L, h), A, D (h,), B, C (b, L, g, n)."""
    h, p, g, n = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups, cfg.mamba_d_state
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    dt = jnp.asarray(np.log1p(np.exp(rng.standard_normal((batch, length, h)) - 2.0)), jnp.float32)
    A = -jnp.asarray(np.exp(rng.uniform(0.0, 1.0, h)), jnp.float32)
    return normal(batch, length, h, p), dt, A, normal(batch, length, g, n), normal(batch, length, g, n), jnp.ones(h)


def measure_length(cfg: ModelConfig, batch: int, length: int, dtype, repeats: int, warmup: int, seed: int):
    """Rows (one per variant) at one sequence length: time, compiled memory, error against "xla"."""
    args = ssd_inputs(cfg, batch, length, dtype, seed)
    outputs, rows = {}, []
    for name, fn in ssd_variants(cfg.mamba_chunk_size).items():
        compiled = jax.jit(fn).lower(*args).compile()
        memory = compiled_memory(compiled)
        timing = time_call(functools.partial(compiled, *args), repeats=repeats, warmup=warmup)
        outputs[name] = compiled(*args)
        rows.append(
            dict(
                seq_len=length,
                variant=name,
                time_ms=1e3 * timing["median_s"],
                temp_mib=memory.get("temp_bytes", math.nan) / 2**20,
                peak_mib=memory.get("peak_bytes", math.nan) / 2**20,
            )
        )
    for row in rows:
        row["rel_err_vs_xla"] = relative_error(outputs[row["variant"]][0], outputs["xla"][0])
    return rows


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def rewriter_report(cfg: ModelConfig, batch: int, length: int, dtype) -> dict[str, Any]:
    """What `rewriter.analyze` says about the naive SSD at this shape."""
    import rewriter

    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ssd_inputs(cfg, batch, length, dtype)]
    report = rewriter.analyze(functools.partial(ssd_chunked_naive, chunk_size=cfg.mamba_chunk_size), *shapes)
    return dict(
        sites=len(report.sites),
        rewritten=len(report.rewritten),
        fused=len(report.fused),
        skipped=len(report.skipped),
        intermediate_mib_removed=sum(s.intermediate_bytes for s in report.rewritten + report.fused) / 2**20,
    )


def run(config) -> Result:
    w, m = config.workload, config.measure
    cfg = load_config_of(config)
    dtype = DTYPES[w.dtype]
    lengths = sweep_lengths(w.seq_lens, w.seq_len)
    rows = []
    for length in (bar := tqdm(lengths, desc="rewrite", unit="length")):
        bar.set_postfix_str(f"seq_len {length}")
        rows += measure_length(cfg, w.batch, length, dtype, m.repeats, m.warmup, config.model.seed)
    report = rewriter_report(cfg, w.batch, lengths[-1], dtype)
    dims = (
        f"{cfg.mamba_n_heads} heads x {cfg.mamba_d_head}, state {cfg.mamba_d_state}, {cfg.mamba_n_groups} group(s), "
        f"chunk {cfg.mamba_chunk_size}"
    )
    return Result(
        title=f"Rewrite: naive vs rewritten vs xla SSD (batch {w.batch}, {w.dtype}, {dims})",
        rows=rows,
        columns=["seq_len", "variant", "time_ms", "temp_mib", "peak_mib", "rel_err_vs_xla"],
        summary=summarize(rows) | {f"rewriter_{k}": v for k, v in report.items()},
        notes=[
            "naive: `ssd_chunked_naive` (broadcast products + sums, as transformers' torch_forward wrote it); "
            "rewritten: the same function through `rewriter.rewrite`; xla: `ssd_chunked` (einsum contractions).",
            "time_ms: median of the compiled SSD call; temp_mib / peak_mib: XLA memory analysis of the executable.",
            f"rewriter_*: `rewriter.analyze` of the naive SSD at seq_len {lengths[-1]}.",
        ],
        plots={"rewrite.png": lambda path: plot(rows, dims, path)},
        model=dict(source=f"SSD of {config.model.checkpoint or config.model.name}: {dims}", mamba_dims=dims),
    )


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    longest = max(r["seq_len"] for r in rows)
    at = {r["variant"]: r for r in rows if r["seq_len"] == longest}
    return dict(
        seq_len=longest,
        rewritten_speedup_over_naive=at["naive"]["time_ms"] / at["rewritten"]["time_ms"],
        rewritten_vs_xla_time=at["rewritten"]["time_ms"] / at["xla"]["time_ms"],
        naive_temp_mib=at["naive"]["temp_mib"],
        rewritten_temp_mib=at["rewritten"]["temp_mib"],
        xla_temp_mib=at["xla"]["temp_mib"],
        max_rel_err_vs_xla=max(r["rel_err_vs_xla"] for r in rows),
    )


def plot(rows: list[dict[str, Any]], dims: str, path: str) -> None:
    plt = matplotlib_pyplot()
    fig, (t_ax, m_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, style in zip(VARIANTS, ("o-", "s-", "^-")):
        mine = [r for r in rows if r["variant"] == name]
        n = [r["seq_len"] for r in mine]
        t_ax.plot(n, [r["time_ms"] for r in mine], style, label=name)
        m_ax.plot(n, [r["temp_mib"] for r in mine], style, label=name)
    lengths = sorted({r["seq_len"] for r in rows})
    for ax, ylabel, title in ((t_ax, "ms", "SSD time"), (m_ax, "MiB", "compiled temporaries")):
        ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel=ylabel)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(dims, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
