"""One `load_model` for both kinds of checkpoint directory, and what else a directory holds (dtype, tokenizer)."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from granite_jax import sharding
from granite_jax.checkpoint import hf, orbax
from granite_jax.checkpoint.dtypes import AUTO, DTYPES, FLOAT8_NAME, WEIGHT_DTYPES, dtype_name, weight_dtype_name
from granite_jax.config import ModelConfig
from granite_jax.errors import CheckpointError
from granite_jax.model import Granite, abstract_model
from granite_jax.ops import Runtime


def load_model(
    model_dir: str | os.PathLike,
    *,
    dtype: Any = "float32",
    weight_dtype: Any = None,
    runtime: Runtime | None = None,
    cfg: ModelConfig | None = None,
    progress: bool = False,
    mesh: Mesh | None = None,
) -> Granite:
    """Load a Hugging Face GraniteMoeHybrid checkpoint directory (safetensors), or a granite-jax orbax one.

    dtype: the activations' dtype, a name in `DTYPES` or its jnp dtype. weight_dtype: the weights' (None: dtype;
    "auto": bfloat16 for float32 arithmetic on a bfloat16 checkpoint where a kernel backend widens it in registers,
    see `dtypes`; "float8": the matrices quantized, see `model.FLOAT8`; a float8 checkpoint loads only as float8, which
    None and "auto" mean for it). runtime: how the model runs (`ops.Runtime`). cfg: instead of the directory's
    config.json. mesh: place every parameter in its shards over this `jax.sharding.Mesh` (`granite_jax.sharding`) as
    it is read, one tensor at a time: the whole model is never on one device, nor twice in host memory."""
    runtime = runtime or Runtime()
    if mesh is not None:
        runtime = runtime.replace(mesh=mesh)
    dtype = dtype_name("dtype", dtype)
    auto = isinstance(weight_dtype, str) and weight_dtype == AUTO
    float8 = _stores_float8(model_dir)
    if float8 and weight_dtype is None:  # nothing else reads it: its weights stay as they are stored
        weight_dtype = FLOAT8_NAME
    weights = weight_dtype_name(dtype, weight_dtype, stored_dtype(model_dir) if auto else None, runtime)
    if float8 and weights != FLOAT8_NAME:
        raise CheckpointError(
            f"{os.fspath(model_dir)}: the checkpoint stores float8 weights; load it with weight dtype float8 "
            f"(or auto), not {weights}"
        )
    kinds = dict(dtype=DTYPES[dtype], param_dtype=WEIGHT_DTYPES[weights])
    cfg = cfg or hf.load_config(model_dir)  # an orbax directory keeps a config.json too
    if mesh is not None:
        sharding.check_mesh(cfg, mesh)
    if orbax.is_orbax_checkpoint(model_dir):
        model = orbax.restore_model(model_dir, **kinds, runtime=runtime, cfg=cfg, mesh=mesh)
    else:
        files = hf.checkpoint_files(model_dir)
        blocks = sharding.row_blocks(mesh)
        graphdef, state = nnx.split(abstract_model(cfg, **kinds, runtime=runtime, row_blocks=blocks))
        params = hf.flatten(nnx.to_pure_dict(state))
        placement = None if mesh is None else sharding.parameter_shardings(params, mesh)
        stored = {k: jax.ShapeDtypeStruct(sharding.transformers_shape(cfg, blocks, k, x.shape), x.dtype)
                  for k, x in params.items()}  # fmt: skip
        relayout = functools.partial(sharding.to_blocks, cfg, blocks)
        values = hf.read_weights(files, stored, progress, placement, relayout)
        nnx.replace_by_pure_dict(state, hf.unflatten(values))
        model = nnx.merge(graphdef, state)
    check_finite(model, model_dir)
    return model


def check_finite(model: Granite, model_dir: str | os.PathLike) -> None:
    """Refuse weights holding NaN or inf (in the checkpoint, or made by the cast to the weights' dtype): every output
    that reads such a weight is non-finite, and generation would print nothing rather than fail. One reduction per
    tensor on the device, after the load, so both checkpoint formats are checked alike."""
    flat = hf.flatten(nnx.to_pure_dict(nnx.state(model)))
    sums = jax.device_get(_magnitude_sums(list(flat.values())))
    counts = {path: int(jnp.sum(~jnp.isfinite(flat[path]))) for path, m in zip(flat, sums) if not np.isfinite(m)}
    bad = [(path, n) for path, n in counts.items() if n]  # a finite sum past float32's range is not a bad weight
    if bad:
        path, n = bad[0]
        more = f"; {len(bad) - 1} more tensor(s) too" if len(bad) > 1 else ""
        raise CheckpointError(
            f"{os.fspath(model_dir)}: tensor {hf.hf_name(path)[0]!r} holds {n} NaN or infinite value(s) of "
            f"{flat[path].size}; expected finite weights{more}"
        )


@jax.jit
def _magnitude_sums(leaves: list[jax.Array]) -> list[jax.Array]:
    """sum |x| of each tensor in float32: not finite when the tensor holds a NaN or an inf (then counted). A plain
    fused reduction: XLA:CPU materialises a count's isfinite mask, a second copy of every weight at once, and its max
    reduction may drop NaNs."""
    return [jnp.sum(jnp.abs(x.astype(jnp.float32))) for x in leaves]


def _stores_float8(model_dir: str | os.PathLike) -> bool:
    if orbax.is_orbax_checkpoint(model_dir):
        return orbax.read_marker(model_dir).get("param_dtype") == FLOAT8_NAME
    return hf.is_float8_checkpoint(model_dir)


def stored_dtype(model_dir: str | os.PathLike) -> str | None:
    """The one dtype a checkpoint stores its weights in, read from the safetensors headers (or the orbax marker)
    without loading a tensor; None if they mix dtypes."""
    if orbax.is_orbax_checkpoint(model_dir):
        found = orbax.read_marker(model_dir).get("param_dtype")
        return found if isinstance(found, str) else None
    if _stores_float8(model_dir):
        return FLOAT8_NAME
    return hf.headers_dtype(hf.checkpoint_files(model_dir))


def load_tokenizer(model_dir: str | os.PathLike):
    """The checkpoint directory's tokenizer (local files only), as transformers' AutoTokenizer loads it, or None if
    the directory has none."""
    d = os.fspath(model_dir)
    if not any(os.path.isfile(os.path.join(d, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        return _tokenizer_class(d).from_pretrained(d, local_files_only=True)
    except Exception as e:  # transformers raises many types for broken tokenizer or config files
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{d}: cannot load the tokenizer ({type(e).__name__}: {first})") from None


NO_MODEL_MESSAGE = (
    "no model given and this install lacks the default model (granite_jax/checkpoints/default): pass --model DIR "
    "(a Hugging Face GraniteMoeHybrid checkpoint directory with config.json, safetensors and tokenizer files)"
)


def default_model_dir() -> str | None:
    """The model shipped with the package (granite_jax/checkpoints/default: a small Granite 4.0 hybrid trained on
    Python's standard library by configs/train/default.py), or None if this install lacks it."""
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "checkpoints", "default")
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def _tokenizer_class(model_dir: str):
    """The fast tokenizer class AutoTokenizer would pick for this directory, taken straight from transformers when
    tokenizer_config.json names one (Granite's name GPT2Tokenizer), else AutoTokenizer itself. Importing
    AutoTokenizer imports PyTorch where it is installed and indexes every model in transformers: about 1.5 s of a
    command's start, twice what the named class costs."""
    transformers = _import_transformers()
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    name = config.get("tokenizer_class") if isinstance(config, dict) and "auto_map" not in config else None
    if isinstance(name, str) and name.isidentifier():
        fast = transformers.PreTrainedTokenizerFast
        for candidate in (name if name.endswith("Fast") else name + "Fast", name):  # AutoTokenizer's use_fast=True
            cls = getattr(transformers, candidate, None)
            if isinstance(cls, type) and issubclass(cls, fast):
                return cls
    return transformers.AutoTokenizer


def _import_transformers():
    """transformers, imported without its advice that PyTorch is missing: granite-jax needs no PyTorch, and the
    advice would greet every command of an install without it."""
    key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    was = os.environ.get(key)
    os.environ[key] = "1"
    try:
        import transformers
    finally:
        if was is None:
            del os.environ[key]
        else:
            os.environ[key] = was
    return transformers
