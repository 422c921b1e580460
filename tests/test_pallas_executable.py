"""pallas_kernels.executable: the launches of programs compiled for an H200 without a GPU, on programs whose answer is
known (a GEMM's FLOPs, a loop's trip count, a conditional's branches, a Pallas call)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import pallas_kernels

S = jax.ShapeDtypeStruct


def test_shape_bytes():
    from pallas_kernels.executable import shape_bytes

    assert shape_bytes("bf16[64,1536,1024]{2,1,0}") == 64 * 1536 * 1024 * 2
    assert shape_bytes("(f32[2,3]{1,0}, bf16[4]{0}, pred[])") == 24 + 8 + 1
    assert shape_bytes("s32[]") == 4 and shape_bytes("u8[0]") == 0


def launches_of(fn, *args, options=None):  # compiled for an H200
    from pallas_kernels import aot, executable

    return executable.launches(aot.lower_for_gpu(fn, args, "h200"), options)


@pytest.mark.aot
def test_a_gemm_and_a_loop_of_known_trips(h200_target):
    from pallas_kernels import executable

    def f(x, w):
        y = jnp.dot(x, w, preferred_element_type=jnp.float32)
        return lax.fori_loop(0, 1000, lambda i, c: jnp.sin(c) * 1.5 + c[::-1], y)

    items = launches_of(f, S((256, 512), jnp.bfloat16), S((512, 1024), jnp.bfloat16))
    gemms = [k for k in items if k.kind == "gemm"]
    assert len(gemms) == 1 and gemms[0].count == 1 and gemms[0].flops == 2 * 256 * 512 * 1024, items
    assert gemms[0].bytes >= (256 * 512 + 512 * 1024) * 2 + 256 * 1024 * 4  # at least its operands and result
    counts = sorted(k.count for k in items)
    assert 1000 in counts and 1001 in counts, items  # the body's kernels, and the condition's one more
    assert all(k.trips_known and k.flops_known for k in items)
    totals = executable.summary(items)
    assert totals["kernels"] == sum(k.count for k in items if k.kind != "copy")
    assert totals["predicted_s"] == pytest.approx(sum(k.seconds() for k in items))
    # outside any CUDA graph, each launch costs its host launch besides its bytes
    assert totals["predicted_s"] >= totals["kernels_outside_graphs"] * executable.LAUNCH_S


@pytest.mark.aot
def test_a_conditional_counts_its_cheapest_branch(h200_target):
    def f(p, x, w):
        return lax.cond(p, lambda: x * 2.0, lambda: jnp.dot(x, w, preferred_element_type=jnp.float32))

    items = launches_of(f, S((), jnp.bool_), S((512, 512), jnp.float32), S((512, 512), jnp.float32))
    assert not [k for k in items if k.kind == "gemm"], items
    assert any(k.flops == 512 * 512 for k in items), items  # the product by 2


@pytest.mark.aot
def test_a_pallas_call_is_named_by_its_kernel(h200_target):
    state, x = S((1, 48, 64, 128), jnp.float32), S((1, 48, 64), jnp.bfloat16)
    dt, A, B, D = S((1, 48), jnp.float32), S((48,), jnp.float32), S((1, 1, 128), jnp.bfloat16), S((48,), jnp.float32)
    with pallas_kernels.cuda_lowering():
        items = launches_of(pallas_kernels.ssd_decode, state, x, dt, A, B, B, D)
    calls = [k for k in items if k.kind == "pallas"]
    assert [k.name for k in calls] == ["ssd_decode"] and not calls[0].flops_known, items
    assert calls[0].bytes >= 2 * 48 * 64 * 128 * 4  # the state read and written


@pytest.mark.aot
def test_a_fusion_gathering_rows_is_charged_for_the_rows(h200_target):
    # A MoE decode: 6 of 64 experts' [1536, 1024] weights gathered and multiplied by one token.
    def f(w, x, chosen):
        return jnp.einsum("d,edf->ef", x, w[chosen])

    w = S((64, 1536, 1024), jnp.bfloat16)
    items = launches_of(f, w, S((1536,), jnp.bfloat16), S((6,), jnp.int32))
    total = sum(k.count * k.bytes for k in items)
    assert 6 * 1536 * 1024 * 2 <= total < 0.2 * 64 * 1536 * 1024 * 2, items


@pytest.mark.aot
def test_a_cublas_gemm_is_charged_its_products_and_operands(h200_target):
    # With XLA's Triton GEMMs off, the product goes to cuBLAS: a custom call returning (result, workspace).
    def f(x, w):
        return jnp.dot(x, w, preferred_element_type=jnp.float32)

    items = launches_of(f, S((256, 512), jnp.bfloat16), S((512, 1024), jnp.bfloat16),
                        options={"xla_gpu_enable_triton_gemm": False})  # fmt: skip
    assert [(k.kind, k.flops) for k in items] == [("gemm", 2 * 256 * 512 * 1024)], items
    assert items[0].bytes == (256 * 512 + 512 * 1024) * 2 + 256 * 1024 * 4  # operands and result, not the workspace


def gpu_mesh(devices: int):
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from pallas_kernels import aot

    return Mesh(np.asarray(aot.gpu_devices(devices)), ("model",), axis_types=(AxisType.Auto,))


@pytest.mark.aot
def test_a_collective_sends_its_ring_share_over_nvlink(h200_target):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels import executable

    mesh = gpu_mesh(4)
    x = S((8, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "model")))
    w = S((1024, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P("model", None)))
    items = launches_of(lambda x, w: jnp.dot(x, w), x, w)  # contracted over the split: partial sums, all-reduced
    reduces = [k for k in items if k.kind == "collective"]
    assert len(reduces) == 1 and reduces[0].devices == 4, items
    assert reduces[0].bytes == 8 * 2048 * 2  # the payload: the (8, 2048) partial product
    assert reduces[0].link_bytes() == 2 * 3 / 4 * reduces[0].bytes  # ring all-reduce: reduce-scatter, all-gather
    totals = executable.summary(items)
    assert totals["collectives"] == 1 and totals["collective_bytes"] == reduces[0].link_bytes()
    assert totals["collective_s"] == pytest.approx(reduces[0].seconds())
    assert reduces[0].seconds() >= reduces[0].link_bytes() / executable.NVLINK_BYTES_PER_S
    gemm = next(k for k in items if k.kind == "gemm")
    assert gemm.flops == 2 * 8 * 256 * 2048  # each device multiplies its quarter of the contraction


@pytest.mark.aot
def test_the_generators_decode_step_over_gpus_all_reduces_once_a_block(h200_target):
    """The sharded decode step compiled for two H200s: the collectives of docs/sharding.md's table (the embedding's,
    the Mamba layer's norm statistic, out_proj, shared MLP and experts), no gather of a weight."""
    from granite_jax.config import ModelConfig
    from granite_jax.generation.steps import abstract_steps
    from granite_jax.ops import Runtime
    from granite_jax.testing import TINY_CONFIG
    from pallas_kernels import aot, executable

    cfg = ModelConfig.from_hf_dict({**TINY_CONFIG, "layer_types": ["mamba"], "num_hidden_layers": 1})
    kw = dict(dtype=jnp.bfloat16, weight_dtype=jnp.bfloat16, runtime=Runtime(platform="gpu"), mesh=gpu_mesh(2))
    fn, args = abstract_steps(cfg, batch=1, prompt_len=1, cache_len=64, **kw)["decode"]
    with pallas_kernels.cuda_lowering():
        items = executable.launches(aot.lower_for_gpu(fn, args, donate_argnums=(2,)))
    collectives = [k for k in items if k.kind == "collective"]
    assert all(k.name.startswith("all-reduce") and k.devices == 2 for k in collectives), collectives
    # Each carries activations, (1, H) rows at most, never a weight matrix; XLA may combine two into one op.
    assert max(k.bytes for k in collectives) <= 2 * 4 * cfg.hidden_size, collectives
    step = [k for k in collectives if "cond/branch" not in k.source]  # greedy sampling's argmax apart
    assert 4 <= sum(k.count for k in step) <= 5, collectives
