"""The CPU decode-product kernel (granite_jax.cpu_matmul) against float64, and where it is and is not used."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from granite_jax import cpu_matmul

pytestmark = pytest.mark.skipif(
    cpu_matmul._unsupported() is not None, reason=f"kernel unsupported here: {cpu_matmul._unsupported()}"
)


def operands(rows: tuple[int, ...], k: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((*rows, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)


def lowered(fn, *args, platform: str = "cpu") -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_kernel_builds_on_this_machine():
    # Where the CPU and compiler allow it (the pytestmark), the kernel must load: a silent fallback would hide a
    # broken build behind XLA's products.
    assert cpu_matmul.available(), cpu_matmul.unavailable_reason()


# Row counts 2..16 (also as (b, 1) leading dims), K with and without a multiple-of-8 tail, N with and without a
# multiple of the 3- and 6-row tiles, N larger than one thread chunk.
@pytest.mark.parametrize(
    "rows,k,n",
    [((2,), 8, 3), ((3,), 13, 7), ((4,), 1, 1), ((5,), 64, 200), ((8, 1), 768, 301), ((16,), 100, 2), ((7, 2), 9, 50)],
)
def test_matches_float64(rows, k, n):
    x, w = operands(rows, k, n)
    assert cpu_matmul.uses_kernel(x, w)
    assert cpu_matmul.TARGET in lowered(cpu_matmul.linear, x, w)
    got = np.asarray(jax.jit(cpu_matmul.linear)(x, w))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T  # error bound of a float32 dot product
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= 1e-6 * k * scale + 1e-30)


def test_empty_contraction_gives_zeros():
    x, w = np.ones((3, 0), np.float32), np.ones((5, 0), np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu_matmul.linear)(x, w)), np.zeros((3, 5), np.float32))


@pytest.mark.parametrize(
    "rows,dtype",
    [((1,), jnp.float32), ((17,), jnp.float32), ((4, 8), jnp.float32), ((8,), jnp.bfloat16), ((8,), jnp.float16)],
)
def test_other_products_stay_with_xla(rows, dtype):
    # One row (XLA's matrix-vector product is fast), more than MAX_ROWS rows (prefill, training), other dtypes.
    x, w = (jnp.asarray(a, dtype) for a in operands(rows, 32, 24))
    assert not cpu_matmul.uses_kernel(x, w)
    assert cpu_matmul.TARGET not in lowered(cpu_matmul.linear, x, w)
    got = np.asarray(cpu_matmul.linear(x, w), np.float64)
    x64, w64 = (np.asarray(t, np.float64) for t in (x, w))
    tolerance = 1e-5 if dtype == jnp.float32 else 3e-2  # 16-bit outputs are rounded to 8 or 11 significant bits
    assert np.all(np.abs(got - x64 @ w64.T) <= tolerance * (np.abs(x64) @ np.abs(w64).T))


def test_other_platforms_get_xla_products():
    x, w = operands((8,), 32, 24)
    text = lowered(cpu_matmul.linear, x, w, platform="cuda")
    assert cpu_matmul.TARGET not in text and "dot_general" in text


def test_gradients_and_vmap():
    x, w = operands((4,), 40, 24)
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(cpu_matmul.linear(x, w))), argnums=(0, 1)))(x, w)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    upstream = np.cos(x64 @ w64.T)  # d sum(sin(y)) / dy, y = x w^T
    for got, want in zip(grads, (upstream @ w64, upstream.T @ x64)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    xs = np.stack([x, 2 * x, -x])
    batched = jax.jit(jax.vmap(cpu_matmul.linear, in_axes=(0, None)))(xs, w)
    np.testing.assert_allclose(np.asarray(batched), np.einsum("bmk,nk->bmn", xs, w), rtol=1e-5, atol=1e-5)


def _reason_in_subprocess(tmp_path, **env) -> str:
    code = "from granite_jax import cpu_matmul; print(cpu_matmul.unavailable_reason())"
    env = {**os.environ, "GRANITE_JAX_CACHE_DIR": str(tmp_path / "cache"), **env}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_disabled_by_environment(tmp_path):
    assert "GRANITE_JAX_CPU_MATMUL=0" in _reason_in_subprocess(tmp_path, GRANITE_JAX_CPU_MATMUL="0")


def test_failed_build_falls_back_with_a_reason(tmp_path):
    reason = _reason_in_subprocess(tmp_path, CXX="/bin/false")
    assert reason.startswith("could not build or load small_matmul.cc"), reason
    assert not list((tmp_path / "cache").glob("*.so"))


def test_build_is_cached(tmp_path):
    assert _reason_in_subprocess(tmp_path) == "None"
    (library,) = (tmp_path / "cache").glob("small_matmul-*.so")
    stamp = library.stat().st_mtime_ns
    assert _reason_in_subprocess(tmp_path) == "None"
    assert library.stat().st_mtime_ns == stamp


BENCHMARK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "cpu_matmul.py")


def test_benchmark_script_times_every_weight_shape(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, BENCHMARK, "--rows", "2,9", "--chain-mib", "1", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    shapes = {(r["out"], r["inp"]) for r in doc["results"]}
    # h-350m: Mamba in/out, attention q/k/v/o, shared-MLP in/out and the tied head (vocab x hidden)
    assert {(3376, 768), (768, 1536), (768, 768), (256, 768), (4096, 768), (768, 2048), (100352, 768)} <= shapes
    assert sorted({r["rows"] for r in doc["results"]}) == [2, 9]
    assert all(r["kernel_gb_s"] > 0 and r["xla_gb_s"] > 0 for r in doc["results"])
    assert doc["environment"]["decode_products"].startswith("cpu_matmul kernel")
    assert "| 100352 x 768 | 9 |" in proc.stdout


def test_benchmark_script_refuses_bad_arguments(tmp_path):
    for args, message in ((["--rows", "2,x"], "--rows"), (["--json", str(tmp_path / "no" / "x.json")], "--json")):
        proc = subprocess.run([sys.executable, BENCHMARK, *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
