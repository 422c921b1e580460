"""Parity: per-layer error of granite-jax against transformers on the same weights and prompts.

One forward over `workload.batch` random prompts of `workload.seq_len` tokens in both; the measurement is
`granite_jax.compare.layer_errors` (the same one `python -m granite_jax.compare` prints).
"""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from granite_jax import compare
from granite_jax.experiments.common import Result, matplotlib_pyplot, model_spec, model_summary, random_tokens


def run(config) -> Result:
    w, m = config.workload, config.measure
    spec = model_spec(config)
    with tqdm(total=2, desc="parity", unit="step") as bar:
        bar.set_postfix_str("loading both models")
        pair = compare.load_workload_pair(spec, w)
        bar.update()
        bar.set_postfix_str("forward")
        tokens = random_tokens(pair.jax.cfg.vocab_size, w.batch, w.seq_len, config.model.seed)
        rows = compare.layer_errors(pair, tokens, rewritten=w.rewriter)
        bar.update()
    layers = [r for r in rows if r["layer"] != "logits"]
    worst = max(layers, key=lambda r: r["rel_err"])
    summary = dict(
        max_rel_err=worst["rel_err"],
        worst_layer=f"{worst['layer']} ({worst['kind']})",
        max_abs_err=max(r["max_abs_err"] for r in layers),
        logits_rel_err=rows[-1]["rel_err"],
        tolerance=m.tolerance,
        within_tolerance=worst["rel_err"] <= m.tolerance and rows[-1]["rel_err"] <= m.tolerance,
    )
    vs_f32 = ["jax_rel_err_vs_f32", "hf_rel_err_vs_f32"] if "jax_rel_err_vs_f32" in rows[0] else []
    summary |= {f"logits_{key}": rows[-1][key] for key in vs_f32}
    return Result(
        title=f"Parity with transformers: per-layer error ({w.dtype})",
        rows=rows,
        columns=["layer", "kind", "max_abs_err", "rel_err", "max_abs", *vs_f32],
        summary=summary,
        notes=[
            "rel_err = ||granite-jax - transformers|| / ||transformers|| over the layer output (batch x tokens x "
            "hidden); the last layer is compared after the final norm, as transformers reports it.",
            f"prompts: {w.batch} x {w.seq_len} random tokens (seed {config.model.seed}).",
            *(
                ["*_rel_err_vs_f32: each side's relative error against granite-jax in float32 on the same weights."]
                if vs_f32
                else []
            ),
        ],
        plots={"parity.png": lambda path: plot(rows, w.dtype, spec.describe(), path)},
        model=dict(source=spec.describe(), **model_summary(pair.jax)),
        workload=dict(
            batch=w.batch,
            seq_len=w.seq_len,
            dtype=w.dtype,
            weight_dtype=w.weight_dtype or w.dtype,
            ssd_impl=w.ssd_impl,
            rewriter=w.rewriter,
            torch_device=str(pair.hf.device),
        ),
    )


def plot(rows: list[dict[str, Any]], dtype: str, source: str, path: str) -> None:
    plt = matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    compare.plot_layer_errors(ax, rows, dtype)
    ax.set_title(f"granite-jax vs transformers, {dtype}\n{source}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
