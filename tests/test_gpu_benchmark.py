"""benchmarks/gpu_ssd.py and gpu_generate.py, the prepared GPU runs: they must work end to end before the device time
is spent. Their CPU smoke runs (the Pallas kernels interpreted) run in this process (`main(argv)`); the scripts' exit
status as processes is checked in test_benchmarks.py."""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys

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
        if name.startswith("decode"):  # the Generator's GPU options put every kernel of a decode step in CUDA graphs
            assert totals["kernels_outside_graphs"] == 0, totals
        assert totals["predicted_s"] >= floor["seconds"] * 0.5, (name, totals, floor)  # same rates, same work
        assert sum(r["count"] for r in result["launches"] if r["kind"] not in ("copy", "wait")) == totals["kernels"]
    assert f"| {step} | {doc['steps'][step]['totals']['kernels']} |" in stdout
    over = runpy.run_path(report)["over_budget"](doc, {name: n - 1 for name, n in budget.items()})
    assert len(over) == len(budget) and "over its budget" in over[0]  # one kernel more than recorded fails


CHECK_SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")


def _trace(kernels: list[tuple[str, float, float, dict]]) -> dict:
    """A profiler trace as `jax.profiler` writes it: a host process with a Python thread, and the GPU's process with
    a stream thread (the kernels) and XLA's derived op line (the same kernels again, not to be counted twice)."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 1, "tid": 10, "name": "thread_name", "args": {"name": "python"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    events = [{"ph": "X", "pid": 1, "tid": 10, "name": "PjitFunction(decode_step)", "ts": 0, "dur": 500}]
    for name, ts, dur, args in kernels:
        events += [
            {"ph": "X", "pid": 2, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args} for tid in (7, 8)
        ]
    return {"traceEvents": meta + events}


def test_profile_splits_device_time_by_kernel_category_and_idle_gaps():
    split = script_main(CHECK_SCRIPT).__globals__["device_time_split"]
    trace = _trace([
        ("gemm_fusion_dot.6", 0, 10, {}),
        ("input_reduce_fusion.26", 10, 4, {"tf_op": "jit(decode_step)/rk,rkn->rn/dot_general"}),  # an expert GEMV
        ("ssd_decode", 16, 5, {}),  # 2 us idle before it
        ("fusion.13", 21, 1, {"tf_op": "jit(decode_step)/top_k"}),
        ("input_reduce_fusion.22", 22, 2, {"tf_op": "jit(decode_step)/reduce_sum"}),
        ("MemcpyD2H", 30, 1, {}),  # 6 us idle before it
        ("flash_fwd_kernel", 24, 3, {}),  # out of order, inside the gap: 3 of its 6 us busy
        # the Pallas decode kernels, named after their functions
        ("mamba_step", 31, 1, {}), ("decode_attention", 32, 1, {}), ("rms_norm", 33, 1, {}), ("route", 34, 1, {}),
        ("experts_up", 35, 1, {}),
    ])  # fmt: skip
    got = split(trace)
    assert got["kernels"] == 12  # the stream's, not the derived op line's or the host's
    assert got["GEMM"] == pytest.approx(15e-6) and got["SSD"] == pytest.approx(6e-6)
    assert got["MoE routing"] == pytest.approx(2e-6) and got["norm/elementwise"] == pytest.approx(3e-6)
    assert got["attention"] == pytest.approx(4e-6) and got["copies"] == pytest.approx(1e-6)
    assert got["idle gaps"] == pytest.approx((2 + 3) * 1e-6)


def test_each_timed_step_stands_beside_its_floor_and_transformers(tmp_path, capsys):
    ns = script_main(CHECK_SCRIPT).__globals__
    compare = {"speed": [  # compare.json's rows: whole prefills, and decodes of new_tokens - 1 steps
        {"batch": b, "prompt_len": 512, "new_tokens": 17, "jax": {"prefill_s": 0.07 * b, "decode_s": 0.016 * 16},
         "hf": {"prefill_s": 0.3 * b, "decode_s": 0.06 * 16}} for b in (1, 8)]}  # fmt: skip
    floors = []

    def floor(kind, batch, tokens, cache_len=0):
        floors.append((kind, batch, tokens, cache_len))
        return {"seconds": 1e-3 * batch * (tokens if kind == "prefill" else 1)}

    rows = {r["step"]: r for r in ns["speed_rows"](compare, floor)}
    assert floors == [("prefill", 1, 512, 0), ("decode", 1, 1, 529), ("prefill", 8, 512, 0), ("decode", 8, 1, 529)]
    decode = rows["decode b8 T512"]
    assert decode["seconds"] == pytest.approx(0.016) and decode["transformers_seconds"] == pytest.approx(0.06)
    assert decode["share_of_floor"] == pytest.approx(8e-3 / 0.016) and decode["vs_transformers"] == pytest.approx(3.75)
    assert rows["prefill b1 T512"]["over_floor"] == pytest.approx(0.07 / 0.512)
    real = ns["model_floor"](ns["shape_config"](smoke=True), "float32")  # gpu_report's floor, on the tiny hybrid
    assert real("prefill", 2, 64)["seconds"] > real("prefill", 1, 32)["seconds"] > 0
    summary = {"steps": list(rows.values()), "correctness": {"tokens": True}}
    ns["plot"](summary, str(tmp_path / "steps.png"))
    assert (tmp_path / "steps.png").read_bytes()[:8] == PNG
    assert "| decode b8 T512 | 16.000 | 50.0% | 60.000 | 3.75x |" in ns["report"](summary)


def test_a_part_that_fails_or_runs_out_is_recorded_and_the_rest_go_on(tmp_path, capsys):
    ns = script_main(CHECK_SCRIPT).__globals__
    result = tmp_path / "r.json"
    result.write_text('{"ok": true}')
    ok = ns["run_part"]("a", [sys.executable, "-c", "print('fine')"], str(result), 60)
    failed = ns["run_part"]("b", [sys.executable, "-c", "import sys; print('broke'); sys.exit(3)"], "/none", 60)
    slow = ns["run_part"]("c", [sys.executable, "-c", "import time; time.sleep(30)"], "/none", 1)
    assert ok["status"] == "ok" and ok["result"] == {"ok": True}
    assert failed["status"] == "exit 3" and "broke" in failed["output_tail"] and "result" not in failed
    assert slow["status"].startswith("timed out after 1 s") and slow["seconds"] < 20
    assert ns["summarize"]([failed | {"part": "tokens"}], True)["correctness"] == {"tokens": False}
    code, _, err = run(capsys, "--parts", "speed,nope", script=CHECK_SCRIPT)
    assert code == 2 and "--parts: unknown part 'nope'" in err
