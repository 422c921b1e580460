"""The embedded default model (granite_jax/checkpoints/default, trained by configs/train/default.py): it ships within
its size budget, transformers loads it and decodes the same greedy tokens as granite-jax, and `generate` uses it when
no --model is given."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from granite_jax.checkpoint import default_model_dir
from granite_jax.generation import Generator
from granite_jax.training import quality

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef read_lines(path):\n", "class Stack:\n    def __init__(self):\n"]


@pytest.fixture(scope="module")
def model_dir() -> str:
    path = default_model_dir()
    assert path is not None, "granite_jax/checkpoints/default is missing: it ships with the package"
    return path


def test_it_is_a_small_granite_hybrid_within_20_mb(model_dir):
    size = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir))
    assert size <= 20 * 2**20, size
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "granitemoehybrid"
    assert {"mamba", "attention"} <= set(config["layer_types"])
    assert config["num_local_experts"] > 0 and config["shared_intermediate_size"] > 0
    assert config["position_embedding_type"] == "nope"


def test_transformers_decodes_the_same_greedy_tokens(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = Generator(model_dir, dtype="float32", weight_dtype="float32")
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        expected = out[0, ids.shape[1] :].tolist()
        got = generator.generate(prompt, max_new_tokens=24, stop_token_ids=())[0]
        assert len(set(expected)) > 4  # a continuation, not one token repeated
        assert list(got.token_ids) == expected, (prompt, got.text, tokenizer.decode(expected))


def test_generate_completes_python_with_it_by_default():
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-m", "granite_jax.generate", "--prompt", "def add(a, b):", "--max-new-tokens", "48"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    body = quality.function_body(out.stdout)  # greedy: a whole body, cut where it dedents, that parses
    assert quality.parses("def add(a, b):", body) and "return" in body, out.stdout
