"""Building, caching and loading the kernels (`granite_jax.cpu.build`): they build and load where they can run, the
reasons they do not elsewhere, the fallbacks (disabled, a failed build, a compiler without AVX-512), the AVX-512 panel
kernel following the CPU and the environment, and the cache.

A build from scratch takes half a minute on two cores: the suite makes one (two on AVX-512 CPUs, the second for AVX2);
the other tests read the libraries already built, fake the compiler, or start a process where a fresh one is the
point (the environment read at first use)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from granite_jax import ops
from granite_jax.cpu import build
from granite_jax.ops import Runtime

ROOT = Path(__file__).resolve().parents[3]
needs_kernels = pytest.mark.skipif(
    build._unsupported() is not None, reason=f"the CPU kernels do not run here: {build._unsupported()}"
)
HAS_AVX512 = "avx512f" in build.cpu_flags()
NAMES = "small_matmul.cc + ssm_update.cc + decode_attention.cc + greedy.cc"

# A first use in a fresh process, reported as JSON: why the kernels do not run (None: they do), the loaded panel
# kernel's AVX-512 path, the description, and the compiler runs it took with their -m flags.
PROBE = """
import json
from granite_jax.cpu import build
runs = []
run_compiler = build._run_compiler
build._run_compiler = lambda cmd: (runs.append(cmd), run_compiler(cmd))[1]
import granite_jax.cpu as cpu
reason = build.unavailable_reason()
flags = sorted({f for cmd in runs for f in cmd if f.startswith("-m")})
print(json.dumps(dict(reason=reason, avx512=build.panels_use_avx512(), describe=cpu.describe(), compiles=len(runs),
                      flags=flags)))
"""


def python(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    """`code` run by a fresh interpreter with the kernels' cache in `cache`, `env` added to this environment."""
    env = {**os.environ, "GRANITE_JAX_CACHE_DIR": str(cache), **env}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)


def probe(cache: Path, **env: str) -> dict:
    proc = python(PROBE, cache, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def libraries(cache: Path) -> dict[str, int]:
    """The built libraries in `cache`: name -> modification time (ns)."""
    return {p.name: p.stat().st_mtime_ns for p in cache.glob("cpu_kernels-*.so")}


# ---------------------------------------------------------------------------------------------- where they run


@needs_kernels
def test_kernels_load_here():
    # Where the CPU and compiler allow them, the kernels must load: a silent fallback would hide a broken build
    # behind XLA's products.
    assert build.available(), build.unavailable_reason()
    assert ops.loaded("cpu") is not None and ops.widens_weights(Runtime())
    assert ops.describe(Runtime()).startswith("cpu: float32/bfloat16 products of 1 row")
    assert ops.describe(Runtime(kernels=False)) == "plain JAX" and not ops.widens_weights(Runtime(kernels=False))
    # The panel kernel's AVX-512 path follows the CPU and GRANITE_JAX_CPU_AVX512, and the description says which runs.
    asked = HAS_AVX512 and os.environ.get("GRANITE_JAX_CPU_AVX512", "1") != "0"
    assert build.panels_use_avx512() == asked and ("(AVX-512)" in ops.describe(Runtime())) == asked


@pytest.mark.slow(18)
@needs_kernels
def test_a_fresh_build_loads_follows_the_cpu_and_is_cached(tmp_path, monkeypatch, rebuild):
    # The suite's one build from scratch, run here rather than in a fresh process (the first use is the same code; a
    # module fixture would build once per xdist worker).
    cache = tmp_path / "cache"
    monkeypatch.setenv("GRANITE_JAX_CACHE_DIR", str(cache))
    run_compiler, runs = build._run_compiler, []
    monkeypatch.setattr(build, "_run_compiler", lambda cmd: (runs.append(cmd), run_compiler(cmd))[1])
    reason, registered, loaded = rebuild()
    assert reason is None and registered == list(build.TARGETS)
    assert len(runs) == len(build.SOURCES) + 1  # one compiler per source, one link
    assert all(("-mavx512f" in cmd) == HAS_AVX512 and {"-mavx2", "-mfma"} <= set(cmd) for cmd in runs)
    (library,) = loaded
    assert library.granite_panels_avx512() == HAS_AVX512
    built = libraries(cache)
    beside = {p.name for p in cache.iterdir()} - {build.LOCK}
    assert len(built) == 1 and beside == set(built)  # no temporary files beside it
    runs.clear()
    assert build.compiled_library(build._flags()).name in built  # a later first use finds it
    assert runs == [] and libraries(cache) == built  # the same library, not rewritten


@pytest.mark.parametrize(
    "cpu_has,setting,avx512",
    [(True, None, True), (True, "1", True), (True, "0", False), (False, None, False), (False, "1", False)],
)
def test_avx512_flags_follow_the_cpu_and_the_environment(monkeypatch, cpu_has, setting, avx512):
    flags = {"avx2", "fma", *(["avx512f"] if cpu_has else [])}
    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    if setting is None:
        monkeypatch.delenv("GRANITE_JAX_CPU_AVX512", raising=False)
    else:
        monkeypatch.setenv("GRANITE_JAX_CPU_AVX512", setting)
    assert build._flags() == (build.FLAGS + build.AVX512_FLAGS if avx512 else build.FLAGS)


# ---------------------------------------------------------------------------------------------- fallbacks


DISABLED = """
import json
import jax, jax.numpy as jnp, numpy as np
from granite_jax import model, ops
from granite_jax.ops import Runtime
from granite_jax.cpu import build
import granite_jax.cpu as cpu
x, w = jnp.ones((1, 8)), jnp.ones((4, 8))
with ops.using(Runtime()):
    text = jax.jit(model.linear).trace(x, w).lower().as_text()
    y = np.asarray(jax.jit(model.linear)(x, w))
print(json.dumps(dict(reason=build.unavailable_reason(), loaded=ops.loaded("cpu") is not None,
                      describe=ops.describe(Runtime()), cpu=cpu.describe(), widens=ops.widens_weights(Runtime()),
                      kernel="granite_" in text, y=y.tolist())))
"""


def test_disabled_by_the_environment(tmp_path):
    # Everywhere: GRANITE_JAX_CPU_KERNELS=0 builds nothing, and the model's ops run plain JAX.
    proc = python(DISABLED, tmp_path / "cache", GRANITE_JAX_CPU_KERNELS="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["reason"] == "disabled by GRANITE_JAX_CPU_KERNELS=0"
    assert found["loaded"] is False and found["widens"] is False and found["kernel"] is False
    assert found["describe"] == "cpu: not running here"
    assert found["cpu"] == "XLA (disabled by GRANITE_JAX_CPU_KERNELS=0)"
    assert found["y"] == [[8.0] * 4]
    assert not (tmp_path / "cache").exists()


@pytest.fixture
def rebuild(monkeypatch):
    """`rebuild()`: a first use again (`_build_and_register` uncached), its registrations recorded instead of made and
    its library kept apart from the one this process runs: (reason, registered targets, loaded libraries)."""
    import jax

    build.unavailable_reason()  # this process's own first use, made before anything is patched
    registered, loaded = [], []
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda name, *args, **kwargs: registered.append(name))
    monkeypatch.setattr(build, "_LIBRARY", loaded)
    return lambda: (build._build_and_register.__wrapped__(), registered, loaded)


@needs_kernels  # elsewhere the reason is the CPU or the environment, not the build
def test_a_failed_build_falls_back_with_a_reason_and_leaves_no_library(tmp_path, monkeypatch, caplog, rebuild):
    cache = tmp_path / "cache"
    monkeypatch.setenv("GRANITE_JAX_CACHE_DIR", str(cache))
    monkeypatch.setenv("CXX", "/bin/false")
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        reason, registered, loaded = rebuild()
    assert reason.startswith(f"could not build or load {NAMES}: "), reason
    assert registered == [] and loaded == []
    assert f"granite_jax.cpu: using XLA ({reason})" in caplog.text
    assert [p.name for p in cache.iterdir()] in ([], [build.LOCK])  # no library, no temporary files


def check_a_compiler_without_avx512(cache: Path, monkeypatch, caplog, rebuild) -> None:
    """On an AVX-512 CPU (this one, as far as the build can tell), a compiler that rejects -mavx512f: a warning, then
    the AVX2 build (the one in `cache`, found there), loaded and registered; the failed build leaves nothing."""
    monkeypatch.setenv("GRANITE_JAX_CACHE_DIR", str(cache))
    monkeypatch.delenv("GRANITE_JAX_CPU_AVX512", raising=False)
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    run_compiler, runs = build._run_compiler, []

    def no_avx512(cmd):
        runs.append(cmd)
        if "-mavx512f" in cmd:
            raise subprocess.CalledProcessError(1, cmd, stderr="cc1plus: error: no AVX-512 here\n")
        run_compiler(cmd)

    monkeypatch.setattr(build, "_run_compiler", no_avx512)
    before = libraries(cache)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        reason, registered, loaded = rebuild()
    assert reason is None
    assert "the AVX-512 build failed (cc1plus: error: no AVX-512 here); building for AVX2" in caplog.text
    assert runs and all("-mavx512f" in cmd for cmd in runs)  # only the failed attempt: the AVX2 one was cached
    assert registered == list(build.TARGETS)
    (library,) = loaded
    assert library.granite_panels_avx512() == 0 and Path(library._name).name in before
    left = {p.name for p in cache.iterdir()} - {build.LOCK}
    assert libraries(cache) == before and left == set(before)


@needs_kernels
@pytest.mark.skipif(HAS_AVX512, reason="AVX-512 here: test_the_avx2_build_on_an_avx512_cpu runs it on its build")
def test_a_compiler_without_avx512_gets_the_avx2_build(monkeypatch, caplog, rebuild):
    # This process's library is the AVX2 build: its cache holds it (built there by its first use, in `rebuild`).
    check_a_compiler_without_avx512(build.cache_dir(), monkeypatch, caplog, rebuild)


@needs_kernels
@pytest.mark.skipif(not HAS_AVX512, reason="no AVX-512F here: the AVX2 build is the one every other test runs")
def test_the_avx2_build_on_an_avx512_cpu(tmp_path, monkeypatch, caplog, rebuild):
    # GRANITE_JAX_CPU_AVX512=0 builds for AVX2 (its own build, in a fresh cache), which a compiler without AVX-512
    # falls back to. This process runs the AVX-512 build of the panel kernel: the float64 comparisons run again on
    # the AVX2 one.
    cache = tmp_path / "cache"
    found = probe(cache, GRANITE_JAX_CPU_AVX512="0")
    assert found["reason"] is None and found["avx512"] is False and "(AVX-512)" not in found["describe"]
    assert found["compiles"] == len(build.SOURCES) + 1 and "-mavx512f" not in found["flags"]
    built = libraries(cache)
    tests = Path(__file__).with_name("test_kernels.py")
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tests), "-k", "panels or mixed or one_row"]
    code = "import sys, pytest; from granite_jax.cpu import build; assert not build.panels_use_avx512(); "
    code += f"sys.exit(pytest.main({args!r}))"
    proc = python(code, cache, GRANITE_JAX_CPU_AVX512="0")
    assert proc.returncode == 0 and " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]
    assert libraries(cache) == built
    check_a_compiler_without_avx512(cache, monkeypatch, caplog, rebuild)


def test_processes_starting_at_once_build_the_library_once(tmp_path, monkeypatch):
    # Two first uses at once (two test workers, two commands) build it once: the second waits on the lock and finds it.
    import threading
    import time

    monkeypatch.setenv("GRANITE_JAX_CACHE_DIR", str(tmp_path / "cache"))
    links = []

    def fake_compiler(cmd):  # compiles nothing; the link writes the library, slowly
        if "-c" not in cmd:
            links.append(cmd)
            time.sleep(0.5)
            Path(cmd[cmd.index("-o") + 1]).write_bytes(b"")

    monkeypatch.setattr(build, "_run_compiler", fake_compiler)
    monkeypatch.setattr(build, "compiler", lambda: "c++")
    found = []
    threads = [threading.Thread(target=lambda: found.append(build.compiled_library(build.FLAGS))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(links) == 1 and len(set(found)) == 1 and found[0].exists()
