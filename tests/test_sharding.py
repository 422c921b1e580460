"""Granite over a mesh of 8 simulated CPU devices (`granite_jax.sharding`): every layout computes the single-device
logits and greedy tokens, the weights load straight into their shards, a mesh that does not divide the model is
refused by name, and an abstract h-small spreads its parameters evenly. The mesh tests run in a fresh interpreter with
the devices (`conftest.run_under_mesh_devices`)."""

from __future__ import annotations

import json

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
LAYOUTS = ["model=8", "data=2,model=2,expert=2"]  # tensor, and a mix with the batch over data and an expert axis
PROMPTS = ["The quick brown fox", "a", "State spaces", "hello world", "x y z", "Granite", "1 2 3", "mesh"]


@pytest.mark.slow(35)
def test_under_mesh_devices():
    run_under_mesh_devices(__file__)


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoint) -> str:
    return hf_checkpoint(**EVEN)


TOKENS = np.random.default_rng(0).integers(0, 300, (8, 16))


def logits(model) -> np.ndarray:
    return np.asarray(model(jnp.asarray(TOKENS)))


@pytest.fixture(scope="module")
def single_device_logits(checkpoint) -> np.ndarray:
    return logits(load_model(checkpoint))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_computes_the_single_device_logits(checkpoint, single_device_logits, layout, mesh_devices):
    sharded = load_model(checkpoint, mesh=sharding.parse_mesh(layout, mesh_devices))
    np.testing.assert_allclose(logits(sharded), single_device_logits, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def single_device_tokens(checkpoint) -> list[list[int]]:
    return [list(r.token_ids) for r in Generator(checkpoint).generate(PROMPTS, max_new_tokens=12, stop_token_ids=[])]


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
