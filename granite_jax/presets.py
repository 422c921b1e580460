"""Architectures of the released Granite 4.0 models, as `config.json` dicts.

Values not confirmed from a published config.json (h-small's attention layer indices, h-micro's residual multiplier
and shared width) use the family's common values. Used for abstract builds, random-weight benchmarks and
`configs/models/`.
"""

from __future__ import annotations

from typing import Any

from granite_jax.config import ModelConfig


def _hybrid(num_layers: int, attention_at: tuple[int, ...]) -> list[str]:
    return ["attention" if i in attention_at else "mamba" for i in range(num_layers)]


_COMMON: dict[str, Any] = dict(
    model_type="granitemoehybrid",
    vocab_size=100352,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    mamba_expand=2,
    mamba_d_conv=4,
    mamba_n_groups=1,
    mamba_d_state=128,
    mamba_chunk_size=256,
    mamba_conv_bias=True,
    mamba_proj_bias=False,
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    position_embedding_type="nope",
    max_position_embeddings=131072,
)

RELEASED: dict[str, dict[str, Any]] = {
    "granite-4.0-h-tiny": _COMMON
    | dict(
        hidden_size=1536,
        num_hidden_layers=40,
        layer_types=_hybrid(40, (5, 15, 25, 35)),
        num_attention_heads=12,
        num_key_value_heads=4,
        mamba_n_heads=48,
        mamba_d_head=64,
        num_local_experts=64,
        num_experts_per_tok=6,
        intermediate_size=512,
        shared_intermediate_size=1024,
        attention_multiplier=0.0078125,
        logits_scaling=6.0,
    ),
    "granite-4.0-h-small": _COMMON
    | dict(
        hidden_size=4096,
        num_hidden_layers=40,
        layer_types=_hybrid(40, (5, 15, 25, 35)),
        num_attention_heads=32,
        num_key_value_heads=8,
        mamba_n_heads=128,
        mamba_d_head=64,
        num_local_experts=72,
        num_experts_per_tok=10,
        intermediate_size=768,
        shared_intermediate_size=1536,
        attention_multiplier=0.0078125,
        logits_scaling=16.0,
    ),
    "granite-4.0-h-micro": _COMMON
    | dict(
        hidden_size=2048,
        num_hidden_layers=40,
        layer_types=_hybrid(40, (5, 15, 25, 35)),
        num_attention_heads=32,
        num_key_value_heads=8,
        mamba_n_heads=64,
        mamba_d_head=64,
        num_local_experts=0,
        num_experts_per_tok=0,
        intermediate_size=8192,
        shared_intermediate_size=8192,
        attention_multiplier=0.015625,
        logits_scaling=8.0,
    ),
    "granite-4.0-micro": _COMMON
    | dict(
        hidden_size=2560,
        num_hidden_layers=40,
        layer_types=["attention"] * 40,
        num_attention_heads=40,
        num_key_value_heads=8,
        mamba_n_heads=128,
        mamba_d_head=40,
        mamba_d_state=256,
        num_local_experts=0,
        num_experts_per_tok=0,
        intermediate_size=8192,
        shared_intermediate_size=8192,
        attention_multiplier=0.015625,
        logits_scaling=10.0,
        position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0},
    ),
    "granite-4.0-h-1b": _COMMON
    | dict(
        hidden_size=1536,
        num_hidden_layers=40,
        layer_types=_hybrid(40, (5, 15, 25, 35)),
        num_attention_heads=12,
        num_key_value_heads=4,
        mamba_n_heads=48,
        mamba_d_head=64,
        num_local_experts=0,
        num_experts_per_tok=0,
        intermediate_size=4096,
        shared_intermediate_size=4096,
        attention_multiplier=0.0078125,
        logits_scaling=6.0,
    ),
    "granite-4.0-h-350m": _COMMON
    | dict(
        hidden_size=768,
        num_hidden_layers=32,
        layer_types=_hybrid(32, (10, 13, 17, 27)),
        num_attention_heads=12,
        num_key_value_heads=4,
        mamba_n_heads=48,
        mamba_d_head=32,
        num_local_experts=0,
        num_experts_per_tok=0,
        intermediate_size=2048,
        shared_intermediate_size=2048,
        attention_multiplier=0.015625,
        residual_multiplier=0.246,
        logits_scaling=3.0,
        max_position_embeddings=32768,
    ),
}


def released_config(name: str, **overrides: Any) -> ModelConfig:
    """The ModelConfig of a released model by name (e.g. 'granite-4.0-h-tiny'); `overrides` replace fields."""
    key = name if name.startswith("granite-") else f"granite-4.0-{name}"
    if key not in RELEASED:
        raise KeyError(f"unknown model {name!r}; expected one of {', '.join(RELEASED)}")
    return ModelConfig.from_hf_dict(RELEASED[key], source=key).replace(**overrides)
