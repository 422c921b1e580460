"""Convert a Hugging Face GraniteMoeHybrid checkpoint into a granite-jax orbax checkpoint.

    python -m granite_jax.convert --model HF_DIR --out DIR [--dtype auto|float32|bfloat16|float16]

The weights are read with the safetensors importer (`params.load_model`), cast to `--dtype` and saved with orbax;
config.json, the tokenizer and the other small files of HF_DIR are copied beside them (see `checkpoint.py` for the
layout). DIR must not exist or be empty. Every command that takes a model directory accepts either kind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import jax.numpy as jnp

from granite_jax.checkpoint import check_writable, is_orbax_checkpoint, save_checkpoint
from granite_jax.config import ConfigError
from granite_jax.params import CheckpointError, load_model

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def checkpoint_dtype(model_dir: str | os.PathLike) -> str:
    """The dtype a HF checkpoint declares in config.json (`dtype`, or 4.x `torch_dtype`); float32 if none."""
    try:
        with open(os.path.join(os.fspath(model_dir), "config.json")) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError):
        return "float32"
    name = d.get("dtype") or d.get("torch_dtype") or "float32"
    return name if name in DTYPES else "float32"


def convert(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "auto", progress=False) -> str:
    """HF checkpoint directory -> orbax checkpoint directory (parameters stored in `dtype`). Returns `out_dir`."""
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"{model_dir}: model directory not found")
    if is_orbax_checkpoint(model_dir):
        raise CheckpointError(f"{model_dir}: is already a granite-jax orbax checkpoint; nothing to convert")
    check_writable(out_dir)  # before the (possibly long) load
    name = checkpoint_dtype(model_dir) if dtype == "auto" else dtype
    if name not in DTYPES:
        raise CheckpointError(f"--dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    model = load_model(model_dir, dtype=DTYPES[name], progress=progress)
    return save_checkpoint(model, out_dir, copy_from=model_dir, source=os.path.abspath(model_dir))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m granite_jax.convert",
        description="Convert a Hugging Face GraniteMoeHybrid checkpoint (safetensors) into a granite-jax orbax "
        "checkpoint, with config.json and the tokenizer copied beside it. The result is written into a temporary "
        "sibling directory and moved into place only when complete.",
    )
    p.add_argument("--model", required=True, metavar="HF_DIR", help="Hugging Face checkpoint directory to read")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory; must not exist or be empty")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="dtype to store the parameters in; 'auto' (default) keeps the dtype named in config.json",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        out = convert(args.model, args.out, dtype=args.dtype, progress=not args.quiet)
    except (CheckpointError, ConfigError) as e:
        print(f"granite_jax.convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
