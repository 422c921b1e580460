"""granite-jax side by side with the PyTorch stack: the same weights in transformers' GraniteMoeHybridForCausalLM.

    python -m granite_jax.compare --model DIR                         # a HF or orbax checkpoint directory
    python -m granite_jax.compare --config granite-4.0-h-350m         # random weights of a released shape

Prints one table: per-layer max and relative error of the hidden states, greedy continuation agreement, prefill and
decode speed of both and their ratios; saves compare.json and compare.png.

How each number is measured:
- Errors: one forward over random prompts in both; granite-jax's layer outputs (`forward(return_hidden=True)`)
  against transformers' `output_hidden_states` (whose last entry has the final norm applied, so ours does too), and
  the logits. Relative error is ||jax - hf|| / ||hf|| over the whole tensor. Below float32, each side is also set
  against granite-jax in float32 on the same weights, since two bfloat16 models differ by their rounding. The largest
  relative error, over the layers and the logits, is set against `parity_tolerance` (`error_summary`).
- Greedy agreement: each prompt is continued greedily by both (`Generator.generate` and `model.generate`), one prompt
  at a time; a row agrees up to its first differing token.
- Speed: greedy generation of exactly `new_tokens` tokens from `batch` random prompts of `prompt_len` tokens, best of
  `repeats` runs after a warm-up. Prefill: prompt in, first token on the host. Decode: the remaining tokens of every
  row over the remaining time. granite-jax times itself (`measure`: `Generator.generate`'s timing, compilation
  excluded); transformers is timed by a streamer that stamps each token as `generate` emits it.
- Devices: transformers runs where `--torch-device` says (auto: on the GPU when granite-jax runs on one).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from granite_jax import cli
from granite_jax.checkpoint import FLOAT8_NAME, export_safetensors, is_orbax_checkpoint, load_tokenizer, stored_dtype
from granite_jax.errors import InputError
from granite_jax.experiments.common import (
    ExperimentError,
    ModelSpec,
    environment,
    format_value,
    matplotlib_pyplot,
    model_summary,
    output_dir,
    random_tokens,
    resolve_torch_device,
    set_torch_threads,
    share_gpu_with_torch,
    torch_matmul_precision,
    write_json,
)
from granite_jax.generation import Generator, SamplingConfig, Timing
from granite_jax.model import Granite, with_dtype
from granite_jax.model import weight_dtype as model_weight_dtype
from granite_jax.ops import SSD_IMPLS

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PROMPTS = (
    "The Granite 4.0 models mix Mamba-2 layers with a few attention layers, so that",
    "def fibonacci(n):\n    ",
    "Three things to check before a long trip by car:",
    "Translate to French: The weather is nice today.",
)


# ---------------------------------------------------------------------------------------------- loading


@dataclasses.dataclass
class Pair:
    """The same weights in granite-jax and in transformers."""

    jax: Granite
    hf: Any  # transformers GraniteMoeHybridForCausalLM
    dtype: str
    source: str
    tokenizer: Any = None
    _generator: Any = None

    @property
    def generator(self):
        """granite-jax's `Generator` over the same model (created once, so compiled steps are reused)."""
        if self._generator is None:
            self._generator = make_generator(self.jax)
        return self._generator


def load_pair(
    spec: ModelSpec,
    *,
    dtype: str = "float32",
    weight_dtype: str | None = None,
    ssd_impl: str = "xla",
    torch_device: str = "cpu",
    mesh: str | None = None,
) -> Pair:
    """Load `spec` into granite-jax, then the same weights into transformers (see `hf_model`) on `torch_device`, both
    computing in `dtype`; granite-jax keeps its weights in `weight_dtype` (None: dtype), over `mesh` if given."""
    check_same_weights(dtype, weight_dtype)
    quiet_transformers()
    model = spec.load(dtype=dtype, weight_dtype=weight_dtype, ssd_impl=ssd_impl, mesh=mesh)
    hf = hf_model(model, spec.checkpoint, dtype).to(torch_device)
    return Pair(model, hf, dtype, spec.describe(), load_tokenizer(spec.checkpoint) if spec.checkpoint else None)


def load_workload_pair(spec: ModelSpec, workload: Any) -> Pair:
    """`load_pair` as an experiment's workload section asks: dtype, weight_dtype, ssd_impl and torch_device."""
    check_same_weights(workload.dtype, workload.weight_dtype, ("workload.dtype", "workload.weight_dtype"))
    return load_pair(
        spec,
        dtype=workload.dtype,
        weight_dtype=workload.weight_dtype,
        ssd_impl=workload.ssd_impl,
        torch_device=resolve_torch_device(workload.torch_device, "workload.torch_device"),
        mesh=workload.get("mesh"),
    )


def check_same_weights(dtype: str, weight_dtype: str | None, names: tuple[str, str] = ("dtype", "weight_dtype")):
    """ExperimentError (naming the two settings) where granite-jax would keep weights that `dtype` cannot hold exactly
    (wider, or float16 under bfloat16): transformers computes in `dtype` on the weights rounded to it, so the two
    would not compare the same weights. Names that are not float dtypes are left to `ModelSpec.load` to report."""
    try:
        rounded = weight_dtype not in (None, dtype) and jnp.finfo(dtype).bits <= jnp.finfo(weight_dtype).bits
    except (TypeError, ValueError):
        return
    if rounded:
        raise ExperimentError(
            f"{names[1]} {weight_dtype} with {names[0]} {dtype}: transformers would run on the weights rounded to "
            f"{dtype}, so the two would not compare the same weights; leave {names[1]} unset or set {names[0]} "
            f"{weight_dtype}"
        )


def hf_model(model: Granite, checkpoint: str | None, dtype: str):
    """transformers' model, computing in `dtype`, with the weights of `model`: read from `checkpoint` if it is a HF
    directory that gives the same values in `dtype` (the model's weights are in `dtype`, or in the dtype the checkpoint
    stores), else exported from `model` to a temporary HF directory first (e.g. float32 arithmetic on bfloat16 weights
    of a float32 checkpoint: transformers gets the rounded values)."""
    import torch
    from transformers import GraniteMoeHybridForCausalLM

    torch_dtype = getattr(torch, dtype)
    weights = model_weight_dtype(model)
    hf_directory = checkpoint and not is_orbax_checkpoint(checkpoint)
    if hf_directory and weights != FLOAT8_NAME and weights in (dtype, stored_dtype(checkpoint)):
        return GraniteMoeHybridForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype).eval()
    tmp = tempfile.mkdtemp(prefix="granite-jax-export-")
    try:  # written in the weights' own dtype (exact: `check_same_weights`), widened to `dtype` by from_pretrained;
        # float8 weights dequantized in float32 (exact), so transformers runs on the values they stand for
        export = "float32" if weights == FLOAT8_NAME else weights if isinstance(weights, str) else dtype
        export_safetensors(model, tmp, dtype=export)
        return GraniteMoeHybridForCausalLM.from_pretrained(tmp, dtype=torch_dtype).eval()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def quiet_transformers() -> None:
    """transformers warns on CPU that its fused kernels are missing; the comparison is with its reference path."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


# ---------------------------------------------------------------------------------------------- errors


def layer_errors(pair: Pair, tokens: np.ndarray, *, rewritten: bool = False) -> list[dict[str, Any]]:
    """Per-layer max absolute and relative error of granite-jax's hidden states (and logits) against transformers'.

    Below float32 the two differ by their rounding as much as by anything else, so each row also has each side's
    relative error against granite-jax in float32 on the same weights (`jax_rel_err_vs_f32`, `hf_rel_err_vs_f32`):
    whether either is further from the float32 result than the other. `rewritten`: run granite-jax's forward through
    `rewriter.rewrite`. Outputs stay where they were computed; one layer at a time goes to the host in float64."""
    ours = jax_layer_outputs(pair.jax, tokens, rewritten)
    theirs = hf_layer_outputs(pair.hf, tokens)
    reference = None
    if jnp.finfo(pair.jax.dtype).bits < 32:
        with jax.default_matmul_precision("highest"):
            reference = jax_layer_outputs(with_dtype(pair.jax, jnp.float32), tokens, rewritten)
    kinds = [*pair.jax.cfg.layer_types[:-1], pair.jax.cfg.layer_types[-1] + " + final norm", ""]
    labels = [*map(str, range(len(kinds) - 1)), "logits"]
    rows = []
    for i, (label, kind, a, b) in enumerate(zip(labels, kinds, ours, theirs, strict=True)):
        a, b = to_float64(a), to_float64(b)
        row = dict(layer=label, kind=kind, **_errors(a, b))
        if reference is not None:
            r = to_float64(reference[i])
            row |= dict(jax_rel_err_vs_f32=_relative(a, r), hf_rel_err_vs_f32=_relative(b, r))
        rows.append(row)
    return rows


def jax_layer_outputs(model: Granite, tokens: np.ndarray, rewritten: bool = False) -> list[jax.Array]:
    """granite-jax's output of every layer, the last after the final norm as transformers reports it, then the
    logits."""
    forward = jax.jit(maybe_rewritten(lambda m, t: m.forward(t, return_hidden=True), rewritten))
    logits, _, hidden = forward(model, jnp.asarray(tokens))
    return [*hidden[:-1], model.norm(hidden[-1]), logits]


def hf_layer_outputs(hf: Any, tokens: np.ndarray) -> list[Any]:
    """transformers' `output_hidden_states` after the embedding, then the logits (torch tensors on its device)."""
    import torch

    with torch.inference_mode():
        out = hf(torch_ids(hf, tokens), output_hidden_states=True)
    return [*out.hidden_states[1:], out.logits]


def to_float64(x: Any) -> np.ndarray:
    """A JAX array or a torch tensor (any device) on the host in float64."""
    if hasattr(x, "detach"):  # torch: to float32 where it lives (numpy has no bfloat16), then to the host
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, np.float64)


def maybe_rewritten(fn, rewritten: bool):
    """`rewriter.rewrite(fn)` when asked for, else `fn`."""
    if not rewritten:
        return fn
    import rewriter

    return rewriter.rewrite(fn)


def _errors(ours: np.ndarray, theirs: np.ndarray) -> dict[str, float]:
    return dict(
        max_abs_err=float(np.abs(ours - theirs).max()),
        rel_err=_relative(ours, theirs),
        max_abs=float(np.abs(theirs).max()),
    )


def _relative(a: np.ndarray, reference: np.ndarray) -> float:
    """||a - reference|| / ||reference|| over the whole tensor."""
    return float(np.linalg.norm(a - reference) / max(np.linalg.norm(reference), 1e-30))


def parity_tolerance(dtype: str) -> float:
    """The largest relative error accepted as parity when both compute in `dtype`: the parity experiment's
    `measure.tolerance` (1e-4) in float32 and wider, and the ~3e-2 it advises below, where two models differ by their
    rounding."""
    return 1e-4 if jnp.finfo(dtype).bits >= 32 else 3e-2


VS_FLOAT32 = ("jax_rel_err_vs_f32", "hf_rel_err_vs_f32")  # below float32, each side against float32


def error_summary(rows: list[dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """The headline numbers of `layer_errors`' rows. Each maximum is taken over every row, the layers and the logits,
    so that it is never below a row it summarises; `within_tolerance` is read off `max_rel_err` alone."""
    worst = max(rows, key=lambda r: r["rel_err"])
    logits = rows[-1]
    summary = dict(
        max_rel_err=worst["rel_err"],
        worst_layer=row_label(worst),
        logits_rel_err=logits["rel_err"],
        tolerance=tolerance,
        within_tolerance=worst["rel_err"] <= tolerance,
        max_abs_err=max(r["max_abs_err"] for r in rows),
    )
    return summary | {f"logits_{key}": logits[key] for key in VS_FLOAT32 if key in logits}


def row_label(row: dict[str, Any]) -> str:
    """'logits', or 'layer i (kind)'."""
    return "logits" if row["layer"] == "logits" else f"layer {row['layer']} ({row['kind']})"


# ---------------------------------------------------------------------------------------------- greedy agreement


def greedy_agreement(pair: Pair, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict[str, Any]:
    """Continue each prompt greedily in both; count the tokens each row agrees on before the first difference.

    granite-jax runs the prompts as one left-padded batch (padding never reaches a real token); transformers runs
    them one at a time, so that its padding handling plays no part."""
    ours = [r.token_ids for r in pair.generator.generate([list(p) for p in prompts], greedy(new_tokens))]
    rows = []
    for ids, mine in zip(prompts, ours):
        theirs = hf_generate(pair.hf, np.asarray([ids]), new_tokens)[0][len(ids) :].tolist()
        rows.append(dict(prompt_tokens=len(ids), agree=leading_agreement(mine, theirs), jax=list(mine), hf=theirs))
    total = sum(len(r["jax"]) for r in rows)
    agreed = sum(r["agree"] for r in rows)
    return dict(
        new_tokens=new_tokens, prompts=len(rows), agreed=agreed, total=total, fraction=agreed / total, rows=rows
    )


def leading_agreement(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens two continuations agree on before their first difference."""
    return next((i for i, (s, t) in enumerate(zip(a, b)) if s != t), min(len(a), len(b)))


def agreement_prompts(pair: Pair, n: int, length: int, seed: int) -> list[list[int]]:
    """The built-in text prompts when the checkpoint has a tokenizer, else random token ids."""
    if pair.tokenizer is not None:
        return [pair.tokenizer(p)["input_ids"] for p in PROMPTS[:n]]
    return random_tokens(pair.jax.cfg.vocab_size, n, length, seed).tolist()


def greedy(new_tokens: int) -> SamplingConfig:
    """Greedy sampling of exactly `new_tokens` tokens: no stop token ends a row early."""
    return SamplingConfig(max_new_tokens=new_tokens, stop_token_ids=())


def make_generator(model: Granite) -> Generator:
    """granite-jax's `Generator` over `model` as it is (its dtype, weights and runtime)."""
    return Generator(model=model, dtype=str(jnp.dtype(model.dtype)), mesh=model.runtime.mesh)


def hf_generate(hf, tokens: np.ndarray, new_tokens: int, streamer=None) -> np.ndarray:
    """transformers' greedy generation of exactly `new_tokens` tokens (no stop token), prompt included."""
    import torch
    from transformers import GenerationConfig

    ids = torch_ids(hf, tokens)
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=None
    )
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=streamer)
    return out.cpu().numpy()


def torch_ids(hf: Any, tokens: np.ndarray) -> Any:
    """Token ids as an int64 tensor on the device of transformers' model."""
    import torch

    return torch.from_numpy(np.asarray(tokens, np.int64)).to(hf.device)


# ---------------------------------------------------------------------------------------------- speed


def measure(generator: Generator, batch_size: int, prompt_len: int, new_tokens: int, seed: int = 0) -> Timing:
    """The timing of greedy generation of exactly `new_tokens` tokens for `batch_size` random prompts of `prompt_len`
    tokens (drawn under `seed`): compilation excluded, and reported apart."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, generator.cfg.vocab_size, (batch_size, prompt_len)).tolist()
    return generator.generate(prompts, greedy(new_tokens))[0].timing


def jax_speed(generator, batch: int, prompt_len: int, new_tokens: int, repeats: int = 2) -> dict[str, float]:
    """granite-jax generation timing (compilation excluded): best of `repeats` after one warm-up."""
    warm = measure(generator, batch, prompt_len, new_tokens)
    timings = [measure(generator, batch, prompt_len, new_tokens, seed=i + 1) for i in range(repeats)]
    return _best(
        [(t.prefill_s, t.decode_s, t.prompt_tokens, t.decode_tokens) for t in timings], compile_s=warm.compile_s
    )


def hf_speed(hf, vocab_size: int, batch: int, prompt_len: int, new_tokens: int, repeats: int = 2) -> dict[str, float]:
    """transformers generation timing from per-token timestamps: best of `repeats` after one short warm-up."""
    hf_generate(hf, random_tokens(vocab_size, batch, prompt_len, 0), 2)
    runs = []
    for i in range(repeats):
        clock = _TokenClock()
        hf_generate(hf, random_tokens(vocab_size, batch, prompt_len, i + 1), new_tokens, streamer=clock)
        prefill_s, decode_s = clock.split()
        runs.append((prefill_s, decode_s, batch * prompt_len, batch * (new_tokens - 1)))
    return _best(runs)


class _TokenClock:
    """A transformers streamer that records when the prompt, each new token and the end are emitted."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        self.times.append(time.perf_counter())

    def split(self) -> tuple[float, float]:  # (prompt -> first token, first token -> last token)
        return self.times[1] - self.times[0], self.times[-2] - self.times[1]


def _best(runs: Sequence[tuple[float, float, int, int]], **extra: float) -> dict[str, float]:
    prefill_s = min(r[0] for r in runs)
    decode_s = min(r[1] for r in runs)
    prompt_tokens, decode_tokens = runs[0][2], runs[0][3]
    return dict(
        prefill_s=prefill_s,
        decode_s=decode_s,
        prefill_tokens_per_s=prompt_tokens / prefill_s,
        decode_tokens_per_s=decode_tokens / decode_s if decode_tokens and decode_s > 0 else float("nan"),
        **extra,
    )


def speed(
    pair: Pair, batch_sizes: Sequence[int], prompt_len: int, new_tokens: int, repeats: int = 2, log=None
) -> list[dict[str, Any]]:
    """Prefill and decode tokens/s of granite-jax and (unless `pair.hf` is None) transformers, and the speed-ups, at
    each batch size."""
    rows = []
    for batch in batch_sizes:
        _log(log, f"speed: granite-jax, batch {batch}")
        ours = jax_speed(pair.generator, batch, prompt_len, new_tokens, repeats)
        row = dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, jax=ours)
        if pair.hf is not None:
            _log(log, f"speed: transformers, batch {batch}")
            theirs = hf_speed(pair.hf, pair.jax.cfg.vocab_size, batch, prompt_len, new_tokens, repeats)
            row |= dict(
                hf=theirs,
                prefill_speedup=ours["prefill_tokens_per_s"] / theirs["prefill_tokens_per_s"],
                decode_speedup=ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
            )
        rows.append(row)
    return rows


def _log(log, message: str) -> None:
    if log is not None:
        log(message)


# ---------------------------------------------------------------------------------------------- the comparison


@dataclasses.dataclass(frozen=True)
class Options:
    error_batch: int = 2
    error_len: int = 320  # crosses a 256-token SSD chunk boundary
    agreement_prompts: int = 4
    agreement_len: int = 16
    agreement_tokens: int = 32
    batch_sizes: tuple[int, ...] = (1, 8)
    prompt_len: int = 512
    new_tokens: int = 32
    repeats: int = 2
    seed: int = 0
    skip_speed: bool = False


def run_compare(pair: Pair, options: Options, log=None) -> dict[str, Any]:
    """Every number of the comparison, as a JSON-ready dict."""
    cfg = pair.jax.cfg
    _log(log, "per-layer errors")
    tokens = random_tokens(cfg.vocab_size, options.error_batch, options.error_len, options.seed)
    errors = layer_errors(pair, tokens)
    _log(log, "greedy agreement")
    prompts = agreement_prompts(pair, options.agreement_prompts, options.agreement_len, options.seed + 1)
    agreement = greedy_agreement(pair, prompts, options.agreement_tokens)
    speeds = (
        []
        if options.skip_speed
        else speed(pair, options.batch_sizes, options.prompt_len, options.new_tokens, options.repeats, log)
    )
    return dict(
        model=pair.source,
        dtype=pair.dtype,
        summary=model_summary(pair.jax),
        options=dataclasses.asdict(options),
        layer_errors=errors,
        error_summary=error_summary(errors, parity_tolerance(pair.dtype)),
        greedy=agreement,
        speed=speeds,
        environment=environment() | _torch_environment(pair.hf),
    )


def _torch_environment(hf: Any) -> dict[str, Any]:
    import importlib.util

    import torch
    import transformers

    env = dict(torch=torch.__version__, torch_threads=torch.get_num_threads(), transformers=transformers.__version__)
    env |= dict(torch_device=str(hf.device))
    if hf.device.type == "cuda":
        env |= dict(torch_device_name=torch.cuda.get_device_name(hf.device))
    # transformers takes its fused Mamba kernels from these packages when installed, else runs its torch path
    return env | {name: importlib.util.find_spec(name) is not None for name in ("mamba_ssm", "causal_conv1d")}


def table(results: dict[str, Any]) -> str:
    """The comparison as one Markdown table: measure | granite-jax | transformers | result."""
    jax_on, torch_on = results["environment"].get("backend", "?"), results["environment"].get("torch_device", "cpu")
    lines = [f"| measure | granite-jax ({jax_on}) | transformers ({torch_on}) | result |", "|---|---|---|---|"]
    for row in results["layer_errors"]:
        result = f"max {format_value(row['max_abs_err'])}, rel {format_value(row['rel_err'])}"
        ours, theirs = _vs_float32_cell(row, "jax"), _vs_float32_cell(row, "hf")
        lines.append(f"| {row_label(row)}: max abs / rel error |{ours}|{theirs}| {result} |")
    lines.append(_tolerance_line(results["error_summary"]))
    g = results["greedy"]
    lines.append(
        f"| greedy agreement ({g['prompts']} prompts x {g['new_tokens']} tokens) | | | "
        f"{g['agreed']}/{g['total']} tokens ({100 * g['fraction']:.1f}%) |"
    )
    for s in results["speed"]:
        shape = f"batch {s['batch']}, {s['prompt_len']} tokens"
        lines.append(_speed_line(f"prefill tok/s ({shape})", s, "prefill"))
        lines.append(_speed_line(f"decode tok/s (batch {s['batch']}, {s['new_tokens']} new)", s, "decode"))
    return "\n".join(lines) + "\n"


def _vs_float32_cell(row: dict[str, Any], side: str) -> str:
    """Below float32: one side's relative error against float32, for its column of the table (blank otherwise)."""
    key = f"{side}_rel_err_vs_f32"
    return f" rel {format_value(row[key])} vs float32 " if key in row else " "


def _tolerance_line(summary: dict[str, Any]) -> str:
    verdict = "within" if summary["within_tolerance"] else "over"
    return (
        f"| max relative error (worst: {summary['worst_layer']}) | | | {format_value(summary['max_rel_err'])}, "
        f"{verdict} tolerance {format_value(summary['tolerance'])} |"
    )


def _speed_line(label: str, s: dict[str, Any], phase: str) -> str:
    ours, theirs = s["jax"][f"{phase}_tokens_per_s"], s["hf"][f"{phase}_tokens_per_s"]
    return f"| {label} | {ours:.1f} | {theirs:.1f} | {s[f'{phase}_speedup']:.2f}x |"


# One colour per meaning in every panel: each side's own colour wherever that side is drawn (its speed, its error
# against float32), one for the difference between the two, one for the tolerance.
COLORS = dict(jax="tab:blue", hf="tab:orange", difference="tab:gray", tolerance="tab:red")
SIDES = dict(jax="granite-jax", hf="transformers")


def plot(results: dict[str, Any], path: str) -> str:
    """Save `figure(results)` to `path`."""
    fig = figure(results)
    fig.savefig(path, dpi=120)
    matplotlib_pyplot().close(fig)
    return path


def figure(results: dict[str, Any]) -> Figure:
    """Left: relative error per layer and of the logits, against the tolerance. Right, when measured: tokens/s of both,
    with the speed-ups."""
    plt = matplotlib_pyplot()
    if results["speed"]:
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
        plot_speed(right, results["speed"])
    else:
        fig, left = plt.subplots(figsize=(7, 4.5))
    plot_layer_errors(left, results["layer_errors"], results["dtype"], results["error_summary"]["tolerance"])
    fig.suptitle(results["model"], fontsize=10)
    fig.tight_layout()
    return fig


def plot_layer_errors(ax: Axes, rows: list[dict[str, Any]], dtype: str, tolerance: float) -> None:
    """Bars of each layer's and the logits' relative error, granite-jax against transformers, under the tolerance
    line; below float32, each side's relative error against float32 as a line in that side's colour."""
    x = np.arange(len(rows))
    errors = [r["rel_err"] for r in rows]
    ax.bar(x, errors, color=COLORS["difference"], label="granite-jax vs transformers")
    measured = [side for side in SIDES if f"{side}_rel_err_vs_f32" in rows[0]]
    vs_f32 = {side: [r[f"{side}_rel_err_vs_f32"] for r in rows] for side in measured}
    for (side, values), marker in zip(vs_f32.items(), "^v"):
        ax.plot(x, values, marker=marker, ms=4, color=COLORS[side], label=SIDES[side])
    ax.axhline(tolerance, color=COLORS["tolerance"], ls="--", label=f"tolerance {format_value(tolerance)}")
    # Linear from 0, so a bar's height is its error and the tolerance line is the scale it reads against: on a log
    # axis the bars' heights depend on where the axis starts, and errors far below the tolerance draw as tall bars.
    ax.set_ylim(0, 1.15 * max(tolerance, *errors, *(v for values in vs_f32.values() for v in values)))
    ax.set_xticks(x, [_tick_label(r) for r in rows], fontsize=7 if len(rows) > 16 else 9)
    ax.set(xlabel="layer (M: Mamba, A: attention)", ylabel="relative error")
    worst = max(errors)
    ratio = f" ({worst / tolerance:.2g} x tolerance)" if tolerance > 0 else ""  # measure.tolerance may be 0
    ax.set_title(f"error per layer, {dtype}: max {format_value(worst)}{ratio}")
    ax.legend(fontsize=8, title="lines: each side vs float32" if vs_f32 else None, title_fontsize=8)


def _tick_label(row: dict[str, Any]) -> str:
    """'logits', or the layer's index over M (Mamba) or A (attention)."""
    if row["layer"] == "logits":
        return "logits"
    return f"{row['layer']}\n{'A' if row['kind'].startswith('attention') else 'M'}"


def plot_speed(ax: Axes, speeds: list[dict[str, Any]]) -> None:
    """Grouped bars of prefill and decode tokens/s per batch size, granite-jax (annotated with the speed-up) and
    transformers when measured."""
    labels, ours, theirs, ratios = [], [], [], []
    for s in speeds:
        for phase in ("prefill", "decode"):
            labels.append(f"{phase}\nbatch {s['batch']}")
            ours.append(s["jax"][f"{phase}_tokens_per_s"])
            theirs.append(s["hf"][f"{phase}_tokens_per_s"] if s.get("hf") else np.nan)
            ratios.append(s.get(f"{phase}_speedup"))
    x = np.arange(len(labels))
    with_hf = not np.all(np.isnan(theirs))
    width = 0.4 if with_hf else 0.6
    ax.bar(x - (0.2 if with_hf else 0), ours, width, color=COLORS["jax"], label=SIDES["jax"])
    if with_hf:
        ax.bar(x + 0.2, theirs, width, color=COLORS["hf"], label=SIDES["hf"])
        for xi, y, r in zip(x, ours, ratios):
            ax.annotate(f"{r:.1f}x", (xi - 0.2, y), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(x, labels)
    ax.set_yscale("log")
    ax.set(ylabel="tokens / s")
    ax.set_title("speed (greedy generation)")
    ax.legend(fontsize=8)


# ---------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m granite_jax.compare",
        description="Load the same weights into transformers' GraniteMoeHybridForCausalLM and into granite-jax, run "
        "the same prompts, and print one table: per-layer max and relative error, greedy continuation agreement, "
        "prefill and decode speed of both and the ratios. Saves compare.json and compare.png.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="DIR", help="checkpoint directory: Hugging Face safetensors or orbax")
    source.add_argument(
        "--config",
        metavar="NAME",
        help="random weights of an architecture: a released name (granite-4.0-h-350m, h-tiny, ...), 'tiny', "
        "or a configs/models/*.py file",
    )
    p.add_argument(
        "--num-layers", type=cli.positive_int, help="with --config: this many layers, same share of attention layers"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default 0)")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="both models' dtype (default: float32)"
    )
    p.add_argument(
        "--weight-dtype",
        choices=("float32", "bfloat16", FLOAT8_NAME),
        help="granite-jax's weights (default: --dtype); bfloat16 with --dtype float32 computes in float32 on the "
        "weights as stored, half the memory; transformers still runs in --dtype, on the same values (no wider than "
        "--dtype). float8: the matrices quantized to float8 with per-channel scales; transformers runs on their "
        "dequantized values (the default for a float8 checkpoint)",
    )
    p.add_argument("--ssd-impl", default="xla", choices=SSD_IMPLS, help="granite-jax's SSD (`Runtime(ssd=...)`, xla)")
    p.add_argument(
        "--batch-sizes",
        type=cli.positive_ints,
        default="1,8",
        help="comma-separated batch sizes for the speed rows (1,8)",
    )
    p.add_argument(
        "--prompt-len", type=cli.positive_int, default=512, help="prompt tokens per row for the speed rows (512)"
    )
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per row for the speed rows (32)")
    p.add_argument("--repeats", type=cli.positive_int, default=2, help="timed runs per measurement, best kept (2)")
    p.add_argument(
        "--error-len", type=cli.positive_int, default=320, help="prompt length of the per-layer error check (320)"
    )
    p.add_argument(
        "--agreement-tokens", type=cli.positive_int, default=32, help="greedy tokens per prompt compared (32)"
    )
    p.add_argument("--no-speed", action="store_true", help="skip the speed rows (errors and agreement only)")
    p.add_argument("--out", metavar="DIR", help="where to write compare.json and compare.png (runs/compare-...)")
    p.add_argument(
        "--torch-threads",
        type=int,
        help="torch.set_num_threads for transformers (default: torch's own, one per core); 1 avoids its thread "
        "pool spinning when other processes share the cores",
    )
    p.add_argument(
        "--torch-device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where transformers runs (default auto: CUDA when granite-jax runs on a GPU and torch sees one, else "
        "CPU). With CUDA, JAX allocates GPU memory as needed instead of preallocating, so both fit",
    )
    p.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    cli.add_cache_argument(p)
    return p


def options_from_args(args: argparse.Namespace) -> Options:
    if args.new_tokens < 2:
        raise ExperimentError(f"--new-tokens: must be >= 2 (the first token is prefill's), got {args.new_tokens}")
    if args.seed < 0:
        raise ExperimentError(f"--seed: must be >= 0, got {args.seed}")
    check_same_weights(args.dtype, args.weight_dtype, ("--dtype", "--weight-dtype"))
    return Options(
        error_len=args.error_len,
        agreement_tokens=args.agreement_tokens,
        batch_sizes=tuple(args.batch_sizes),
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        seed=args.seed,
        skip_speed=args.no_speed,
    )


def _default_out(args: argparse.Namespace) -> str:
    name = os.path.basename(os.path.normpath(args.model)) if args.model else args.config
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    return os.path.join("runs", f"compare-{slug}-{time.strftime('%Y%m%d-%H%M%S')}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    log = None if args.quiet else (lambda m: print(f"[{time.perf_counter() - start:6.1f}s] {m}", file=sys.stderr))
    try:
        if args.model and args.num_layers is not None:
            raise ExperimentError("--num-layers applies to --config (random weights) only")
        options = options_from_args(args)
        cli.use_compilation_cache(args.compilation_cache)
        set_torch_threads(args.torch_threads, "--torch-threads")
        if args.torch_device != "cpu":
            share_gpu_with_torch()  # before resolve_torch_device starts JAX's backend
        torch_device = resolve_torch_device(args.torch_device)
        out = args.out or _default_out(args)
        with output_dir(out, "--out"):  # a failed run leaves no empty directory behind
            spec = ModelSpec(checkpoint=args.model, name=args.config, num_layers=args.num_layers, seed=args.seed)
            _log(log, f"loading {spec.describe()} into granite-jax and transformers")
            with torch_matmul_precision(args.dtype):
                pair = load_pair(
                    spec,
                    dtype=args.dtype,
                    weight_dtype=args.weight_dtype,
                    ssd_impl=args.ssd_impl,
                    torch_device=torch_device,
                )
                results = run_compare(pair, options, log)
    except InputError as e:  # ExperimentError, ConfigError, CheckpointError, GenerationError
        print(f"granite_jax.compare: error: {e}", file=sys.stderr)
        return 2
    results["command"] = "python -m granite_jax.compare " + " ".join(sys.argv[1:] if argv is None else argv)
    write_json(os.path.join(out, "compare.json"), results)
    plot(results, os.path.join(out, "compare.png"))
    print(f"{results['model']} ({results['dtype']}, {results['summary']['num_params'] / 1e6:.1f}M parameters)\n")
    print(table(results))
    print(f"wrote {out}/compare.json and compare.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
