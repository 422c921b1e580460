"""Train a Granite 4.0 model from scratch, or fine-tune a checkpoint, on text files.

    python -m granite_jax.train --config configs/train/default.py
    python -m granite_jax.train --config configs/train/finetune.py --config.init_from=DIR --config.data.train='*.txt'

The config (ml_collections, `get_config()`; every field in granite_jax/training/config.py, docs/training.md) names the
model (a released architecture and/or config.json fields, or `init_from` a Hugging Face or orbax checkpoint), the data
(globs of text files or "stdlib", the running Python's standard library), the batch, AdamW's schedule, evaluation and
checkpoints. Override any field as --config.SECTION.FIELD=VALUE.

The run's directory (output_dir) keeps its checkpoints: the same command resumes a stopped run where it was, and a
finished run writes metrics.jsonl, loss.png, summary.json and the model as a Hugging Face directory (model/). The SSD
runs as "xla", which is differentiable: the Pallas kernels are forward-only.
"""

from __future__ import annotations

import json
import sys

import jax
from absl import app, logging
from ml_collections import config_flags

from granite_jax.cli import fail, flags_parser, guarded, use_compilation_cache
from granite_jax.training.config import schema

PROG = "granite_jax.train"
_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Training config file, e.g. configs/train/default.py. Override any field with --config.SECTION.FIELD=VALUE: "
    "--config.output_dir=DIR, --config.init_from=DIR (fine-tune), --config.steps=N, --config.seed=N, "
    "--config.data.train='GLOB[,GLOB]'|stdlib, --config.data.held_out=GLOB, --config.data.seq_len=N, "
    "--config.batch.rows=N, --config.batch.micro=N, --config.optimizer.learning_rate=X, "
    "--config.model.preset=granite-4.0-h-350m, --config.model.hf.hidden_size=N, --config.model.remat=True, "
    "--config.model.param_dtype=bfloat16, --config.eval.every=N, --config.checkpoint.every=N. "
    "See docs/training.md.",
    lock_config=True,
)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        fail(PROG, f"unexpected arguments: {' '.join(argv[1:])}")
    config = _CONFIG.value
    if config is None:
        fail(PROG, "--config is required, e.g. --config configs/train/default.py")
    use_compilation_cache(None)
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    from granite_jax.training import train

    if jax.default_backend() == "gpu":
        print(f"{PROG}: the SSD runs as 'xla' (differentiable); the Pallas kernels are forward-only", file=sys.stderr)
    sys.exit(guarded(PROG, lambda: report(train(config))))


def report(summary: dict) -> int:
    """Print a finished run's summary (JSON) and its completions' parse share."""
    print(json.dumps({k: v for k, v in summary.items() if k != "completions"}, indent=2))
    if "completions" in summary:
        c = summary["completions"]
        print(f"held-out function headers whose completion parses: {c['parse_share']:.0%} "
              f"({c['parse_and_end_share']:.0%} also end before the token limit)")  # fmt: skip
    return 0


# Bad flags and config files: one line, exit code 2.
parse_flags = flags_parser(PROG, _CONFIG, "a training", "steps", schema)


def cli() -> None:
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
