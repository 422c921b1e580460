"""Float8 weights: the matrices in float8 (e4m3) with one scale per output channel, from a wider checkpoint (quantized
at load or by convert) or from a checkpoint in the released FP8 ones' format (written here by torch, independently)."""

from __future__ import annotations

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from granite_jax import Generator, gpu
from granite_jax.checkpoint import CheckpointError, load_model
from granite_jax.convert import main as convert_main
from granite_jax.generate import main as generate_main
from granite_jax.model import FLOAT8, quantize, scaled_linear, weight_dtype
from granite_jax.testing import make_float8_checkpoint

TOKENS = np.random.RandomState(0).randint(0, 300, (2, 24))


@pytest.fixture(scope="module")
def float8_checkpoint(tiny_checkpoint, tmp_path_factory) -> str:
    return make_float8_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("fp8") / "ckpt")


def logits(model) -> np.ndarray:
    return np.asarray(model(jnp.asarray(TOKENS)).astype(jnp.float32))


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_quantize_keeps_each_output_channel_within_float8_rounding():
    w = np.random.RandomState(1).standard_normal((6, 40)).astype(np.float32) * np.logspace(-3, 2, 6)[:, None]
    w[2] = 0.0
    q, scale = quantize(jnp.asarray(w), axis=1)
    assert q.dtype == FLOAT8 and scale.shape == (6,) and float(scale[2]) == 1.0
    back = np.asarray(q, np.float64) * np.asarray(scale, np.float64)[:, None]
    np.testing.assert_allclose(np.abs(back).max(1), np.abs(w).max(1), rtol=1e-6)  # each channel's max is exact
    # e4m3: 3 mantissa bits (half a step: 2^-4 relative), subnormals below 2^-6 in steps of 2^-9 (in scale units)
    assert np.all(np.abs(back - w) <= 2.0**-4 * np.abs(w) + 2.0**-10 * np.asarray(scale)[:, None])


def test_scaled_linear_is_the_product_with_the_dequantized_matrix():
    rng = np.random.RandomState(2)
    x, w = rng.standard_normal((5, 64)).astype(np.float32), rng.standard_normal((24, 64)).astype(np.float32)
    q, scale = quantize(jnp.asarray(w), axis=1)
    exact = np.asarray(x, np.float64) @ (np.asarray(q, np.float64) * np.asarray(scale, np.float64)[:, None]).T
    np.testing.assert_allclose(np.asarray(scaled_linear(jnp.asarray(x), q, scale)), exact, rtol=1e-5, atol=1e-5)


def test_a_released_format_checkpoint_means_its_dequantized_values(tiny_checkpoint, float8_checkpoint, tmp_path):
    # The same values written as float32 (q * scale, by torch): equal logits prove the names, layouts and the scales'
    # convention (multiplied, per output channel) are read as the format defines them.
    dequantized = make_float8_checkpoint(tiny_checkpoint, tmp_path / "deq", dequantized=True)
    model = load_model(float8_checkpoint, dtype="float32")
    assert weight_dtype(model) == "float8"
    np.testing.assert_allclose(logits(model), logits(load_model(dequantized, dtype="float32")), rtol=1e-5, atol=1e-5)


def test_quantizing_at_load_matches_the_released_format(tiny_checkpoint, float8_checkpoint):
    ours = load_model(tiny_checkpoint, dtype="float32", weight_dtype="float8")
    theirs = load_model(float8_checkpoint, dtype="float32")
    assert relative_error(logits(ours), logits(theirs)) < 1e-3  # their scales are rounded to bfloat16


def test_float8_stays_close_to_bfloat16(tiny_checkpoint):
    reference = logits(load_model(tiny_checkpoint, dtype="bfloat16"))
    quantized = logits(load_model(tiny_checkpoint, dtype="bfloat16", weight_dtype="float8"))
    assert relative_error(quantized, reference) < 0.02
    assert (quantized.argmax(-1) == reference.argmax(-1)).mean() >= 0.95


def test_a_float8_checkpoint_is_not_widened(float8_checkpoint):
    with pytest.raises(
        CheckpointError, match=r"stores float8 weights; load it with weight dtype float8 .* not bfloat16"
    ):
        load_model(float8_checkpoint, dtype="bfloat16", weight_dtype="bfloat16")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda q: q.update(format="pack-quantized"), r"quantization_config\.format: expected 'float-quantized'"),
        (
            lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block"),
            r"config_groups\.group_0\.weights\.strategy: expected 'channel', got 'block'",
        ),
        (
            lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
            r"static activation scales are not supported",
        ),
    ],
)
def test_other_quantizations_are_named_and_refused(float8_checkpoint, tmp_path, edit, message):
    d = shutil.copytree(float8_checkpoint, tmp_path / "q")
    config = json.loads((d / "config.json").read_text())
    edit(config["quantization_config"])
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_model(d, dtype="bfloat16")


def test_convert_to_float8_and_back(tiny_checkpoint, tmp_path, call_main):
    out = tmp_path / "orbax8"
    assert (
        call_main(convert_main, ["--model", tiny_checkpoint, "--out", str(out), "--dtype", "float8", "--quiet"])[0] == 0
    )
    restored = load_model(out, dtype="bfloat16")
    assert weight_dtype(restored) == "float8"
    direct = load_model(tiny_checkpoint, dtype="bfloat16", weight_dtype="float8")
    np.testing.assert_array_equal(logits(restored), logits(direct))


def test_generate_dtype_float8_is_bfloat16_over_float8_weights(tiny_checkpoint, capsys):
    argv = ["--model", tiny_checkpoint, "--prompt", "The quick brown fox", "--max-new-tokens", "6", "--ignore-eos"]
    assert generate_main([*argv, "--dtype", "float8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["weight_dtype"] == "float8"
    python = Generator(tiny_checkpoint, dtype="bfloat16", weight_dtype="float8")
    expected = python.generate("The quick brown fox", max_new_tokens=6, stop_token_ids=[])[0]
    assert doc["results"][0]["token_ids"] == list(expected.token_ids)


def test_generate_refuses_float8_arithmetic_with_other_weights(tiny_checkpoint, call_main):
    code, err = call_main(generate_main, ["--model", tiny_checkpoint, "--dtype", "float8", "--weight-dtype", "float32"])
    assert code == 2 and err == (
        "granite_jax.generate: error: --dtype float8 means float8 weights; --weight-dtype float32 contradicts it"
    )


def test_the_gpu_product_quantizes_activations_per_row():
    rng = np.random.RandomState(3)
    x = rng.standard_normal((8, 256)).astype(np.float32) * np.logspace(-2, 2, 8)[:, None]
    w = rng.standard_normal((32, 256)).astype(np.float32)
    q, scale = quantize(jnp.asarray(w), axis=1)
    exact = x.astype(np.float64) @ (np.asarray(q, np.float64) * np.asarray(scale, np.float64)[:, None]).T
    got = np.asarray(gpu.float8_linear(jnp.asarray(x, jnp.bfloat16), q, scale).astype(jnp.float32))
    # e4m3 keeps 3 mantissa bits: each activation within 2^-4 of itself, uniformly, so a row's outputs are off by about
    # the rounding's rms, 2^-4 / sqrt(3) = 3.6%, whatever the row's magnitude (its scale is its own).
    errors = np.linalg.norm(got - exact, axis=1) / np.linalg.norm(exact, axis=1)
    assert np.all(errors < 0.06) and np.ptp(np.log(errors)) < 1.5


@pytest.mark.aot
def test_float8_weights_run_float8_gemms_on_an_h200(h200_target):
    from pallas_kernels.aot import lower_for_gpu

    x = jax.ShapeDtypeStruct((512, 1536), jnp.bfloat16)
    w, scale = jax.ShapeDtypeStruct((3072, 1536), FLOAT8), jax.ShapeDtypeStruct((3072,), jnp.float32)
    hlo = lower_for_gpu(gpu.float8_linear, (x, w, scale)).compile().as_text()
    # the GEMM fusion's operands are both float8: tensor cores' FP8 product, not a widened one
    operands = r"\(parameter_0: f8e4m3fn\[512,1536\], parameter_1: f8e4m3fn\[3072,1536\]\) -> f32\[512,3072\]"
    assert re.search(r"%gemm_fusion\S* " + operands, hlo), hlo[:3000]
