"""Config files and the experiment runner: model configs from the presets, quick runs writing JSON/MD/PNG, bad input."""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys

import jax
import pytest

from conftest import load_script
from granite_jax import cli, compare, experiment
from granite_jax.checkpoint import CheckpointError
from granite_jax.config import ATTENTION, ModelConfig
from granite_jax.experiments import throughput
from granite_jax.experiments.common import ExperimentError, model_config, sweep_lengths, with_num_layers
from granite_jax.presets import RELEASED
from granite_jax.testing import TINY_CONFIG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG = b"\x89PNG\r\n\x1a\n"


def load(relative: str, arg: str | None = None):
    return cli.load_config(os.path.join(ROOT, relative), arg)


# ---------------------------------------------------------------------------------------------- config files


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_model_configs_are_the_presets(name):
    slug = name.replace("granite-4.0-", "granite_4_0_").replace("-", "_")
    config = load(f"configs/models/{slug}.py").to_dict()
    assert config == RELEASED[name]
    assert ModelConfig.from_hf_dict(config) == model_config(name) == model_config(f"configs/models/{slug}.py")


def test_tiny_model_config():
    assert load("configs/models/tiny.py").to_dict() == dict(TINY_CONFIG, vocab_size=320)
    assert model_config("configs/models/tiny.py:dense").num_local_experts == 0
    with pytest.raises(ExperimentError, match="unknown model 'h-9b'"):
        model_config("h-9b")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs/experiments/*.py"))))
def test_experiment_configs_load(path):
    for arg in (None, "quick"):
        config = cli.load_config(path, arg)
        assert config.experiment in experiment.EXPERIMENTS
        assert {"model", "workload", "measure", "output_dir"} <= set(config.keys())
        assert config.output_dir is None and config.model.checkpoint is None


def test_num_layers_keeps_attention_share():
    cfg = model_config("granite-4.0-h-350m", num_layers=8)  # 4 of 32 attention -> 1 of 8
    assert cfg.num_layers == 8 and cfg.layer_types.count(ATTENTION) == 1
    assert with_num_layers(model_config("granite-4.0-micro"), 3).layer_types == (ATTENTION,) * 3
    assert with_num_layers(model_config("tiny"), 2).layer_types.count(ATTENTION) == 1


def test_sweep_lengths():
    assert sweep_lengths(None, 4096) == [256, 512, 1024, 2048, 4096]
    assert sweep_lengths(None, 3000) == [256, 512, 1024, 2048, 3000]
    assert sweep_lengths((64, 16, 64), 4096) == [16, 64]


# ---------------------------------------------------------------------------------------------- quick runs


def _run(relative: str, tmp_path, **workload):
    config = load(relative, "quick")
    config.output_dir = str(tmp_path / "out")
    config.workload.update(workload)
    out = experiment.run(config)
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    with open(os.path.join(out, "results.md")) as f:
        markdown = f.read()
    return out, results, markdown


def test_parity_quick_run(tmp_path):
    out, results, markdown = _run("configs/experiments/parity.py", tmp_path)
    assert results["config"]["experiment"] == "parity" and results["config"]["model"]["name"] == "tiny"
    assert [r["layer"] for r in results["rows"]] == ["0", "1", "2", "3", "logits"]
    summary, rows = results["summary"], results["rows"]
    assert summary["within_tolerance"] and summary["max_rel_err"] < 1e-5
    # one maximum over every row: never below the logits' error it summarises (here the logits are the worst)
    assert summary["max_rel_err"] == max(r["rel_err"] for r in rows) >= summary["logits_rel_err"] == rows[-1]["rel_err"]
    assert summary["max_abs_err"] == max(r["max_abs_err"] for r in rows)
    assert "| 1 | attention |" in markdown and "![parity.png](parity.png)" in markdown
    assert results["workload"]["torch_device"] == ("cuda:0" if jax.default_backend() == "gpu" else "cpu")  # auto
    assert open(os.path.join(out, "parity.png"), "rb").read(8) == PNG


def test_parity_in_bfloat16_reports_both_sides_against_float32(tmp_path):
    _, results, markdown = _run("configs/experiments/parity.py", tmp_path, dtype="bfloat16")
    summary, rows = results["summary"], results["rows"]
    assert 0 < summary["logits_jax_rel_err_vs_f32"] < 5e-2 and 0 < summary["logits_hf_rel_err_vs_f32"] < 5e-2
    assert summary["max_rel_err"] == max(r["rel_err"] for r in rows) >= summary["logits_rel_err"]
    assert summary["within_tolerance"] == (summary["max_rel_err"] <= summary["tolerance"])
    assert "jax_rel_err_vs_f32" in markdown and "hf_rel_err_vs_f32" in markdown


def test_scaling_quick_run(tmp_path):
    out, results, markdown = _run("configs/experiments/scaling.py", tmp_path, seq_lens=(16, 32))
    rows = results["rows"]
    assert [r["seq_len"] for r in rows] == [16, 32]
    for row in rows:
        assert row["prefill_s"] > 0 and row["peak_mib"] > 0 and row["mamba_s"] > 0 and row["attention_s"] > 0
        assert 0 < row["attention_share"] < 1
    assert set(results["summary"]) >= {"prefill_time_exponent", "mamba_time_exponent", "attention_share_longest"}
    assert results["environment"]["jax"] and results["config"]["workload"]["seq_lens"] == [16, 32]
    assert isinstance(results["environment"]["cpu_model"], str)  # what the timings ran on
    assert "| seq_len | prefill_s |" in markdown
    assert open(os.path.join(out, "scaling.png"), "rb").read(8) == PNG


def test_rewrite_quick_run(tmp_path):
    out, results, markdown = _run("configs/experiments/rewrite.py", tmp_path)
    rows = results["rows"]
    assert [(r["seq_len"], r["variant"]) for r in rows] == [
        (n, v) for n in (128, 256) for v in ("naive", "rewritten", "xla")
    ]
    for row in rows:
        assert row["median_ms"] > 0 and row["temp_mib"] >= 0 and row["rel_diff_vs_xla"] < 1e-5
    assert results["summary"]["sites_rewritten"] > 0 and "rewriter sites at seq_len 256" in markdown
    assert "- workload: batch 1, seq_lens (128, 256), dtype float32" in markdown
    assert open(os.path.join(out, "rewrite.png"), "rb").read(8) == PNG


@pytest.mark.parametrize("weight_dtype", [None, "bfloat16"])
def test_throughput_quick_run_without_transformers(tmp_path, weight_dtype):
    config = load("configs/experiments/throughput.py", "quick")
    config.output_dir = str(tmp_path / "out")
    config.measure.transformers = False
    config.workload.weight_dtype = weight_dtype
    out = experiment.run(config)
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    rows, summary = results["rows"], results["summary"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["jax_decode_tok_s"] > 0 for r in rows)
    assert "hf_decode_tok_s" not in rows[0]
    assert open(os.path.join(out, "throughput.png"), "rb").read(8) == PNG
    # The floor: the weights a token reads (all but the experts it is not routed to) at the best bandwidth, in the
    # weights' dtype (float32 arithmetic on bfloat16 weights reads two bytes per parameter).
    width = 2 if weight_dtype == "bfloat16" else 4
    assert results["model"]["dtype"] == "float32" and results["model"]["weight_dtype"] == (weight_dtype or "float32")
    assert results["config"]["workload"]["weight_dtype"] == weight_dtype
    assert summary["param_bytes"] == width * results["model"]["num_params"]
    cfg = model_config("tiny")
    experts_per_layer = cfg.num_local_experts * 3 * cfg.intermediate_size * cfg.hidden_size  # (gate, up), down
    unread = cfg.num_layers * experts_per_layer * (1 - cfg.num_experts_per_tok / cfg.num_local_experts)
    assert unread > 0 and summary["bytes_read_per_token"] == pytest.approx(summary["param_bytes"] - width * unread)
    best = max(summary["bandwidth_gb_s"].values())  # every probe, the kernels' own product where they run
    assert {"xla_matvec_rows", "numpy_matvec"} <= set(summary["bandwidth_gb_s"])
    assert ("kernel_matvec" in summary["bandwidth_gb_s"]) == throughput.cpu_kernels_run()
    assert summary["decode_floor_tok_s"] == pytest.approx(best * 1e9 / summary["bytes_read_per_token"])
    # Batch 1 between two sustained reads of the bytes its own decode read, in pairs: the floor of a pair is the mean
    # of each read's best decode-pattern probe, the ratio is decode over that floor; the headline is over steady pairs.
    floors, ratios = summary["paired_sustained_floor_tok_s"], summary["paired_decode_vs_sustained_floors"]
    assert len(floors) == len(ratios) == len(summary["paired_decode_tok_s"]) == len(summary["paired_steady"]) == 2
    for decode, floor, ratio, before, after in zip(
        summary["paired_decode_tok_s"],
        floors,
        ratios,
        summary["paired_sustained_gb_s_before"],
        summary["paired_sustained_gb_s_after"],
        strict=True,
    ):
        for probes in (before, after):
            assert set(probes) == {"xla_matvec_rows"} | ({"kernel_matvec"} if throughput.cpu_kernels_run() else set())
        mean = (max(before.values()) + max(after.values())) / 2
        assert floor == pytest.approx(mean * 1e9 / summary["bytes_read_per_token"])
        assert ratio == pytest.approx(decode / floor) and decode > 0
    steady = [r for r, ok in zip(ratios, summary["paired_steady"]) if ok]
    assert summary["paired_steady_pairs"] == len(steady)
    assert summary["decode_vs_sustained_floor"] == (pytest.approx(statistics.median(steady)) if steady else None)
    assert summary["decode_vs_sustained_floor_min"] == (min(steady) if steady else None)
    # The pooled figure's arithmetic has known-answer tests below; here, that it reaches the summary as a headline.
    assert summary["decode_vs_pooled_floor"] > 0 and "paired_decode_vs_pooled_floor" not in summary
    assert open(os.path.join(out, "floor_pairs.png"), "rb").read(8) == PNG


def test_paired_floor_judges_each_run_by_the_reads_around_it(monkeypatch):
    """A known answer: the host reads 40 GB/s, then moves to 55 in the middle of the second pair, and stays there."""

    class Timing:
        decode_tokens = 4

        def __init__(self, tok_s):
            self.decode_tokens_per_s = tok_s

    rates = iter([0.0, 35.0, 38.0, 45.0])  # tokens/s of the warm-up and the three pairs
    runs = []

    def measure(generator, batch, prompt_len, new_tokens, seed=0):
        runs.append((generator, batch, prompt_len, new_tokens))
        return Timing(next(rates))

    monkeypatch.setattr(compare, "measure", measure)
    reads = iter([40.0, 40.0, 40.0, 55.0, 55.0, 55.0])
    asked = []

    def sustained(total_bytes, nbytes):
        asked.append(total_bytes)
        gb_s = next(reads)
        return {"xla_matvec_rows": gb_s - 5, "kernel_matvec": gb_s}

    monkeypatch.setattr(throughput, "sustained_bandwidth", sustained)
    out = throughput.paired_floor("a generator", read_bytes=10**9, prompt_len=8, new_tokens=5, pairs=3)
    assert runs == [("a generator", 1, 8, 5)] * 4  # batch 1: a warm-up, then one run per pair
    assert asked == [4 * 10**9] * 6  # each read covers the bytes a run's decode reads
    assert out["steady"] == [True, False, True] and out["steady_pairs"] == 2
    assert out["sustained_floor_tok_s"] == pytest.approx([40, 47.5, 55])  # GB/s over 1 GB per token
    assert out["decode_vs_sustained_floors"] == pytest.approx([35 / 40, 38 / 47.5, 45 / 55])
    assert out["decode_vs_sustained_floor"] == pytest.approx((35 / 40 + 45 / 55) / 2)  # the steady pairs only
    assert out["decode_vs_sustained_floor_min"] == pytest.approx(45 / 55)
    assert out["sustained_gb_s_after"][1] == {"xla_matvec_rows": 50.0, "kernel_matvec": 55.0}
    # Pooled, every pair counts: 12 tokens over 4/35 + 4/38 + 4/45 s, against six reads of 4 GB, three at 40 GB/s and
    # three at 55 (1 GB per token).
    decode = 12 / (4 / 35 + 4 / 38 + 4 / 45)
    assert out["pooled_floor_tok_s"] == pytest.approx(6 / (3 / 40 + 3 / 55))
    assert out["decode_vs_pooled_floor"] == pytest.approx(decode / (6 / (3 / 40 + 3 / 55)))
    assert len(out["seconds"]) == 3 and out["seconds"] == sorted(out["seconds"])


def test_paired_floor_without_a_steady_pair_has_no_headline(monkeypatch, tmp_path):
    class Timing:
        decode_tokens, decode_tokens_per_s = 2, 30.0

    monkeypatch.setattr(compare, "measure", lambda *args, **kwargs: Timing())
    reads = iter([36.0, 54.0, 54.0, 36.0])  # the host's level moved during both pairs
    monkeypatch.setattr(throughput, "sustained_bandwidth", lambda total, nbytes: {"kernel_matvec": next(reads)})
    out = throughput.paired_floor(None, read_bytes=10**9, prompt_len=8, new_tokens=3, pairs=2)
    assert out["steady"] == [False, False] and out["steady_pairs"] == 0
    assert out["decode_vs_sustained_floor"] is None and out["decode_vs_sustained_floor_min"] is None
    assert out["decode_vs_sustained_floors"] == pytest.approx([30 / 45, 30 / 45])
    assert out["decode_vs_pooled_floor"] == pytest.approx(30 / (2 / (1 / 36 + 1 / 54)))  # still a figure, pooled
    throughput.plot_pairs(out, 10**9, 54.0, "a test", str(tmp_path / "pairs.png"))  # hollow points only
    assert (tmp_path / "pairs.png").read_bytes()[:8] == PNG


THROUGHPUT_SCRIPT = os.path.join(ROOT, "benchmarks", "throughput.py")


def test_throughput_script_on_a_checkpoint(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    args = ["--checkpoint", tiny_checkpoint, "--skip-transformers", "--prompt-len", "8", "--new-tokens", "3"]
    args += ["--batch-sizes", "1,2", "--repeats", "1", "--floor-pairs", "2", "--probe-mib", "8", "--json", str(out)]
    args += ["--plot", str(tmp_path / "pairs.png")]
    capsys.readouterr()
    assert load_script(THROUGHPUT_SCRIPT).main(args) == 0  # in this process (the exit status: the test below)
    stdout = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert [(r["impl"], r["batch"]) for r in doc["rows"]] == [("granite-jax", 1), ("granite-jax", 2)]
    paired = doc["paired"]
    assert len(paired["decode_tok_s"]) == 2 and "| granite-jax | 1 |" in stdout
    assert ("median" in stdout) == (paired["steady_pairs"] > 0)
    reads = zip(paired["sustained_gb_s_before"], paired["sustained_gb_s_after"], strict=True)
    floors = [(max(b.values()) + max(a.values())) / 2 * 1e9 / doc["bytes_read_per_token"] for b, a in reads]
    assert paired["sustained_floor_tok_s"] == pytest.approx(floors)
    assert (tmp_path / "pairs.png").read_bytes()[:8] == PNG
    b1 = doc["rows"][0]["decode_tok_s"]
    best = max(doc["bandwidth_gb_s"].values())
    assert doc["decode_floor_tok_s"] == pytest.approx(best * 1e9 / doc["bytes_read_per_token"])
    assert f"{b1 / doc['decode_floor_tok_s']:.0%} |" in stdout  # the burst-floor column of batch 1
    assert doc["environment"]["kernels"] in stdout  # what ran besides plain JAX


def test_throughput_script_refuses_bad_input(tmp_path, call_main):
    bad = (
        (["--floor-pairs", "-1"], "--floor-pairs >= 0"),
        (["--probe-mib", "0"], "--probe-mib must be >= 1"),
        (["--plot", str(tmp_path / "p.png"), "--floor-pairs", "0"], "--plot draws the batch-1 floor pairs"),
        (["--plot", str(tmp_path / "p.png"), "--batch-sizes", "8"], "--plot draws the batch-1 floor pairs"),
        (["--plot", "-"], "--plot needs a file name"),
        (["--plot", str(tmp_path / "no" / "p.png")], "--plot " + str(tmp_path / "no" / "p.png")),
        (["--json", str(tmp_path / "no" / "x.json")], "the directory does not exist"),
        (["--checkpoint", str(tmp_path / "missing"), "--skip-transformers"], "model directory not found"),
    )
    for args, message in bad:
        code, err = call_main(THROUGHPUT_SCRIPT, args)
        assert code == 2 and message in err, err
    args, message = bad[-1]  # and as a process: the exit code and one line
    proc = subprocess.run([sys.executable, THROUGHPUT_SCRIPT, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_sustained_bandwidth_reads_the_bytes_asked_for(monkeypatch):
    calls = []
    probes = {"xla_matvec_rows": lambda: calls.append("rows"), "kernel_matvec": lambda: calls.append("kernel")}
    monkeypatch.setattr(throughput, "bandwidth_probes", lambda nbytes, names: (1000, probes))
    out = throughput.sustained_bandwidth(total_bytes=4500, nbytes=1000)
    assert calls == ["rows"] * 6 + ["kernel"] * 6  # one warm-up each, then ceil(4500 / 1000) reads timed together
    assert set(out) == set(probes) and all(v > 0 for v in out.values())
    assert throughput.sustained_bandwidth(total_bytes=1, nbytes=1000) and calls.count("rows") == 8  # at least one


def test_bad_workload_values_rejected(tmp_path):
    config = load("configs/experiments/scaling.py", "quick")
    config.workload.dtype = "int8"
    with pytest.raises(ExperimentError, match="workload.dtype must be one of float32, bfloat16, float16, got 'int8'"):
        experiment.run(config)
    config = load("configs/experiments/throughput.py", "quick")
    config.workload.weight_dtype = "int4"
    with pytest.raises(ExperimentError, match="workload.weight_dtype must be one of .*, got 'int4'"):
        experiment.run(config)
    config = load("configs/experiments/parity.py", "quick")
    config.workload.dtype, config.workload.weight_dtype = "bfloat16", "float32"
    with pytest.raises(ExperimentError, match="^workload.weight_dtype float32 with workload.dtype bfloat16: "):
        experiment.run(config)
    config = load("configs/experiments/parity.py", "quick")
    config.model.checkpoint = str(tmp_path / "missing")
    config.model.num_layers = 2
    with pytest.raises(ExperimentError, match="num_layers applies to random weights only"):
        experiment.run(config)
    config = load("configs/experiments/throughput.py", "quick")
    config.workload.rewriter = True
    with pytest.raises(ExperimentError, match="workload.rewriter: the throughput experiment"):
        experiment.run(config)
    config = load("configs/experiments/throughput.py", "quick")
    config.measure.floor_pairs = -1
    with pytest.raises(ExperimentError, match="measure.floor_pairs must be an integer >= 0, got -1"):
        experiment.run(config)
    config = load("configs/experiments/scaling.py", "quick")
    config.measure.repeats = 0
    with pytest.raises(ExperimentError, match="measure.repeats must be an integer >= 1, got 0"):
        experiment.run(config)
    for path, section, field, value, message in [
        ("rewrite.py", "measure", "naive_repeats", 0, "measure.naive_repeats must be an integer >= 1, got 0"),
        ("parity.py", "measure", "tolerance", -1.0, "measure.tolerance must be a number >= 0.0, got -1.0"),
        ("throughput.py", "measure", "floor_probe_mib", -1, "measure.floor_probe_mib must be an integer >= 0"),
        ("parity.py", "model", "seed", -1, "model.seed must be an integer >= 0, got -1"),
    ]:
        config = load(f"configs/experiments/{path}", "quick")
        config[section][field] = value
        with pytest.raises(ExperimentError, match=message):
            experiment.run(config)
    config = load("configs/experiments/parity.py", "quick")
    config.model.checkpoint = str(tmp_path / "missing")
    config.output_dir = str(tmp_path / "not_left_behind")
    with pytest.raises((ExperimentError, CheckpointError)):  # fails after the output directory was made
        experiment.run(config)
    assert not os.path.exists(config.output_dir)
    config = load("configs/experiments/scaling.py", "quick")
    config.workload.seq_lens = (True,)
    with pytest.raises(ExperimentError, match="workload.seq_lens must be positive integers"):
        experiment.run(config)
    (tmp_path / "a_file").write_text("")
    config = load("configs/experiments/scaling.py", "quick")
    config.output_dir = str(tmp_path / "a_file" / "out")
    with pytest.raises(ExperimentError, match="output_dir: cannot create"):  # at once, not after the run
        experiment.run(config)
    config = load("configs/experiments/parity.py", "quick")
    config.workload.torch_device = "gpu"
    with pytest.raises(ExperimentError, match="workload.torch_device: 'gpu' is not one of auto, cpu, cuda"):
        experiment.run(config)
    import torch

    if not torch.cuda.is_available():
        config = load("configs/experiments/parity.py", "quick")
        config.workload.torch_device = "cuda"
        config.output_dir = str(tmp_path / "no_cuda")
        with pytest.raises(ExperimentError, match="workload.torch_device cuda: torch .* sees no CUDA device"):
            experiment.run(config)
        assert not os.path.exists(config.output_dir)
    if jax.default_backend() != "gpu":
        config = load("configs/experiments/scaling.py", "quick")
        config.workload.ssd_impl = "pallas"
        with pytest.raises(ExperimentError, match="ssd_impl='pallas' needs an NVIDIA GPU"):
            experiment.run(config)


def test_gpu_memory_is_shared_with_torch_before_any_check_can_start_jax(monkeypatch):
    # XLA_PYTHON_CLIENT_PREALLOCATE only counts before JAX's backend starts, and checking ssd_impl="pallas" starts it:
    # so it is set before the workload is checked (here the check fails), and only when transformers may use CUDA.
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "unset")  # recorded, so that teardown restores the original
    for experiment_name, torch_device, expected in (
        ("parity", "auto", "false"),
        ("parity", "cpu", None),
        ("scaling", "auto", None),  # no transformers: JAX's allocator stays as it is
    ):
        monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE")
        config = load(f"configs/experiments/{experiment_name}.py", "quick")
        config.workload.torch_device = torch_device
        config.workload.ssd_impl = "fast"
        with pytest.raises(ExperimentError, match="workload.ssd_impl: 'fast' is not one of"):
            experiment.run(config)
        assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == expected
        monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "unset")


def test_experiment_config_argument_is_checked():
    for path in glob.glob(os.path.join(ROOT, "configs", "experiments", "*.py")):
        with pytest.raises(ValueError, match="unknown argument 'quik'"):
            load(path, "quik")


def parse_flags(capsys, config: str) -> tuple[int | None, str]:
    """(exit code, stderr) of the command's flag parsing of `--config config`, in this process; None: accepted."""
    from absl import flags

    capsys.readouterr()
    flags.FLAGS.unparse_flags()
    try:
        experiment.parse_flags(["granite_jax.experiment", "--config", config])
        code = None
    except SystemExit as e:
        code = e.code
    finally:
        flags.FLAGS.unparse_flags()
    return code, capsys.readouterr().err.strip()


def test_command_line_errors_are_one_line_exit_2(capsys):
    cases = [
        ("configs/models/tiny.py", "configs/models/tiny.py is not an experiment config (no field 'experiment'"),
        ("configs/experiments/parity.py:bogus", "unknown argument 'bogus'; expected ':quick' or nothing"),
        ("README.md", "README.md is not a Python config file"),
        ("configs/experiments/missing.py", "configs/experiments/missing.py' not found"),
    ]
    for path, message in cases:
        code, err = parse_flags(capsys, os.path.join(ROOT, path))
        assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    cmd = [sys.executable, "-m", "granite_jax.experiment"]
    help_run = subprocess.run([*cmd, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert help_run.returncode == 0 and "model.seed" in help_run.stdout and ":quick" in help_run.stdout


def test_bad_overrides_are_one_line_exit_2():
    # As processes: the overrides' flags exist once absl has loaded the config file, in a fresh interpreter.
    cmd = [sys.executable, "-m", "granite_jax.experiment", "--config", "configs/experiments/parity.py"]
    overrides = ["--config.workload.seqlen=4096", "--config.workload.batch=x"]
    runs = [subprocess.Popen([*cmd, o], cwd=ROOT, stderr=subprocess.PIPE, text=True) for o in overrides]
    errors = [proc.stderr.read().strip().splitlines() for proc in runs]
    assert [proc.wait(timeout=120) for proc in runs] == [2, 2]
    assert errors[0] == [
        "granite_jax.experiment: error: --config.workload.seqlen: unknown field 'seqlen' in config.workload "
        "(fields: batch, dtype, mesh, new_tokens, rewriter, seq_len, seq_lens, ssd_impl, torch_device, weight_dtype)"
    ]
    assert len(errors[1]) == 1 and "--config.workload.batch=x" in errors[1][0], errors[1]


WORKLOAD_FIELDS = "batch, dtype, mesh, new_tokens, rewriter, seq_len, seq_lens, ssd_impl, torch_device, weight_dtype"
BAD_CONFIG_FILES = {  # a shipped config edited by its copy: (experiment, edit, the error after "--config: FILE: ")
    "unknown_top_level_field": (
        "scaling",
        "c.outputdir = 'runs/x'",
        "unknown field 'outputdir' in config (fields: experiment, measure, model, output_dir, workload)",
    ),
    "unknown_nested_field": (
        "scaling",
        "c.workload.seqlen = 64",
        f"unknown field 'seqlen' in config.workload (fields: {WORKLOAD_FIELDS})",
    ),
    "field_of_another_experiment": (
        "scaling",
        "c.measure.tolerance = 0.1",
        "unknown field 'tolerance' in config.measure (fields: repeats, warmup)",
    ),
    "missing_field": (
        "scaling",
        "del c.workload['seq_len']",
        f"missing field 'seq_len' in config.workload (expected fields: {WORKLOAD_FIELDS})",
    ),
    "missing_field_of_its_experiment": (
        "parity",
        "del c.measure['tolerance']",
        "missing field 'tolerance' in config.measure (expected fields: repeats, tolerance, warmup)",
    ),
    "missing_section": (
        "scaling",
        "del c['measure']",
        "missing field 'measure' in config (expected fields: experiment, measure, model, output_dir, workload)",
    ),
    "wrong_type": (
        "throughput",
        "del c.workload['batch']; c.workload.batch = '8'",  # a new field: ml_collections checks none of its type
        "config.workload.batch must be an integer, got '8' (str)",
    ),
    "unknown_experiment": (
        "parity",
        "c.experiment = 'speed'",
        "experiment: 'speed' is not one of rewrite, parity, throughput, scaling",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIG_FILES))
def test_config_file_fields_are_checked_like_overrides(case, edited_config, capsys):
    experiment_name, edit, message = BAD_CONFIG_FILES[case]
    path = edited_config(os.path.join(ROOT, "configs", "experiments", f"{experiment_name}.py"), edit)
    assert parse_flags(capsys, path) == (2, f"granite_jax.experiment: error: --config: {path}: {message}")


def test_shipped_experiment_configs_pass_the_command_check(capsys):
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "experiments", "*.py")))
    assert {cli.load_config(path).experiment for path in paths} == set(experiment.KIND_FIELDS)
    assert set(experiment.KIND_FIELDS) == set(experiment.EXPERIMENTS)
    for path in paths:
        for config in (path, f"{path}:quick"):
            assert parse_flags(capsys, config) == (None, ""), config


def test_output_dir_removes_only_an_empty_directory_it_made_when_the_work_fails(tmp_path):
    from granite_jax.experiments.common import output_dir

    new = tmp_path / "new"
    with pytest.raises(KeyboardInterrupt), output_dir(str(new), "--out"):  # Ctrl-C too
        assert new.is_dir()
        raise KeyboardInterrupt
    assert not new.exists()
    with pytest.raises(RuntimeError), output_dir(str(tmp_path), "--out"):  # there before: kept
        raise RuntimeError
    with pytest.raises(RuntimeError), output_dir(str(new), "--out"):  # written to: kept
        (new / "partial.json").write_text("{}")
        raise RuntimeError
    assert (new / "partial.json").exists()
