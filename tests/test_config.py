"""Reading config.json: both layer-type spellings, RoPE forms, multipliers, and rejection of what is not implemented."""

from __future__ import annotations

import json
import math
import re

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


@pytest.mark.parametrize("text, kind", [("[]", "array"), ("null", "null"), ("64", "number"), ('"x"', "string")])
def test_from_json_refuses_a_top_level_that_is_not_an_object(tmp_path, text, kind):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{path}: expected a JSON object, got {kind}$"):
        ModelConfig.from_json(path)


def test_from_json_refuses_a_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(json.dumps(BASE).encode() + b"\n\xff")
    with pytest.raises(ConfigError, match=f"{path}: not UTF-8 text \\(byte 0xff at offset"):
        ModelConfig.from_json(path)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("num_attention_heads", 0, "a positive integer"),
        ("num_key_value_heads", 0, "a positive integer"),
        ("head_dim", 0, "a positive integer"),
        ("hidden_size", -64, "a positive integer"),
        ("vocab_size", 1.5, "a positive integer"),
        ("num_hidden_layers", 0, "a positive integer"),
        ("shared_intermediate_size", 0, "a positive integer"),
        ("intermediate_size", 0, "a positive integer"),  # the routed experts' width (8 experts by default)
        ("max_position_embeddings", 0, "a positive integer"),
        ("mamba_n_heads", 0, "a positive integer"),
        ("mamba_d_head", 0, "a positive integer"),
        ("mamba_d_state", "16", "a positive integer"),
        ("mamba_n_groups", 0, "a positive integer"),
        ("mamba_d_conv", 0, "a positive integer"),
        ("mamba_chunk_size", 0, "a positive integer"),
        ("mamba_expand", True, "a positive integer"),
        ("num_local_experts", -1, "an integer >= 0"),
        ("pad_token_id", "x", "an integer >= 0"),
        ("eos_token_id", "x", "an integer >= 0"),
    ],
)
def test_sizes_must_be_positive_integers(field, value, expected):
    with pytest.raises(ConfigError, match=re.escape(f"config: {field}: expected {expected}, got {value!r}")):
        cfg(**{field: value})


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(rms_norm_eps=math.nan), "rms_norm_eps: expected a finite number > 0, got nan"),
        (dict(rms_norm_eps=-1.0), "rms_norm_eps: expected a finite number > 0, got -1.0"),
        (dict(rms_norm_eps=0), "rms_norm_eps: expected a finite number > 0, got 0.0"),
        (dict(rms_norm_eps="1e-5"), "rms_norm_eps: expected a number, got '1e-5'"),
        (dict(logits_scaling=0), "logits_scaling: expected a finite number != 0, got 0.0"),
        (dict(logits_scaling=math.inf), "logits_scaling: expected a finite number != 0, got inf"),
        (dict(embedding_multiplier=math.nan), "embedding_multiplier: expected a finite number, got nan"),
        (dict(residual_multiplier=-math.inf), "residual_multiplier: expected a finite number, got -inf"),
        (dict(attention_multiplier=None), "attention_multiplier: expected a number, got None"),
        (dict(position_embedding_type="rope", rope_theta=0), "rope_theta: expected a finite number > 0, got 0.0"),
        (dict(position_embedding_type="rope", rope_parameters=[1]), "rope_parameters: expected an object, got [1]"),
        (dict(tie_word_embeddings="false"), "tie_word_embeddings: expected true or false, got 'false'"),
        (dict(eos_token_id=[1, "a"]), "eos_token_id[1]: expected an integer >= 0, got 'a'"),
        (dict(layer_types="mamba"), "layer_types: expected a list of layer types, got 'mamba'"),
        (dict(time_step_limit=5), "time_step_limit: expected [low, high], got 5"),
    ],
)
def test_scalars_must_be_finite_numbers_of_the_right_sign(fields, message):
    with pytest.raises(ConfigError, match=re.escape(f"config: {message}")):
        cfg(**fields)


def test_integral_numbers_and_dense_defaults_are_accepted():
    c = cfg(rms_norm_eps=1, logits_scaling=-2, hidden_size=64.0, num_key_value_heads=None, eos_token_id=[0, 2])
    assert c.rms_norm_eps == 1.0 and isinstance(c.rms_norm_eps, float) and c.logits_scaling == -2.0
    assert c.hidden_size == 64 and isinstance(c.hidden_size, int) and c.num_key_value_heads == 4
    assert c.eos_token_id == (0, 2)
    dense = cfg(num_local_experts=0, num_experts_per_tok=0, intermediate_size=0)  # the routed width is unused
    assert dense.num_local_experts == 0 and dense.intermediate_size == 0


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(mamba_chunk_size=0), "mamba_chunk_size: expected a positive integer, got 0"),
        (dict(num_key_value_heads=0), "num_key_value_heads: expected a positive integer, got 0"),
        (dict(layer_types=()), "layer_types: empty"),
        (dict(rms_norm_eps=math.nan), "rms_norm_eps: expected a finite number > 0, got nan"),
    ],
)
def test_direct_construction_is_validated_too(changes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg().replace(**changes)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(time_step_limit=(1.0, 0.0)), r"time_step_limit: \(1.0, 0.0\) must be \(low, high\).*low <= high"),
        (dict(time_step_limit=("a", 1.0)), "time_step_limit: "),
        (dict(tie_word_embeddings="no"), "tie_word_embeddings: expected True or False, got 'no'"),
        (dict(mamba_conv_bias=1), "mamba_conv_bias: expected True or False, got 1"),
        (dict(eos_token_id=-2), r"eos_token_id\[0\]: expected an integer >= 0, got -2"),
        (dict(eos_token_id="2"), "eos_token_id: expected a token id or a sequence of them, got '2'"),
        (dict(layer_types="mamba"), "layer_types: expected a sequence of layer types, got 'mamba'"),
    ],
)
def test_replace_checks_like_config_json(changes, message):
    with pytest.raises(ConfigError, match=message):
        cfg().replace(**changes)


def test_replace_normalizes_lists_and_one_eos_id_to_tuples():
    c = cfg().replace(layer_types=["mamba", "attention"], eos_token_id=7, time_step_limit=[0.5, 2.0])
    assert (c.layer_types, c.eos_token_id, c.time_step_limit) == (("mamba", "attention"), (7,), (0.5, 2.0))
    assert c.replace(eos_token_id=[3, 4]).eos_token_id == (3, 4)
    hash(c)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "no model_type; expected 'granitemoehybrid'"),
        ({"model_type": "granitemoe"}, "model_type 'granitemoe'; expected 'granitemoehybrid'"),
        (
            {"model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridModel"]},
            r"architectures \['GraniteMoeHybridModel'\]; expected \['GraniteMoeHybridForCausalLM'\]",
        ),
    ],
)
def test_from_json_refuses_another_models_config(tmp_path, fields, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(BASE | fields))
    with pytest.raises(ConfigError, match=f"{path}: {message}"):
        ModelConfig.from_json(path)
    path.write_text(json.dumps(BASE | {"model_type": "granitemoehybrid"}))  # architectures may be absent
    assert ModelConfig.from_json(path) == ModelConfig.from_hf_dict(BASE)
