"""The benchmark scripts' command lines: every flag documented with its default, and bad input refused at once.

A bad argument must end the script with one line on stderr and exit code 2 before any model is loaded or anything
timed (a late failure costs minutes, or loses a finished run's results). Only the argument handling runs here, in this
process (`main(argv)`), and one bad argument per script as a process, for its exit status and its one line: the
scripts themselves are exercised in test_experiment.py, test_gpu_benchmark.py and granite_jax/cpu/tests/.
"""

from __future__ import annotations

import functools
import json
import os
import re
import runpy
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu")
PATHS = {  # script -> its path (the CPU kernels' benchmarks live in their optional package)
    **{
        name: f"benchmarks/{name}"
        for name in (
            "throughput.py",
            "rewrite_ssd.py",
            "gpu_ssd.py",
            "gpu_generate.py",
            "gpu_check.py",
            "memory_saving.py",
            "float8_accuracy.py",
            "first_token.py",
            "mesh_plan.py",
            "sharded_loading.py",
            "serve_load.py",
        )
    },
    "gpu_report.py": "benchmarks/gpu_report.py",
    "kernels.py": "granite_jax/cpu/benchmarks/kernels.py",
    "decode_attention.py": "granite_jax/cpu/benchmarks/decode_attention.py",
}

FLAGS = {
    "throughput.py": (
        "--shape --layers --checkpoint --prompt-len --new-tokens --batch-sizes --dtype --weight-dtype --repeats "
        "--skip-transformers --floor-pairs --probe-mib --json --plot"
    ),
    "kernels.py": "--shape --rows --expert-tokens --contexts --dtype --chain-mib --repeats --parts --json",
    "decode_attention.py": "--shape --layers --weight-dtype --prompt-len --batch --steps --rounds --json",
    "rewrite_ssd.py": (
        "--lengths --batch --heads --head-dim --state --groups --chunk --reps --naive-reps --max-naive-seconds --json"
    ),
    "gpu_ssd.py": (
        "--lengths --batch --dtype --naive-max-len --skip --budget-seconds --no-layer --no-split --sweep --sweep-len "
        "--decode-batches --min-seconds --peak-tflops --peak-gbs --out --smoke --replot --once"
    ),
    "gpu_generate.py": "--max-new-tokens --repeats --out --smoke",
    "gpu_check.py": "--parts --budget-seconds --out-dir --smoke",
    "gpu_report.py": (
        "--shape --layers --steps --dtype --weight-dtype --ssd-impl --cache-len --gpu --no-per-layer --top --json "
        "--budget --record-budget"
    ),
    "memory_saving.py": "--shape --capacity --sessions --contexts --dtype --json --png",
    "float8_accuracy.py": "--model --prompts --prompt-len --new-tokens --json",
    "first_token.py": "--model --prompt --max-new-tokens --runs --json",
    "mesh_plan.py": "--shape --devices --steps --cache-len --json",
    "sharded_loading.py": "--model --mesh --json",
    "serve_load.py": (
        "--model --shape --layers --dtype --concurrency --seconds --max-tokens --max-batch "
        "--prefill-budget --feed-below --out"
    ),
}

# (script, arguments, part of the one error line); {missing} is a JSON path in a directory that does not exist,
# {dir} an existing directory
BAD = [
    ("throughput.py", ["--batch-sizes", "1,x"], "argument --batch-sizes: expected comma-separated positive integers"),
    ("throughput.py", ["--batch-sizes", ""], "argument --batch-sizes: expected comma-separated positive integers"),
    ("throughput.py", ["--batch-sizes", "1,0"], "argument --batch-sizes: every value must be >= 1"),
    ("throughput.py", ["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    ("throughput.py", ["--prompt-len", "0"], "argument --prompt-len: must be >= 1"),
    ("throughput.py", ["--layers", "0"], "argument --layers: must be >= 1"),
    ("throughput.py", ["--new-tokens", "1"], "need --new-tokens >= 2"),
    ("throughput.py", ["--json", "{dir}"], "is a directory"),
    ("kernels.py", ["--shape", "nosuch"], "argument --shape: invalid choice: 'nosuch'"),
    ("kernels.py", ["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    ("kernels.py", ["--json", "{dir}"], "is a directory"),
    ("kernels.py", ["--contexts", "0"], "argument --contexts: every value must be >= 1"),
    ("decode_attention.py", ["--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
    ("decode_attention.py", ["--shape", "nosuch"], "argument --shape: invalid choice: 'nosuch'"),
    ("decode_attention.py", ["--json", "{dir}"], "is a directory"),
    ("rewrite_ssd.py", ["--heads", "0"], "argument --heads: must be >= 1, got 0"),
    ("rewrite_ssd.py", ["--chunk", "0"], "argument --chunk: must be >= 1, got 0"),
    ("rewrite_ssd.py", ["--groups", "5"], "--heads must be a multiple of --groups"),
    ("rewrite_ssd.py", ["--lengths", "512", "0"], "argument --lengths: must be >= 1, got 0"),
    ("rewrite_ssd.py", ["--batch", "x"], "argument --batch: expected a positive integer, got 'x'"),
    ("rewrite_ssd.py", ["--json", "{missing}"], "the directory does not exist"),
    ("rewrite_ssd.py", ["--json", "{dir}"], "is a directory"),
    ("gpu_generate.py", ["--smoke", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    ("gpu_generate.py", ["--smoke", "--repeats", "x"], "argument --repeats: expected a positive integer, got 'x'"),
    ("gpu_generate.py", ["--smoke", "--out", "{dir}"], "is a directory"),
    ("gpu_check.py", ["--smoke", "--parts", "tokens,speeds"], "--parts: unknown part 'speeds'; expected some of"),
    ("gpu_check.py", ["--smoke", "--budget-seconds", "0"], "argument --budget-seconds: must be > 0"),
    ("gpu_ssd.py", ["--smoke", "--decode-batches", "x"], "argument --decode-batches: expected comma-separated"),
    ("gpu_ssd.py", ["--smoke", "--lengths", "64"], "--lengths does not apply with --smoke"),
    ("gpu_ssd.py", ["--smoke", "--lengths", "2048,8192,32768"], "--lengths does not apply with --smoke"),
    ("gpu_ssd.py", ["--lengths", "2048,x"], "argument --lengths: expected comma-separated positive integers"),
    ("gpu_ssd.py", ["--smoke", "--batch", "0"], "argument --batch: must be >= 1, got 0"),
    ("gpu_ssd.py", ["--smoke", "--sweep", "--sweep-len", "0"], "argument --sweep-len: must be >= 1"),
    ("gpu_ssd.py", ["--smoke", "--skip", "palas"], "argument --skip: unknown palas"),
    ("gpu_ssd.py", ["--smoke", "--peak-gbs", "0"], "argument --peak-gbs: must be > 0"),
    ("gpu_report.py", ["--steps", "decode-b2"], "--steps: unknown step 'decode-b2'; expected some of prefill-512,"),
    ("gpu_report.py", ["--layers", "0"], "argument --layers: must be >= 1, got 0"),
    ("gpu_report.py", ["--json", "{missing}"], "the directory does not exist"),
    ("gpu_report.py", ["--budget", "{dir}"], "not a kernel budget (IsADirectoryError"),
    ("memory_saving.py", ["--sessions", "0"], "argument --sessions: every value must be >= 1"),
    ("float8_accuracy.py", ["--prompts", "0"], "argument --prompts: must be >= 1, got 0"),
    ("float8_accuracy.py", ["--json", "{dir}"], "is a directory"),
    ("first_token.py", ["--runs", "0"], "argument --runs: must be >= 1, got 0"),
    ("mesh_plan.py", ["--devices", "2,9"], "--devices '2,9': expected comma-separated sizes from 1 to 8"),
    ("mesh_plan.py", ["--steps", "decode-b2"], "--steps: unknown step 'decode-b2'; expected some of decode-b1,"),
    ("mesh_plan.py", ["--json", "{dir}"], "is a directory"),
    ("sharded_loading.py", ["--model", "{missing}"], "model directory not found"),
    ("sharded_loading.py", ["--json", "{dir}"], "is a directory"),
    ("serve_load.py", ["--concurrency", "1,0"], "argument --concurrency: every value must be >= 1"),
    ("serve_load.py", ["--layers", "4"], "--layers needs --shape"),
    ("serve_load.py", ["--out", "{missing}"], "the directory does not exist"),
]

FIRST_BAD = {script: (args, message) for script, args, message in reversed(BAD)}  # each script's first case


def arguments(args: list[str], tmp_path) -> list[str]:
    return [a.format(missing=tmp_path / "no" / "x.json", dir=tmp_path) for a in args]


@functools.cache
def script_main(script: str):
    """The script's `main`, its module run once per process (`runpy`: the module is in `sys.modules` while it runs,
    as its dataclasses need)."""
    return runpy.run_path(os.path.join(ROOT, PATHS[script]), run_name="script_" + script.removesuffix(".py"))["main"]


def in_process(script: str, args: list[str], capsys) -> tuple[int, str, str]:
    """The script's `main(args)` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = script_main(script)(args)
    except SystemExit as e:  # argparse's errors, and --help
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("script", "args", "message"), BAD, ids=[f"{s} {' '.join(a)}" for s, a, _ in BAD])
def test_bad_arguments_end_with_one_line_before_any_work(script, args, message, tmp_path, capsys):
    code, out, err = in_process(script, arguments(args, tmp_path), capsys)
    lines = err.splitlines()
    assert code == 2, err[-3000:]
    assert len(lines) == 1 and ": error: " in lines[0], err[-3000:]  # no usage block
    assert message in lines[0] and "Traceback" not in err, lines
    assert out == ""  # nothing measured, no progress
    assert not (tmp_path / "no").exists()  # and no output directory made


@pytest.mark.parametrize("script", sorted(FIRST_BAD))
def test_a_bad_argument_ends_the_script_with_exit_2(script, tmp_path):
    args, message = FIRST_BAD[script]
    command = [sys.executable, PATHS[script], *arguments(args, tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"{script}: error: ") and message in lines[0], lines  # named after the script
    assert proc.stdout == "" and "Traceback" not in proc.stderr


@pytest.mark.parametrize("script", sorted(FLAGS))
def test_help_documents_every_flag_and_its_default(script, capsys):
    code, out, err = in_process(script, ["--help"], capsys)
    assert code == 0, err[-3000:]
    options = out.split("options:")[1]
    # one entry per flag: its line and its help text's lines, up to the next flag
    entries = {m.group(1): m.group(0) for m in re.finditer(r"^  (--[\w-]+).*\n(?:(?!  -).*\n?)*", options, re.M)}
    assert sorted(entries) == sorted(FLAGS[script].split())
    for flag, text in entries.items():
        assert "(default: " in " ".join(text.split()), f"{script} {flag}: no help text or no default shown:\n{text}"


def test_memory_saving_predicts_the_hybrid_saving_more_as_the_context_grows(tmp_path, capsys):
    from conftest import load_script

    out = tmp_path / "saving.json"
    script = load_script(os.path.join(ROOT, "benchmarks/memory_saving.py"))
    # h-350m: the same comparison as h-tiny's at half the cost of building the abstract models; 2 GB: a short fit
    args = ["--shape", "granite-4.0-h-350m", "--contexts", "4096,65536", "--sessions", "2", "--capacity", "2GB"]
    assert script.main([*args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "prediction" and doc["capacity_bytes"] == 2e9 and "| 64K | 2 |" in capsys.readouterr().out
    (short, long), (h, a) = doc["rows"], (doc["configs"]["hybrid"], doc["configs"]["attention_only"])
    assert a["layers"] == h["layers"] == len(a["attention_layers"]) > len(h["attention_layers"])  # all attention
    assert a["q_heads"] * a["head_dim"] == a["hidden_size"] == h["hidden_size"]  # micro's layout at the same width
    per_token = {k: len(c["attention_layers"]) * c["kv_heads"] * c["head_dim"] for k, c in (("h", h), ("a", a))}
    for r in (short, long):  # the KV caches in proportion to their layers' kv heads * head_dim
        assert r["attention_only"]["kv_cache"] * per_token["h"] == r["hybrid"]["kv_cache"] * per_token["a"]
    assert long["saving_total"] > short["saving_total"] and long["saving_kv_and_state"] > short["saving_kv_and_state"]
    for r, model in ((r, m) for r in (short, long) for m in ("hybrid", "attention_only")):
        assert r[f"{model}_fits"] == (r[model]["total"] <= 2e9)
    assert doc["fits"][0]["hybrid_context"] > doc["fits"][0]["attention_only_context"] > 0
