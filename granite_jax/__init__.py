"""granite-jax: IBM Granite 4.0 (GraniteMoeHybrid) in JAX / Flax NNX.

Usage:

    from granite_jax import load_model, Generator, SamplingConfig
    model = load_model("path/to/hf-checkpoint")          # or an orbax checkpoint written by granite_jax.convert
    logits = model(tokens)                               # (b, T) int32 -> (b, T, vocab)
    Generator("path/to/hf-checkpoint").generate("Hello", SamplingConfig(max_new_tokens=32))
"""

from granite_jax.config import ConfigError, ModelConfig
from granite_jax.model import (
    Cache,
    Granite,
    abstract_model,
    count_params,
    pack_for_decoding,
    with_dtype,
    with_ssd_impl,
)
from granite_jax.params import CheckpointError, load_model
from granite_jax.presets import RELEASED, released_config
from granite_jax.ssd import ssd, ssd_reference, ssd_step

__all__ = [
    "RELEASED",
    "Cache",
    "CheckpointError",
    "ConfigError",
    "Generator",
    "Granite",
    "ModelConfig",
    "SamplingConfig",
    "abstract_model",
    "count_params",
    "load_model",
    "pack_for_decoding",
    "released_config",
    "ssd",
    "ssd_reference",
    "ssd_step",
    "with_dtype",
    "with_ssd_impl",
]


def __getattr__(name: str):
    # Generation pulls in the tokenizer stack; import it only when asked for. (`granite_jax.generate` is the module.)
    if name in ("Generator", "SamplingConfig"):
        import importlib

        return getattr(importlib.import_module("granite_jax.generate"), name)
    raise AttributeError(f"module 'granite_jax' has no attribute {name!r}")
