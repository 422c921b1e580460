"""Reading config.json: both layer-type spellings, RoPE forms, multipliers, and rejection of what is not implemented."""

from __future__ import annotations

import json
import math

import pytest

from granite_jax.config import ConfigError, ModelConfig
from granite_jax.presets import RELEASED, released_config

BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    mamba_n_heads=8,
    mamba_d_state=16,
    intermediate_size=32,
    shared_intermediate_size=32,
)


def cfg(**changes) -> ModelConfig:
    return ModelConfig.from_hf_dict(BASE | changes)


def test_layer_type_spellings_are_equivalent():
    old = cfg(layer_types=["mamba", "attention"])
    new = cfg(layer_types=["linear_attention", "full_attention"])
    assert old == new and old.layer_types == ("mamba", "attention")


def test_defaults_follow_transformers():
    c = cfg()
    assert c.layer_types == ("mamba", "mamba") and c.mamba_d_head == 16 and c.head_dim == 16
    assert c.rope_theta is None and c.time_step_limit == (0.0, math.inf) and c.num_local_experts == 8


@pytest.mark.parametrize(
    "fields, theta",
    [
        (dict(position_embedding_type="rope", rope_theta=5e5), 5e5),
        (dict(position_embedding_type="rope", rope_parameters={"rope_type": "default", "rope_theta": 1e7}), 1e7),
        (dict(position_embedding_type="nope", rope_theta=5e5), None),
    ],
)
def test_rope_forms(fields, theta):
    assert cfg(**fields).rope_theta == theta


def test_multipliers_head_dim_dense_and_limits():
    c = cfg(
        embedding_multiplier=12,
        attention_multiplier=0.5,
        residual_multiplier=0.22,
        logits_scaling=6,
        head_dim=24,
        num_local_experts=0,
        num_experts_per_tok=0,
        tie_word_embeddings=True,
        time_step_limit=[0.001, {"__float__": "Infinity"}],
        rms_norm_eps=1e-5,
    )
    assert (c.embedding_multiplier, c.attention_multiplier, c.residual_multiplier, c.logits_scaling) == (
        12,
        0.5,
        0.22,
        6,
    )
    assert c.head_dim == 24 and c.num_local_experts == 0 and c.tie_word_embeddings and c.rms_norm_eps == 1e-5
    assert c.time_step_limit == (0.001, math.inf)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(position_embedding_type="alibi"), "position_embedding_type: 'alibi'"),
        (
            dict(position_embedding_type="rope", rope_parameters={"rope_type": "yarn", "factor": 4.0}),
            "rope_type: 'yarn'",
        ),
        (dict(mamba_d_head=10), "mamba_n_heads \\* mamba_d_head"),
        (dict(layer_types=["mamba", "conv"]), "layer_types\\[1\\]: unknown layer type 'conv'"),
        (dict(layer_types=["mamba"]), "layer_types: 1 entries but num_hidden_layers=2"),
        (dict(hidden_act="gelu"), "hidden_act: 'gelu'"),
        (dict(num_key_value_heads=3), "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
        (dict(mamba_n_groups=3), "mamba_n_groups=3 does not divide mamba_n_heads=8"),
        (dict(model_type="llama"), "model_type: 'llama'"),
    ],
)
def test_unsupported_values_are_rejected_by_name(fields, message):
    with pytest.raises(ConfigError, match=message):
        cfg(**fields)


def test_from_json_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{ not json")
    with pytest.raises(ConfigError, match=f"{path}: not valid JSON"):
        ModelConfig.from_json(path)


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_configs_round_trip_through_hf_dict(name):
    c = released_config(name)
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(c.to_hf_dict()))) == c
