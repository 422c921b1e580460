"""`train(config)`: the training run behind `python -m granite_jax.train`.

A run lives in its output directory: the config it was started with (config.json), the tokenizer, the tokenized
splits, orbax checkpoints of (parameters, optimizer state) every `checkpoint.every` steps (the last
`checkpoint.keep`), metrics.jsonl, loss.png, and at the end the trained model as a Hugging Face directory (model/)
and summary.json. Started again with the same config, a run resumes from its last checkpoint: the batches of a step
are a function of the seed and the step (`data.Sampler`), so a run killed at any moment and resumed ends with the
parameters of the run that was never stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import config_dict

from granite_jax.checkpoint import DTYPES, WEIGHT_DTYPES, export_safetensors, load_model, load_tokenizer
from granite_jax.config import ModelConfig
from granite_jax.errors import InputError
from granite_jax.model import Granite, count_params
from granite_jax.ops import Runtime
from granite_jax.presets import RELEASED
from granite_jax.system import free_memory
from granite_jax.training import corpus, data, quality, report, step
from granite_jax.training.config import base_config
from granite_jax.training.tokenizer import SPECIAL_TOKENS, train_bpe

# Fields a resumed run may change: how often it evaluates, checkpoints, logs and what it exports. Any other change
# would make the resumed run differ from the one it continues.
RESUMABLE_CHANGES = ("eval", "checkpoint", "log_every", "export", "memory_gb")


@dataclasses.dataclass
class Run:
    """What a run trains: the model split into graph and parameters, its tokenizer, and the token streams."""

    model: Granite
    tokenizer: Any
    train_files: list[str]
    held_out_files: list[str]
    train_tokens: np.ndarray
    held_out_tokens: np.ndarray


def train(config: config_dict.ConfigDict, *, progress: bool | None = None) -> dict[str, Any]:
    """Train (or resume) the run `config` describes; returns its summary (also written to summary.json)."""
    check_values(config)
    out = os.path.abspath(config.output_dir)
    os.makedirs(out, exist_ok=True)
    check_resumable(config, out)
    run = prepare(config, out)
    rows, micro = config.batch.rows, config.batch.micro
    graphdef, params = nnx.split(run.model)
    o = config.optimizer
    lr = step.schedule(o.learning_rate, o.warmup_steps, config.steps, o.final_lr_ratio)
    tx = step.optimizer(lr, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, clip_norm=o.clip_norm)
    opt_state = tx.init(params)
    train_step = check_memory(step.make_train_step(graphdef, tx), params, opt_state, config)
    eval_step = step.make_eval_step(graphdef)

    manager = checkpoints(out, config)
    start = manager.latest_step() or 0
    if start:
        params, opt_state = restore(manager, start, params, opt_state)
    sampler = data.Sampler(run.train_tokens, config.data.seq_len, config.seed, run.tokenizer.pad_token_id)
    log = report.MetricsLog(os.path.join(out, "metrics.jsonl"), keep_through=start)
    eval_rows = data.windows(run.held_out_tokens, config.data.seq_len, 0, run.tokenizer.pad_token_id)
    bar = report.Progress(config.steps, start, enabled=progress)
    done, window = start, report.Window()
    try:
        for s in range(start, config.steps):
            batch = sampler.batch(s, rows).reshaped(rows // micro, micro)
            params, opt_state, metrics = train_step(params, opt_state, batch.inputs, batch.targets, batch.mask)
            done = s + 1
            window.add(float(batch.mask.sum()))
            if done % config.log_every == 0 or done == config.steps:
                metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
                log.write(dict(step=done, **metrics, lr=float(lr(s)), tokens_per_s=window.rate()))
                bar.show(done, metrics["loss"], window.rate())
                window.reset()
            if config.eval.every and (done % config.eval.every == 0 or done == config.steps):
                held = held_out_loss(eval_step, params, eval_rows, micro, config.eval.batches)
                log.write(dict(step=done, held_out_loss=held))
                report.plot_losses(log.rows, os.path.join(out, "loss.png"))
                window.reset()
            if manager.should_save(done) or done == config.steps:
                manager.save(done, args=_save_args(params, opt_state), force=done == config.steps)
                window.reset()
    except KeyboardInterrupt:
        manager.wait_until_finished()
        saved = manager.latest_step() or 0
        raise KeyboardInterrupt(f"interrupted at step {done}; "
                                f"the checkpoint of step {saved} resumes with the same command") from None  # fmt: skip
    finally:
        bar.close()
    manager.wait_until_finished()
    return finish(config, out, run, graphdef, params, eval_step, log)


# ---------------------------------------------------------------------------------------------- setting up


def prepare(config: config_dict.ConfigDict, out: str) -> Run:
    """The run's tokenizer, splits and model (fresh from the seed, or the checkpoint `init_from`)."""
    files = corpus.matched_files(config.data.train, "data.train", config.data.exclude)
    if config.data.held_out:
        held_files = corpus.matched_files(config.data.held_out, "data.held_out", config.data.exclude)
        train_files = sorted(set(files) - set(held_files))
    else:
        train_files, held_files = corpus.split_files(files, config.data.held_out_fraction)
    tokenizer = run_tokenizer(config, out, train_files)
    eos = tokenizer.eos_token_id
    train_tokens = data.cached_tokens(os.path.join(out, "train.npy"), train_files, tokenizer, eos)
    held_tokens = data.cached_tokens(os.path.join(out, "held_out.npy"), held_files, tokenizer, eos)
    if len(held_tokens) < 2:
        raise InputError(f"data.held_out: the held-out files hold {len(held_tokens)} tokens")
    model = build_model(config, tokenizer)
    check_seq_len(config.data.seq_len, model.cfg)
    return Run(model, tokenizer, train_files, held_files, train_tokens, held_tokens)


def check_values(config: config_dict.ConfigDict) -> None:
    """InputError naming the first field whose value cannot drive a run (types are checked by the command line)."""
    minimums = {"steps": 1, "log_every": 1, "batch.rows": 1, "batch.micro": 1, "checkpoint.every": 1,
                "checkpoint.keep": 1, "eval.every": 0, "eval.batches": 0, "eval.headers": 0, "eval.max_new_tokens": 1,
                "tokenizer.vocab_size": 256 + len(SPECIAL_TOKENS), "optimizer.warmup_steps": 0}  # fmt: skip
    for name, low in minimums.items():
        value = _field(config, name)
        if value < low:
            raise InputError(f"{name}: expected an integer >= {low}, got {value}")
    if config.batch.rows % config.batch.micro:
        raise InputError(f"batch.micro: {config.batch.micro} does not divide batch.rows={config.batch.rows}")
    if not 0 < config.data.held_out_fraction < 1:
        raise InputError(f"data.held_out_fraction: expected a number in (0, 1), got {config.data.held_out_fraction}")
    if not config.optimizer.learning_rate > 0:
        raise InputError(f"optimizer.learning_rate: expected a positive number, got {config.optimizer.learning_rate}")


def _field(config: config_dict.ConfigDict, name: str) -> Any:
    for part in name.split("."):
        config = config[part]
    return config


def run_tokenizer(config: config_dict.ConfigDict, out: str, train_files: list[str]):
    """The checkpoint's tokenizer when fine-tuning, `tokenizer.path`'s when given, else a byte-level BPE trained on
    the training split (once: a resumed run reads it back from the output directory)."""
    source = config.init_from or config.tokenizer.path
    if source:
        tokenizer = load_tokenizer(source)
        if tokenizer is None:
            field = "init_from" if config.init_from else "tokenizer.path"
            raise InputError(f"{field}: {source} has no tokenizer files (tokenizer.json, tokenizer_config.json)")
    else:
        saved = os.path.join(out, "tokenizer")
        tokenizer = load_tokenizer(saved) if os.path.isdir(saved) else None
        if tokenizer is None:
            texts = (corpus.read_text(f) for f in train_files)
            partial = _fresh_dir(saved)
            tokenizer = train_bpe(texts, config.tokenizer.vocab_size, partial, progress=_terminal())
            os.replace(partial, saved)
    if tokenizer.pad_token_id is None:  # Granite's released tokenizers name a pad token; a text file's may not
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(config: config_dict.ConfigDict, tokenizer) -> Granite:
    """The model to train, under a differentiable runtime: the "xla" SSD (the Pallas kernels are forward-only) and
    no platform kernels, each decoder layer rematerialised if `model.remat`."""
    runtime = Runtime(ssd="xla", kernels=False, remat=config.model.remat)
    dtype, weights = config.model.dtype, config.model.param_dtype
    for field, name, names in (("model.dtype", dtype, DTYPES), ("model.param_dtype", weights, WEIGHT_DTYPES)):
        if name not in names or name == "float8":
            raise InputError(f"{field}: {name!r} is not one of float32, bfloat16")
    if config.init_from:
        return load_model(config.init_from, dtype=dtype, weight_dtype=weights, runtime=runtime)
    cfg = model_config(config.model, tokenizer)
    return Granite(cfg, dtype=DTYPES[dtype], param_dtype=WEIGHT_DTYPES[weights], runtime=runtime,
                   rngs=nnx.Rngs(config.seed))  # fmt: skip


def model_config(section: config_dict.ConfigDict, tokenizer) -> ModelConfig:
    """The architecture: the released model `preset` names (or none), updated by the config.json fields in
    `model.hf`; the vocabulary and special tokens are the tokenizer's."""
    if section.preset and section.preset not in RELEASED:
        raise InputError(f"model.preset: {section.preset!r} is not one of '', {', '.join(RELEASED)}")
    fields = dict(RELEASED.get(section.preset, {})) | section.hf.to_dict()
    fields |= dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                   bos_token_id=None)  # fmt: skip
    return ModelConfig.from_hf_dict(fields, source="model.hf")


def check_seq_len(seq_len: int, cfg: ModelConfig) -> None:
    if not 2 <= seq_len <= cfg.max_position_embeddings:
        raise InputError(
            f"data.seq_len: {seq_len} is not a length the model takes (2 to its max_position_embeddings, "
            f"{cfg.max_position_embeddings})"
        )


def check_memory(train_step, params, opt_state, config: config_dict.ConfigDict):
    """The step compiled for the configured batch (what training runs: compiled once), refused when it needs more
    memory than there is (`memory_gb`, or what the device has free), saying which micro-batch fits."""
    limit = config.memory_gb * 2**30 if config.memory_gb else free_memory()
    step = _compiled(train_step, params, opt_state, config.batch.micro, config)
    need = _step_bytes(step)
    if limit is None or need is None or need <= limit:
        return step
    bytes_of = lambda m: _step_bytes(_compiled(train_step, params, opt_state, m, config)) or 0  # noqa: E731
    fits = largest_fitting_micro(bytes_of, config.batch.micro, config.batch.rows, limit)
    advice = (
        f"batch.micro={fits} fits (keep batch.rows={config.batch.rows}: the rest is accumulated)"
        if fits
        else "not even one row fits: shorten data.seq_len, or set model.remat=True or model.param_dtype=bfloat16"
    )
    raise InputError(
        f"batch.micro: a step of {config.batch.micro} rows of {config.data.seq_len} tokens needs "
        f"{need / 2**30:.2f} GiB, {limit / 2**30:.2f} GiB available; {advice}"
    )


def largest_fitting_micro(step_bytes, micro: int, rows: int, limit: float) -> int | None:
    """The largest micro-batch below `micro` that divides `rows` and whose step needs at most `limit` bytes, or
    None: one row tried first (a batch nothing fits costs one compilation more), then a bisection (memory grows with
    the micro-batch), so a few compilations, not one for each candidate."""
    candidates = [m for m in range(1, micro) if rows % m == 0]
    if not candidates or step_bytes(1) > limit:
        return None
    best, lo, hi = 1, 1, len(candidates) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if step_bytes(candidates[mid]) <= limit:
            best, lo = candidates[mid], mid + 1
        else:
            hi = mid - 1
    return best


def _compiled(train_step, params, opt_state, micro: int, config: config_dict.ConfigDict):
    """The jitted step compiled for batches of `micro` rows a pass."""
    rows = jax.ShapeDtypeStruct((config.batch.rows // micro, micro, config.data.seq_len), jnp.int32)
    mask = jax.ShapeDtypeStruct(rows.shape, jnp.float32)
    return train_step.lower(params, opt_state, rows, rows, mask).compile()


def _step_bytes(compiled) -> int | None:
    """Bytes a compiled step holds at once (arguments, outputs, temporaries), or None where XLA does not say."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes
               - analysis.alias_size_in_bytes)  # fmt: skip


# ---------------------------------------------------------------------------------------------- checkpoints


def check_resumable(config: config_dict.ConfigDict, out: str) -> None:
    """Record the config in a new output directory; in one that holds a run, refuse a config that differs from it
    beyond `RESUMABLE_CHANGES`."""
    path = os.path.join(out, "config.json")
    current = json.loads(config.to_json())
    if not os.path.isfile(path):
        _write_json(path, current)
        return
    with open(path) as f:
        first = _with_defaults(json.load(f), json.loads(base_config().to_json()))  # fields added since: their defaults
    for name, (was, now) in _differences(first, current).items():
        if name.split(".")[0] not in RESUMABLE_CHANGES:
            raise InputError(
                f"output_dir: {out} holds a run of another config ({name}: {was!r} there, {now!r} here); "
                "resume it with its config or choose a new output_dir"
            )
    _write_json(path, current)


def _with_defaults(recorded: Any, defaults: Any) -> Any:
    """A recorded config with the fields it lacks taken from `defaults` (the schema's fields of today)."""
    if not isinstance(recorded, dict) or not isinstance(defaults, dict):
        return recorded
    return {k: _with_defaults(recorded[k], defaults.get(k)) if k in recorded else v for k, v in defaults.items()} | {
        k: v for k, v in recorded.items() if k not in defaults
    }


def _differences(a: Any, b: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        found = {}
        for key in sorted(set(a) | set(b)):
            found |= _differences(a.get(key), b.get(key), f"{prefix}{key}.")
        return found
    return {} if a == b else {prefix[:-1]: (a, b)}


def checkpoints(out: str, config: config_dict.ConfigDict):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=config.checkpoint.keep,
        save_interval_steps=config.checkpoint.every,
        cleanup_tmp_directories=True,  # a save a kill interrupted: never read, removed
        enable_async_checkpointing=False,
    )
    return ocp.CheckpointManager(os.path.join(out, "checkpoints"), options=options)


def _save_args(params, opt_state):
    import orbax.checkpoint as ocp

    return ocp.args.StandardSave({"leaves": jax.tree.leaves((params, opt_state))})


def restore(manager, at: int, params, opt_state):
    """(params, opt_state) of the checkpoint of step `at`, into the structure of the ones given."""
    import orbax.checkpoint as ocp

    leaves, treedef = jax.tree.flatten((params, opt_state))
    abstract = {"leaves": [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]}
    restored = manager.restore(at, args=ocp.args.StandardRestore(abstract))
    return jax.tree.unflatten(treedef, restored["leaves"])


# ---------------------------------------------------------------------------------------------- evaluation, export


def held_out_loss(eval_step, params, rows: data.Batch, micro: int, batches: int) -> float:
    """Mean token loss (nats) over the first `batches` micro-batches of held-out rows (0: all of them)."""
    n = len(rows.inputs) if not batches else min(len(rows.inputs), batches * micro)
    total = count = 0.0
    for i in range(0, n, micro):
        chunk = data.Batch(*(_padded(a[i : min(i + micro, n)], micro) for a in (rows.inputs, rows.targets, rows.mask)))
        s, c = eval_step(params, chunk.inputs, chunk.targets, chunk.mask)
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


def _padded(a: np.ndarray, rows: int) -> np.ndarray:
    """Rows topped up to `rows` with zero rows (masked out: their mask rows are zero): one compiled shape."""
    return np.concatenate([a, np.zeros((rows - len(a), *a.shape[1:]), a.dtype)]) if len(a) < rows else a


def finish(config, out: str, run: Run, graphdef, params, eval_step, log) -> dict[str, Any]:
    """Export the model, measure it on the whole held-out split beside the n-gram baselines, and write summary.json
    (and completions of held-out function headers for Python corpora, `eval.headers`)."""
    model = nnx.merge(graphdef, params)
    model_dir = export(model, run.tokenizer, os.path.join(out, "model"), config.export.dtype)
    rows = data.windows(run.held_out_tokens, config.data.seq_len, 0, run.tokenizer.pad_token_id)
    held = held_out_loss(eval_step, params, rows, config.batch.micro, 0)
    baselines = quality.ngram_baselines(run.train_tokens, run.held_out_tokens, len(run.tokenizer))
    held_bytes = sum(len(corpus.read_text(f).encode()) for f in run.held_out_files)
    tokens = len(run.held_out_tokens) - 1
    summary: dict[str, Any] = dict(
        steps=config.steps,
        parameters=count_params(model),
        train_tokens=int(len(run.train_tokens)),
        held_out_tokens=tokens,
        held_out_loss=held,
        held_out_bits_per_byte=held * tokens / held_bytes / math.log(2),
        baselines=baselines,
        model_dir=model_dir,
        train_tokens_per_s=log.last("tokens_per_s"),
        flops_per_token=report.training_flops_per_token(model.cfg, config.data.seq_len),
    )
    summary["model_tflops_per_s"] = summary["flops_per_token"] * (summary["train_tokens_per_s"] or 0.0) / 1e12
    if config.eval.headers:
        from granite_jax.generation import Generator

        headers = quality.function_headers(run.held_out_files, config.eval.headers)
        generator = Generator(model_dir, max_cache_len=1024)
        summary["completions"] = quality.header_completions(generator, headers, config.eval.max_new_tokens)
    _write_json(os.path.join(out, "summary.json"), summary | {"config": json.loads(config.to_json())})
    return summary


def export(model: Granite, tokenizer, path: str, dtype: str) -> str:
    """The model as a Hugging Face directory (config.json, model.safetensors, tokenizer files), replaced whole."""
    partial = _fresh_dir(path)
    export_safetensors(model, partial, dtype=dtype)
    tokenizer.save_pretrained(partial)
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.replace(partial, path)
    return path


def _fresh_dir(path: str) -> str:
    """An empty `path`.partial-<pid>: written whole, then renamed over `path` (an interrupt leaves no half)."""
    partial = f"{path}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    return partial


def _write_json(path: str, value: Any) -> None:
    partial = f"{path}.partial-{os.getpid()}"
    with open(partial, "w") as f:
        json.dump(value, f, indent=2)
    os.replace(partial, path)


def _terminal() -> bool:
    return sys.stderr.isatty()
