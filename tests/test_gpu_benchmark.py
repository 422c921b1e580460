"""benchmarks/gpu_ssd.py and gpu_generate.py, the prepared GPU runs: they must work end to end before the device time
is spent. Their CPU smoke runs (the Pallas kernels interpreted) run in this process (`main(argv)`); the scripts' exit
status as processes is checked in test_benchmarks.py."""

from __future__ import annotations

import functools
import json
import os
import runpy

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_ssd.py")
GENERATE_SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_generate.py")
PNG = b"\x89PNG\r\n\x1a\n"


@functools.cache
def script_main(path: str):
    """The script's `main`, its module run once per process (`runpy`: in `sys.modules` while it runs, as its
    dataclasses need)."""
    return runpy.run_path(path, run_name="script_" + os.path.splitext(os.path.basename(path))[0])["main"]


def run(capsys, *args: str, script: str = SCRIPT) -> tuple[int, str, str]:
    """The script's `main(args)` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = script_main(script)(list(args))
    except SystemExit as e:  # argparse's errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow(10)
def test_smoke_run_checks_times_and_writes_speedups(tmp_path, capsys):
    out = tmp_path / "results" / "gpu.json"
    args = ("--smoke", "--no-layer", "--decode-batches", "1", "--min-seconds", "0.01", "--out", str(out))
    code, _, err = run(capsys, *args)
    assert code == 0, err[-3000:]
    doc = json.loads(out.read_text())
    assert doc["checks_ok"] and all(r.get("ok") for r in doc["results"] if r["kind"] == "check")
    pairs = {(r["kind"], r["impl"]) for r in doc["speedups"]}
    assert {("ssd", "pallas"), ("ssd", "pallas_y16"), ("decode", "pallas")} <= pairs
    timed = {(r["kind"], r.get("L", r.get("batch")), r["impl"]): r["us"] for r in doc["results"] if "us" in r}
    for r in doc["speedups"]:  # each pairs a kernel with xla timed at the same section and size
        assert r["us"] == timed[r["kind"], r["size"], r["impl"]] and r["xla_us"] == timed[r["kind"], r["size"], "xla"]
        assert r["speedup_vs_xla"] == pytest.approx(r["xla_us"] / r["us"])
    ssd_rows = [r for r in doc["speedups"] if r["kind"] == "ssd"]  # against XLA's faster form too (bfloat16 operands)
    assert ssd_rows and all(r["speedup_vs_best_xla"] == pytest.approx(min(r["xla_us"], r["xla_bf16_us"]) / r["us"])
                            for r in ssd_rows)  # fmt: skip
    assert "naive" not in {r["impl"] for r in doc["results"]}  # left out by default (its GPU compile is too slow)
    assert "rewritten" in {r["impl"] for r in doc["results"] if r["kind"] == "ssd"}
    split = [r for r in doc["results"] if r["kind"] == "split"]  # the prefill's three kernels timed apart, per length
    assert sorted((r["L"], r["impl"]) for r in split) == [
        (L, k) for L in (40, 100) for k in ("pallas_local", "pallas_outputs", "pallas_pass")
    ]
    assert all(r["us"] > 0 for r in split)
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == PNG  # the chart beside the JSON
    png.unlink()
    code, _, err = run(capsys, "--replot", str(out))  # redrawn from the JSON alone
    assert code == 0 and png.read_bytes()[:8] == PNG, err[-3000:]
    (tmp_path / "bad.json").write_text("{}")
    code, _, err = run(capsys, "--replot", str(tmp_path / "bad.json"))
    assert code == 2 and "bad.json: cannot draw it (KeyError" in err, err


def test_once_calls_the_prefill_and_measures_nothing(capsys):
    code, out, err = run(capsys, "--smoke", "--once")
    assert code == 0, err[-3000:]
    assert "once: pallas prefill at L=40" in out
    assert "ssd:" not in out and "check:" not in out


def test_unwritable_out_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    for out, message in ((tmp_path, "is a directory"), (tmp_path / "a_file" / "x.json", "cannot create")):
        code, stdout, err = run(capsys, "--smoke", "--out", str(out))
        assert code == 2 and message in err, err
        assert "ssd:" not in stdout  # nothing was measured


@pytest.mark.slow(10)
def test_generation_check_compares_pallas_with_xla(tmp_path, capsys):
    # gpu_generate.py's CPU smoke run: the Generator with the Pallas SSD (interpreted) against XLA's, both dtypes.
    out = tmp_path / "gen.json"
    code, _, err = run(capsys, "--smoke", "--max-new-tokens", "4", "--out", str(out), script=GENERATE_SCRIPT)
    assert code == 0, err[-3000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] and doc["runs"]["float32"]["agreeing_tokens"] == [4, 4]
    for dtype in ("float32", "bfloat16"):
        runs = doc["runs"][dtype]
        assert {len(ids) for impl in ("xla", "pallas") for ids in runs[impl]["token_ids"]} == {4}
        assert runs["pallas"]["decode_tokens_per_s"] > 0
    assert len(set(doc["runs"]["float32"]["xla"]["token_ids"][1])) > 1  # large weights: a varied continuation
    code, _, err = run(capsys, script=GENERATE_SCRIPT)  # no GPU, no --smoke
    assert code == 2 and "no GPU" in err


BUDGET_FILE = os.path.join(ROOT, "benchmarks", "kernel_budget.json")


@pytest.mark.slow(22)
@pytest.mark.aot
@pytest.mark.parametrize("step", sorted(json.load(open(BUDGET_FILE))["kernels"]))
def test_report_keeps_the_steps_within_their_kernel_budget(h200_target, tmp_path, capsys, step):
    # What CI runs: the Generator's steps for h-tiny's first six layers (five Mamba, one attention) compiled for an
    # H200 without a GPU, each step's kernels against the count recorded in benchmarks/kernel_budget.json (a step a
    # test, so that the two workers compile them side by side).
    report = os.path.join(ROOT, "benchmarks", "gpu_report.py")
    out = tmp_path / "report.json"
    code, stdout, err = run(capsys, "--budget", BUDGET_FILE, "--steps", step, "--json", str(out), script=report)
    assert code == 0, err[-3000:]
    doc = json.loads(out.read_text())
    budget = {step: json.load(open(BUDGET_FILE))["kernels"][step]}
    assert (doc["mamba_layers"], doc["attention_layers"]) == (5, 1) and set(doc["steps"]) == set(budget)
    for name, result in doc["steps"].items():
        totals, floor = result["totals"], result["floor"]
        assert 0 < totals["kernels"] <= budget[name] and totals["pallas_calls"] > 0
        assert totals["predicted_s"] >= floor["seconds"] * 0.5, (name, totals, floor)  # same rates, same work
        assert sum(r["count"] for r in result["launches"] if r["kind"] not in ("copy", "wait")) == totals["kernels"]
    assert f"| {step} | {doc['steps'][step]['totals']['kernels']} |" in stdout
    over = runpy.run_path(report)["over_budget"](doc, {name: n - 1 for name, n in budget.items()})
    assert len(over) == len(budget) and "over its budget" in over[0]  # one kernel more than recorded fails
