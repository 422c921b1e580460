"""The Generator: parity with transformers' generate, decode == full forward, chunked prefill, batching, compilation,
sampling and stops, streaming, validation."""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from granite_jax import ops
from granite_jax.generation import GenerationError, Generator, SamplingConfig
from granite_jax.generation import generator as generator_module
from granite_jax.generation.generator import DECODE_CHUNK
from granite_jax.generation.layout import bucket_length, cache_bucket
from granite_jax.ops import Runtime

PROMPTS = ["Granite is a family of language models.", "The quick", "def forward(x): return x * 2 + 1  # numbers"]
GREEDY_32 = SamplingConfig(max_new_tokens=32, stop_token_ids=())


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoint) -> str:
    """The tiny hybrid with large random weights: greedy continuations vary token to token (the default init repeats
    one token forever, which would make token-for-token comparisons nearly vacuous)."""
    return hf_checkpoint(initializer_range=1.0)


@pytest.fixture(scope="module")
def generator(checkpoint) -> Generator:
    return Generator(checkpoint)


def hf_greedy(checkpoint: str, prompts: list[str]) -> list[list[int]]:
    """transformers' greedy 32 new tokens per prompt (left-padded batch), in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **enc, do_sample=False, max_new_tokens=32, eos_token_id=None, pad_token_id=tokenizer.pad_token_id
        )
    return out[:, enc["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def hf_generate(checkpoint):
    """hf_generate(prompts) -> `hf_greedy` on the module's checkpoint."""
    return functools.partial(hf_greedy, checkpoint)


def teacher_forced_logits(generator: Generator, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """Logits (1 + N, V) predicting each token of `continuation` (N,), fed one by one through the decode step: entry 0
    from the prefill's last position, entry i from the step that consumed continuation token i - 1 (the positions a
    full forward over prompt + continuation scores)."""
    layout = generator.layout([len(prompt)], len(continuation) + 1)
    params = SamplingConfig().device_params()
    prepared = generator.prepared(1)
    logits, _, cache = generator.prefill([prompt], layout, params)
    out = [np.asarray(logits)[0]]
    for i, token in enumerate(continuation):
        logits, _, cache = generator.steps.decode(
            prepared, cache, np.asarray([token], np.int32), params, np.int32(i + 1)
        )
        out.append(np.asarray(logits)[0])
    return np.stack(out)


def encoded(generator: Generator, prompt: str) -> list[int]:
    return generator.prompts.encode(prompt)[1][0]


@pytest.fixture(scope="module")
def alone(generator) -> list[tuple[int, ...]]:
    """Greedy 32 tokens of each prompt run on its own."""
    return [generator.generate(p, GREEDY_32)[0].token_ids for p in PROMPTS]


# ---------------------------------------------------------------------------------------------- parity


def test_greedy_matches_transformers_single_prompt(generator, hf_generate, alone):
    (expected,) = hf_generate(PROMPTS[:1])
    assert len(set(expected)) > 8  # a non-degenerate continuation
    assert list(alone[0]) == expected


def test_greedy_matches_transformers_left_padded_batch(generator, hf_generate):
    results = generator.generate(PROMPTS, GREEDY_32)
    assert len({len(r.prompt_ids) for r in results}) == 3  # three different lengths, so real left padding
    assert [list(r.token_ids) for r in results] == hf_generate(PROMPTS)


def test_bfloat16_checkpoint_on_bfloat16_weights_matches_transformers_in_float32(hf_checkpoint):
    # The released checkpoints are bfloat16. float32 arithmetic on the bfloat16 weights (weight_dtype) is the float32
    # model of such a checkpoint at half its weight memory: transformers in float32 (which upcasts the weights), in
    # logits (teacher-forced through batch-1 decode steps: the matrix-vector and expert kernels) and token for token
    # (the batch through bfloat16 panels).
    import torch
    from transformers import AutoModelForCausalLM

    d = hf_checkpoint(initializer_range=1.0, dtype="bfloat16")
    generator = Generator(d, weight_dtype="bfloat16")
    assert generator.weight_dtype == "bfloat16" and generator.model.dtype == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(nnx.state(generator.model, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    prompt, continuation = encoded(generator, PROMPTS[0]), list(range(40, 56))
    stepped = teacher_forced_logits(generator, prompt, continuation)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1 :].numpy()
    assert np.max(np.abs(stepped - want)) <= 1e-5 * np.max(np.abs(want))
    results = generator.generate(PROMPTS, GREEDY_32)
    packed = [a for arrays in generator.prepared(len(PROMPTS)).values() for a in arrays.values()]
    assert {a.dtype for a in packed} <= {jnp.dtype(jnp.bfloat16)}  # the CPU kernels' panels, where they run
    assert [list(r.token_ids) for r in results] == hf_greedy(d, PROMPTS)
    with pytest.raises(ValueError, match="weight_dtype must be one of float32, bfloat16, float16, float8, got 'int8'"):
        Generator(d, weight_dtype="int8")


AUTO_BF16 = "bfloat16" if ops.widens_weights(Runtime()) else "float32"  # without such kernels "auto" keeps float32


@pytest.mark.parametrize(
    "stored, dtype, weight_dtype, loaded",
    [
        ("bfloat16", "float32", "default", AUTO_BF16),  # "auto"
        ("bfloat16", "float32", None, "float32"),  # None: the weights in dtype, as asked
        ("bfloat16", "bfloat16", "auto", "bfloat16"),
        ("bfloat16", "float16", "auto", "float16"),
        ("float32", "float32", "auto", "float32"),  # a float32 checkpoint is not narrowed
    ],
)
def test_auto_weight_dtype_narrows_only_bfloat16_checkpoints_under_float32(
    hf_checkpoint, stored, dtype, weight_dtype, loaded
):
    kwargs = {} if weight_dtype == "default" else dict(weight_dtype=weight_dtype)
    generator = Generator(hf_checkpoint(dtype=stored), dtype=dtype, **kwargs)
    assert generator.weight_dtype == loaded and generator.model.dtype == jnp.dtype(dtype)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(generator.model, nnx.Param))} == {jnp.dtype(loaded)}


def test_batch_equals_each_prompt_alone(generator, alone):
    assert [r.token_ids for r in generator.generate(PROMPTS, GREEDY_32)] == alone


def full_forward(model, ids: list[int]) -> np.ndarray:
    """Logits (T, V) of one uncached forward (jitted: eagerly, every op would compile on its own)."""
    return np.asarray(jax.jit(lambda m, x: m(x))(model, np.asarray([ids], np.int32)))[0]


def assert_decode_matches_full_forward(generator: Generator, prompt: list[int], n: int) -> None:
    """Teacher-forcing n tokens through the jitted decode step gives one full forward's logits (fp32, rel 1e-5)."""
    continuation = np.random.default_rng(0).integers(0, generator.cfg.vocab_size, n).tolist()
    stepped = teacher_forced_logits(generator, prompt, continuation)
    full = full_forward(generator.model, prompt + continuation)[len(prompt) - 1 :]
    assert stepped.shape == full.shape
    assert np.max(np.abs(stepped - full)) <= 1e-5 * np.max(np.abs(full))


def test_decode_matches_full_forward(generator):
    assert_decode_matches_full_forward(generator, encoded(generator, PROMPTS[0]), 24)


@pytest.fixture(scope="module")
def chunked(generator):
    """chunked(n) -> the test model with prefill_chunk=n (weights and tokenizer shared)."""
    made: dict[int, Generator] = {}

    def make(chunk: int) -> Generator:
        if chunk not in made:
            made[chunk] = Generator(model=generator.model, tokenizer=generator.tokenizer, prefill_chunk=chunk)
        return made[chunk]

    return make


@pytest.mark.parametrize("chunk", [16, 24])  # aligned with the SSD chunk (16) and not
def test_chunked_prefill_matches_one_shot(generator, chunked, chunk):
    prompt = np.random.default_rng(1).integers(0, generator.cfg.vocab_size, 70).tolist()
    params = SamplingConfig().device_params()
    one_shot_logits, one_shot_token, _ = generator.prefill([prompt], generator.layout([70], 1), params)
    logits, token, cache = chunked(chunk).prefill([prompt], chunked(chunk).layout([70], 1), params)
    assert generator.layout([70], 1).segment_len == 128 and chunked(chunk).layout([70], 1).segment_len == chunk
    assert int(cache.index) == bucket_length(70, chunk) > 70
    scale = np.max(np.abs(np.asarray(one_shot_logits)))
    assert np.max(np.abs(np.asarray(logits) - np.asarray(one_shot_logits))) <= 1e-5 * scale
    assert np.asarray(token).tolist() == np.asarray(one_shot_token).tolist()


def test_chunked_batch_with_padding_only_segments_equals_each_alone(generator, chunked):
    """A 40-token and a 3-token prompt in 16-token segments: the short row's first two segments are all padding."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, generator.cfg.vocab_size, n).tolist() for n in (40, 3)]
    gen = chunked(16)
    batch = gen.generate(prompts, max_new_tokens=12, stop_token_ids=())
    assert batch[0].timing.padded_prompt_len == 48
    assert [r.token_ids for r in batch] == [
        generator.generate([p], max_new_tokens=12, stop_token_ids=())[0].token_ids for p in prompts
    ]


def test_attention_free_model_decodes_like_full_forward(hf_checkpoint):
    generator = Generator(hf_checkpoint(initializer_range=1.0, layer_types=["mamba"] * 4))
    assert generator.layout([5], 6).cache_len == 0  # no KV cache at all
    assert_decode_matches_full_forward(generator, [5, 17, 33, 2, 250], 8)


# ---------------------------------------------------------------------------------------------- compilation


def test_varied_prompt_lengths_do_not_recompile_decode(generator, alone):
    decode_before = generator.compilations["decode"]
    lengths = [3, 7, 11, 16, 20, 29]  # buckets 16 and 32
    for n in lengths:
        generator.generate([list(range(5, 5 + n))], max_new_tokens=3, stop_token_ids=())
    assert generator.compilations["decode"] == decode_before  # batch size 1 was compiled by `alone`
    prefill_shapes = {(1, bucket_length(n, 512), 1024) for n in lengths}
    assert prefill_shapes <= {key[1:4] for key in generator._compiled if key[0] == "prefill"}


def test_buckets():
    assert [bucket_length(n, 512) for n in (1, 16, 17, 100, 512, 513, 1500)] == [16, 16, 32, 128, 512, 1024, 1536]
    assert [cache_bucket(n, 1024) for n in (10, 1024, 1025, 16384, 16385, 131072 + 200)] == [
        1024,
        1024,
        2048,
        16384,
        32768,
        147456,
    ]


# ---------------------------------------------------------------------------------------------- sampling and stops


def test_seed_gives_the_same_output(generator):
    sample = SamplingConfig(temperature=1.0, seed=7, max_new_tokens=12, stop_token_ids=())
    first = generator.generate(PROMPTS[0], sample)[0].token_ids
    assert generator.generate(PROMPTS[0], sample)[0].token_ids == first
    assert generator.generate(PROMPTS[0], sample.replace(seed=8))[0].token_ids != first


def test_top_k_one_and_tiny_top_p_are_greedy(generator, alone):
    for options in (dict(top_k=1), dict(top_p=1e-6)):
        sample = SamplingConfig(temperature=1.5, seed=3, max_new_tokens=32, stop_token_ids=(), **options)
        assert generator.generate(PROMPTS[0], sample)[0].token_ids == alone[0]


def test_stop_token_ends_each_row_on_its_own(generator, alone):
    stop = alone[0][5]
    first = alone[0].index(stop)
    results = generator.generate(PROMPTS, GREEDY_32.replace(stop_token_ids=(stop,)))
    for result, expected in zip(results, alone):
        if stop in expected:
            end = expected.index(stop) + 1
            assert result.token_ids == expected[:end] and result.finish_reason == "stop_token"
        else:
            assert result.token_ids == expected and result.finish_reason == "length"
    assert len(results[0].token_ids) == first + 1
    assert results[0].text == generator.tokenizer.decode(alone[0][:first], skip_special_tokens=True)
    # One prompt: its steps are queued one ahead of the tokens read, and the stop still cuts at the same token.
    (single,) = generator.generate(PROMPTS[0], GREEDY_32.replace(stop_token_ids=(stop,)))
    assert single.token_ids == results[0].token_ids and single.finish_reason == "stop_token"
    assert single.timing.decode_tokens == first and single.timing.decode_steps <= first + 1


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one", "batch"])
def test_decode_in_chunks_equals_one_call_per_step(generator, monkeypatch, prompts):
    # A call runs decode_chunk steps; the draws, the stops (mid-chunk, each row on its own) and a last, shorter chunk
    # (10 steps: 4 + 4 + 2) must be those of one call per step, and the loop ends on device at the last row's stop.
    assert generator.decode_chunk == DECODE_CHUNK == 4
    sample = SamplingConfig(temperature=1.0, top_k=20, seed=5, max_new_tokens=11, stop_token_ids=())
    free = generator.generate(prompts, sample)
    stop = free[0].token_ids[6]
    runs = {}
    for chunk in (4, 1):
        monkeypatch.setattr(generator, "decode_chunk", chunk)
        for stops in ((), (stop,)):
            results = generator.generate(prompts, sample.replace(stop_token_ids=stops))
            runs[chunk, stops] = [(r.token_ids, r.finish_reason) for r in results], results[0].timing
    assert [out for out, _ in (runs[4, ()], runs[1, ()])] == [[(r.token_ids, "length") for r in free]] * 2
    assert runs[4, (stop,)][0] == runs[1, (stop,)][0]
    first = free[0].token_ids.index(stop)
    assert runs[4, (stop,)][0][0] == (free[0].token_ids[: first + 1], "stop_token")
    assert runs[4, ()][1].decode_steps == 10
    if len(prompts) == 1:  # the step that sampled the stop was the last one run, though the next call was queued
        assert runs[4, (stop,)][1].decode_steps == first


def test_model_eos_stops_by_default(generator):
    (eos,) = generator.cfg.eos_token_id
    result = generator.generate(PROMPTS[1], SamplingConfig(max_new_tokens=32, stop_token_ids=(eos,)))[0]
    default = generator.generate(PROMPTS[1], SamplingConfig(max_new_tokens=32))[0]
    assert default.token_ids == result.token_ids
    assert default.token_ids[-1] == eos and default.finish_reason == "stop_token"  # the continuation reaches EOS
    assert len(default.token_ids) < 32


def test_stop_string_cuts_the_text_and_streaming_matches(generator, alone):
    full = generator.tokenizer.decode(alone[0], skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip()
    pieces: list[str] = []
    result = generator.generate(
        PROMPTS[0],
        GREEDY_32.replace(stop_strings=(stop,)),
        stream_callback=lambda row, text: pieces.append(text),
    )[0]
    assert result.finish_reason == "stop_string"
    assert result.text == full[: full.index(stop)]
    assert "".join(pieces) == result.text and len(pieces) > 1  # streamed piece by piece, not all at the end
    assert len(result.token_ids) < 32 and tuple(result.token_ids) == alone[0][: len(result.token_ids)]


def test_streaming_batch_rebuilds_every_text(generator):
    pieces: dict[int, list[str]] = {i: [] for i in range(3)}
    results = generator.generate(PROMPTS, GREEDY_32, stream_callback=lambda row, text: pieces[row].append(text))
    assert ["".join(pieces[i]) for i in range(3)] == [r.text for r in results]
    assert all(len(pieces[i]) > 1 for i in range(3) if len(results[i].token_ids) > 4)


def test_timing_is_reported(generator):
    (result,) = generator.generate(PROMPTS[0], max_new_tokens=8, stop_token_ids=())
    t = result.timing
    assert t.prompt_tokens == len(result.prompt_ids) and t.decode_steps == 7 and t.decode_tokens == 7
    assert t.prefill_tokens_per_s > 0 and t.decode_tokens_per_s > 0


def test_kernel_backends_prepare_weights_for_batched_decoding_only(checkpoint, generator):
    # What a backend derives from the weights (the CPU kernels' panels) is made for steps of 2-16 rows only, and the
    # tokens do not depend on it: a runtime that declines the copies gives the same ones.
    single = Generator(checkpoint)
    single.generate(PROMPTS[0], GREEDY_32)  # batch 1 and prefill never use the copies: none made
    assert single.prepared_bytes == 0
    batch = [r.token_ids for r in generator.generate(PROMPTS, GREEDY_32)]
    assert (generator.prepared_bytes > 0) == ("cpu" in ops.prepare(generator.model, 3))
    unpacked = Generator(checkpoint, runtime=Runtime(pack_weights=False))
    assert [r.token_ids for r in unpacked.generate(PROMPTS, GREEDY_32)] == batch
    assert unpacked.prepared_bytes == 0
    plain = Generator(model=generator.model, tokenizer=generator.tokenizer, runtime=Runtime(kernels=False))
    assert [r.token_ids for r in plain.generate(PROMPTS, GREEDY_32)] == batch and plain.prepared_bytes == 0


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ("", "prompt 1 is empty"),
        (["fine", ""], "prompt 2 is empty"),
        ([], "no prompts given"),
        ([[1, 2], []], "prompt 2 is empty"),
        ([[1, 10**6]], r"token id 1000000 is outside \[0, vocab_size="),
        (["ab\udcff"], "prompt 1 is not valid UTF-8 text"),  # an undecodable byte from argv (surrogateescape)
        (b"hello", "prompts must be a string, token ids, or a list of either; got bytes"),
        ({"hello": 1}, "prompts must be a string, token ids, or a list of either; got dict"),
        (None, "prompts must be a string, token ids, or a list of either; got NoneType"),
    ],
)
def test_invalid_prompts_are_rejected(generator, prompts, message):
    with pytest.raises(GenerationError, match=message):
        generator.generate(prompts, max_new_tokens=2)


def test_invalid_sampling_values_are_rejected(generator):
    with pytest.raises(GenerationError, match="temperature must be a finite number >= 0"):
        generator.generate("hi", temperature=-1.0)
    with pytest.raises(GenerationError, match="unknown sampling option"):
        generator.generate("hi", temprature=1.0)
    with pytest.raises(GenerationError, match=r"stop token id 99999 is outside \[0, vocab_size="):
        generator.generate("hi", stop_token_ids=(99999,))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(dtype="bfloat16"), "dtype='bfloat16', but the model given computes in float32"),
        (dict(weight_dtype="bfloat16"), "weight_dtype='bfloat16', but the model given holds float32 weights"),
        (dict(runtime="pallas"), "runtime must be a granite_jax.Runtime or None, got str"),
        (dict(prefill_chunk=True), "prefill_chunk must be an integer >= 1, got True"),
        (dict(decode_chunk=0), "decode_chunk must be an integer >= 1, got 0"),
        (dict(max_cache_len=True), "max_cache_len must be an integer >= 1 or None, got True"),
    ],
)
def test_generator_options_that_contradict_the_model_are_rejected(generator, options, message):
    with pytest.raises(GenerationError, match=re.escape(message)):
        Generator(model=generator.model, tokenizer=generator.tokenizer, **options)


def test_generator_options_take_dtypes_and_numpy_ints_as_well_as_names(generator):
    same = dict(dtype=jnp.float32, weight_dtype=np.dtype("float32"), prefill_chunk=np.int64(256))
    given = Generator(model=generator.model, tokenizer=generator.tokenizer, **same, max_cache_len=np.int64(64))
    assert given.prefill_chunk == 256 and type(given.prefill_chunk) is int and type(given.max_cache_len) is int
    given.generate(PROMPTS[0], SamplingConfig(max_new_tokens=2))
    json.dumps(given.last_timing.as_dict())  # numpy ints would not serialise
    with pytest.raises(GenerationError, match="dtype='bfloat16', but the model given computes in float32"):
        Generator(model=generator.model, dtype=jnp.bfloat16)


def test_a_given_model_runs_the_runtime_asked_for(generator, alone):
    naive = Generator(model=generator.model, tokenizer=generator.tokenizer, runtime=Runtime(ssd="naive"))
    assert naive.model.runtime.ssd == "naive" and generator.model.runtime.ssd == "xla"
    assert naive.generate(PROMPTS[0], GREEDY_32)[0].token_ids == alone[0]
    with pytest.raises(ValueError, match="ssd: 'fast' is not one of xla, naive, pallas"):
        Runtime(ssd="fast")
    with pytest.raises(ValueError, match="pack_weights: expected None, True or False, got 'no'"):
        Runtime(pack_weights="no")


def test_request_arguments_of_the_wrong_kind_are_rejected(generator):
    for kwargs, message in [
        (dict(system=5, chat=True), "system must be a string or None, got int"),
        (dict(stream_callback=5), "stream_callback must be callable, got int"),
        (dict(sampling={"max_new_tokens": 2}), "sampling must be a SamplingConfig (or None), got dict"),
    ]:
        with pytest.raises(GenerationError, match=re.escape(message)):
            generator.generate("hi", **kwargs)
    no_tokenizer = Generator(model=generator.model)
    with pytest.raises(GenerationError, match="no tokenizer was given; pass token ids"):
        no_tokenizer.generate("hi")


def test_token_ids_from_a_tokenizer_that_does_not_fit_the_model_are_rejected(generator):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(generator.model_dir, local_files_only=True)
    tokenizer.add_tokens(["<|beyond|>"])  # id len(tokenizer) - 1 >= the model's vocab_size
    assert tokenizer.convert_tokens_to_ids("<|beyond|>") >= generator.cfg.vocab_size
    mismatched = Generator(model=generator.model, tokenizer=tokenizer)
    with pytest.raises(GenerationError, match="the tokenizer files do not match this checkpoint"):
        mismatched.generate("hi <|beyond|>", max_new_tokens=2)


def test_a_cache_larger_than_free_memory_is_refused_before_allocating(generator, monkeypatch):
    with pytest.raises(GenerationError, match=r"the cache for 1 sequence\(s\) of up to \d+ tokens needs"):
        generator.generate("hi", max_new_tokens=10**12)
    # The Mamba layers' conv and SSM states count too: memory for exactly the KV slots (counted by hand) is too little.
    cfg = generator.cfg
    cache_len = generator.layout([5], 4).cache_len
    kv = 2 * cfg.layer_types.count("attention") * cfg.num_key_value_heads * cache_len * cfg.head_dim * 4  # float32
    monkeypatch.setattr(generator_module, "free_memory", lambda: kv)
    with pytest.raises(GenerationError, match="the cache for 1 sequence"):
        generator.generate([[5, 6, 7, 8, 9]], max_new_tokens=4)


def test_rope_model_rejects_prompts_past_max_positions(hf_checkpoint):
    d = hf_checkpoint(position_embedding_type="rope", rope_theta=10000.0, max_position_embeddings=64)
    generator = Generator(d)
    with pytest.raises(GenerationError, match="65 tokens is longer than max_position_embeddings=64"):
        generator.generate([list(range(5, 70))])
    assert generator.layout([60], 100).max_new_tokens == 5  # new tokens stop at the position limit
    (result,) = generator.generate([list(range(5, 65))], max_new_tokens=100, stop_token_ids=())
    assert len(result.token_ids) == 5 and result.finish_reason == "max_position"
    (result,) = generator.generate([list(range(5, 65))], max_new_tokens=5, stop_token_ids=())
    assert result.finish_reason == "length"


def test_fixed_cache_len_rejects_what_does_not_fit(generator):
    fixed = Generator(model=generator.model, tokenizer=generator.tokenizer, max_cache_len=40)
    assert fixed.layout([10], 20).cache_len == 40
    with pytest.raises(GenerationError, match="more than max_cache_len=40"):
        fixed.layout([10], 30)


# ---------------------------------------------------------------------------------------------- chat


def test_chat_applies_the_template(generator):
    _, (ids,) = generator.prompts.encode("Hi there", chat=True, system="Be brief.")
    text = generator.tokenizer.decode(ids)
    assert text == (
        "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>Hi there<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>"
    )
    _, (plain,) = generator.prompts.encode("Hi there")
    assert len(plain) < len(ids)


# ---------------------------------------------------------------------------------------------- compiled steps


def test_gpu_steps_ask_xla_for_graphs_of_control_flow_and_cpu_steps_keep_its_defaults():
    # What the options do (no decode kernel outside a CUDA graph) is checked on the compiled program in the
    # deviceless report's test (tests/test_gpu_benchmark.py); here, which programs get them.
    from granite_jax.generation.steps import compiler_options

    graphed = compiler_options(Runtime(platform="gpu"))["xla_gpu_enable_command_buffer"].split(",")
    assert {"FUSION", "CUSTOM_CALL", "CONDITIONAL", "WHILE"} <= set(graphed)
    assert compiler_options(Runtime(platform="cpu")) == {}
