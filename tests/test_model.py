"""Parity of the Flax model with transformers' GraniteMoeHybridForCausalLM in fp32, per layer and on the logits; the
model's own pieces (conv ring, cached attention, MoE routes, dtypes, input checks) against float64 or each other."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from granite_jax import model as granite_model
from granite_jax import ops
from granite_jax.checkpoint import load_model
from granite_jax.model import (
    Cache,
    KVState,
    Positions,
    abstract_model,
    attend_cache,
    causal_conv,
    conv_step,
    count_params,
    expert_linear,
    history_ring,
    ring_history,
    with_dtype,
    with_runtime,
)
from granite_jax.ops import Runtime
from granite_jax.presets import released_config
from granite_jax.ssd import ssd
from granite_jax.testing import attention_float64

RTOL = 1e-5
# One compiled program per (model, shape): op-by-op dispatch of a whole model is far slower than compiling it.
_forward = jax.jit(lambda model, ids, pad: model.forward(ids, pad=pad, return_hidden=True))
_logits = jax.jit(lambda model, ids, pad: model(ids, pad=pad))

VARIANTS = {
    "moe_hybrid": {},
    "dense_hybrid": dict(num_local_experts=0, num_experts_per_tok=0, shared_intermediate_size=96),
    "attention_rope": dict(
        layer_types=["attention"] * 3,
        num_hidden_layers=3,
        position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_local_experts=0,
        num_experts_per_tok=0,
    ),
    "mamba_only": dict(layer_types=["mamba"] * 3, num_hidden_layers=3),
    "groups": dict(mamba_n_groups=2),
    "untied_head": dict(tie_word_embeddings=False),
    "explicit_head_dim": dict(head_dim=24, layer_types=["attention", "mamba"], num_hidden_layers=2),
}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@dataclasses.dataclass
class Pair:
    hf: torch.nn.Module
    jax: object
    vocab: int


@pytest.fixture(scope="module")
def pairs(hf_checkpoint):
    from transformers import GraniteMoeHybridForCausalLM

    made = {}

    def get(name: str) -> Pair:
        if name not in made:
            d = hf_checkpoint(**VARIANTS[name])
            hf = GraniteMoeHybridForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            made[name] = Pair(hf, load_model(d), hf.config.vocab_size)
        return made[name]

    return get


def compare(pair: Pair, ids: np.ndarray, pad: np.ndarray | None = None) -> dict[str, float]:
    """Relative error of every layer output and the logits on real (non-padding) tokens; asserts the bound."""
    mask = np.ones(ids.shape, np.int64) if pad is None else (np.arange(ids.shape[1])[None] >= pad[:, None])
    with torch.no_grad():
        out = pair.hf(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            output_hidden_states=True,
            use_cache=False,
        )
    pad = np.zeros(ids.shape[0], np.int32) if pad is None else pad
    logits, _, hidden = _forward(pair.jax, jnp.asarray(ids), jnp.asarray(pad))
    real = mask.astype(bool)
    # transformers records the embeddings, every layer output, and the last one after the final norm.
    ours = [np.asarray(h) for h in hidden[:-1]] + [np.asarray(pair.jax.norm(hidden[-1]))]
    theirs = [t.numpy() for t in out.hidden_states]
    errors = {f"layer {i}": rel_err(o[real], t[real]) for i, (o, t) in enumerate(zip(ours, theirs[1:], strict=True))}
    # Each layer adds a few % to the residual stream, so an error in one layer's update is diluted in the stream:
    # compare what each layer adds too (not the last: transformers records it after the final norm).
    embedded = pair.jax.embed(jnp.asarray(ids)) * pair.jax.cfg.embedding_multiplier
    previous = (np.asarray(embedded), theirs[0])
    errors["embeddings"] = rel_err(previous[0][real], previous[1][real])
    for i, (o, t) in enumerate(zip(ours[:-1], theirs[1:-1], strict=True)):
        errors[f"layer {i} update"] = rel_err((o - previous[0])[real], (t - previous[1])[real])
        previous = (o, t)
    errors["logits"] = rel_err(np.asarray(logits)[real], out.logits.numpy()[real])
    worst = max(errors, key=errors.get)
    print(f"worst relative error: {worst} = {errors[worst]:.2e}")
    assert errors[worst] <= RTOL, errors
    np.testing.assert_array_equal(np.asarray(logits).argmax(-1)[real], out.logits.numpy().argmax(-1)[real])
    return errors


@pytest.mark.parametrize("length", [1, 7, 16, 48, 40])  # chunk 16: shorter, one, several, not a multiple
def test_moe_hybrid_matches_transformers(pairs, length):
    pair = pairs("moe_hybrid")
    ids = np.random.default_rng(length).integers(0, pair.vocab, (2, length))
    compare(pair, ids)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "moe_hybrid"])
@pytest.mark.parametrize("length", [40])
def test_variant_matches_transformers(pairs, variant, length):
    pair = pairs(variant)
    ids = np.random.default_rng(length).integers(0, pair.vocab, (2, length))
    compare(pair, ids)


@pytest.mark.parametrize("variant", ["moe_hybrid", "attention_rope"])
def test_left_padded_batch_matches_transformers_and_single_prompts(pairs, variant):
    pair = pairs(variant)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, pair.vocab, (2, 40))
    pad = np.array([0, 11])
    ids[1, :11] = 0
    compare(pair, ids, pad)
    batched = np.asarray(_logits(pair.jax, jnp.asarray(ids), jnp.asarray(pad)))
    for row in range(2):
        alone = np.asarray(_logits(pair.jax, jnp.asarray(ids[row : row + 1, pad[row] :]), jnp.zeros(1, jnp.int32)))
        assert rel_err(batched[row, pad[row] :], alone[0]) <= RTOL


def test_padding_does_not_leak_into_real_tokens(pairs):
    pair = pairs("moe_hybrid")
    ids = np.random.default_rng(2).integers(3, pair.vocab, (2, 40))
    ids[1, 10:] = ids[0, 10:]
    pad = np.array([10, 10])  # same real tokens after different garbage in the padding
    logits = np.asarray(_logits(pair.jax, jnp.asarray(ids), jnp.asarray(pad)))
    np.testing.assert_array_equal(logits[0, 10:], logits[1, 10:])


@pytest.mark.parametrize("variant", ["moe_hybrid", "groups"])
def test_naive_ssd_model_equals_xla(pairs, variant):
    pair = pairs(variant)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, pair.vocab, (2, 40)))
    naive = with_runtime(pair.jax, pair.jax.runtime.replace(ssd="naive"))
    assert naive.runtime.ssd == "naive" and pair.jax.runtime.ssd == "xla"
    zeros = jnp.zeros(2, jnp.int32)
    assert rel_err(_logits(naive, ids, zeros), _logits(pair.jax, ids, zeros)) <= RTOL


def test_cached_segments_equal_one_forward(pairs):
    pair = pairs("moe_hybrid")
    ids = np.random.default_rng(4).integers(3, pair.vocab, (2, 45))
    pad = np.array([0, 6])
    full = np.asarray(_logits(pair.jax, jnp.asarray(ids), jnp.asarray(pad)))
    cache = Cache.init(pair.jax.cfg, 2, 64, pad=jnp.asarray(pad))
    pieces = []
    step = jax.jit(lambda model, ids, cache: model.forward(ids, cache=cache)[:2])
    for start, stop in [(0, 20), (20, 21), (21, 45)]:
        logits, cache = step(pair.jax, jnp.asarray(ids[:, start:stop]), cache)
        pieces.append(np.asarray(logits))
    stepped = np.concatenate(pieces, axis=1)
    for row in range(2):
        assert rel_err(stepped[row, pad[row] :], full[row, pad[row] :]) <= RTOL
    assert cache.layers[0].ssm.dtype == jnp.float32
    with pytest.raises(ValueError, match="2 tokens from slot 45 do not fit a KV cache of 46 slots"):
        pair.jax.forward(jnp.asarray(ids[:, :2]), cache=dataclasses.replace(Cache.init(pair.jax.cfg, 2, 46), index=45))
    full_cache = dataclasses.replace(Cache.init(pair.jax.cfg, 2, 45, pad=jnp.asarray(pad)), index=jnp.int32(45))
    logits, _ = step(pair.jax, jnp.asarray(ids[:, :1]), full_cache)  # under jit: no room is NaN, never clamped
    assert np.isnan(np.asarray(logits)).all()


def conv_float64(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """The depthwise causal conv of x (b, T, C) from zero history, in float64: out[t] = sum_k w[k] x[t - K + 1 + k]."""
    K, T = weight.shape[0], x.shape[1]
    padded = np.concatenate([np.zeros((x.shape[0], K - 1, x.shape[2])), x], axis=1)
    return sum(padded[:, k : k + T] * weight[k] for k in range(K)) + bias


# The conv state is a ring keyed by slot (so that a decode step writes it in place): a prompt segment, one-token steps
# and another segment, from any first slot (left padding shifts it), give the conv of the whole sequence.
@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("first_slot", [0, 3, 6])
def test_conv_ring_segments_and_steps_equal_one_conv(K, first_slot):
    rng = np.random.default_rng(K + first_slot)
    x, weight, bias = rng.normal(size=(2, 12, 5)), rng.normal(size=(K, 5)), rng.normal(size=5)
    w, b = jnp.asarray(weight, jnp.float32), jnp.asarray(bias, jnp.float32)
    xs = jnp.asarray(x, jnp.float32)
    out, history = causal_conv(xs[:, :5], jnp.zeros((2, K - 1, 5)), w, b)
    pieces, ring, slot = [out], history_ring(history, first_slot + 5), first_slot + 5
    for t in range(5, 9):
        out, ring = jax.jit(conv_step)(xs[:, t : t + 1], ring, slot, w, b)
        pieces.append(out)
        slot += 1
    out, _ = causal_conv(xs[:, 9:], ring_history(ring, slot), w, b)
    got = np.concatenate([np.asarray(p) for p in pieces + [out]], axis=1)
    np.testing.assert_allclose(got, conv_float64(x, weight, bias), rtol=2e-6, atol=2e-6)


def test_decode_step_updates_the_conv_state_in_place(tiny_model):
    # A shifted history (or reading the old ring beside the update) made XLA copy each layer's donated conv state.
    cache = Cache.init(tiny_model.cfg, 2, 16)
    step = jax.jit(lambda model, ids, cache: model.forward(ids, cache=cache)[:2], donate_argnums=2)
    hlo = step.trace(tiny_model, jnp.ones((2, 1), jnp.int32), cache).lower().compile().as_text()
    conv_params = re.findall(r"%(\S+) = \S+ parameter\(\d+\), metadata=\{op_name=\"cache\.layers\[\d+\]\.conv\"", hlo)
    assert len(conv_params) == tiny_model.cfg.layer_types.count("mamba")
    copied = [name for name in conv_params if re.search(rf"copy\(%{re.escape(name)}\)", hlo)]
    assert not copied, f"the decode step copies the conv states {copied}"


@pytest.mark.parametrize("start, T", [(0, 5), (33, 1), (90, 7), (99, 1)])
def test_blocked_cache_attention_equals_float64(start, T):
    # 100 slots in blocks of 16: the last block is shifted back and overlaps the one before it; row 1's padding
    # (37 slots) fills more than two whole blocks, so its first blocks are entirely masked.
    rng = np.random.default_rng(start)
    b, kv, rep, hd, S = 2, 2, 3, 8, 100
    q = rng.standard_normal((b, T, kv, rep, hd), dtype=np.float32)
    k, v = (rng.standard_normal((b, kv, S, hd), dtype=np.float32) for _ in range(2))
    pad = np.array([0, 37 if start >= 37 else 2])
    query_slots = start + np.arange(T)
    pos = Positions(jnp.asarray(query_slots, jnp.int32), jnp.asarray(pad, jnp.int32))
    cache = KVState(jnp.asarray(k), jnp.asarray(v))
    want = attention_float64(q, k, v, query_slots, pad, 0.3)
    real = query_slots[None, :] >= pad[:, None]  # padding queries' outputs are unused
    for runtime in (Runtime(kernels=False), Runtime()):  # the plain-JAX blocks, and a platform's kernel where one runs
        with ops.using(runtime):
            out = attend_cache(jnp.asarray(q), cache, pos, 0.3, block=16)
        np.testing.assert_allclose(np.asarray(out)[real], want[real], rtol=1e-5, atol=1e-5)


def test_bfloat16_model_is_close_and_keeps_fp32_state(tiny_checkpoint):
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 300, (2, 40)))
    f32 = np.asarray(_logits(load_model(tiny_checkpoint), ids, jnp.zeros(2, jnp.int32)))
    model = load_model(tiny_checkpoint, dtype=jnp.bfloat16)
    assert model.layers[0].mamba.in_proj.weight[...].dtype == jnp.bfloat16
    prefill = jax.jit(lambda model, ids, cache: model.forward(ids, cache=cache)[:2])
    logits, cache = prefill(model, ids, Cache.init(model.cfg, 2, 48, jnp.bfloat16))
    assert logits.dtype == jnp.bfloat16 and cache.layers[0].ssm.dtype == jnp.float32
    assert rel_err(np.asarray(logits, np.float32), f32) < 3e-2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_ssd_gets_x_b_c_in_the_model_dtype(tiny_checkpoint, dtype, monkeypatch):
    # As transformers' conv1d returns them. Float32 x, B, C from a bfloat16 model sent the Pallas kernels down their
    # float32 (3xTF32) path: a whole h-tiny Mamba layer ran 0.56x the "xla" layer on an H200 (docs/kernels.md).
    seen = []

    def spy(x, dt, A, B, C, D, **kwargs):
        seen.append((x.dtype, B.dtype, C.dtype, dt.dtype))
        return ssd(x, dt, A, B, C, D, **kwargs)

    monkeypatch.setattr(granite_model, "ssd", spy)
    jax.jit(lambda m, ids: m(ids))(load_model(tiny_checkpoint, dtype=dtype), jnp.ones((1, 20), jnp.int32))
    assert seen and set(seen) == {(jnp.dtype(dtype),) * 3 + (jnp.dtype(jnp.float32),)}


@pytest.mark.parametrize("batch", [1, 3])
def test_float32_on_bfloat16_weights_is_the_float32_model_of_those_weights(tiny_checkpoint, batch):
    # weight_dtype bfloat16 under dtype float32: every product and the Mamba decoding step take the weights as stored
    # (a kernel backend widens them in registers; plain JAX converts them where they are used), so prefill and decode
    # give the logits of the float32 model whose weights are the same bfloat16 values, from half the weight memory.
    reference = load_model(tiny_checkpoint)
    rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), nnx.state(reference, nnx.Param))
    nnx.update(reference, rounded)
    mixed = load_model(tiny_checkpoint, dtype=jnp.float32, weight_dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(mixed, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    naive = nnx.state(with_runtime(mixed, Runtime(ssd="naive")), nnx.Param)  # shares the weights as they are
    assert {x.dtype for x in jax.tree.leaves(naive)} == {jnp.dtype(jnp.bfloat16)}
    ids = jnp.asarray(np.random.default_rng(4).integers(3, 300, (batch, 10)))
    step = jax.jit(lambda model, ids, cache: model.forward(ids, cache=cache)[:2])
    outs = []
    for model in (reference, mixed):
        out, cache = step(model, ids[:, :4], Cache.init(model.cfg, batch, 16))  # a prefill, then decode steps
        logits = [np.asarray(out)]
        for t in range(4, ids.shape[1]):
            out, cache = step(model, ids[:, t : t + 1], cache)
            logits.append(np.asarray(out))
        outs.append(np.concatenate(logits, axis=1))
    assert outs[1].dtype == np.float32
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6 * np.abs(outs[0]).max())


def test_with_dtype_computes_in_float32_on_the_same_bfloat16_weights(tiny_checkpoint):
    # compare's float32 reference for a bfloat16 model: the bfloat16 weights shared as they are, every operation in
    # float32, i.e. the model loaded in float32 on bfloat16 weights.
    bf16 = load_model(tiny_checkpoint, dtype=jnp.bfloat16)
    f32 = with_dtype(bf16, jnp.float32)
    assert f32.dtype == jnp.float32 and f32.cfg == bf16.cfg
    shared = zip(jax.tree.leaves(nnx.state(bf16, nnx.Param)), jax.tree.leaves(nnx.state(f32, nnx.Param)))
    assert all(a is b for a, b in shared)
    expected = load_model(tiny_checkpoint, dtype=jnp.float32, weight_dtype=jnp.bfloat16)
    ids = jnp.asarray(np.random.default_rng(5).integers(3, 300, (2, 24)))
    forward = jax.jit(lambda m, t: m.forward(t)[0])
    logits = forward(f32, ids)
    assert logits.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(forward(expected, ids)))
    assert rel_err(forward(bf16, ids), logits) > 1e-4  # bfloat16 rounding: f32 is not the bfloat16 model


# Published totals (ibm.com/granite/docs): h-tiny ~6.9B, h-small ~32.2B, h-1b ~1.46B, h-350m ~0.34B.
@pytest.mark.parametrize(
    "name, billions, tol",
    [
        ("granite-4.0-h-tiny", 6.94, 0.02),
        ("granite-4.0-h-small", 32.2, 0.1),
        ("granite-4.0-h-1b", 1.46, 0.01),
        ("granite-4.0-h-350m", 0.34, 0.005),
        ("granite-4.0-h-micro", 3.19, 0.02),
        ("granite-4.0-micro", 3.40, 0.02),
    ],
)
def test_released_configs_build_abstractly_with_published_sizes(name, billions, tol):
    model = abstract_model(released_config(name), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert count_params(model) / 1e9 == pytest.approx(billions, abs=tol)


def test_abstract_construction_restores_tracer_error_origins():
    # abstract_model drops the origin note of tracer attribute errors only while it traces (a quadratic cost on
    # older jax): afterwards tracers explain themselves again.
    partial_eval = pytest.importorskip("jax._src.interpreters.partial_eval")
    before = partial_eval.DynamicJaxprTracer.__dict__.get("_origin_msg")
    abstract_model(released_config("granite-4.0-h-350m"))
    assert partial_eval.DynamicJaxprTracer.__dict__.get("_origin_msg") is before


@pytest.mark.parametrize("variant", ["moe_hybrid", "untied_head"])
def test_fresh_model_is_initialised_as_transformers_initialises_one(variant, tmp_path):
    """Every tensor of a fresh model against the same tensor of a fresh transformers model of its config
    (`_init_weights`): matrices, convolutions and the embedding normal with the config's `initializer_range`, the
    padding token's row zero, norms one, and the Mamba vectors (dt_bias, A_log, D, conv bias) equal: a run from
    scratch starts where transformers' would."""
    from safetensors.numpy import load_file
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    from granite_jax.checkpoint.hf import hf_tensors
    from granite_jax.config import ModelConfig
    from granite_jax.model import Granite
    from granite_jax.testing import TINY_CONFIG

    fields = TINY_CONFIG | VARIANTS[variant] | dict(vocab_size=96, pad_token_id=3, initializer_range=0.05)
    ours = hf_tensors(Granite(ModelConfig.from_hf_dict(fields), rngs=nnx.Rngs(0)))
    torch.manual_seed(0)
    GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**fields)).save_pretrained(tmp_path)  # checkpoint names
    theirs = load_file(tmp_path / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, ref in theirs.items():
        assert ours[name].shape == ref.shape, name
        if ref.std() == 0 or name.endswith("A_log"):  # constants: ones, zeros, log(1..h)
            np.testing.assert_allclose(ours[name], ref, rtol=1e-6, err_msg=name)
        else:
            assert ours[name].std() == pytest.approx(ref.std(), rel=0.15), name
            assert abs(ours[name].mean()) < 4 * ref.std() / np.sqrt(ref.size), name
    np.testing.assert_array_equal(ours["model.embed_tokens.weight"][3], 0)


def test_expert_routes_agree_with_float64_in_value_and_gradient():
    # `expert_linear` gathers the chosen experts' matrices for few rows (decoding) and groups many rows by expert for
    # one ragged product (prefill, training). Both are the float64 product, and their gradients agree: the model
    # trains through either (plain JAX: Runtime(kernels=False)).
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((4, 24, 16)), jnp.float32)
    for rows in (granite_model.GATHER_ROWS, granite_model.GATHER_ROWS + 16):
        x = jnp.asarray(rng.standard_normal((rows, 24)), jnp.float32)
        experts = jnp.asarray(rng.integers(0, 4, rows), jnp.int32)
        want = np.einsum("rk,rkn->rn", np.asarray(x, np.float64), np.asarray(w, np.float64)[np.asarray(experts)])
        with ops.using(Runtime(kernels=False)):
            got = jax.jit(expert_linear)(x, w, experts)
            loss = lambda x, w, e: jnp.sum(jnp.sin(expert_linear(x, w, e)))  # noqa: E731
            grads = jax.jit(jax.grad(loss, (0, 1)))(x, w, experts)
        assert rel_err(got, want) <= RTOL
        upstream = np.cos(want)
        gx = np.einsum("rn,rkn->rk", upstream, np.asarray(w, np.float64)[np.asarray(experts)])
        gw = np.zeros(w.shape)
        np.add.at(gw, np.asarray(experts), np.einsum("rk,rn->rkn", np.asarray(x, np.float64), upstream))
        assert rel_err(grads[0], gx) <= RTOL and rel_err(grads[1], gw) <= RTOL


def test_plain_jax_model_equals_the_models_runtime_in_prefill_and_decode(tiny_checkpoint):
    # The default runtime runs a platform's kernels where they are available (CPUs); the plain-JAX model is the
    # definition. A prefill and decode steps at batch 1 and 3 give the same logits either way.
    model = load_model(tiny_checkpoint)
    plain = with_runtime(model, Runtime(kernels=False))
    step = jax.jit(lambda model, ids, cache: model.forward(ids, cache=cache)[:2])
    for batch in (1, 3):
        ids = jnp.asarray(np.random.default_rng(batch).integers(3, 300, (batch, 12)))
        outs = []
        for m in (plain, model):
            out, cache = step(m, ids[:, :5], Cache.init(m.cfg, batch, 16))
            logits = [np.asarray(out)]
            for t in range(5, ids.shape[1]):
                out, cache = step(m, ids[:, t : t + 1], cache)
                logits.append(np.asarray(out))
            outs.append(np.concatenate(logits, axis=1))
        assert rel_err(outs[1], outs[0]) <= RTOL


def test_with_runtime_shares_the_weights_and_retraces(tiny_checkpoint):
    # A runtime is not a weight: switching it copies nothing, and a jitted function taking the model traces again.
    model = load_model(tiny_checkpoint)
    naive = with_runtime(model, Runtime(ssd="naive"))
    shared = zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(naive, nnx.Param)))
    assert all(a is b for a, b in shared)
    traced = []
    logits = jax.jit(lambda m, ids: traced.append(m.runtime) or m(ids))
    ids = jnp.ones((1, 20), jnp.int32)
    for m in (model, naive, model):
        logits(m, ids)
    assert traced == [Runtime(), Runtime(ssd="naive")]


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint):
    return load_model(tiny_checkpoint)


@pytest.mark.parametrize(
    "tokens, pad, message",
    [
        ([[5, 6, 7, 320]], None, r"tokens\[0, 3\] = 320: expected token ids in \[0, vocab_size=320\)"),
        ([[5, -1]], None, r"tokens\[0, 1\] = -1"),
        ([[5.0, 6.0]], None, "tokens: expected integer token ids, got dtype float"),
        ([5, 6], None, r"tokens: expected a non-empty \(batch, length\) array, got shape \(2,\)"),
        (np.zeros((1, 0), np.int32), None, r"got shape \(1, 0\)"),
        (np.zeros((0, 4), np.int32), None, r"got shape \(0, 4\)"),
        ([[5, 6]], [0, 1], r"pad: expected shape \(1,\), one count per row of tokens, got shape \(2,\)"),
        ([[5, 6]], 1, r"pad: expected shape \(1,\)"),
        ([[5, 6]], [2], r"pad\[0\] = 2: expected 0 <= pad < T=2"),
        ([[5, 6], [5, 6]], [0, -1], r"pad\[1\] = -1"),
        ([[5, 6]], [0.5], "pad: expected integer padding counts"),
    ],
)
def test_bad_tokens_and_pad_are_named(tiny_model, tokens, pad, message):
    with pytest.raises(ValueError, match=message):
        tiny_model(tokens, pad=pad)


def test_cache_of_another_batch_size_is_refused(tiny_model):
    with pytest.raises(ValueError, match="cache: holds 2 rows, tokens have 1"):
        tiny_model.forward(jnp.asarray([[5]]), cache=Cache.init(tiny_model.cfg, 2, 8))


@pytest.mark.parametrize("bad", [320, -1], ids=["past_vocab", "negative"])
def test_traced_out_of_range_ids_give_their_row_nan(tiny_model, bad):
    tokens = jnp.asarray([[5, 6, 7, 8]] * 2)
    good, poisoned = (
        np.asarray(_logits(tiny_model, t, jnp.zeros(2, jnp.int32))) for t in (tokens, tokens.at[1, 2].set(bad))
    )
    assert np.isnan(poisoned[1]).all()
    np.testing.assert_array_equal(poisoned[0], good[0])
