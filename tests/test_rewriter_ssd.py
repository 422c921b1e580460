"""The rewriter on the model: the naive SSD, the naive Mamba-2 layer and the full naive model, against the
hand-written "xla" einsum implementation; the report of the naive SSD's six sites, at h-tiny size included."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from ml_collections import config_dict

import rewriter
from granite_jax import ops
from granite_jax.config import ModelConfig
from granite_jax.model import Granite, MambaMixer
from granite_jax.ops import Runtime
from granite_jax.ssd import ssd_chunked, ssd_chunked_naive
from granite_jax.testing import TINY_CONFIG

ROOT = Path(__file__).resolve().parents[1]
GATE_OFF = rewriter.Options(min_flops=0, min_dim=1)
SITES = ("S1", "S2", "S3", "S4", "S5", "S6")


def site_lines() -> dict[str, int]:
    """Line of each naive-SSD site's sum in granite_jax/ssd.py (S6 sums on the line after its product)."""
    lines = Path(importlib.import_module("granite_jax.ssd").__file__).read_text().splitlines()
    found = {}
    for i, line in enumerate(lines, start=1):
        if m := re.search(r"# (S[1-5]):", line):
            found[m.group(1)] = i
        if "C_times_states.sum(-1)" in line:
            found["S6"] = i
    assert sorted(found) == list(SITES), found
    return found


def ssd_sites(report: rewriter.Report) -> list[rewriter.Site]:
    return [s for s in report.sites if "ssd.py:" in s.source]


def assert_lists_ssd_sites(report: rewriter.Report, layers: int = 1) -> list[rewriter.Site]:
    sites = ssd_sites(report)
    lines = site_lines()
    want = [f"ssd.py:{lines[name]}:" for name in SITES] * layers
    assert [re.search(r"ssd\.py:\d+:", s.source).group(0) for s in sites] == want, str(report)
    return sites


def ssd_inputs(b=2, L=72, h=4, p=8, g=1, n=16, seed=0):
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    dt = jnp.asarray(rng.uniform(0.01, 0.2, (b, L, h)), jnp.float32)
    A = -jnp.asarray(rng.uniform(0.5, 2.0, (h,)), jnp.float32)
    return f32(b, L, h, p), dt, A, f32(b, L, g, n), f32(b, L, g, n), f32(h)


def assert_close_to(actual, expected, rtol=2e-5):
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("groups", [1, 2])
def test_naive_ssd_matches_xla(groups):
    args = ssd_inputs(g=groups)
    naive = lambda *a, initial_state=None: ssd_chunked_naive(*a, chunk_size=16, initial_state=initial_state)
    fast = rewriter.rewrite(naive, options=GATE_OFF)
    initial = jnp.asarray(np.random.default_rng(5).standard_normal((2, 4, 8, 16)), jnp.float32)
    for init in (None, initial):
        y, state = fast(*args, initial_state=init)
        y_ref, state_ref = jax.jit(ssd_chunked, static_argnames="chunk_size")(*args, chunk_size=16, initial_state=init)
        assert_close_to(y, y_ref)
        assert_close_to(state, state_ref)
    sites = assert_lists_ssd_sites(fast.last_report)
    assert [s.status for s in sites] == ["rewritten", "fused", "rewritten", "rewritten", "rewritten", "rewritten"]
    assert sites[1].fused_into == sites[2].id
    if groups == 1:  # B and C repeated to every head: the scores are computed once per group
        assert sites[0].hidden_broadcasts == 2 and sites[0].flops == 2 * 2 * 5 * 16 * 16 * 16


def test_naive_ssd_gradients_match_xla():
    args = ssd_inputs(L=48)
    w = jnp.asarray(np.random.default_rng(7).standard_normal((2, 48, 4, 8)), jnp.float32)
    naive = rewriter.rewrite(lambda *a: ssd_chunked_naive(*a, chunk_size=16)[0], options=GATE_OFF)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * w)
    grads = jax.jit(jax.grad(loss(naive), argnums=(0, 1, 3, 4)))(*args)
    xla = lambda *a: ssd_chunked(*a, chunk_size=16)[0]
    expected = jax.jit(jax.grad(loss(xla), argnums=(0, 1, 3, 4)))(*args)
    for g, e in zip(grads, expected):
        assert_close_to(g, e, rtol=1e-4)


def h_tiny_config(**overrides) -> config_dict.ConfigDict:
    sys.path.insert(0, str(ROOT / "configs" / "rewriter"))
    try:
        import h_tiny_mamba
    finally:
        sys.path.pop(0)
    config = h_tiny_mamba.get_config()
    config.update(overrides)
    return config


def test_h_tiny_report_at_8192_tokens():
    """The case study's buffer: C times B holds 12,884,901,888 floats (48 GiB) at batch 1 x 8,192 tokens."""
    from rewriter.report import report_for

    report = report_for(h_tiny_config(batch=1, seq_len=8192))
    sites = assert_lists_ssd_sites(report)
    s1 = sites[0]
    assert s1.intermediate_elements == 12_884_901_888 and s1.intermediate_shape == (1, 32, 256, 256, 48, 128)
    assert s1.intermediate_bytes == 51_539_607_552 and "48.0 GiB" in str(report)
    assert [s.status for s in sites] == ["rewritten", "fused", "rewritten", "rewritten", "rewritten", "rewritten"]
    assert s1.flops == 2 * 32 * 256 * 256 * 128  # per group: the 48 heads share B and C


def test_report_command(tmp_path):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "rewriter.report", "--config", str(ROOT / "configs/rewriter/h_tiny_mamba.py")]
    cmd += ["--config.seq_len=512", "--config.target=ssd", f"--config.json_out={out}"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "805,306,368" in result.stdout  # S1 at 512 tokens: 2 chunks x 256 x 256 x 48 x 128
    sites = json.loads(out.read_text())["sites"]
    assert len(sites) == 6 and sites[0]["intermediate_elements"] == 805_306_368


VALUE_ERRORS = [  # found once the config is read: checked through `report_for`, the command's own path to its errors
    ("seq_len", 0, "--config.seq_len must be >= 1, got 0"),
    ("target", "bogus", "--config.target: 'bogus' is not one of mamba_layer, ssd, model"),
    ("model", "granite-9", "--config.model: unknown model 'granite-9'"),
    ("min_dim", 0, "--config.min_dim must be None or an int >= 1, got 0"),
]
COMMAND_ERRORS = [  # flags and files absl reads, and the output check: as processes, all at once
    ("--config.seqlen=5", "unknown field 'seqlen' in config (fields: batch,"),
    ("--config.seq_len=abc", "--config.seq_len=abc"),
    ("--config=missing.py", "config file 'missing.py' not found"),
    ("--config=configs/experiments/parity.py", "is not a rewriter report config (no field 'target'"),
    ("--config.json_out=/nonexistent/r.json", "/nonexistent/r.json: the directory does not exist"),
    ("--config.seq_len=0", "--config.seq_len must be >= 1, got 0"),
]


def test_report_refuses_bad_values():
    from granite_jax.cli import load_config
    from rewriter import report

    for field, value, message in VALUE_ERRORS:
        config = load_config(str(ROOT / "configs/rewriter/h_tiny_mamba.py"))
        config[field] = value
        with pytest.raises(ValueError, match=re.escape(message)):
            report.report_for(config)


def test_report_command_refuses_bad_input_with_one_line_and_exit_2():
    config = str(ROOT / "configs/rewriter/h_tiny_mamba.py")
    cmd = [sys.executable, "-m", "rewriter.report", "--config", config]
    runs = [subprocess.Popen([*cmd, arg], cwd=ROOT, stderr=subprocess.PIPE, text=True) for arg, _ in COMMAND_ERRORS]
    for run, (_, message) in zip(runs, COMMAND_ERRORS, strict=True):
        err = run.stderr.read()
        assert run.wait(timeout=300) == 2 and message in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


REPORT_FIELDS = (
    "batch, dtype, fuse_chains, hidden_size, json_out, mamba_chunk_size, mamba_d_head, mamba_d_state, mamba_n_groups, "
    "mamba_n_heads, min_dim, min_flops, model, precision, seq_len, target"
)
BAD_CONFIG_FILES = {  # the shipped config edited by its copy: (edit, the error after "--config: FILE: ")
    "unknown_field": ("c.seqlen = 512", f"unknown field 'seqlen' in config (fields: {REPORT_FIELDS})"),
    "unknown_section": (
        "c.options = dict(min_flops=0.0)",
        f"unknown field 'options' in config (fields: {REPORT_FIELDS})",
    ),
    "missing_field": ("del c['min_dim']", f"missing field 'min_dim' in config (expected fields: {REPORT_FIELDS})"),
    "wrong_type": ("del c['seq_len']; c.seq_len = '512'", "config.seq_len must be an integer, got '512' (str)"),
}


def parse_report_flags(capsys, config: str) -> tuple[int | None, str]:
    """(exit code, stderr) of the command's flag parsing of `--config config`, in this process; None: accepted."""
    from absl import flags

    from rewriter import report

    parse = report.define_flags(flags.FlagValues())  # the command's own parser, on flags apart from absl's global ones
    capsys.readouterr()
    try:
        parse(["rewriter.report", "--config", config])
        code = None
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("case", sorted(BAD_CONFIG_FILES))
def test_report_config_file_fields_are_checked_like_overrides(case, edited_config, capsys):
    edit, message = BAD_CONFIG_FILES[case]
    path = edited_config(str(ROOT / "configs" / "rewriter" / "h_tiny_mamba.py"), edit)
    assert parse_report_flags(capsys, path) == (2, f"rewriter.report: error: --config: {path}: {message}")


def test_shipped_report_configs_pass_the_command_check(capsys):
    paths = sorted((ROOT / "configs" / "rewriter").glob("*.py"))
    assert paths
    for path in paths:
        assert parse_report_flags(capsys, str(path)) == (None, ""), path


def test_report_command_help_lists_the_fields():
    cmd = [sys.executable, "-m", "rewriter.report", "--help"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for field in ("target", "seq_len", "dtype", "mamba_n_heads", "min_flops", "min_dim", "precision", "json_out"):
        assert field in text, field


TINY = ModelConfig.from_hf_dict(TINY_CONFIG | {"vocab_size": 300})


def runtime(ssd: str) -> Runtime:
    """The SSD `ssd` in plain JAX (no platform kernels): only the SSD differs between the two sides."""
    return Runtime(ssd=ssd, kernels=False)


def test_naive_mamba_layer_matches_xla():
    x = jax.random.normal(jax.random.key(1), (2, 40, 64))
    graphdef, state = nnx.split(MambaMixer(TINY, rngs=nnx.Rngs(0)))

    def layer(ssd: str):  # a mixer alone is traced under the runtime in effect (a model enters its own)
        def run(state, x):
            with ops.using(runtime(ssd)):
                return nnx.merge(graphdef, state)(x)[0]

        return run

    fast = rewriter.rewrite(layer("naive"), options=GATE_OFF)
    expected = jax.jit(layer("xla"))(state, x)
    assert_close_to(fast(state, x), expected)
    assert_lists_ssd_sites(fast.last_report)


def test_naive_model_matches_xla():
    tokens = jax.random.randint(jax.random.key(2), (2, 40), 0, 300)
    graphdef, state = nnx.split(Granite(TINY, runtime=runtime("naive"), rngs=nnx.Rngs(0)))
    model = lambda state, tokens: nnx.merge(graphdef, state)(tokens)
    fast = rewriter.rewrite(model, options=GATE_OFF)
    xla_graphdef, xla_state = nnx.split(Granite(TINY, runtime=runtime("xla"), rngs=nnx.Rngs(0)))
    expected = jax.jit(lambda state, tokens: nnx.merge(xla_graphdef, state)(tokens))(xla_state, tokens)
    assert_close_to(fast(state, tokens), expected, rtol=1e-5)  # (the two differ by ~2e-7)
    assert_lists_ssd_sites(fast.last_report, layers=3)  # three Mamba layers
