"""Throughput: prefill and decode tokens per second of granite-jax, against transformers on the same weights.

For each batch size, greedy generation of exactly `workload.new_tokens` tokens from random prompts of
`workload.seq_len` tokens; the measurement is `granite_jax.compare.speed` (the one `python -m granite_jax.compare`
prints): granite-jax through `Generator.measure` (compilation excluded and reported apart), transformers through
`model.generate` with per-token timestamps. Best of `measure.repeats` runs after a warm-up.
"""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from granite_jax import compare
from granite_jax.experiments.common import (
    ExperimentError,
    Result,
    matplotlib_pyplot,
    model_spec,
    model_summary,
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
    if m.transformers:
        pair = compare.load_pair(spec, dtype=w.dtype, ssd_impl=w.ssd_impl)
    else:
        pair = compare.Pair(spec.load(dtype=w.dtype, ssd_impl=w.ssd_impl), None, w.dtype, spec.describe())
    speeds = []
    for batch in (bar := tqdm(batch_sizes, desc="throughput", unit="batch")):
        bar.set_postfix_str(f"batch {batch}")
        speeds += compare.speed(pair, (batch,), w.seq_len, w.new_tokens, m.repeats)
    rows = [flat_row(s) for s in speeds]
    return Result(
        title=f"Throughput: prefill and decode tokens/s ({w.dtype}, prompt {w.seq_len}, {w.new_tokens} new tokens)",
        rows=rows,
        summary=summarize(rows),
        notes=[
            "prefill: prompt in, first token on the host; decode: the remaining tokens of every row over the "
            "remaining time. Best of measure.repeats runs after a warm-up; granite-jax compilation excluded "
            "(jax_compile_s).",
            "speedup = granite-jax tokens/s / transformers tokens/s.",
        ],
        plots={"throughput.png": lambda path: plot(speeds, spec.describe(), path)},
        model=dict(source=spec.describe(), **model_summary(pair.jax)),
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
