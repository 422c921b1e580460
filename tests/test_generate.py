"""The generate command: its help, its output (streamed, plain, JSON) equal to the Generator's, and bad input as one
line with exit status 2. In this process through `main`, but for one run of `python -m granite_jax.generate`."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys

import jax
import pytest

from granite_jax import cli, generate
from granite_jax.generation import Generator

PROMPTS = ["Granite is a family of language models.", "The quick"]


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoint) -> str:
    return hf_checkpoint(initializer_range=1.0)  # large weights: continuations that vary token to token


@pytest.fixture(scope="module")
def generator(checkpoint) -> Generator:
    return Generator(checkpoint)


def run(capsys, monkeypatch, *args: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `main(args)` in this process, with `stdin` as standard input."""
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    capsys.readouterr()
    try:
        code = generate.main(list(args))
    except SystemExit as e:  # argparse's errors and --help
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def test_help_explains_every_flag(capsys, monkeypatch):
    code, text, _ = run(capsys, monkeypatch, "--help")
    assert code == 0
    for flag in (
        "--model",
        "--prompt ",
        "--prompt-file",
        "--chat",
        "--system",
        "--max-new-tokens",
        "--temperature",
        "--top-k",
        "--top-p",
        "--seed",
        "--stop ",
        "--stop-token-id",
        "--ignore-eos",
        "--dtype",
        "--weight-dtype",
        "--ssd-impl",
        "--prefill-chunk",
        "--decode-chunk",
        "--max-cache-len",
        "--no-pack-weights",
        "--stream",
        "--no-stream",
        "--json",
        "--quiet",
    ):
        assert flag in text, flag


ERRORS = [  # (arguments, stdin, expected message)
    (("--model", "/nonexistent/model", "--prompt", "hi"), None, "/nonexistent/model: model directory not found"),
    (("--model", "{ckpt}"), b"\xff\xfehello", "standard input: not valid UTF-8"),
    (
        ("--model", "{ckpt}", "--prompt", "hi", "--temperature", "1", "--top-p", "0"),
        None,
        "top_p must be a number in (0, 1]",
    ),
    (("--model", "{ckpt}", "--prompt", "hi", "--max-new-tokens", "0"), None, "max_new_tokens must be an integer"),
    (("--model", "{ckpt}", "--prompt", "hi", "--decode-chunk", "0"), None, "argument --decode-chunk: must be >= 1"),
    (("--model", "{ckpt}", "--prompt", "hi", "--temperature", "x"), None, "invalid float value"),
    (("--model", "{ckpt}", "--prompt", "hi", "--stream", "--json"), None, "--stream and --json exclude each other"),
    (("--model", "{ckpt}", "--prompt", "hi", "--system", "be brief"), None, "--system needs --chat"),
    (("--model", "{ckpt}", "--prompt", ""), None, "prompt 1 is empty"),  # found before the load: no progress bar
    (("--model", "{ckpt}"), b"", "prompt 1 is empty"),
    (("--model", "{rope}", "--prompt", "x" * 100, "--quiet"), None, "longer than max_position_embeddings=64"),
    (("--model", "{ckpt}", "--prompt", "ab\udcff", "--quiet"), None, "prompt 1 is not valid UTF-8"),  # bytes ab\xff
    (("--model", "{ckpt}", "--prompt", "hi", "--stop-token-id", "99999", "--quiet"), None, "stop token id 99999"),
    (("--model", "{badtok}", "--prompt", "hi", "--quiet"), None, "cannot load the tokenizer (JSONDecodeError"),
    # sampling flags that greedy decoding would ignore
    (("--model", "{ckpt}", "--prompt", "hi", "--top-p", "0.9"), None, "top_p=0.9 needs temperature > 0: greedy"),
    (("--model", "{ckpt}", "--prompt", "hi", "--top-k", "5"), None, "top_k=5 needs temperature > 0: greedy"),
    (("--model", "{ckpt}", "--prompt", "hi", "--seed", "3"), None, "seed=3 needs temperature > 0: greedy"),
    (
        ("--model", "{ckpt}", "--prompt", "hi", "--temperature", "inf"),
        None,
        "temperature must be a finite number >= 0 (0: greedy), got inf",
    ),
    (("--model", "{ckpt}", "--prompt", "hi", "--compilation-cache", "/proc/x"), None, "--compilation-cache /proc/x:"),
]


def test_errors_are_one_line_with_exit_status_2(hf_checkpoint, checkpoint, tmp_path, capsys, monkeypatch):
    rope = hf_checkpoint(position_embedding_type="rope", rope_theta=10000.0, max_position_embeddings=64)
    badtok = shutil.copytree(checkpoint, tmp_path / "badtok")
    (badtok / "tokenizer.json").write_text("{")
    for args, stdin, message in ERRORS:
        argv = [a.format(ckpt=checkpoint, rope=rope, badtok=badtok) for a in args]
        code, _, err = run(capsys, monkeypatch, *argv, stdin=stdin)
        assert code == 2 and len(err.splitlines()) == 1 and message in err, (args, err)
        assert err.startswith("granite_jax.generate: error: "), err


def test_the_command_exits_2_without_a_traceback():
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-m", "granite_jax.generate", "--model", "/nonexistent/model", "--prompt", "hi"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 2 and "/nonexistent/model" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the Pallas kernels run here")
def test_pallas_without_a_gpu_is_refused_before_loading(checkpoint, capsys, monkeypatch):
    code, _, err = run(capsys, monkeypatch, "--model", checkpoint, "--prompt", "hi", "--ssd-impl", "pallas")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("granite_jax.generate: error: --ssd-impl: ssd_impl='pallas' needs an NVIDIA GPU"), err


def test_json_output_is_the_generators(checkpoint, generator, capsys, monkeypatch):
    prompts = ("--prompt", PROMPTS[0], "--prompt", PROMPTS[1])
    code, out, err = run(capsys, monkeypatch, "--model", checkpoint, *prompts, "--max-new-tokens", "6", "--json")
    assert code == 0, err
    doc = json.loads(out)
    expected = generator.generate(PROMPTS, max_new_tokens=6)
    assert [r["text"] for r in doc["results"]] == [r.text for r in expected]
    assert [r["token_ids"] for r in doc["results"]] == [list(r.token_ids) for r in expected]
    assert doc["prefill_tokens_per_s"] > 0 and doc["decode_tokens_per_s"] > 0
    assert doc["dtype"] == doc["weight_dtype"] == "float32"


def test_a_bfloat16_checkpoint_keeps_its_weights_as_the_api_does(hf_checkpoint, capsys, monkeypatch):
    d = hf_checkpoint(initializer_range=1.0, dtype="bfloat16")
    args = ("--model", d, "--prompt", PROMPTS[0], "--max-new-tokens", "6", "--ignore-eos", "--json")
    code, out, err = run(capsys, monkeypatch, *args)
    assert code == 0, err
    doc = json.loads(out)
    api = Generator(d)  # weight_dtype "auto", as the command's default
    assert (doc["dtype"], doc["weight_dtype"]) == ("float32", api.weight_dtype)
    expected = api.generate(PROMPTS[0], max_new_tokens=6, stop_token_ids=())[0]
    assert doc["results"][0]["token_ids"] == list(expected.token_ids)


def test_a_single_prompt_streams_its_text(checkpoint, generator, capsys, monkeypatch):
    args = ("--model", checkpoint, "--prompt", PROMPTS[1], "--max-new-tokens", "5", "--chat", "--quiet")
    code, out, err = run(capsys, monkeypatch, *args)
    assert code == 0, err
    assert out == generator.generate(PROMPTS[1], max_new_tokens=5, chat=True)[0].text + "\n"


def test_a_batch_prints_each_text_under_its_prompt(checkpoint, generator, capsys, monkeypatch, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n")
    args = ("--model", checkpoint, "--prompt-file", str(prompts), "--max-new-tokens", "4", "--quiet")
    code, out, err = run(capsys, monkeypatch, *args)
    assert code == 0, err
    expected = generator.generate(PROMPTS, max_new_tokens=4)
    texts = [cli.printable(r.text) for r in expected]  # control characters escaped
    assert out == "".join(
        f"=== prompt {i + 1} ({r.finish_reason}) ===\n{t}\n" for i, (r, t) in enumerate(zip(expected, texts))
    )


def test_a_prompt_files_byte_order_mark_is_dropped(checkpoint, capsys, monkeypatch, tmp_path):
    (tmp_path / "bom.txt").write_bytes("\ufeffGranite is".encode())
    args = ("--model", checkpoint, "--max-new-tokens", "2", "--json")
    code, out, _ = run(capsys, monkeypatch, *args, "--prompt-file", str(tmp_path / "bom.txt"))
    assert code == 0
    with_bom = json.loads(out)["results"][0]
    _, out, _ = run(capsys, monkeypatch, *args, "--prompt", "Granite is")
    assert with_bom["prompt"] == "Granite is" and with_bom == json.loads(out)["results"][0]


def test_control_characters_are_escaped_on_the_terminal_not_in_json(checkpoint, capsys, monkeypatch):
    text = "a\x1b[2Jb\rc\td\n\u202ee\x7f"  # clear screen, carriage return, a right-to-left override, DEL
    original = Generator.generate

    def generate_with_text(self, prompts, *args, **kwargs):
        results = original(self, prompts, *args, **kwargs)
        callback = kwargs.get("stream_callback")
        if callback is not None:
            callback(0, text)
        return [dataclasses.replace(r, text=text) for r in results]

    monkeypatch.setattr(Generator, "generate", generate_with_text)
    escaped = "a\\x1b[2Jb\\x0dc\td\n\\u202ee\\x7f"
    args = ("--model", checkpoint, "--prompt", "hi", "--max-new-tokens", "1")
    for flags in (("--no-stream",), ("--stream",)):
        code, out, _ = run(capsys, monkeypatch, *args, *flags)
        assert code == 0 and out.endswith(escaped + "\n") and "\x1b" not in out, (flags, out)
    code, out, _ = run(capsys, monkeypatch, *args, "--json")
    assert json.loads(out)["results"][0]["text"] == text


def test_compilation_cache_in_the_users_cache_directory_by_default(checkpoint, tmp_path):
    # A fresh interpreter: JAX sets its persistent cache up once per process, at the first compilation.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "GRANITE_JAX_COMP"))}
    env |= dict(JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(tmp_path / "cache"))
    command = [sys.executable, "-m", "granite_jax.generate", "--model", checkpoint, "--prompt", "hi", "--quiet"]
    out = subprocess.run([*command, "--max-new-tokens", "1"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert len(os.listdir(tmp_path / "cache" / "granite-jax" / "xla")) > 2  # the prefill and the load's programs


def test_compilation_cache_setting(monkeypatch, tmp_path):
    from granite_jax import cli

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(cli.CACHE_ENV, raising=False)
    assert cli.compilation_cache_dir(None) == str(tmp_path / "granite-jax" / "xla")
    assert cli.compilation_cache_dir("off") is None and cli.compilation_cache_dir(str(tmp_path / "c")) == str(
        tmp_path / "c"
    )
    monkeypatch.setenv(cli.CACHE_ENV, "0")
    assert cli.compilation_cache_dir(None) is None
    monkeypatch.setenv(cli.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert cli.compilation_cache_dir(None) == str(tmp_path / "elsewhere")
    assert cli.compilation_cache_dir("off") is None  # the flag wins
