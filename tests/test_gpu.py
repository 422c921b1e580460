"""granite_jax.gpu: the grouped expert product against a float64 reference, and where the runtime chooses it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from granite_jax import gpu, ops
from granite_jax.model import GATHER_ROWS, expert_linear
from granite_jax.ops import Runtime

CASES = {  # rows, experts, how rows pick experts
    "prefill-like": (3072, 64, "uniform"),
    "few per expert": (150, 64, "uniform"),
    "one expert": (100, 8, "one"),
    "two of many": (200, 64, "two"),  # most groups empty
    "past one block": (97, 2, "uniform"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_expert_product_is_each_rows_expert_product(case):
    rows, n_experts, pick = CASES[case]
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((rows, 24)), rng.standard_normal((n_experts, 24, 40))
    experts = {
        "uniform": rng.integers(0, n_experts, rows),
        "one": np.full(rows, n_experts - 1),
        "two": rng.choice([3, 40], rows),
    }[pick]
    expected = np.einsum("rk,rkn->rn", x, w[experts])  # float64
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    got = jax.jit(gpu.grouped_expert_linear)(f32(x), f32(w), jnp.asarray(experts, jnp.int32))
    assert got.shape == expected.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_blocks_are_a_power_of_two_near_the_rows_per_expert():
    assert [gpu.block_rows(r, 64) for r in (64, 384, 3072, 49152, 10**6)] == [16, 16, 64, 512, 512]
    assert gpu.block_rows(100, 2) == 64


def test_the_grouped_product_is_chosen_where_it_is_predicted_faster():
    tiny, small = (64, 1536, 1024), (72, 4096, 1536)  # h-tiny's and h-small's [gate | up] experts (E, H, 2F)
    assert not gpu.grouped_is_faster(384, tiny, 2)  # h-tiny decode, batch 64: 6 experts a token, dense
    assert gpu.grouped_is_faster(3072, tiny, 2)  # h-tiny prefill of 512 tokens
    # h-small decode at batch 64: 640 rows, 9 an expert; gathering 112 blocks' matrices costs more than the FLOPs
    assert not gpu.grouped_is_faster(640, small, 2) and gpu.grouped_is_faster(8192, small, 2)


def test_the_gpu_platform_runs_the_grouped_product_where_it_is_faster():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((64, 64, 32)), jnp.float32)
    chosen = []
    for rows in (GATHER_ROWS, 3 * GATHER_ROWS, 4096):
        x, e = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32), jnp.asarray(rng.integers(0, 64, rows))
        plain = jax.jit(ops.under(Runtime(kernels=False), expert_linear)).lower(x, w, e).as_text()
        for_gpu = jax.jit(ops.under(Runtime(platform="gpu"), expert_linear)).lower(x, w, e).as_text()
        grouped = gpu.takes_grouped(rows, w.shape, 4)
        assert (for_gpu != plain) == grouped  # otherwise the plain gather or dense product
        chosen.append(grouped)
    assert chosen == [False, False, True]  # both kinds tried


def test_the_model_for_a_gpu_computes_the_plain_models_logits(tiny_checkpoint):
    # A prefill of many routed rows takes the grouped product under the gpu platform's runtime.
    from granite_jax.checkpoint import load_model
    from granite_jax.model import with_runtime

    plain = load_model(tiny_checkpoint, runtime=Runtime(kernels=False))
    for_gpu = with_runtime(plain, Runtime(platform="gpu"))
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 300, (2, 256)))
    rows, E, H = ids.size * plain.cfg.num_experts_per_tok, plain.cfg.num_local_experts, plain.cfg.hidden_size
    assert gpu.grouped_is_faster(rows, (E, H, 2 * plain.cfg.intermediate_size), 4)
    forward = jax.jit(lambda model, ids: model.forward(ids)[0])
    expected, got = np.asarray(forward(plain, ids)), np.asarray(forward(for_gpu, ids))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
