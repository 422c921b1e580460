"""The checkpoint directory's tokenizer: the one transformers' AutoTokenizer loads, without AutoTokenizer's import
cost where tokenizer_config.json names a fast tokenizer class."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from granite_jax.checkpoint import load_tokenizer
from granite_jax.checkpoint.loading import _tokenizer_class

TEXT = "The quick brown fox<|end_of_text|> jumps\n over  the lazy dog. <|pad|>"


def tokenizer_dir(tiny_checkpoint: str, tmp_path, **edits) -> str:
    """The tiny checkpoint's tokenizer files, with tokenizer_config.json's fields edited (None: removed)."""
    d = tmp_path / "tokenizer"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(tiny_checkpoint, name), d / name)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.update(edits)
    config = {k: v for k, v in config.items() if v is not None}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return os.fspath(d)


@pytest.mark.parametrize("name", ["TokenizersBackend", "GPT2Tokenizer", "PreTrainedTokenizerFast", None])
def test_the_tokenizer_is_the_one_auto_tokenizer_loads(tiny_checkpoint, tmp_path, name):
    d = tokenizer_dir(tiny_checkpoint, tmp_path, tokenizer_class=name)
    ours, auto = load_tokenizer(d), AutoTokenizer.from_pretrained(d, local_files_only=True)
    assert type(ours) is type(auto)
    assert ours(TEXT)["input_ids"] == auto(TEXT)["input_ids"]
    assert ours.decode(auto(TEXT)["input_ids"]) == auto.decode(auto(TEXT)["input_ids"])
    assert (ours.eos_token_id, ours.pad_token_id, ours.all_special_tokens) == (
        auto.eos_token_id,
        auto.pad_token_id,
        auto.all_special_tokens,
    )
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == auto.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize(
    "edits",
    [
        dict(tokenizer_class=None),  # no class named: AutoTokenizer reads config.json
        dict(tokenizer_class="NoSuchTokenizer"),
        dict(tokenizer_class="os.system"),
        dict(auto_map={"AutoTokenizer": ["tokenization.Custom", None]}),  # remote code: AutoTokenizer refuses it
    ],
)
def test_anything_but_a_named_fast_class_is_left_to_auto_tokenizer(tiny_checkpoint, tmp_path, edits):
    assert _tokenizer_class(tokenizer_dir(tiny_checkpoint, tmp_path, **edits)) is AutoTokenizer


def test_loading_the_tokenizer_imports_neither_torch_nor_the_auto_classes(tiny_checkpoint):
    # A fresh interpreter is the point: this process has imported both. AutoTokenizer's import pulls in torch where it
    # is installed (it is, for the comparison with transformers) and indexes every model: ~1.5 s of a command's start.
    code = (
        "import sys; from granite_jax.checkpoint import load_tokenizer; load_tokenizer(sys.argv[1]); "
        "print(sorted(m for m in ('torch', 'transformers.models.auto.tokenization_auto') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code, tiny_checkpoint], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
