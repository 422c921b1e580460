"""Hugging Face checkpoints in: the name table, sharded files, the dtype policy, and a clear error for every kind of bad
input."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from granite_jax import ops
from granite_jax.checkpoint import CheckpointError, load_model, stored_dtype
from granite_jax.checkpoint.dtypes import weight_dtype_name
from granite_jax.checkpoint.hf import map_name
from granite_jax.checkpoint.orbax import MARKER
from granite_jax.config import ConfigError
from granite_jax.ops import Runtime


def copy_checkpoint(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return os.fspath(dst)


def assert_same_parameters(a, b) -> None:
    """Two models hold the same parameters, at the same places, bit for bit."""
    flat_a, flat_b = (nnx.to_flat_state(nnx.state(m, nnx.Param)) for m in (a, b))
    assert [path for path, _ in flat_a] == [path for path, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(path))


def rewrite_tensors(ckpt: str, edit) -> None:
    path = os.path.join(ckpt, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_every_checkpoint_tensor_has_a_mapping(tiny_checkpoint):
    names = load_file(os.path.join(tiny_checkpoint, "model.safetensors")).keys()
    assert all(map_name(n) is not None for n in names)


def test_sharded_checkpoint_loads_like_single_file(hf_checkpoint, tiny_checkpoint):
    sharded = hf_checkpoint(max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert_same_parameters(load_model(sharded), load_model(tiny_checkpoint))


def test_bf16_checkpoint_cast_to_requested_dtype(hf_checkpoint):
    d = hf_checkpoint(dtype="bfloat16")
    model = load_model(d, dtype=jnp.float32)
    assert model.embed_tokens.embedding[...].dtype == jnp.float32
    assert load_model(d, dtype=jnp.bfloat16).embed_tokens.embedding[...].dtype == jnp.bfloat16


def test_stored_dtype_read_from_the_headers(hf_checkpoint, tiny_checkpoint, tmp_path):
    bf16 = hf_checkpoint(dtype="bfloat16", max_shard_size="100KB")  # sharded: every shard's header is read
    assert stored_dtype(bf16) == "bfloat16" and stored_dtype(tiny_checkpoint) == "float32"
    mixed = copy_checkpoint(tiny_checkpoint, tmp_path / "mixed")
    rewrite_tensors(mixed, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.float16)}))
    assert stored_dtype(mixed) is None


def test_auto_weight_dtype_narrows_only_bfloat16_under_float32_where_a_backend_widens_it(monkeypatch):
    # Without a backend that widens bfloat16 weights in registers, XLA widens them before its products, possibly all
    # at once (a float32 copy): "auto" keeps the weights in the arithmetic's dtype there.
    for widens, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(ops, "widens_weights", lambda runtime, widens=widens: widens)
        assert weight_dtype_name("float32", "auto", "bfloat16", Runtime()) == expected
        assert weight_dtype_name("float16", "auto", "bfloat16", Runtime()) == "float16"
        assert weight_dtype_name("float32", "auto", "float32", Runtime()) == "float32"
        assert weight_dtype_name("float32", "auto", None, Runtime()) == "float32"  # mixed dtypes
        assert weight_dtype_name("float32", None, "bfloat16", Runtime()) == "float32"
        assert weight_dtype_name("float32", jnp.bfloat16, "float32", Runtime()) == "bfloat16"


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="model directory not found"):
        load_model(tmp_path / "nope")


def test_missing_config(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(ConfigError, match="config.json not found"):
        load_model(d)


def test_pickled_weights_are_refused_not_unpickled(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    os.remove(os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "pytorch_model.bin"), "wb") as f:
        f.write(b"\x80\x04 this would be a pickle")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*never unpickles.*safetensors"):
        load_model(d)


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    rewrite_tensors(d, lambda t: t.pop("model.layers.2.mamba.D"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*layers\.2\.mamba\.D"):
        load_model(d)


def test_unexpected_tensor_is_named(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    rewrite_tensors(d, lambda t: t.update({"model.layers.0.mamba.extra": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"model.safetensors: unexpected tensor 'model.layers.0.mamba.extra'"):
        load_model(d)


def test_misshaped_tensor_is_named_with_both_shapes(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    rewrite_tensors(d, lambda t: t.update({"model.layers.1.self_attn.q_proj.weight": np.zeros((64, 32), np.float32)}))
    with pytest.raises(
        CheckpointError, match=r"'model.layers.1.self_attn.q_proj.weight' has shape \(64, 32\).*\(64, 64\)"
    ):
        load_model(d)


def test_integer_tensor_is_refused_not_cast(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    rewrite_tensors(d, lambda t: t.update({"model.layers.1.self_attn.q_proj.weight": np.ones((64, 64), np.int8)}))
    with pytest.raises(
        CheckpointError, match=r"'model.layers.1.self_attn.q_proj.weight' has dtype int8, expected one of float32"
    ):
        load_model(d)


def test_truncated_file(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(d)


def test_config_that_disagrees_with_tensors(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["mamba_d_state"] = 32
    json.dump(cfg, open(cfg_path, "w"))
    disagreement = r"tensor 'model.layers.0.mamba.[a-z_0-9.]+' has shape .* the config implies"
    with pytest.raises(CheckpointError, match=disagreement):
        load_model(d)


def test_untied_config_without_head(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["tie_word_embeddings"] = False
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(CheckpointError, match="no lm_head.weight"):
        load_model(d)


def test_transformers_5_tensor_names_load_the_same_model(tiny_checkpoint, tmp_path):
    """save_pretrained(..., save_original_format=False) writes the MoE tensors under their in-memory names."""
    renames = {
        r"block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
        r"block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
        r"block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight",
    }

    def rename(tensors):
        for name in [n for n in tensors if any(n.endswith(old) for old in renames)]:
            old = next(o for o in renames if name.endswith(o))
            tensors[name[: -len(old)] + renames[old]] = tensors.pop(name)

    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    rewrite_tensors(d, rename)
    assert any("experts.gate_up_proj" in n for n in load_file(os.path.join(d, "model.safetensors")))
    assert_same_parameters(load_model(d), load_model(tiny_checkpoint))


def test_one_tensor_under_two_names_is_refused(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    name = "model.layers.0.block_sparse_moe.router.layer.weight"
    rewrite_tensors(d, lambda t: t.update({"model.layers.0.block_sparse_moe.router.weight": t[name]}))
    with pytest.raises(CheckpointError, match=r"sets layers.0.block_sparse_moe.router.weight, which .* already set"):
        load_model(d)


def test_tied_config_with_a_head_equal_to_the_embedding_loads(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    rewrite_tensors(d, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    assert_same_parameters(load_model(d), load_model(tiny_checkpoint))
    rewrite_tensors(d, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1}))
    with pytest.raises(CheckpointError, match="lm_head.weight differs from the embedding.*tie_word_embeddings=true"):
        load_model(d)


def test_index_decides_which_shard_holds_each_tensor(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    tensors = load_file(os.path.join(d, "model.safetensors"))
    save_file({"model.norm.weight": tensors["model.norm.weight"] * 2}, os.path.join(d, "extra.safetensors"))
    weight_map = {name: "model.safetensors" for name in tensors} | {"model.norm.weight": "extra.safetensors"}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    model = load_model(d)  # model.safetensors' own norm weight is not the one the index names
    np.testing.assert_array_equal(np.asarray(model.norm.weight[...]), tensors["model.norm.weight"] * 2)
    weight_map["model.layers.0.mamba.D"] = "extra.safetensors"
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    with pytest.raises(CheckpointError, match=r"extra.safetensors: no tensor 'model.layers.0.mamba.D', though"):
        load_model(d)


@pytest.mark.parametrize(
    "content, message",
    [
        (
            b'{"weight_map": {"model.norm.weight": 5}}',
            "weight_map['model.norm.weight']: expected the file name of a shard",
        ),
        (b'{"weight_map": {"model.norm.weight": "../model.safetensors"}}', "got '../model.safetensors'"),
        (b'{"weight_map": {"model.norm.weight": ""}}', "weight_map['model.norm.weight']: expected the file name"),
        (b'{"weight_map": {}}', "weight_map: expected a non-empty object of tensor name -> shard file, got {}"),
        (b'{"metadata": {}}', "weight_map: expected a non-empty object of tensor name -> shard file, got None"),
        (b"[1, 2]", "expected a JSON object, got array"),
        (b'{"weight_map": {}}\xff', "not UTF-8 text (byte 0xff at offset 18)"),
        (b'{"weight_map": ', "not valid JSON"),
    ],
)
def test_bad_index_is_named_with_the_entry(tiny_checkpoint, tmp_path, content, message):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    index = os.path.join(d, "model.safetensors.index.json")
    with open(index, "wb") as f:
        f.write(content)
    with pytest.raises(CheckpointError, match=re.escape(f"{index}: ") + ".*" + re.escape(message)):
        load_model(d)


@pytest.mark.parametrize(
    "content, message",
    [(b"[1]", "expected a JSON object, got array"), (b"\xff", "not UTF-8 text"), (b"{", "not valid JSON")],
)
def test_bad_orbax_marker_is_named(tmp_path, content, message):
    d = tmp_path / "orbax"
    (d / "state").mkdir(parents=True)
    (d / MARKER).write_bytes(content)
    with pytest.raises(CheckpointError, match=re.escape(f"{d / MARKER}: {message}")):
        load_model(d)


@pytest.mark.parametrize("argument", ["dtype", "weight_dtype"])
@pytest.mark.parametrize("value", ["bf16", "float33", 5, jnp.int32, jnp.int8, np.float64, True])
def test_unsupported_dtype_is_named_with_the_accepted_ones(tiny_checkpoint, argument, value):
    names = "float32, bfloat16, float16" + (", float8" if argument == "weight_dtype" else "")
    message = rf"{argument} must be one of {names}, got {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=message):
        load_model(tiny_checkpoint, **{argument: value})


@pytest.mark.parametrize("value", ["bfloat16", jnp.bfloat16, np.dtype(jnp.bfloat16), jnp.dtype("bfloat16")])
def test_dtype_given_by_name_or_object_loads(tiny_checkpoint, value):
    model = load_model(tiny_checkpoint, dtype=jnp.float32, weight_dtype=value)
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_weights_are_refused_with_the_tensor_named(tiny_checkpoint, tmp_path, value):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")

    def poison(tensors):
        tensors["model.layers.1.self_attn.o_proj.weight"][3, :5] = value

    rewrite_tensors(d, poison)
    message = r"tensor 'model.layers.1.self_attn.o_proj.weight' holds 5 NaN or infinite value\(s\) of \d+; expected"
    with pytest.raises(CheckpointError, match=message):
        load_model(d)


def test_weights_that_overflow_the_requested_dtype_are_refused(tiny_checkpoint, tmp_path):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    rewrite_tensors(d, lambda t: t["model.layers.0.mamba.D"].__setitem__(0, 1e6))  # float16's largest is 65504
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mamba.D' holds 1 NaN or infinite"):
        load_model(d, dtype="float16")


class Terminal(io.StringIO):
    """A stderr that says it is a terminal, as tqdm asks before drawing."""

    def isatty(self) -> bool:
        return True


def test_the_progress_bar_is_drawn_on_a_terminal_only(tiny_checkpoint, monkeypatch):
    for stream, drawn in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        load_model(tiny_checkpoint, progress=True)
        assert ("loading weights" in stream.getvalue()) == drawn


def test_an_error_during_the_load_leaves_the_bar_on_a_line_of_its_own(tiny_checkpoint, tmp_path, monkeypatch):
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "c")
    rewrite_tensors(d, lambda t: t.update({"model.layers.3.mamba.extra": np.zeros(3, np.float32)}))
    monkeypatch.setattr(sys, "stderr", stream := Terminal())
    with pytest.raises(CheckpointError):
        load_model(d, progress=True)
    drawn = stream.getvalue()
    assert "loading weights" in drawn and drawn.endswith("\n")  # closed: what prints next starts a line
    monkeypatch.undo()
