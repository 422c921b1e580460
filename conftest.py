"""Fixtures shared by every test directory (tests/, granite_jax/cpu/tests/): random tiny GraniteMoeHybrid checkpoints
saved by transformers, built once per session; a command's or script's `main` called in this process; a compile-only
H200 for the deviceless tests."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys

import jax
import pytest

# Compilation dominates the suite's time. Tests check numerics, not speed: skipping most XLA optimisation passes
# halves it; and many tests (and both xdist workers, and the commands run as processes, which inherit the environment)
# compile the same programs, which XLA's persistent cache then compiles once.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
if jax.__version__.startswith("0.10.") and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    # XLA:CPU's older loop emitters compile ~40% faster; the flag is known to this jaxlib (an unknown one is fatal).
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_use_fusion_emitters=false".strip()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), ".pytest_cache", "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_disable_most_optimizations", True)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
)


@functools.cache
def load_script(path: str):
    """A script (benchmarks/*.py: not modules of a package) imported once per test process."""
    spec = importlib.util.spec_from_file_location("script_" + os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def call_main(capsys):
    """`call_main(main, argv)` -> (exit code, stderr): a command's `main` (or a script's, given its path) run in this
    process. Cheaper than a subprocess for argument errors (no interpreter and jax start-up per case); each command's
    own tests still run it once as a process, for the exit status."""

    def call(main, args: list[str]) -> tuple[int, str]:
        main = load_script(main).main if isinstance(main, str) else main
        capsys.readouterr()
        try:
            code = main(args)
        except SystemExit as e:  # argparse's errors
            code = e.code
        return code, capsys.readouterr().err.strip()

    return call


@pytest.fixture
def edited_config(tmp_path):
    """`edited_config(shipped_path, edit)` -> path of a config file whose get_config() is the shipped one's after
    the Python statement `edit` (on `c`)."""

    def write(shipped: str, edit: str) -> str:
        path = tmp_path / "config.py"
        path.write_text(
            f"from granite_jax.cli import load_config\n\n\ndef get_config():\n    c = load_config({shipped!r})\n"
            f"    {edit}\n    return c\n"
        )
        return str(path)

    return write


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """`hf_checkpoint(**config_overrides)` -> directory of a random HF checkpoint with a tokenizer (cached)."""
    from granite_jax.testing import make_checkpoint

    made: dict[str, str] = {}

    def make(seed: int = 0, **overrides) -> str:
        key = json.dumps([seed, overrides], sort_keys=True)
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp("ckpt"), seed, **overrides)
        return made[key]

    return make


def pytest_collection_modifyitems(items: list) -> None:
    """The `slow(seconds)` tests first, longest first: pytest-xdist hands tests out in order, and one started last
    keeps its worker busy alone while the other has finished."""

    def seconds(item) -> float:
        mark = item.get_closest_marker("slow")
        return mark.args[0] if mark is not None and mark.args else 0.0

    items.sort(key=lambda item: -seconds(item))


MESH_DEVICES = 8  # simulated CPU devices the tests under a mesh run on


def run_under_mesh_devices(test_file: str) -> None:
    """Run the tests of `test_file` but its `test_under_mesh_devices` (the one calling this) in a fresh interpreter
    with MESH_DEVICES CPU devices, failing with its output. JAX fixes the CPU device count when its backend starts,
    and eight devices slow every other test by a quarter, so the suite's own processes keep one."""
    import subprocess

    if jax.device_count() >= MESH_DEVICES:
        pytest.skip("this is the interpreter with the mesh devices")
    flag = f"--xla_force_host_platform_device_count={MESH_DEVICES}"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}", JAX_PLATFORMS="cpu")
    options = ["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-k", "not test_under_mesh_devices"]
    run = subprocess.run([sys.executable, "-m", "pytest", *options, test_file], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-6000:] + run.stderr[-3000:]
    assert " skipped" not in run.stdout.splitlines()[-1], run.stdout[-3000:]  # every case ran there


@pytest.fixture
def mesh_devices():
    """The CPU devices of a mesh test; skips in an interpreter with fewer (see `run_under_mesh_devices`)."""
    if jax.device_count() < MESH_DEVICES:
        pytest.skip("runs in a fresh interpreter with the mesh devices (run_under_mesh_devices)")
    return jax.devices()[:MESH_DEVICES]


@pytest.fixture
def h200_target():
    """A compile-only H200 (`pallas_kernels.aot`) for the `aot` tests; skips where deviceless CUDA compilation is
    unavailable, but fails under GRANITE_JAX_REQUIRE_AOT=1 (`make test` runs them with the CUDA PJRT plugin and sets it,
    so that its aot step cannot pass with nothing run)."""
    from pallas_kernels import aot

    try:
        return aot.gpu_device("h200")
    except aot.AotUnavailableError as e:
        if os.environ.get("GRANITE_JAX_REQUIRE_AOT") == "1":
            pytest.fail(f"GRANITE_JAX_REQUIRE_AOT=1 but {e}")
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def tiny_checkpoint(hf_checkpoint) -> str:
    """The default tiny MoE hybrid (granite_jax.testing.TINY_CONFIG)."""
    return hf_checkpoint()
