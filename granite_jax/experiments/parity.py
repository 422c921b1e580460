"""Parity: per-layer error of granite-jax against transformers on the same weights and prompts.

One forward over `workload.batch` random prompts of `workload.seq_len` tokens in both; the measurement is
`granite_jax.compare.layer_errors` (the same one `python -m granite_jax.compare` prints).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from granite_jax import compare
from granite_jax.experiments.common import Result, matplotlib_pyplot, model_spec, model_summary, random_tokens

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def run(config) -> Result:
    w, m = config.workload, config.measure
    spec = model_spec(config)
    with tqdm(total=2, desc="parity", unit="step", disable=None) as bar:
        bar.set_postfix_str("loading both models")
        pair = compare.load_workload_pair(spec, w)
        bar.update()
        bar.set_postfix_str("forward")
        tokens = random_tokens(pair.jax.cfg.vocab_size, w.batch, w.seq_len, config.model.seed)
        rows = compare.layer_errors(pair, tokens, rewritten=w.rewriter)
        bar.update()
    vs_f32 = [key for key in compare.VS_FLOAT32 if key in rows[0]]
    return Result(
        title=f"Parity with transformers: per-layer error ({w.dtype})",
        rows=rows,
        columns=["layer", "kind", "max_abs_err", "rel_err", "max_abs", *vs_f32],
        summary=compare.error_summary(rows, m.tolerance),
        notes=[
            "rel_err = ||granite-jax - transformers|| / ||transformers|| over the layer output (batch x tokens x "
            "hidden); the last layer is compared after the final norm, as transformers reports it.",
            f"prompts: {w.batch} x {w.seq_len} random tokens (seed {config.model.seed}).",
            "max_rel_err and max_abs_err are over every row, the layers and the logits; within_tolerance is "
            "max_rel_err <= tolerance.",
            *(
                ["*_rel_err_vs_f32: each side's relative error against granite-jax in float32 on the same weights."]
                if vs_f32
                else []
            ),
        ],
        plots={"parity.png": lambda path: plot(rows, w.dtype, m.tolerance, spec.describe(), path)},
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


def plot(rows: list[dict[str, Any]], dtype: str, tolerance: float, source: str, path: str) -> None:
    """Save `figure(...)` to `path`."""
    fig = figure(rows, dtype, tolerance, source)
    fig.savefig(path, dpi=120)
    matplotlib_pyplot().close(fig)


def figure(rows: list[dict[str, Any]], dtype: str, tolerance: float, source: str) -> Figure:
    """`compare.plot_layer_errors` of the rows against `tolerance`, titled with the model's source."""
    fig, ax = matplotlib_pyplot().subplots(figsize=(8, 4.5))
    compare.plot_layer_errors(ax, rows, dtype, tolerance)
    fig.suptitle(f"granite-jax vs transformers: {source}", fontsize=10)
    fig.tight_layout()
    return fig
