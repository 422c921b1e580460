"""Shared fixtures: random tiny GraniteMoeHybrid checkpoints saved by transformers, built once per session."""

from __future__ import annotations

import json
import os

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")
# Tests check numerics, not speed: skipping most XLA optimisation passes halves compile time, which dominates here.
jax.config.update("jax_disable_most_optimizations", True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


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
