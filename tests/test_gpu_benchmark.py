"""benchmarks/gpu_ssd.py, the one prepared GPU run: it must work end to end before the device time is spent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_ssd.py")
GENERATE_SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_generate.py")
ENV = dict(os.environ, JAX_PLATFORMS="cpu")
PNG = b"\x89PNG\r\n\x1a\n"


def run(*args: str, cwd: str, script: str = SCRIPT) -> subprocess.CompletedProcess:
    command = [sys.executable, script, *args]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=cwd, timeout=900)


def test_smoke_run_checks_times_and_writes_speedups(tmp_path):
    out = tmp_path / "results" / "gpu.json"
    proc = run("--smoke", "--no-layer", "--decode-batches", "1", "--out", str(out), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["checks_ok"] and all(r.get("ok") for r in doc["results"] if r["kind"] == "check")
    pairs = {(r["kind"], r["impl"]) for r in doc["speedups"]}
    assert {("ssd", "pallas"), ("ssd", "pallas_y16"), ("decode", "pallas")} <= pairs
    timed = {(r["kind"], r.get("L", r.get("batch")), r["impl"]): r["us"] for r in doc["results"] if "us" in r}
    for r in doc["speedups"]:  # each pairs a kernel with xla timed at the same section and size
        assert r["us"] == timed[r["kind"], r["size"], r["impl"]] and r["xla_us"] == timed[r["kind"], r["size"], "xla"]
        assert r["speedup_vs_xla"] == pytest.approx(r["xla_us"] / r["us"])
    assert "naive" not in {r["impl"] for r in doc["results"]}  # left out by default (its GPU compile did not end)
    assert "rewritten" in {r["impl"] for r in doc["results"] if r["kind"] == "ssd"}
    split = [r for r in doc["results"] if r["kind"] == "split"]  # the prefill's three kernels timed apart, per length
    assert sorted((r["L"], r["impl"]) for r in split) == [
        (L, k) for L in (40, 100) for k in ("pallas_local", "pallas_outputs", "pallas_pass")
    ]
    assert all(r["us"] > 0 for r in split)
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == PNG  # the chart beside the JSON
    png.unlink()
    proc = run("--replot", str(out), cwd=str(tmp_path))  # redrawn from the JSON alone
    assert proc.returncode == 0 and png.read_bytes()[:8] == PNG, proc.stderr[-3000:]
    (tmp_path / "bad.json").write_text("{}")
    proc = run("--replot", str(tmp_path / "bad.json"), cwd=str(tmp_path))
    assert proc.returncode == 2 and "bad.json: cannot draw it (KeyError" in proc.stderr, proc.stderr


def test_once_calls_the_prefill_and_measures_nothing(tmp_path):
    proc = run("--smoke", "--once", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "once: pallas prefill at L=40" in proc.stdout
    assert "ssd:" not in proc.stdout and "check:" not in proc.stdout


def test_unwritable_out_is_refused_before_any_work(tmp_path):
    (tmp_path / "a_file").write_text("")
    for out, message in ((tmp_path, "is a directory"), (tmp_path / "a_file" / "x.json", "cannot create")):
        proc = run("--smoke", "--out", str(out), cwd=str(tmp_path))
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert "ssd:" not in proc.stdout  # nothing was measured


def test_generation_check_compares_pallas_with_xla(tmp_path):
    # gpu_generate.py's CPU smoke run: the Generator with the Pallas SSD (interpreted) against XLA's, both dtypes.
    out = tmp_path / "gen.json"
    proc = run("--smoke", "--out", str(out), cwd=str(tmp_path), script=GENERATE_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] and doc["runs"]["float32"]["agreeing_tokens"] == [8, 8]
    for dtype in ("float32", "bfloat16"):
        runs = doc["runs"][dtype]
        assert {len(ids) for impl in ("xla", "pallas") for ids in runs[impl]["token_ids"]} == {8}
        assert runs["pallas"]["decode_tokens_per_s"] > 0
    assert len(set(doc["runs"]["float32"]["xla"]["token_ids"][1])) > 1  # large weights: a varied continuation
    proc = run(cwd=str(tmp_path), script=GENERATE_SCRIPT)  # no GPU, no --smoke
    assert proc.returncode == 2 and "no GPU" in proc.stderr


@pytest.mark.aot
def test_step_kernels_counts_and_splits_the_decode_step(h200_target, tmp_path):
    # h-tiny's first six layers (five Mamba, one attention) compiled for an H200 without a GPU: the decode step's
    # kernel launches, and one layer of each kind plus the rest adding up to them (up to XLA fusing across layers).
    out = tmp_path / "steps.json"
    args = ["--layers", "6", "--prompt-len", "64", "--cache-len", "128", "--json", str(out)]
    proc = run(*args, cwd=ROOT, script=os.path.join(ROOT, "benchmarks", "gpu_step_kernels.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert (doc["mamba_layers"], doc["attention_layers"]) == (5, 1)
    parts, kernels = doc["decode_parts"], "kCustomKernel"
    assert parts["mamba_layer"][kernels] > 0 and parts["attention_layer"][kernels] > 0 and parts["rest"][kernels] > 0
    total = 5 * parts["mamba_layer"][kernels] + parts["attention_layer"][kernels] + parts["rest"][kernels]
    assert total == pytest.approx(doc["steps"]["decode"][kernels], rel=0.05)
    assert doc["steps"]["prefill"][kernels] > doc["steps"]["decode"][kernels]
    assert "| decode: mamba layer |" in proc.stdout
