"""Scaling: prefill time and peak memory against sequence length, split into Mamba and attention layers.

At each length the whole prefill (`forward(last_only=True)`) is compiled ahead of time and timed; XLA's memory
analysis of that executable gives the peak memory bound (arguments + outputs + temporaries). One Mamba layer and one
attention layer are also compiled and timed alone on the same input shape, and multiplied by their counts: that gives
attention's share of the layer time, and log-log slopes show Mamba's linear growth against attention's quadratic
score matrix.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from granite_jax import ops
from granite_jax.compare import maybe_rewritten
from granite_jax.config import ATTENTION, MAMBA
from granite_jax.experiments.common import (
    Result,
    compiled_memory,
    matplotlib_pyplot,
    model_spec,
    model_summary,
    random_tokens,
    sweep_lengths,
    time_call,
)
from granite_jax.model import Granite, Positions


def run(config) -> Result:
    w, m = config.workload, config.measure
    spec = model_spec(config)
    model = spec.load(dtype=w.dtype, weight_dtype=w.weight_dtype, ssd_impl=w.ssd_impl, mesh=w.mesh)
    lengths = sweep_lengths(w.seq_lens, w.seq_len)
    rows = []
    for length in (bar := tqdm(lengths, desc="scaling", unit="length", disable=None)):
        bar.set_postfix_str(f"seq_len {length}")
        rows.append(measure_length(model, w.batch, length, w.rewriter, m.repeats, m.warmup, config.model.seed))
    return Result(
        title=f"Scaling: prefill time and peak memory vs sequence length (batch {w.batch}, {w.dtype})",
        rows=rows,
        summary=growth_summary(rows),
        notes=[
            "prefill_s: median wall-clock of the jitted forward over the prompt (last-position logits), compiled "
            "ahead of time; peak_mib: XLA memory analysis of that executable (arguments + outputs + temporaries).",
            "mamba_s / attention_s: one layer of each kind timed alone at the same shape, times the layer count; "
            "attention_share = attention_s / (mamba_s + attention_s).",
            "*_exponent: slope of log(time or memory) against log(seq_len) over the longer half of the sweep "
            "(1 = linear, 2 = quadratic).",
        ],
        plots={"scaling.png": lambda path: plot(rows, spec.describe(), path)},
        model=dict(source=spec.describe(), **model_summary(model)),
        workload=dict(
            batch=w.batch,
            seq_lens=lengths,
            dtype=w.dtype,
            weight_dtype=w.weight_dtype or w.dtype,
            ssd_impl=w.ssd_impl,
            rewriter=w.rewriter,
        ),
    )


def measure_length(model: Granite, batch: int, length: int, rewritten: bool, repeats: int, warmup: int, seed: int):
    """One row: whole-prefill time and memory, and the time of one layer of each kind, at this sequence length."""
    cfg = model.cfg
    tokens = jnp.asarray(random_tokens(cfg.vocab_size, batch, length, seed))
    prefill = jax.jit(maybe_rewritten(lambda mdl, t: mdl.forward(t, last_only=True)[0], rewritten))
    compiled = prefill.lower(model, tokens).compile()
    memory = compiled_memory(compiled)
    total = time_call(lambda: compiled(model, tokens), repeats=repeats, warmup=warmup)["median_s"]
    row: dict[str, Any] = dict(
        seq_len=length,
        prefill_s=total,
        tokens_per_s=batch * length / total,
        peak_mib=memory.get("peak_bytes", math.nan) / 2**20,
        temp_mib=memory.get("temp_bytes", math.nan) / 2**20,
    )
    x = jax.random.normal(jax.random.key(seed), (batch, length, cfg.hidden_size), model.dtype)
    for kind in (MAMBA, ATTENTION):
        count = cfg.layer_types.count(kind)
        if count == 0:
            row[f"{kind}_s"], row[f"{kind}_layer_temp_mib"] = 0.0, 0.0
            continue
        layer_s, layer_memory = time_layer(model, cfg.layer_types.index(kind), x, rewritten, repeats, warmup)
        row[f"{kind}_s"] = layer_s * count
        row[f"{kind}_layer_temp_mib"] = layer_memory.get("temp_bytes", math.nan) / 2**20
    layers_s = row["mamba_s"] + row["attention_s"]
    row["attention_share"] = row["attention_s"] / layers_s if layers_s > 0 else math.nan
    return row


def time_layer(model: Granite, index: int, x, rewritten: bool, repeats: int, warmup: int):
    """Median seconds and compiled memory of decoder layer `index` alone on input x (b, T, hidden), run as the model
    runs it (its `Runtime`)."""

    def layer_forward(layer, x):
        slots = jnp.arange(x.shape[1], dtype=jnp.int32)
        with ops.using(model.runtime):
            return layer(x, Positions(slots, jnp.zeros((x.shape[0],), jnp.int32)), None)[0]

    layer = model.layers[index]
    compiled = jax.jit(maybe_rewritten(layer_forward, rewritten)).lower(layer, x).compile()
    seconds = time_call(lambda: compiled(layer, x), repeats=repeats, warmup=warmup)["median_s"]
    return seconds, compiled_memory(compiled)


def growth_exponent(lengths, values) -> float:
    """Least-squares slope of log(value) against log(length) over the longer half of the points (at least two)."""
    pairs = [(n, v) for n, v in zip(lengths, values) if v and v > 0 and math.isfinite(v)]
    pairs = pairs[-max(2, (len(pairs) + 1) // 2) :]
    if len(pairs) < 2:
        return math.nan
    logs = np.log(np.asarray(pairs, np.float64))
    return float(np.polyfit(logs[:, 0], logs[:, 1], 1)[0])


def growth_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    lengths = [r["seq_len"] for r in rows]
    summary = {
        f"{name}_exponent": growth_exponent(lengths, [r[key] for r in rows])
        for name, key in (
            ("prefill_time", "prefill_s"),
            ("mamba_time", "mamba_s"),
            ("attention_time", "attention_s"),
            ("peak_memory", "peak_mib"),
            ("mamba_layer_memory", "mamba_layer_temp_mib"),
            ("attention_layer_memory", "attention_layer_temp_mib"),
        )
    }
    summary["attention_share_shortest"] = rows[0]["attention_share"]
    summary["attention_share_longest"] = rows[-1]["attention_share"]
    return summary


def plot(rows: list[dict[str, Any]], source: str, path: str) -> None:
    plt = matplotlib_pyplot()
    n = np.asarray([r["seq_len"] for r in rows], np.float64)
    fig, (t_ax, m_ax, s_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    for key, label, style in (
        ("prefill_s", "whole prefill", "k.-"),
        ("mamba_s", "Mamba layers", "o-"),
        ("attention_s", "attention layers", "s-"),
    ):
        values = np.asarray([r[key] for r in rows], np.float64)
        if np.any(values > 0):
            t_ax.plot(n, values, style, label=label)
    first = rows[0]["prefill_s"]
    t_ax.plot(n, first * n / n[0], ":", color="gray", label="linear from first point")
    t_ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="seconds")
    t_ax.set_title("prefill time")
    t_ax.legend(fontsize=8)
    m_ax.plot(n, [r["peak_mib"] for r in rows], "k.-", label="whole prefill (peak)")
    m_ax.plot(n, [r["mamba_layer_temp_mib"] for r in rows], "o-", label="one Mamba layer (temporaries)")
    m_ax.plot(n, [r["attention_layer_temp_mib"] for r in rows], "s-", label="one attention layer (temporaries)")
    m_ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="MiB")
    m_ax.set_title("compiled memory")
    m_ax.legend(fontsize=8)
    s_ax.plot(n, [100 * r["attention_share"] for r in rows], "s-", color="tab:green")
    s_ax.set(xscale="log", xlabel="sequence length", ylabel="% of layer time", ylim=(0, 100))
    s_ax.set_title("attention's share of layer time")
    for ax in (t_ax, m_ax, s_ax):
        ax.set_xticks(n, [str(int(v)) for v in n])
        ax.minorticks_off()
    fig.suptitle(source, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
