"""Checkpoints: Hugging Face safetensors directories (`hf`) and granite-jax's orbax ones (`orbax`), one `load_model`
for both, and the dtype policy (`dtypes`)."""

from granite_jax.checkpoint.dtypes import AUTO, DTYPES, FLOAT8_NAME, WEIGHT_DTYPES, dtype_name
from granite_jax.checkpoint.hf import export_safetensors, load_config
from granite_jax.checkpoint.loading import (
    NO_MODEL_MESSAGE,
    default_model_dir,
    load_model,
    load_tokenizer,
    stored_dtype,
)
from granite_jax.checkpoint.orbax import check_writable, is_orbax_checkpoint, save_checkpoint
from granite_jax.errors import CheckpointError

__all__ = [
    "AUTO",
    "DTYPES",
    "FLOAT8_NAME",
    "NO_MODEL_MESSAGE",
    "WEIGHT_DTYPES",
    "CheckpointError",
    "default_model_dir",
    "check_writable",
    "dtype_name",
    "export_safetensors",
    "is_orbax_checkpoint",
    "load_config",
    "load_model",
    "load_tokenizer",
    "save_checkpoint",
    "stored_dtype",
]
