"""The CPU kernels' benchmark scripts (granite_jax/cpu/benchmarks/), end to end at tiny settings: what they time,
what they print and write, and bad arguments refused at once. Run in this process (`main(argv)`); one case per script
runs as a process, for its exit status."""

import json
import os
import subprocess
import sys

import pytest

from granite_jax.cpu import build
from granite_jax.cpu.benchmarks import decode_attention, kernels

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
KERNELS = os.path.join(BENCHMARKS, "kernels.py")
DECODE_ATTENTION = os.path.join(BENCHMARKS, "decode_attention.py")

needs_kernels = pytest.mark.skipif(
    build._unsupported() is not None, reason=f"the kernels do not run here: {build._unsupported()}"
)


def run(main, args: list[str], capsys) -> str:
    """`main(args)` in this process, which must succeed: its stdout."""
    capsys.readouterr()
    assert main(args) == 0, capsys.readouterr().err[-3000:]
    return capsys.readouterr().out


@needs_kernels
def test_benchmark_script_times_every_weight_shape(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--parts", "products", "--rows", "1,9", "--chain-mib", "1", "--repeats", "1", "--json", str(out)]
    stdout = run(kernels.main, args, capsys)
    doc = json.loads(out.read_text())
    shapes = {(r["out"], r["inp"]) for r in doc["results"]}
    # h-350m: Mamba in/out, attention q/k/v/o, shared-MLP in/out and the tied head (vocab x hidden)
    assert {(3376, 768), (768, 1536), (768, 768), (256, 768), (4096, 768), (768, 2048), (100352, 768)} <= shapes
    assert sorted({r["rows"] for r in doc["results"]}) == [1, 9]
    assert all(r["kernel_gb_s"] > 0 and r["xla_gb_s"] > 0 for r in doc["results"])
    assert doc["environment"]["kernels"].startswith("cpu: float32/bfloat16 products")
    assert doc["state_update"] == [] and doc["mamba_step"] == [] and doc["attention"] == []  # only the parts asked for
    assert "| 100352 x 768 | 9 |" in stdout


@needs_kernels
def test_benchmark_script_times_the_mamba_state_update(tmp_path, capsys):
    out = tmp_path / "bench.json"
    stdout = run(kernels.main, ["--parts", "state", "--rows", "1,9", "--repeats", "1", "--json", str(out)], capsys)
    doc = json.loads(out.read_text())
    assert [r["batch"] for r in doc["state_update"]] == [1, 9]  # one token through all of h-350m's 28 Mamba layers
    assert all(r["layers"] == 28 and r["kernel_gb_s"] > 0 and r["xla_gb_s"] > 0 for r in doc["state_update"])
    assert doc["mamba_step"] == [] and "| 9 | (9, 48, 32, 128) |" in stdout


@pytest.mark.slow(10)
@needs_kernels
def test_benchmark_script_times_the_mamba_step(tmp_path, capsys):
    out = tmp_path / "bench.json"
    stdout = run(kernels.main, ["--parts", "mamba", "--rows", "1,9", "--repeats", "1", "--json", str(out)], capsys)
    doc = json.loads(out.read_text())
    assert [r["batch"] for r in doc["mamba_step"]] == [1, 9]
    assert all(
        r["layers"] == 28 and r["kernel_us_per_layer"] > 0 and r["xla_us_per_layer"] > 0 for r in doc["mamba_step"]
    )
    assert "one token through all 28 layers; microseconds per layer" in stdout


@needs_kernels
def test_benchmark_script_times_decode_attention(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--parts", "attention", "--rows", "1,9", "--contexts", "40,300", "--chain-mib", "1", "--repeats", "1"]
    stdout = run(kernels.main, [*args, "--json", str(out)], capsys)
    doc = json.loads(out.read_text())
    # decode attention over h-350m's KV heads (4 of 64, 3 queries each) at each batch and filled length
    assert [(r["rows"], r["context"]) for r in doc["attention"]] == [(1, 40), (9, 40), (1, 300), (9, 300)]
    assert all((r["kv_heads"], r["queries_per_kv"], r["head_dim"]) == (4, 3, 64) for r in doc["attention"])
    assert all(r["kernel_gb_s"] > 0 and r["xla_gb_s"] > 0 for r in doc["attention"])
    assert "| 9 | 300 |" in stdout


@needs_kernels
def test_benchmark_script_times_expert_products(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--shape", "granite-4.0-h-tiny", "--parts", "experts", "--expert-tokens", "1,12", "--dtype", "bfloat16"]
    stdout = run(kernels.main, [*args, "--chain-mib", "1", "--repeats", "1", "--json", str(out)], capsys)
    doc = json.loads(out.read_text())
    assert doc["results"] == [] and doc["state_update"] == []  # only the parts asked for
    # h-tiny: 64 experts, 6 per token, hidden 1536, expert width 512: rows = tokens x 6, in (1536 -> 1024), out;
    # 12 tokens are 72 rows, past the gather: XLA's grouped product
    got = [(r["tokens"], r["rows"], r["experts"], r["inp"], r["out"]) for r in doc["experts"]]
    assert got == [(t, 6 * t, 64, k, n) for t in (1, 12) for k, n in ((1536, 1024), (512, 1536))]
    rates = ("kernel_gb_s", "xla_gb_s", "kernel_gflop_s", "xla_gflop_s")
    assert all(r[rate] > 0 for r in doc["experts"] for rate in rates)
    assert "| 12 | 72 | 64 x 512 x 1536 |" in stdout and "one layer, bfloat16" in stdout
    stdout = run(kernels.main, ["--parts", "experts", "--rows", "1", "--repeats", "1"], capsys)
    assert "granite-4.0-h-350m has no routed experts" in stdout


@needs_kernels
def test_decode_attention_benchmark_compares_the_two_steps(tmp_path, capsys):
    out = tmp_path / "ab.json"
    args = ["--shape", "tiny", "--prompt-len", "40", "--rounds", "2", "--steps", "2", "--json", str(out)]
    stdout = run(decode_attention.main, args, capsys)  # exit 1 where a step did not compile as it should
    doc = json.loads(out.read_text())
    assert len(doc["rounds"]) == 2 and all(r["kernel_s"] > 0 and r["xla_s"] > 0 for r in doc["rounds"])
    assert doc["median_xla_over_kernel"] > 0 and "40-token context" in stdout


@needs_kernels
def test_decode_attention_benchmark_sets_the_kernel_aside_only_meanwhile():
    from granite_jax import model, ops

    impls = ops.backend("cpu").impls
    kept = impls[model.attend_cache.__qualname__]
    with decode_attention.attention_by_xla():
        assert model.attend_cache.__qualname__ not in impls and model.linear.__qualname__ in impls
    assert impls[model.attend_cache.__qualname__] is kept


def test_benchmark_script_refuses_bad_arguments(tmp_path, call_main):
    no_dir = str(tmp_path / "no" / "x.json")
    bad = (
        (["--rows", "2,x"], "argument --rows: expected comma-separated positive integers, got '2,x'"),
        (["--rows", "17"], "argument --rows: the kernels take 1-16 rows, got 17"),
        (["--json", no_dir], "--json"),
        (["--parts", "products,gpu"], "argument --parts: expected a comma-separated subset of products,state,mamba,"),
        (["--expert-tokens", "0"], "argument --expert-tokens: every value must be >= 1"),
        (["--chain-mib", "0"], "argument --chain-mib: must be >= 1, got 0"),
        (["--dtype", "float16"], "--dtype"),
    )
    for args, message in bad:
        code, err = call_main(kernels.main, args)
        assert code == 2 and message in err, err
    proc = subprocess.run([sys.executable, KERNELS, *bad[0][0]], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and bad[0][1] in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    code, err = call_main(decode_attention.main, ["--shape", "nosuch"])
    assert code == 2 and "argument --shape: invalid choice: 'nosuch'" in err, err
