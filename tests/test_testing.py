"""The random-checkpoint command: what it writes and what it says about it."""

from __future__ import annotations

import os

from granite_jax import testing


def test_the_command_says_what_it_wrote_and_that_its_text_is_gibberish(tmp_path, capfd):
    testing.main([str(tmp_path / "tiny")])
    out, err = capfd.readouterr()  # the file descriptors: the trainer writes from Rust
    assert os.path.isfile(tmp_path / "tiny" / "config.json") and os.path.isfile(tmp_path / "tiny" / "tokenizer.json")
    assert out.startswith(f"wrote a random tiny Granite 4.0 checkpoint to {tmp_path / 'tiny'}"), out
    assert "gibberish by design" in out and f"--model {tmp_path / 'tiny'}" in out
    assert not err.strip() and "\n\n" not in out  # no blank lines from the tokenizer trainer's progress
