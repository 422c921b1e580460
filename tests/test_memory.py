"""granite_jax.memory: the prediction held to XLA's compiled programs and to a measured run, fit, and the command."""

from __future__ import annotations

import json
import math
import sys

import jax
import jax.numpy as jnp
import pytest

from granite_jax.config import MAMBA
from granite_jax.experiments.common import model_config, random_model
from granite_jax.generation.steps import abstract_steps
from granite_jax.memory import fit, measure_run, predict
from granite_jax.memory.__main__ import main
from granite_jax.memory.measure import RssMeter
from granite_jax.ops import Runtime

TINY = model_config("tiny")


def nbytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def compiled_prefill(cfg, *, batch: int, tokens: int, context: int, dtype):
    fn, args = abstract_steps(
        cfg,
        batch=batch,
        prompt_len=tokens,
        cache_len=context,
        dtype=dtype,
        weight_dtype=dtype,
        runtime=Runtime(kernels=False),
    )["prefill"]
    return jax.jit(fn, donate_argnums=(2,)).lower(*args).compile(), args


def test_exact_parts_are_the_compiled_arguments(dtype=jnp.bfloat16):
    compiled, args = compiled_prefill(TINY, batch=2, tokens=32, context=256, dtype=dtype)
    plan = predict(TINY, context=256, sessions=2, dtype=dtype, prefill_chunk=32, platform="cpu")
    cache = args[2]
    extras = nbytes((cache.pad, cache.index, args[3:]))  # the cache's positions, token ids, sampling, step index
    exact = plan.weights + plan.kv_cache + plan.mamba_state
    assert compiled.memory_analysis().argument_size_in_bytes == exact + extras


@pytest.mark.parametrize(
    "batch, tokens, context, dtype",
    [(1, 512, 4096, jnp.float32), (4, 256, 8192, jnp.bfloat16)],
)
def test_activations_near_compiled_temporaries_on_cpu(batch, tokens, context, dtype):
    compiled, _ = compiled_prefill(TINY, batch=batch, tokens=tokens, context=context, dtype=dtype)
    plan = predict(TINY, context=context, sessions=batch, dtype=dtype, prefill_chunk=tokens, platform="cpu")
    ratio = plan.activations / compiled.memory_analysis().temp_size_in_bytes
    assert 0.75 <= ratio <= 1.25, ratio


def test_kv_cache_linear_in_context_and_attention_layers_only():
    small, large = (predict(TINY, context=t, sessions=3) for t in (4096, 3 * 4096))
    assert large.kv_cache == 3 * small.kv_cache > 0
    assert large.mamba_state == small.mamba_state > 0
    assert large.weights == small.weights
    more_attention = TINY.replace(layer_types=("attention", "attention", MAMBA, MAMBA))
    assert predict(more_attention, context=4096, sessions=3).kv_cache == 2 * small.kv_cache
    mamba_only = TINY.replace(layer_types=(MAMBA,) * 4)
    assert predict(mamba_only, context=4096, sessions=3).kv_cache == 0


def test_mamba_state_grows_with_sessions_only():
    one, eight = predict(TINY, context=1024, sessions=1), predict(TINY, context=1 << 20, sessions=8)
    assert eight.mamba_state == 8 * one.mamba_state


def test_fit_is_the_largest_that_fits():
    capacity = predict(TINY, context=50_000, sessions=3, dtype=jnp.float32).total
    context = fit(TINY, capacity, sessions=3, dtype=jnp.float32)
    assert predict(TINY, context=context, sessions=3, dtype=jnp.float32).total <= capacity
    assert predict(TINY, context=context + 1, sessions=3, dtype=jnp.float32).total > capacity
    sessions = fit(TINY, capacity, context=20_000, dtype=jnp.float32)
    assert predict(TINY, context=20_000, sessions=sessions, dtype=jnp.float32).total <= capacity
    assert predict(TINY, context=20_000, sessions=sessions + 1, dtype=jnp.float32).total > capacity
    assert fit(TINY, 1, sessions=1) == 0


# ---------------------------------------------------------------------------------------------- the command


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table_lists_every_part_per_combination(capsys):
    code, out, _ = run(capsys, "--config", "tiny", "--context", "4096,8K", "--sessions", "1,2", "--platform", "gpu")
    assert code == 0
    for header in ("4096 × 1", "4096 × 2", "8192 × 1", "8192 × 2"):
        assert header in out
    for part in ("weights", "kv_cache", "mamba_state", "activations", "total"):
        assert f"| {part} |" in out
    plan = predict(TINY, context=8192, sessions=2, platform="gpu")
    assert f"{plan.kv_cache / 1e9:.3f}" in out


def test_json_holds_the_bytes(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, _, _ = run(
        capsys, "--config", "granite-4.0-h-350m", "--context", "128K", "--sessions", "4", "--json", str(path)
    )
    assert code == 0
    found = json.loads(path.read_text())
    expected = predict(model_config("h-350m"), context=131072, sessions=4, platform=found["platform"])
    assert found["predicted"] == [json.loads(json.dumps(expected.as_dict()))]
    code, out, _ = run(capsys, "--config", "h-350m", "--context", "128K", "--sessions", "4", "--json", "-")
    assert json.loads(out) == found | {"model": "h-350m"}


def test_fit_prints_and_writes_the_largest(capsys, tmp_path):
    path = tmp_path / "fit.json"
    args = ("--config", "h-350m", "--context", "4096", "--sessions", "2", "--fit", "2.5GiB", "--json", str(path))
    code, out, _ = run(capsys, *args)
    assert code == 0
    found = json.loads(path.read_text())["fit"]
    options = dict(dtype=jnp.bfloat16, platform=json.loads(path.read_text())["platform"])
    cfg = model_config("h-350m")
    assert found["capacity"] == int(2.5 * 2**30)
    assert found["largest_context"] == [dict(sessions=2, context=fit(cfg, int(2.5 * 2**30), sessions=2, **options))]
    assert found["most_sessions"] == [dict(context=4096, sessions=fit(cfg, int(2.5 * 2**30), context=4096, **options))]
    assert f"context up to {found['largest_context'][0]['context']} tokens" in out


def test_float8_weights_half_of_bfloat16(capsys):
    sizes = {}
    for dtype in ("bfloat16", "float8"):
        code, out, _ = run(capsys, "--config", "tiny", "--dtype", dtype, "--json", "-")
        assert code == 0
        sizes[dtype] = json.loads(out)["predicted"][0]["weights"]
    assert 0.45 <= sizes["float8"] / sizes["bfloat16"] <= 0.6


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--context", "4096"], "one of the arguments --config --model is required"),
        (["--config", "h-huge"], "unknown model 'h-huge'"),
        (["--model", "/nonexistent/model"], "model directory not found"),
        (["--config", "tiny", "--context", "0"], "--context"),
        (["--config", "tiny", "--context", "4096,x"], "--context"),
        (["--config", "tiny", "--sessions", "-1"], "--sessions"),
        (["--config", "tiny", "--fit", "lots"], "--fit"),
        (["--config", "tiny", "--fit", "12 parsecs"], "--fit"),
        (["--config", "tiny", "--dtype", "int8"], "--dtype"),
        (["--config", "tiny", "--json", "/nonexistent/dir/x.json"], "directory does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, says):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's checks exit from parse_args
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("granite_jax.memory: error: ") and err.count("\n") == 1, err
    assert says in err
    assert out == ""


def test_measured_rows_give_the_ratio(capsys, monkeypatch):
    """The command's --measure table, from a measurement made up here (the real one is tested below)."""
    measure_module = sys.modules["granite_jax.memory.measure"]  # (the package's `measure_runs` is the function)

    def fake(make_model, runs, **_):
        plan = predict(TINY, context=runs[0][0], sessions=runs[0][1], platform="cpu")
        base = dict(context=plan.context, sessions=plan.sessions, prompt_tokens=16, decode_steps=0, platform="cpu")
        m = measure_module.Measurement(
            weights=plan.weights, cache=2 * (plan.kv_cache + plan.mamba_state), activations=None, prepared=0,
            how="made up", **base,
        )  # fmt: skip
        return [m]

    monkeypatch.setattr(measure_module, "measure_runs", fake)
    code, out, _ = run(capsys, "--config", "tiny", "--context", "4096", "--platform", "cpu", "--measure")
    assert code == 0
    assert "| 4096 | 1 | weights |" in out and "| 1.000 |" in out
    assert "| 4096 | 1 | cache |" in out and "| 2.000 |" in out


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's resident memory")
def test_measured_run_near_prediction_on_cpu():
    """A context where the KV cache and the attention's copies of it dominate (150 MB), in bfloat16, so that the
    process's few MB of noise (Python objects, allocator slack) stay under 5%. The cache is allocated and zeroed as
    the prediction counts it; the activations are XLA's buffers, which the prediction estimates within 25% of
    XLA's own analysis (above), and the process touches them all."""
    context, sessions, chunk = 131072, 4, 64
    model = random_model(TINY, dtype=jnp.bfloat16, runtime=Runtime(kernels=False))
    found = measure_run(model, RssMeter(), context=context, sessions=sessions, prefill_chunk=chunk, decode_steps=0)
    plan = predict(TINY, context=context, sessions=sessions, dtype=jnp.bfloat16, prefill_chunk=chunk, platform="cpu")
    assert found.cache / (plan.kv_cache + plan.mamba_state) == pytest.approx(1, abs=0.02)
    assert found.activations / plan.activations == pytest.approx(1, abs=0.25)
