"""The seam between the model and platform kernels: which implementation an op runs under a Runtime, fallbacks, the
covering rule of fused kernels, and arrays a backend derives from the weights."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from granite_jax import ops
from granite_jax.config import ModelConfig
from granite_jax.model import Granite
from granite_jax.ops import Runtime

TINY = ModelConfig(
    vocab_size=32,
    hidden_size=16,
    layer_types=("mamba", "attention"),
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    intermediate_size=0,
    shared_intermediate_size=16,
    num_local_experts=0,
    num_experts_per_tok=0,
    mamba_n_heads=4,
    mamba_d_head=8,
    mamba_d_state=8,
    mamba_chunk_size=8,
)


@ops.replaceable
def double(x):
    return 2 * x


@ops.replaceable
def triple(x):
    return 3 * x


@pytest.fixture
def fake_platform(monkeypatch):
    """Backends "fake" (this platform's kernels) and "fused" (an SSD choice), registered for the test only."""
    monkeypatch.setattr(ops, "BACKENDS", {**ops.BACKENDS, "fake": __name__, "fused": __name__, "absent": "no.such"})
    monkeypatch.setattr(ops, "PLATFORM_KERNELS", {jax.default_backend(): "fake"})
    monkeypatch.setattr(ops, "SSD_IMPLS", (*ops.SSD_IMPLS, "fused", "absent"))
    monkeypatch.setattr(ops, "_REGISTRY", dict(ops._REGISTRY))
    ops.loaded.cache_clear()
    yield
    ops.loaded.cache_clear()


def test_an_op_runs_its_body_unless_the_runtime_chooses_a_backend(fake_platform):
    ops.register("fake", double, lambda reference, x: reference(x) + 1)  # falls back, then adds
    assert double(5) == 11  # the default runtime turns on the platform's kernels
    with ops.using(Runtime(kernels=False)):
        assert double(5) == 10
    with ops.using(Runtime()):
        assert double(5) == 11 and triple(5) == 15  # an op the backend does not replace runs its body


def test_a_fused_implementation_gives_way_where_an_earlier_backend_replaced_what_it_covers(fake_platform):
    ops.register("fake", double, lambda reference, x: -1, covers=(triple,))
    ops.register("fused", triple, lambda reference, x: 30)
    assert double(1) == -1  # nothing earlier replaces `triple`: the fused implementation runs
    with ops.using(Runtime(ssd="fused")):  # "fused" comes first and replaces `triple`
        assert double(1) == 2 and triple(1) == 30


def test_a_backend_that_is_absent_or_cannot_run_here_costs_speed_only(fake_platform, caplog):
    ops.register("fake", double, lambda reference, x: -1)
    ops.backend("fake").available = lambda: "no such CPU here"
    with caplog.at_level(logging.INFO, logger="granite_jax.ops"):
        assert double(4) == 8
        with ops.using(Runtime(ssd="absent")):
            assert double(4) == 8
    assert "does not run here (no such CPU here)" in caplog.text
    assert "the absent backend is not installed" in caplog.text
    assert ops.describe(Runtime(ssd="absent")) == "absent: not running here; fake: not running here"


def test_the_runtime_is_checked():
    with pytest.raises(ValueError, match="ssd: 'fast' is not one of xla, naive, pallas"):
        Runtime(ssd="fast")
    with pytest.raises(ValueError, match="kernels: expected True or False, got 1"):
        Runtime(kernels=1)
    assert Runtime(kernels=False).backends == () and Runtime(ssd="naive", kernels=False).backends == ("naive",)
    with pytest.raises(ValueError, match="platform: 'tpu' is not one of None, cpu, gpu"):
        Runtime(platform="tpu")
    # a program for another platform than this one's (a deviceless GPU compile) takes that platform's backend
    assert Runtime(ssd="pallas", platform="gpu").backends == ("pallas", "gpu")
    assert Runtime(platform="gpu", kernels=False).backends == ()


def test_prepared_arrays_reach_the_implementation_of_their_weight(fake_platform):
    # A backend's arrays derived from weights travel into a jitted step beside the weights; inside, each product
    # finds the one made from its own weight.
    from granite_jax import model as granite_model

    seen = []

    def linear(reference, x, w):
        seen.append(ops.companion(w, "fake"))
        return reference(x, w)

    ops.register("fake", granite_model.linear, linear)
    ops.backend("fake").prepare = lambda model, rows: {"lm_head.weight": jnp.full((2,), rows, jnp.float32)}
    model = Granite(TINY.replace(tie_word_embeddings=False), rngs=nnx.Rngs(0))
    prepared = ops.prepare(model, rows=3)
    assert list(prepared) == ["fake"] and np.asarray(prepared["fake"]["lm_head.weight"]).tolist() == [3.0, 3.0]
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, prepared, tokens):
        model = nnx.merge(graphdef, state)
        with ops.bound(model, prepared):
            return model(tokens)

    step(state, prepared, jnp.ones((1, 4), jnp.int32))
    found = [c for c in seen if c is not None]
    assert len(found) == 1 and found[0].shape == (2,)  # the head's, and no other weight's
    assert ops.companion(jnp.ones(2), "fake") is None  # outside `bound`
