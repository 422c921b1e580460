"""Generation: parity with transformers' generate, decode == full forward, chunked prefill, batching, stops, CLI."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from granite_jax import cpu_kernels
from granite_jax import generate as generate_module
from granite_jax.generate import Generator, bucket_length, cache_bucket
from granite_jax.model import Packed
from granite_jax.sampling import GenerationError, SamplingConfig

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
    prompt, continuation = generator.encode(PROMPTS[0])[1][0], list(range(40, 56))
    stepped = generator.teacher_forced_logits([prompt], [continuation])[0]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1 :].numpy()
    assert np.max(np.abs(stepped - want)) <= 1e-5 * np.max(np.abs(want))
    results = generator.generate(PROMPTS, GREEDY_32)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(generator.model, Packed))} == {jnp.dtype(jnp.bfloat16)}
    assert [list(r.token_ids) for r in results] == hf_greedy(d, PROMPTS)
    with pytest.raises(
        GenerationError, match="weight_dtype must be auto, None or one of float32, bfloat16, float16, got 'int8'"
    ):
        Generator(d, weight_dtype="int8")


AUTO_BF16 = "bfloat16" if cpu_kernels.available() else "float32"  # without the kernels "auto" keeps float32 weights


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
    stepped = generator.teacher_forced_logits([prompt], [continuation])[0]
    full = full_forward(generator.model, prompt + continuation)[len(prompt) - 1 :]
    assert stepped.shape == full.shape
    assert np.max(np.abs(stepped - full)) <= 1e-5 * np.max(np.abs(full))


def test_decode_matches_full_forward(generator):
    assert_decode_matches_full_forward(generator, generator.encode(PROMPTS[0])[1][0], 24)


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
    one_shot_logits, one_shot_token, _ = generator.prefill([prompt])
    logits, token, cache = chunked(chunk).prefill([prompt])
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
    assert {("prefill", 1, bucket_length(n, 512), 1024) for n in lengths} <= set(generator._executables)


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
    assert generator.decode_chunk == generate_module.DECODE_CHUNK == 4
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


def test_decode_chunks_read_a_bfloat16_embedding_in_place(hf_checkpoint):
    # XLA:CPU gathers from a bfloat16 table by widening all of it, which the chunk's loop hoists out of its body: a
    # float32 copy of the embedding per call, unless the lookup is `cpu_kernels.take_rows`' kernel.
    if not cpu_kernels.available():
        pytest.skip(f"the CPU kernels are not used here: {cpu_kernels.unavailable_reason()}")
    generator = Generator(hf_checkpoint(dtype="bfloat16"), weight_dtype="bfloat16")
    generator.generate(PROMPTS[:2], SamplingConfig(max_new_tokens=3, stop_token_ids=()))
    (step,) = [v for k, v in generator._executables.items() if k[0] == "decode" and k[-1] is not None]
    hlo = step.func.as_text()
    assert cpu_kernels.TAKE_TARGET in hlo
    table = f"f32[{generator.cfg.vocab_size},{generator.cfg.hidden_size}]"
    assert table not in hlo, "the decode chunk widens the whole embedding table"


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


def test_weights_are_packed_for_batched_decoding_unless_declined(checkpoint, generator, monkeypatch, caplog):
    single = Generator(checkpoint)
    single.generate(PROMPTS[0], GREEDY_32)  # batch 1 and prefill never use the packed copies: none made
    assert single.packed_bytes == 0 and not jax.tree.leaves(nnx.state(single.model, Packed))

    batch = [r.token_ids for r in generator.generate(PROMPTS, GREEDY_32)]  # 3 rows: the kernel on the panels
    if cpu_kernels.available():
        assert generator.packed_bytes == sum(x.nbytes for x in jax.tree.leaves(nnx.state(generator.model, Packed))) > 0
    unpacked = Generator(checkpoint, pack_weights=False)
    assert [r.token_ids for r in unpacked.generate(PROMPTS, GREEDY_32)] == batch
    assert unpacked.packed_bytes == 0 and not jax.tree.leaves(nnx.state(unpacked.model, Packed))

    monkeypatch.setattr(generate_module, "available_memory", lambda: 10_000)  # the copy would not fit: declined
    monkeypatch.setattr(generate_module, "free_memory", lambda: None)  # (nor would the KV cache: not checked here)
    short = Generator(checkpoint)
    with caplog.at_level("WARNING", logger="granite_jax.generate"):
        assert [r.token_ids for r in short.generate(PROMPTS, GREEDY_32)] == batch
    assert short.packed_bytes == 0
    assert "not packing the weights for decoding" in caplog.text
    insist = Generator(checkpoint, pack_weights=True)
    insist.generate(PROMPTS[:2], max_new_tokens=2)
    assert (insist.packed_bytes > 0) == cpu_kernels.available()


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
    with pytest.raises(GenerationError, match="temperature must be >= 0"):
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
        (dict(ssd_impl="fast"), "ssd_impl must be one of xla, naive, pallas, got 'fast'"),
        (dict(prefill_chunk=True), "prefill_chunk must be an integer >= 1, got True"),
        (dict(decode_chunk=0), "decode_chunk must be an integer >= 1, got 0"),
        (dict(max_cache_len=True), "max_cache_len must be an integer >= 1 or None, got True"),
        (dict(pack_weights="no"), "pack_weights must be None, True or False, got 'no'"),
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


def test_a_given_model_runs_the_ssd_impl_asked_for(generator, alone):
    naive = Generator(model=generator.model, tokenizer=generator.tokenizer, ssd_impl="naive")
    assert naive.cfg.ssd_impl == "naive" and generator.cfg.ssd_impl == "xla"
    assert naive.generate(PROMPTS[0], GREEDY_32)[0].token_ids == alone[0]


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
    with pytest.raises(GenerationError, match=re.escape("continuation: expected 1 row(s) of one length")):
        generator.teacher_forced_logits([[5, 6]], [[1, 2], [3, 4]])
    with pytest.raises(GenerationError, match="continuation row 1: token id 1000000 is outside"):
        generator.teacher_forced_logits([[5, 6]], [[1, 10**6]])
    with pytest.raises(GenerationError, match="continuation row 1: expected a list of integer token ids"):
        generator.teacher_forced_logits([[5, 6]], ["ab"])
    assert generator.teacher_forced_logits([[5, 6]], [[]]).shape == (1, 1, generator.cfg.vocab_size)  # prefill's only


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
    monkeypatch.setattr(generate_module, "free_memory", lambda: kv)
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
    _, (ids,) = generator.encode("Hi there", chat=True, system="Be brief.")
    text = generator.tokenizer.decode(ids)
    assert text == (
        "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>Hi there<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>"
    )
    _, (plain,) = generator.encode("Hi there")
    assert len(plain) < len(ids)


# ---------------------------------------------------------------------------------------------- CLI


CLI_ENV = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_VERBOSITY="error",
    JAX_DISABLE_MOST_OPTIMIZATIONS="1",  # as in conftest: compile time dominates on a tiny model
)


def start_cli(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "granite_jax.generate", *args]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=CLI_ENV)


def cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    process = start_cli(*args)
    out, err = process.communicate(stdin, timeout=600)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_cli_help_explains_every_flag():
    out = cli("--help")
    assert out.returncode == 0
    text = out.stdout.decode()
    for flag in (
        "--model",
        "--prompt ",
        "--prompt-file",
        "--chat",
        "--system",
        "--max-new-tokens",
        "--temperature",
        "--top-k",
        "--top-p",
        "--seed",
        "--stop ",
        "--stop-token-id",
        "--ignore-eos",
        "--dtype",
        "--weight-dtype",
        "--ssd-impl",
        "--prefill-chunk",
        "--decode-chunk",
        "--max-cache-len",
        "--no-pack-weights",
        "--stream",
        "--no-stream",
        "--json",
        "--quiet",
    ):
        assert flag in text, flag


CLI_ERRORS = [  # (arguments, stdin, expected message)
    (("--prompt", "hi"), None, "pass --model DIR"),
    (("--model", "/nonexistent/model", "--prompt", "hi"), None, "/nonexistent/model: model directory not found"),
    (("--model", "{ckpt}"), b"\xff\xfehello", "standard input: not valid UTF-8"),
    (("--model", "{ckpt}", "--prompt", "hi", "--top-p", "0"), None, "top_p must be in (0, 1]"),
    (("--model", "{ckpt}", "--prompt", "hi", "--max-new-tokens", "0"), None, "max_new_tokens must be an integer"),
    (
        ("--model", "{ckpt}", "--prompt", "hi", "--decode-chunk", "0"),
        None,
        "argument --decode-chunk: must be >= 1, got 0",
    ),
    (("--model", "{ckpt}", "--prompt", "hi", "--temperature", "x"), None, "invalid float value"),
    (("--model", "{ckpt}", "--prompt", "hi", "--stream", "--json"), None, "--stream and --json exclude each other"),
    (("--model", "{ckpt}", "--prompt", "hi", "--system", "be brief"), None, "--system needs --chat"),
    (("--model", "{ckpt}", "--prompt", ""), None, "prompt 1 is empty"),  # found before the load: no progress bar
    (("--model", "{ckpt}"), b"", "prompt 1 is empty"),
    (("--model", "{rope}", "--prompt", "x" * 100, "--quiet"), None, "longer than max_position_embeddings=64"),
    (("--model", "{ckpt}", "--prompt", "ab\udcff", "--quiet"), None, "prompt 1 is not valid UTF-8"),  # bytes ab\xff
    (("--model", "{ckpt}", "--prompt", "hi", "--stop-token-id", "99999", "--quiet"), None, "stop token id 99999"),
    (("--model", "{badtok}", "--prompt", "hi", "--quiet"), None, "cannot load the tokenizer (JSONDecodeError"),
]


def test_cli_errors_exit_2_with_one_line(hf_checkpoint, checkpoint, tmp_path, call_main):
    rope = hf_checkpoint(position_embedding_type="rope", rope_theta=10000.0, max_position_embeddings=64)
    badtok = shutil.copytree(checkpoint, tmp_path / "badtok")
    (badtok / "tokenizer.json").write_text("{")

    def argv(args):
        return [a.format(ckpt=checkpoint, rope=rope, badtok=badtok) for a in args]

    # As processes, all at once (each is mostly interpreter and import start-up): the first, for the exit status of
    # `python -m`, and those that read standard input; the rest through `main` in this process meanwhile.
    as_processes = [CLI_ERRORS[0]] + [case for case in CLI_ERRORS if case[1] is not None]
    runs = []
    for args, stdin, message in as_processes:
        process = start_cli(*argv(args))
        process.stdin.write(stdin or b"")
        process.stdin.close()
        runs.append((process, message))
    for args, stdin, message in CLI_ERRORS:
        if (args, stdin, message) not in as_processes:
            code, err = call_main(generate_module.main, argv(args))
            assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    for process, message in runs:
        err = process.stderr.read().decode().strip()
        assert process.wait(timeout=600) == 2, err
        assert len(err.splitlines()) == 1 and message in err, err
        assert "Traceback" not in err


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the Pallas kernels run here")
def test_cli_pallas_without_a_gpu_is_refused_before_loading(checkpoint):
    out = cli("--model", checkpoint, "--prompt", "hi", "--ssd-impl", "pallas")
    assert out.returncode == 2
    err = out.stderr.decode().strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: --ssd-impl: ssd_impl='pallas' needs an NVIDIA GPU"), err


def test_cli_json_output(checkpoint, generator):
    prompts = ("--prompt", PROMPTS[0], "--prompt", PROMPTS[1])
    out = cli("--model", checkpoint, *prompts, "--max-new-tokens", "6", "--json", "--no-pack-weights")
    assert out.returncode == 0, out.stderr.decode()
    doc = json.loads(out.stdout)
    expected = generator.generate(PROMPTS[:2], max_new_tokens=6)  # packed weights: the same tokens
    assert [r["text"] for r in doc["results"]] == [r.text for r in expected]
    assert [r["token_ids"] for r in doc["results"]] == [list(r.token_ids) for r in expected]
    assert doc["prefill_tokens_per_s"] > 0 and doc["decode_tokens_per_s"] > 0
    assert doc["dtype"] == doc["weight_dtype"] == "float32"


def test_cli_keeps_a_bfloat16_checkpoints_weights_in_bfloat16_by_default(hf_checkpoint):
    d = hf_checkpoint(initializer_range=1.0, dtype="bfloat16")
    out = cli("--model", d, "--prompt", PROMPTS[0], "--max-new-tokens", "6", "--ignore-eos", "--json")
    assert out.returncode == 0, out.stderr.decode()
    doc = json.loads(out.stdout)
    assert (doc["dtype"], doc["weight_dtype"]) == ("float32", AUTO_BF16)
    assert doc["results"][0]["token_ids"] == hf_greedy(d, PROMPTS[:1])[0][:6]  # transformers in float32


def test_cli_streams_a_single_prompt(checkpoint, generator):
    out = cli("--model", checkpoint, "--prompt", PROMPTS[1], "--max-new-tokens", "5", "--chat", "--quiet")
    assert out.returncode == 0, out.stderr.decode()
    expected = generator.generate(PROMPTS[1], max_new_tokens=5, chat=True)[0].text
    assert out.stdout.decode() == expected + "\n"
