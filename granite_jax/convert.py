"""Convert a Hugging Face GraniteMoeHybrid checkpoint into a granite-jax orbax checkpoint.

    python -m granite_jax.convert --model HF_DIR --out DIR [--dtype auto|float32|bfloat16|float16]

The weights are read with the safetensors importer (`checkpoint.load_model`), cast to `--dtype` and saved with orbax;
config.json, the tokenizer and the other small files of HF_DIR are copied beside them (see `checkpoint.py` for the
layout). DIR must not exist or be empty. Every command that takes a model directory accepts either kind.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from granite_jax import cli
from granite_jax.checkpoint import (
    DTYPES,
    CheckpointError,
    check_writable,
    is_orbax_checkpoint,
    load_model,
    save_checkpoint,
    stored_dtype,
)
from granite_jax.errors import InputError


def convert(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "auto", progress=False) -> str:
    """HF checkpoint directory -> orbax checkpoint directory (parameters stored in `dtype`). Returns `out_dir`."""
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"{model_dir}: model directory not found")
    if is_orbax_checkpoint(model_dir):
        raise CheckpointError(f"{model_dir}: is already a granite-jax orbax checkpoint; nothing to convert")
    check_writable(out_dir)  # before the (possibly long) load
    name = dtype
    if dtype == "auto":  # the dtype the safetensors store (their headers); float32 if they mix dtypes or hold float64
        stored = stored_dtype(model_dir)
        name = stored if stored in DTYPES else "float32"
    if name not in DTYPES:
        raise CheckpointError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    model = load_model(model_dir, dtype=name, progress=progress)
    return save_checkpoint(model, out_dir, copy_from=model_dir, source=os.path.abspath(model_dir))


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
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
        help="dtype to store the parameters in; 'auto' (default) keeps the dtype the checkpoint's tensors are "
        "stored in (float32 if they mix dtypes)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        out = convert(args.model, args.out, dtype=args.dtype, progress=not args.quiet)
    except InputError as e:
        print(f"granite_jax.convert: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("granite_jax.convert: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
