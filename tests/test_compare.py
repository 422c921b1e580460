"""granite_jax.compare on the tiny checkpoint: per-layer parity, greedy agreement, speed rows, JSON and PNG."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import pytest

from granite_jax import compare, with_dtype
from granite_jax.experiments.common import ModelSpec, random_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def compared(hf_checkpoint, tmp_path_factory):
    # large random weights: greedy continuations vary (the default init repeats one token, a nearly vacuous check)
    checkpoint = hf_checkpoint(initializer_range=1.0)
    out = tmp_path_factory.mktemp("compare")
    argv = ["--model", checkpoint, "--out", str(out), "--quiet", "--batch-sizes", "1", "--prompt-len", "16"]
    argv += ["--new-tokens", "4", "--repeats", "1", "--error-len", "40", "--agreement-tokens", "8"]
    assert compare.main(argv) == 0
    with open(out / "compare.json") as f:
        return out, json.load(f)


def test_per_layer_error_within_float32_tolerance(compared):
    _, results = compared
    rows = results["layer_errors"]
    assert [r["layer"] for r in rows] == ["0", "1", "2", "3", "logits"]
    assert rows[1]["kind"] == "attention" and rows[3]["kind"] == "mamba + final norm"
    for row in rows:
        assert row["rel_err"] <= 1e-5, row
        assert "jax_rel_err_vs_f32" not in row  # float32 is its own reference


def test_greedy_continuations_agree(compared):
    _, results = compared
    greedy = results["greedy"]
    assert greedy["prompts"] == 4 and greedy["new_tokens"] == 8  # the built-in text prompts (tokenizer present)
    assert greedy["fraction"] == 1.0
    assert all(row["jax"] == row["hf"] for row in greedy["rows"])
    assert all(len(set(row["jax"])) > 1 for row in greedy["rows"]), greedy["rows"]  # not one token repeated


def test_speed_rows_and_outputs(compared, capsys):
    out, results = compared
    assert [s["batch"] for s in results["speed"]] == [1]
    for s in results["speed"]:
        for side in ("jax", "hf"):
            assert s[side]["prefill_tokens_per_s"] > 0 and s[side]["decode_tokens_per_s"] > 0
        assert s["decode_speedup"] == pytest.approx(s["jax"]["decode_tokens_per_s"] / s["hf"]["decode_tokens_per_s"])
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results["command"].startswith("python -m granite_jax.compare --model")
    text = compare.table(results)
    assert "greedy agreement (4 prompts x 8 tokens) | | | 32/32 tokens (100.0%)" in text
    assert "decode tok/s (batch 1, 4 new)" in text
    import torch

    torch_device = "cuda:0" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"  # auto
    assert f"| measure | granite-jax ({jax.default_backend()}) | transformers ({torch_device}) | result |" in text
    assert results["environment"]["torch_device"] == torch_device


def test_float32_on_bfloat16_weights_is_transformers_on_the_same_values(tmp_path):
    # --weight-dtype bfloat16: granite-jax keeps the random weights in bfloat16 and computes in float32; transformers
    # gets the same values written in float32, so both run one float32 model.
    out = tmp_path / "out"
    argv = ["--config", "tiny", "--weight-dtype", "bfloat16", "--out", str(out), "--quiet", "--no-speed"]
    assert compare.main([*argv, "--error-len", "40", "--agreement-tokens", "8"]) == 0
    results = json.loads((out / "compare.json").read_text())
    assert results["dtype"] == "float32" and results["summary"]["weight_dtype"] == "bfloat16"
    assert all(row["rel_err"] <= 1e-5 for row in results["layer_errors"]), results["layer_errors"]
    assert results["greedy"]["fraction"] == 1.0


def test_bfloat16_weights_of_a_float32_checkpoint_give_transformers_the_rounded_values(tiny_checkpoint, tmp_path):
    # The checkpoint stores float32; granite-jax keeps its weights rounded to bfloat16, so transformers must get those
    # values (exported), not the checkpoint's, which differ from them by ~2e-3 (relative).
    out = tmp_path / "out"
    argv = ["--model", tiny_checkpoint, "--weight-dtype", "bfloat16", "--out", str(out), "--quiet", "--no-speed"]
    assert compare.main([*argv, "--error-len", "40", "--agreement-tokens", "1"]) == 0  # (no decode step to compile)
    results = json.loads((out / "compare.json").read_text())
    assert results["summary"]["weight_dtype"] == "bfloat16"
    assert all(row["rel_err"] <= 1e-5 for row in results["layer_errors"]), results["layer_errors"]


def test_weights_that_dtype_cannot_hold_are_refused(tmp_path, capsys):
    # transformers would compute on the weights rounded to --dtype, granite-jax on the wider ones: not one model.
    out = tmp_path / "out"
    argv = ["--config", "tiny", "--dtype", "bfloat16", "--weight-dtype", "float32", "--out", str(out), "--quiet"]
    assert compare.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "granite_jax.compare: error: --weight-dtype float32 with --dtype bfloat16: transformers would run on the "
        "weights rounded to bfloat16, so the two would not compare the same weights; leave --weight-dtype unset or "
        "set --dtype float32"
    )
    assert not out.exists()
    with pytest.raises(compare.ExperimentError, match="^weight_dtype float16 with dtype bfloat16: "):
        compare.load_pair(ModelSpec(name="tiny"), dtype="bfloat16", weight_dtype="float16")
    with pytest.raises(compare.ExperimentError, match="weight_dtype must be one of .*, got 'int4'"):
        compare.load_pair(ModelSpec(name="tiny"), weight_dtype="int4")


def test_bfloat16_rows_set_each_side_beside_float32(tmp_path):
    # In bfloat16 the two differ by their rounding: each row also sets each side against granite-jax in float32 on the
    # same weights. Recomputed here from the same weights (seed 0) and prompts: the reference is float32 arithmetic
    # (transformers in float32 on the same bfloat16 values gives its logits), and each column measures its own side.
    out = tmp_path / "out"
    argv = ["--config", "tiny", "--dtype", "bfloat16", "--out", str(out), "--quiet", "--no-speed"]
    assert compare.main([*argv, "--error-len", "40", "--agreement-tokens", "1"]) == 0  # (no decode step to compile)
    results = json.loads((out / "compare.json").read_text())
    assert "| logits: max abs / rel error | rel " in compare.table(results)
    pair = compare.load_pair(ModelSpec(name="tiny"), dtype="bfloat16")
    tokens = random_tokens(pair.jax.cfg.vocab_size, 2, 40, 0)  # compare's error prompts
    f64 = compare.to_float64
    ours = [f64(x) for x in compare.jax_layer_outputs(pair.jax, tokens)]
    theirs = [f64(x) for x in compare.hf_layer_outputs(pair.hf, tokens)]
    reference = [f64(x) for x in compare.jax_layer_outputs(with_dtype(pair.jax, jnp.float32), tokens)]
    hf_float32 = f64(compare.hf_layer_outputs(pair.hf.float(), tokens)[-1])  # .float(): in place, after the above
    assert compare._relative(reference[-1], hf_float32) < 1e-5
    rows = results["layer_errors"]
    for row, a, b, r in zip(rows, ours, theirs, reference, strict=True):
        assert row["jax_rel_err_vs_f32"] == pytest.approx(compare._relative(a, r), rel=1e-4), row
        assert row["hf_rel_err_vs_f32"] == pytest.approx(compare._relative(b, r), rel=1e-4), row
        assert 1e-4 < row["jax_rel_err_vs_f32"] < 5e-2 and 1e-4 < row["hf_rel_err_vs_f32"] < 5e-2, row


def test_auto_torch_device_follows_granite_jax(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for backend, expected in (("gpu", "cuda"), ("cpu", "cpu")):
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        assert compare.resolve_torch_device("auto") == expected
    assert compare.resolve_torch_device("cpu") == "cpu" and compare.resolve_torch_device("cuda") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert compare.resolve_torch_device("auto") == "cpu"


def test_a_generation_error_is_one_line_and_leaves_no_empty_output(hf_checkpoint, tmp_path, capsys):
    rope = hf_checkpoint(position_embedding_type="rope", rope_theta=10000.0, max_position_embeddings=8)
    capsys.readouterr()  # the checkpoint writer's progress bar
    out = tmp_path / "out"
    argv = ["--model", rope, "--out", str(out), "--no-speed", "--quiet", "--error-len", "4"]
    assert compare.main(argv) == 2  # the agreement prompts are longer than the 8 positions
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "longer than max_position_embeddings=8" in err, err
    assert not out.exists()


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert compare.main(["--model", str(tmp_path / "missing"), "--no-speed", "--quiet"]) == 2
    expected = f"granite_jax.compare: error: {tmp_path / 'missing'}: model directory not found"
    assert capsys.readouterr().err.strip() == expected
    assert compare.main(["--config", "granite-9", "--quiet"]) == 2
    assert "unknown model 'granite-9'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        compare.main(["--model", "a", "--config", "tiny"])
    assert exit_info.value.code == 2
    capsys.readouterr()
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    bad_inputs = [  # each refused before any model is built
        (["--config", "tiny", "--out", str(a_file / "sub")], f"--out: cannot create {a_file / 'sub'}"),
        (["--config", os.path.join(ROOT, "configs/models/tiny.py:bad")], "get_config(bad) failed: configs/models/tiny"),
        (["--config", os.path.join(ROOT, "configs/experiments/parity.py")], "parity.py: not a model config"),
        (["--config", "tiny", "--seed", "-1"], "--seed: must be >= 0, got -1"),
        (["--config", "tiny", "--new-tokens", "1"], "--new-tokens: must be >= 2"),
    ]
    if jax.default_backend() != "gpu":
        bad_inputs.append((["--config", "tiny", "--ssd-impl", "pallas"], "ssd_impl='pallas' needs an NVIDIA GPU"))
    import torch

    if not torch.cuda.is_available():
        bad_inputs.append((["--config", "tiny", "--torch-device", "cuda"], "--torch-device cuda: torch 2"))
    for args, message in bad_inputs:
        assert compare.main([*args, "--no-speed", "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    bad_flags = [  # refused by the argument parser, with usage
        (["--batch-sizes", "1,x"], "argument --batch-sizes: expected comma-separated positive integers, got '1,x'"),
        (["--batch-sizes", "0"], "argument --batch-sizes: every value must be >= 1"),
        (["--prompt-len", "0"], "argument --prompt-len: must be >= 1, got 0"),
        (["--num-layers", "0"], "argument --num-layers: must be >= 1, got 0"),
    ]
    for args, message in bad_flags:
        with pytest.raises(SystemExit) as exit_info:
            compare.main(["--config", "tiny", *args, "--quiet"])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_leading_agreement_counts_tokens_before_the_first_difference():
    assert compare.leading_agreement([1, 2, 3], [1, 2, 4]) == 2
    assert compare.leading_agreement([1, 2], [1, 2, 3]) == 2  # a shorter row agreeing throughout
    assert compare.leading_agreement([5], [6]) == 0 and compare.leading_agreement([], [1]) == 0


# ---------------------------------------------------------------------------------------------- plot and summary


def _results(dtype: str, rel_errs: list[float], vs_f32: list[tuple[float, float]] = ()) -> dict:
    """compare's results as `figure` reads them: layers 0-3 (1 attention) and the logits, one speed row."""
    kinds = ["mamba", "attention", "mamba", "mamba + final norm", ""]
    rows = [
        dict(layer=layer, kind=kind, max_abs_err=10 * e, rel_err=e, max_abs=10.0)
        for layer, kind, e in zip(["0", "1", "2", "3", "logits"], kinds, rel_errs, strict=True)
    ]
    for row, (ours, theirs) in zip(rows, vs_f32):
        row |= dict(jax_rel_err_vs_f32=ours, hf_rel_err_vs_f32=theirs)
    side = lambda prefill, decode: dict(prefill_tokens_per_s=prefill, decode_tokens_per_s=decode)
    speed = dict(batch=1, prompt_len=16, new_tokens=4, jax=side(900.0, 90.0), hf=side(300.0, 45.0))
    return dict(
        model="synthetic",
        dtype=dtype,
        layer_errors=rows,
        error_summary=compare.error_summary(rows, compare.parity_tolerance(dtype)),
        speed=[speed | dict(prefill_speedup=3.0, decode_speedup=2.0)],
    )


def _legend_colours(ax) -> set[tuple[str, str]]:
    """(label, colour) of each legend entry: a bar series' face colour or a line's colour."""
    from matplotlib.colors import to_hex

    handles, labels = ax.get_legend_handles_labels()
    colour = lambda h: to_hex(h.patches[0].get_facecolor() if hasattr(h, "patches") else h.get_color())
    return {(label, colour(h)) for h, label in zip(handles, labels, strict=True)}


@pytest.mark.parametrize("worst", [3e-7, 5e-4])
def test_error_panel_draws_the_tolerance_on_a_linear_axis_from_zero(worst):
    # float32 errors of ~1e-7 against a 1e-4 tolerance must draw as slivers, not tall bars on a log axis starting
    # just below them; an error over the tolerance stretches the axis so that its bar stands over the line.
    from granite_jax.experiments.common import matplotlib_pyplot

    fig = compare.figure(_results("float32", [4e-8, 2e-7, 6e-8, 1e-7, worst]))
    ax = fig.axes[0]
    tolerance = compare.parity_tolerance("float32")
    (line,) = [line for line in ax.get_lines() if line.get_label().startswith("tolerance")]
    assert list(line.get_ydata()) == [tolerance, tolerance]
    bottom, top = ax.get_ylim()
    assert ax.get_yscale() == "linear" and bottom == 0
    assert max(tolerance, worst) <= top <= 1.2 * max(tolerance, worst)
    tallest = max(bar.get_height() for bar in ax.patches)
    assert tallest == worst
    if worst < tolerance / 100:
        assert tallest / top < 0.01
    matplotlib_pyplot().close(fig)


def test_each_colour_means_one_thing_in_every_panel():
    from granite_jax.experiments.common import matplotlib_pyplot

    vs_f32 = [(4e-3, 5e-3), (6e-3, 6e-3), (7e-3, 9e-3), (1e-2, 1e-2), (2e-2, 3e-2)]
    fig = compare.figure(_results("bfloat16", [5e-3, 8e-3, 1e-2, 1.2e-2, 4e-2], vs_f32))
    errors, speed = fig.axes
    entries = _legend_colours(errors) | _legend_colours(speed)
    assert len({label for label, _ in entries}) == len({colour for _, colour in entries}) == len(entries), entries
    assert {"granite-jax", "transformers"} <= {label for label, _ in _legend_colours(errors)}
    assert {"granite-jax", "transformers"} == {label for label, _ in _legend_colours(speed)}
    matplotlib_pyplot().close(fig)


def test_error_summary_maxima_are_the_max_of_every_row(compared):
    _, results = compared
    rows, summary = results["layer_errors"], results["error_summary"]
    worst = max(rows, key=lambda r: r["rel_err"])
    assert summary["max_rel_err"] == worst["rel_err"] >= summary["logits_rel_err"] == rows[-1]["rel_err"]
    assert summary["worst_layer"] == compare.row_label(worst)
    assert summary["max_abs_err"] == max(r["max_abs_err"] for r in rows)
    assert summary["tolerance"] == 1e-4 and summary["within_tolerance"]
    assert f"| max relative error (worst: {summary['worst_layer']}) | | | " in compare.table(results)
