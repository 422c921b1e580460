"""granite-jax: IBM Granite 4.0 (GraniteMoeHybrid) in JAX / Flax NNX.

    from granite_jax import load_model, Generator, SamplingConfig
    model = load_model("path/to/checkpoint")      # Hugging Face safetensors, or orbax (python -m granite_jax.convert)
    logits = model(tokens)                        # (b, T) int32 -> (b, T, vocab)
    Generator("path/to/checkpoint").generate("Hello", SamplingConfig(max_new_tokens=32))

How a model runs (the SSD implementation, platform kernels) is its `Runtime`, apart from what it is (`ModelConfig`).
"""

from granite_jax.checkpoint import CheckpointError, load_model, save_checkpoint
from granite_jax.config import ConfigError, ModelConfig
from granite_jax.model import Cache, Granite, abstract_model, count_params, with_dtype, with_runtime
from granite_jax.ops import Runtime
from granite_jax.presets import RELEASED, released_config
from granite_jax.sampling import GenerationError, SamplingConfig

__all__ = [
    "RELEASED",
    "Cache",
    "CheckpointError",
    "ConfigError",
    "GenerationError",
    "Generator",
    "Granite",
    "ModelConfig",
    "Runtime",
    "SamplingConfig",
    "abstract_model",
    "count_params",
    "load_model",
    "released_config",
    "save_checkpoint",
    "with_dtype",
    "with_runtime",
]


def __getattr__(name: str):
    # The Generator pulls in the tokenizer stack: imported when first asked for.
    if name == "Generator":
        from granite_jax.generation import Generator

        return Generator
    raise AttributeError(f"module 'granite_jax' has no attribute {name!r}")
