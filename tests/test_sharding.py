"""Granite over a mesh of 8 simulated CPU devices (`granite_jax.sharding`): every layout computes the single-device
logits and greedy tokens, the weights load straight into their shards, a mesh that does not divide the model is
refused by name, and an abstract h-small spreads its parameters evenly. The mesh tests run in a fresh interpreter with
the devices (`conftest.run_under_mesh_devices`)."""

from __future__ import annotations

import collections
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import run_under_mesh_devices
from granite_jax import Generator, sharding
from granite_jax.checkpoint import load_model, save_checkpoint
from granite_jax.checkpoint.hf import flatten
from granite_jax.errors import InputError
from granite_jax.model import abstract_model
from granite_jax.presets import released_config

# Every head, expert and vocabulary count of the test model divides 8, so that every layout can be tried; one Mamba
# and one attention layer (compiling for 8 devices is the tests' cost).
EVEN = dict(
    num_attention_heads=8,
    num_key_value_heads=8,
    num_local_experts=8,
    mamba_n_heads=8,
    num_hidden_layers=2,
    layer_types=["mamba", "attention"],
)
# Tensor, expert, data, and a mix with the batch over data and an expert axis.
LAYOUTS = ["model=8", "expert=8", "data=8", "data=2,model=2,expert=2"]
PROMPTS = ["The quick brown fox", "a", "State spaces", "hello world", "x y z", "Granite", "1 2 3", "mesh"]


@pytest.mark.slow(70)
def test_under_mesh_devices():
    run_under_mesh_devices(__file__)


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoint) -> str:
    return hf_checkpoint(**EVEN)


TOKENS = np.random.default_rng(0).integers(0, 300, (8, 16))


def logits(model) -> np.ndarray:
    return np.asarray(nnx.jit(lambda m, tokens: m(tokens))(model, jnp.asarray(TOKENS)))  # one program, not op by op


@pytest.fixture(scope="module")
def single_device_logits(checkpoint) -> np.ndarray:
    return logits(load_model(checkpoint))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_computes_the_single_device_logits(checkpoint, single_device_logits, layout, mesh_devices):
    sharded = load_model(checkpoint, mesh=sharding.parse_mesh(layout, mesh_devices))
    np.testing.assert_allclose(logits(sharded), single_device_logits, rtol=1e-5, atol=1e-5)


def test_an_id_outside_the_vocabulary_gives_nan_over_vocabulary_shards(checkpoint, single_device_logits, mesh_devices):
    model = load_model(checkpoint, mesh=sharding.parse_mesh("model=8", mesh_devices))
    tokens = TOKENS.copy()
    tokens[1, 3] = model.cfg.vocab_size  # traced inside jit, unchecked: the row's logits are NaN, as on one device
    got = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
    assert np.isnan(got[1]).all()
    np.testing.assert_allclose(np.delete(got, 1, axis=0), np.delete(single_device_logits, 1, axis=0), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


@pytest.fixture(scope="module")
def single_device_tokens(checkpoint) -> list[list[int]]:
    return [list(r.token_ids) for r in Generator(checkpoint).generate(PROMPTS, max_new_tokens=12, stop_token_ids=[])]


# Tensor (heads and the KV cache split) and data (rows split); the experts' layout decodes in the mix, from the
# command line below, and every layout's logits are checked above.
@pytest.mark.parametrize("layout", ["model=8", "data=8"])
def test_greedy_generation_over_each_layout_is_the_single_device_one(
    checkpoint, single_device_tokens, layout, mesh_devices
):
    gen = Generator(checkpoint, mesh=sharding.parse_mesh(layout, mesh_devices))
    results = gen.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[])
    assert [list(r.token_ids) for r in results] == single_device_tokens


def collectives(layout: str, checkpoint: str, mesh_devices) -> collections.Counter:
    """{(collective, the op it comes from): operands} in the compiled decode step outside its sampling branch."""
    gen = Generator(checkpoint, mesh=sharding.parse_mesh(layout, mesh_devices))
    rows = gen.mesh.shape.get("data", 1)
    text = gen.steps.compile("decode", {}, rows, 64).as_text()
    found: collections.Counter = collections.Counter()
    for line in text.splitlines():
        op = re.search(r"= (\(.*?\)|\S+) (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)\(", line)
        if op and "cond/branch" not in line:
            source = re.search(r'op_name="jit\(decode_step\)/(.*?)"', line).group(1)
            for part in source.strip("()").split(":"):  # a combined all-reduce names each source
                found[op.group(2), part.split("/")[-1]] += op.group(1).count("[") // max(source.count(":") + 1, 1)
    return found


# Over the model axis (Megatron's one all-reduce a block, plus the norm), for the one-Mamba, one-attention model: the
# embedding's rows from the vocabulary shards, each device's own ids, summed (the mesh backend's "psum"); in the Mamba
# layer the gated norm's sum of squares over the heads ("reduce_sum", (b, 1, 1)) and out_proj's partial products
# ("dot_general"); in the attention layer o_proj's ("dot_general"); in both the shared MLP's output ("dot_general")
# and the experts' (the mesh backend's "psum", over the expert axis too). XLA combines all-reduces over the same
# devices into one op, so operands are counted. No all-gather, no permute: the Mamba rows and the SwiGLU's [gate | up]
# lie in blocks, a device's heads and columns together. Over data only, the rows never meet.
EXPECTED_COLLECTIVES = {
    "model=8": {("all-reduce", "psum"): 3, ("all-reduce", "reduce_sum"): 1, ("all-reduce", "dot_general"): 4},
    "expert=8": {("all-reduce", "psum"): 2},
    "data=8": {},
}
EXPECTED_COLLECTIVES["data=2,model=2,expert=2"] = EXPECTED_COLLECTIVES["model=8"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_decode_step_has_the_expected_collectives_and_no_others(checkpoint, layout, mesh_devices):
    assert dict(collectives(layout, checkpoint, mesh_devices)) == EXPECTED_COLLECTIVES[layout]


def test_a_model_saved_from_its_shards_is_the_checkpoint_it_came_from(
    checkpoint, single_device_logits, tmp_path, mesh_devices
):
    sharded = load_model(checkpoint, mesh=sharding.parse_mesh("data=2,model=4", mesh_devices))
    assert sharded.layers[0].mamba.blocks == 4
    saved = save_checkpoint(sharded, tmp_path / "from-shards")  # in transformers' row order, whatever the mesh
    np.testing.assert_allclose(logits(load_model(saved)), single_device_logits, rtol=1e-5, atol=1e-5)


def test_block_orders_put_each_devices_heads_and_columns_together():
    cfg = released_config("granite-4.0-h-tiny")
    rows, channels = sharding.mamba_block_order(cfg, 4)
    d, n, h = cfg.mamba_d_inner, cfg.mamba_d_state, cfg.mamba_n_heads
    block = rows.reshape(4, -1)[1]  # the second device's rows: [z | x B C | dt] of heads h/4 .. h/2
    z, x, B, C, dt = np.split(block, np.cumsum([d // 4, d // 4, n, n]))
    np.testing.assert_array_equal(z, np.arange(d // 4, d // 2))
    np.testing.assert_array_equal(x, d + np.arange(d // 4, d // 2))
    np.testing.assert_array_equal(B, 2 * d + np.arange(n))  # the one group, copied into every block
    np.testing.assert_array_equal(C, 2 * d + n + np.arange(n))
    np.testing.assert_array_equal(dt, 2 * d + 2 * n + np.arange(h // 4, h // 2))
    assert set(rows) == set(range(cfg.mamba_in_proj_dim)) and len(channels) == d + 4 * 2 * n
    w = np.random.default_rng(0).normal(size=(cfg.mamba_in_proj_dim, 3))
    path = "layers.0.mamba.in_proj.weight"
    np.testing.assert_array_equal(sharding.from_blocks(cfg, 4, path, sharding.to_blocks(cfg, 4, path, w)), w)
    np.testing.assert_array_equal(sharding.gate_up_order(4, 2), [0, 1, 4, 5, 2, 3, 6, 7])


def test_weights_load_straight_into_their_shards(checkpoint, tmp_path, mesh_devices):
    mesh = sharding.parse_mesh("data=2,model=4", mesh_devices)
    orbax_dir = save_checkpoint(load_model(checkpoint), tmp_path / "orbax")
    for source in (checkpoint, orbax_dir):
        model = load_model(source, mesh=mesh)
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            key = ".".join(map(str, path))
            want = sharding.parameter_spec(key, v[...].ndim, mesh)
            assert v[...].sharding.spec == want, (source, key)
        q = model.layers[0].mamba.in_proj.weight[...]
        assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0] // 4, q.shape[1])}  # a quarter each


def test_the_cache_is_made_in_its_shards(checkpoint, mesh_devices):
    mesh = sharding.parse_mesh("data=2,model=4", mesh_devices)
    gen = Generator(checkpoint, mesh=mesh)
    cache = gen.steps.cache(2, 64, np.zeros(2, np.int32))
    kv, mamba = cache.layers[1], cache.layers[0]
    assert kv.k.sharding.spec == jax.sharding.PartitionSpec("data", "model")
    assert mamba.ssm.sharding.spec == jax.sharding.PartitionSpec("data", "model")
    assert mamba.conv.sharding.spec == jax.sharding.PartitionSpec("data", None, "model")


def test_a_mesh_that_does_not_divide_the_model_is_named(hf_checkpoint, mesh_devices):
    d = hf_checkpoint()  # 2 key/value heads
    with pytest.raises(InputError, match="mesh axis 'model' of size 4 does not divide the model's 2 key/value heads"):
        load_model(d, mesh=sharding.parse_mesh("data=2,model=4", mesh_devices))
    with pytest.raises(InputError, match="multiply to 4 devices, and there are 8"):
        sharding.parse_mesh("data=2,model=2", mesh_devices)
    with pytest.raises(InputError, match="expected comma-separated AXIS=SIZE .* got 'tensor=8'"):
        sharding.parse_mesh("tensor=8", mesh_devices)
    with pytest.raises(InputError, match="by 8 prompts|multiple of 2 prompts"):
        Generator(d, mesh=sharding.parse_mesh("data=2,model=2,expert=2", mesh_devices)).generate(["one"])


def test_h_small_spreads_its_parameters_over_eight_devices(mesh_devices):
    cfg = released_config("granite-4.0-h-small")
    flat = flatten(nnx.to_pure_dict(nnx.state(abstract_model(cfg, param_dtype=jnp.bfloat16), nnx.Param)))
    total = sum(x.size * 2 for x in flat.values())
    # model=8: all but the norms and routers split 8 ways. model=4,expert=2: the experts 8 ways, the rest 4 (whole
    # across "expert"), so it holds a quarter of the dense part: 16% more than an eighth of the whole.
    for layout, bound in (("model=8", 1.01), ("model=4,expert=2", 1.2)):
        mesh = sharding.parse_mesh(layout, mesh_devices)
        sharding.check_mesh(cfg, mesh)
        per_device = 0
        for path, x in flat.items():
            spec = sharding.parameter_spec(path, x.ndim, mesh)
            per_device += x.size * 2 // int(np.prod([mesh.shape[a] for a in spec if a is not None]))
        assert per_device / (total / 8) < bound, (layout, per_device / 1e9, total / 8e9)


def test_generate_runs_over_a_mesh_from_the_command_line(checkpoint, single_device_tokens, mesh_devices, capsys):
    from granite_jax.generate import main

    argv = ["--model", checkpoint, *(a for p in PROMPTS for a in ("--prompt", p)), "--max-new-tokens", "12"]
    assert main([*argv, "--ignore-eos", "--json", "--mesh", "data=2,model=2,expert=2"]) == 0
    assert [r["token_ids"] for r in json.loads(capsys.readouterr().out)["results"]] == single_device_tokens


def test_an_experiment_config_runs_over_a_mesh(checkpoint, tmp_path, mesh_devices):
    from granite_jax import experiment
    from granite_jax.cli import load_config

    config = load_config(
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs/experiments/parity.py"),
        "quick",
    )
    config.model.update(name=None, checkpoint=checkpoint)
    config.workload.mesh = "model=8"  # granite-jax over 8 devices against transformers on one, layer by layer
    config.output_dir = str(tmp_path / "out")
    with open(f"{experiment.run(config)}/results.json") as f:
        results = json.load(f)
    assert results["config"]["workload"]["mesh"] == "model=8"
    assert results["summary"]["within_tolerance"] and results["summary"]["max_rel_err"] < 1e-5


def test_float8_weights_over_a_mesh_are_one_devices(checkpoint, tmp_path, mesh_devices):
    # The float8 matrices' stored channel scales follow their rows into the blocks (in_proj's, the SwiGLUs'
    # [gate | up]): a float8 orbax checkpoint restored over the mix computes one device's logits.
    kinds = dict(dtype="bfloat16", weight_dtype="float8")
    model = load_model(checkpoint, **kinds)
    one, stored = logits(model), save_checkpoint(model, tmp_path / "float8")
    sharded = logits(load_model(stored, mesh=sharding.parse_mesh("data=2,model=2,expert=2", mesh_devices), **kinds))
    np.testing.assert_allclose(sharded, one, atol=0.01 * np.abs(one).max())  # bfloat16 partial sums, summed apart
