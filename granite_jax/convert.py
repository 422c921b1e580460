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
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from granite_jax import cli
from granite_jax.checkpoint import check_writable, is_orbax_checkpoint, save_checkpoint
from granite_jax.config import ConfigError
from granite_jax.model import Granite
from granite_jax.params import (
    CONV,
    DTYPES,
    EXPERTS,
    KEEP,
    NAME_MAP,
    CheckpointError,
    Transform,
    load_model,
    map_name,
    stored_dtype,
)


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
    model = load_model(model_dir, dtype=DTYPES[name], progress=progress)
    return save_checkpoint(model, out_dir, copy_from=model_dir, source=os.path.abspath(model_dir))


# ---------------------------------------------------------------------------------------------- export


_UNDO = {id(KEEP): lambda w: w, id(EXPERTS): lambda w: w.transpose(0, 2, 1)}
_UNDO[id(CONV)] = lambda w: w.T[:, None, :]  # [K, C] -> depthwise Conv1d [C, 1, K]


def _inverse_entry(pattern: str, target: str) -> tuple[re.Pattern, str]:
    """(regex over NNX paths, HF-name template) from one `NAME_MAP` entry (non-nested groups, escaped dots)."""
    groups = re.findall(r"\([^()]*\)", pattern)
    name_template = pattern
    for i, g in enumerate(groups, 1):
        name_template = name_template.replace(g, f"\\{i}", 1)
    name_template = name_template.replace("\\.", ".")
    path_regex = re.escape(target)
    for i, g in enumerate(groups, 1):
        path_regex = path_regex.replace(re.escape(f"\\{i}"), f"(?P<g{i}>{g[1:-1]})", 1)
    return re.compile(path_regex), name_template


_INVERSE = [(*_inverse_entry(pattern, target), transform) for pattern, target, transform in NAME_MAP]


def hf_name(path: str) -> tuple[str, Transform]:
    """The Hugging Face checkpoint name of an NNX state path, and the import transform that maps it (`map_name`)."""
    for path_regex, name_template, transform in _INVERSE:
        if m := path_regex.fullmatch(path):
            name = re.sub(r"\\(\d)", lambda g: m.group(f"g{g.group(1)}"), name_template)
            if map_name(name) != (path, transform):  # the table is not invertible at this entry
                raise CheckpointError(f"NNX parameter {path!r}: {name!r} does not import back to it")
            return name, transform
    raise CheckpointError(f"NNX parameter {path!r} has no Hugging Face checkpoint name")


def hf_tensors(model: Granite) -> dict[str, Any]:
    """The model's parameters as float32 numpy arrays under their Hugging Face checkpoint names and layouts."""
    from granite_jax.params import _flatten

    out = {}
    for path, value in _flatten(nnx.to_pure_dict(nnx.state(model))).items():
        name, transform = hf_name(path)
        out[name] = np.array(_UNDO[id(transform)](np.asarray(value, np.float32)), order="C")  # a writable copy
    return out


def export_safetensors(model: Granite, out_dir: str | os.PathLike, *, dtype: str = "float32") -> str:
    """Write the model as a Hugging Face checkpoint (model.safetensors + config.json) that transformers loads."""
    import torch
    from safetensors.torch import save_file

    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    tensors = {k: torch.from_numpy(v).to(getattr(torch, dtype)) for k, v in hf_tensors(model).items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(model.cfg.to_hf_dict() | {"dtype": dtype}, f, indent=2)
    return out


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
    except (CheckpointError, ConfigError) as e:
        print(f"granite_jax.convert: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("granite_jax.convert: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
