"""The serving engine in-process: continuous batching gives each request the tokens it gets alone (the Generator's),
whatever joins or leaves beside it; prefix caching changes nothing but the work; faults stay with their request."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

from granite_jax.errors import GenerationError
from granite_jax.generation import Generator
from granite_jax.sampling import SamplingConfig
from granite_jax.serving import Engine, Overloaded, Request
from granite_jax.serving.engine import buckets, piece_length
from granite_jax.serving.prefix import PrefixCache

PROMPTS = [
    "The quick brown fox",
    "Granite is a family of language models. The hybrid design mixes",
    "def forward(x):",
    "Long context at constant decode memory",
    "numbers 0123456789",
    "The quick brown fox jumps over",
    "many sequences at once",
]


def untied(hf_checkpoint, **config) -> Generator:
    # An untied head: a random model's tokens then depend on its state (tied, it repeats its last input token).
    return Generator(hf_checkpoint(tie_word_embeddings=False, **config))


@pytest.fixture(scope="module")
def generator(hf_checkpoint) -> Generator:
    return untied(hf_checkpoint)


@pytest.fixture(scope="module")
def rope_generator(hf_checkpoint) -> Generator:
    return untied(hf_checkpoint, position_embedding_type="rope", max_position_embeddings=512)


def small_engine(generator: Generator, **options) -> Engine:
    # A context of 160 with 8 slots of room: rows move back along the clock every few steps once it is full. Every
    # test uses the same shapes, so that the module compiles them once.
    defaults = dict(max_batch=2, max_context=160, prefill_chunk=8, prefill_budget=4, room=8)
    return Engine(generator, **(defaults | options))


def run(engine: Engine, requests: list[tuple[list[int], SamplingConfig]], join_every: int = 3) -> list:
    """Submit the requests `join_every` turns apart (some wait for a slot) and turn until all have ended."""
    outcomes: dict[int, object] = {}
    pending = list(enumerate(requests))
    turns = 0
    while len(outcomes) < len(requests):
        if pending and turns % join_every == 0:
            i, (ids, sampling) = pending.pop(0)
            done = lambda o, i=i: outcomes.__setitem__(i, o)  # noqa: E731
            engine.submit(Request(ids, sampling, lambda _: None, done, logprobs=True))
        engine.turn()
        turns += 1
    return [outcomes[i] for i in range(len(requests))]


def ids_of(generator: Generator, prompt: str) -> list[int]:
    return generator.prompts.encode(prompt)[1][0]


def assert_logprobs_of_one_forward(generator: Generator, prompts: list[list[int]], outcomes: list) -> None:
    """The log-probabilities the engine reported for its tokens are the model's over each whole text at once: each
    token saw exactly its own sequence's states (greedy tokens alone are a weak check on a random model)."""
    texts = [ids + list(o.token_ids[:-1]) for ids, o in zip(prompts, outcomes)]
    width = max(map(len, texts))
    pad = np.asarray([width - len(t) for t in texts], np.int32)
    tokens = np.asarray([[0] * p + t for p, t in zip(pad, texts)], np.int32)
    forward = jax.jit(lambda tokens, pad: generator.model(tokens, pad=pad))  # one compilation, not one an op
    logprobs = jax.nn.log_softmax(forward(tokens, pad).astype(jnp.float32), axis=-1)
    for row, outcome in enumerate(outcomes):
        generated = list(outcome.token_ids)
        positions = width - len(generated) + np.arange(len(generated))  # the ones predicting them
        expected = logprobs[row, positions, generated]
        np.testing.assert_allclose(outcome.logprobs, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("positions", ["nope", "rope"])
def test_joining_and_leaving_requests_get_the_tokens_they_get_alone(positions, request):
    generator = request.getfixturevalue("generator" if positions == "nope" else "rope_generator")
    engine = small_engine(generator)
    sampling = [SamplingConfig(max_new_tokens=24 + 8 * i, stop_token_ids=()) for i in range(len(PROMPTS))]
    prompts = [ids_of(generator, p) for p in PROMPTS]
    outcomes = run(engine, list(zip(prompts, sampling)))
    assert_logprobs_of_one_forward(generator, prompts, outcomes)
    for prompt, s, outcome in zip(PROMPTS[:2], sampling, outcomes):
        alone = generator.generate(prompt, s)[0]
        assert outcome.token_ids == alone.token_ids, prompt
        assert outcome.text == alone.text and outcome.finish_reason == "length"
    # The batch grew and shrank, rows moved back along the clock, and prompts ran in pieces beside decoding rows.
    assert engine.counters["reclocks"] > 0 and engine.counters["resizes"] > 0
    assert engine.counters["fed_tokens"] > 0
    assert engine.active == 0 and len(engine.slots) == 1


def test_rows_sample_with_their_own_options_as_alone(generator):
    engine = small_engine(generator)
    options = [
        dict(temperature=0.9, seed=1),
        dict(),
        dict(temperature=1.3, top_k=5, seed=2),
        dict(temperature=0.7, top_p=0.6, seed=3),
    ]
    sampling = [SamplingConfig(max_new_tokens=10, stop_token_ids=(), **o) for o in options]
    together = run(engine, [(ids_of(generator, p), s) for p, s in zip(PROMPTS, sampling)], join_every=1)
    for prompt, s, outcome in zip(PROMPTS, sampling, together):
        assert outcome.token_ids == generator.generate(prompt, s)[0].token_ids, (prompt, s)


@pytest.mark.parametrize("join_every", [40, 2])  # one at a time: snapshots at prefill pieces; together: from rows
def test_prefix_cache_reuses_state_and_changes_no_token(generator, join_every):
    system = "Granite is a family of language models. The hybrid design mixes Mamba-2 state space layers. "
    # A long unrelated request first, so that the later rows start past slot 0 of the batch's clock.
    prompts = [PROMPTS[3] * 4, system + "The quick", system + "Long context", PROMPTS[0]]
    prompts += [system + "Long context", system + "def f"]
    requests = [(ids_of(generator, p), SamplingConfig(max_new_tokens=8, stop_token_ids=())) for p in prompts]
    requests[0] = (requests[0][0], SamplingConfig(max_new_tokens=40, stop_token_ids=()))
    # The last two arrive once the others have ended (a snapshot is taken as the prompt is read).
    plain_engine = small_engine(generator, prefix_cache_bytes=0)
    plain = run(plain_engine, requests[:4], join_every) + run(plain_engine, requests[4:], join_every)
    engine = small_engine(generator)
    cached = run(engine, requests[:4], join_every) + run(engine, requests[4:], join_every)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert_logprobs_of_one_forward(generator, [ids for ids, _ in requests], cached)
    shared = len(ids_of(generator, system))
    # The second system-prompt user found where its prompt parts from the first's; the third hits that snapshot,
    # and the repeated prompt hits its own, one token before its end.
    assert [o.cached_tokens for o in cached][:3] == [0, 0, 0]
    assert cached[4].cached_tokens == len(requests[4][0]) - 1
    assert shared - 2 <= cached[5].cached_tokens <= shared + 1
    assert engine.prefix.stats.hits == 2
    assert (engine.counters["row_snapshots"] > 0) == (join_every == 2)


def test_prefix_cache_stays_within_its_memory(generator):
    engine = small_engine(generator, prefix_cache_bytes=1)
    requests = [(ids_of(generator, p), SamplingConfig(max_new_tokens=4, stop_token_ids=())) for p in PROMPTS[:3]]
    run(engine, requests + requests, join_every=40)
    assert engine.prefix.bytes == 0 and engine.prefix.stats.hits == 0


def test_prefix_cache_lru_evicts_the_oldest():
    cache = PrefixCache(budget_bytes=3 * 8)
    snapshot = lambda: {"x": np.zeros(1, np.float64)}  # noqa: E731 - 8 bytes
    for key in ([1], [1, 2], [1, 2, 3]):
        cache.add(key, snapshot())
    assert cache.lookup([1, 2, 3, 4])[0] == 3
    cache.lookup([1, 5])  # [1] is now more recent than [1, 2]
    cache.add([9], snapshot())
    assert cache.lookup([1, 2, 9])[0] == 1 and cache.stats.evictions == 1


def test_no_compilation_after_warmup(generator):
    engine = small_engine(generator)
    engine.warmup()
    lowered = []

    def listen(name, *_, **__):
        if name.endswith("jaxpr_to_mlir_module_duration"):
            lowered.append(name)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        requests = [(ids_of(generator, p), SamplingConfig(max_new_tokens=5)) for p in PROMPTS]
        run(engine, requests + requests[:2], join_every=2)
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert lowered == []


def test_cancelled_and_failing_requests_free_their_slots(generator, monkeypatch):
    engine = small_engine(generator)
    ended: dict[str, object] = {}
    make = lambda name, n: Request(  # noqa: E731
        ids_of(generator, PROMPTS[1] if name == "bad" else PROMPTS[0]),
        SamplingConfig(max_new_tokens=n),
        lambda _: None,
        lambda o: ended.__setitem__(name, o),
    )
    engine.submit(long := make("long", 30))
    for _ in range(4):
        engine.turn()
    assert engine.active == 1
    engine.cancel(long)
    engine.turn()
    assert ended["long"].finish_reason == "cancelled" and engine.active == 0

    real = engine.prefill
    monkeypatch.setattr(engine, "prefill", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    engine.submit(make("bad", 5))
    engine.turn()
    assert ended["bad"].finish_reason == "error" and "boom" in ended["bad"].error
    monkeypatch.setattr(engine, "prefill", real)
    outcome = run(engine, [(ids_of(generator, PROMPTS[0]), SamplingConfig(max_new_tokens=5))])[0]
    assert outcome.token_ids == generator.generate(PROMPTS[0], max_new_tokens=5)[0].token_ids


def test_full_queue_and_too_long_requests_are_refused(generator):
    engine = small_engine(generator, max_batch=1, max_queue=1)
    ids = ids_of(generator, PROMPTS[0])
    request = lambda: Request(ids, SamplingConfig(max_new_tokens=4), lambda _: None, lambda _: None)  # noqa: E731
    engine.submit(request())
    engine.submit(request())
    with pytest.raises(Overloaded):
        engine.submit(request())
    with pytest.raises(GenerationError, match="more than this server's context of 160"):
        engine.check(ids, SamplingConfig(max_new_tokens=160))


def test_bad_engine_options_are_refused_by_name(generator):
    with pytest.raises(GenerationError, match="max_batch must be an integer >= 1, got 0"):
        Engine(generator, max_batch=0)
    with pytest.raises(GenerationError, match="max_queue must be an integer >= 0"):
        Engine(generator, max_queue=-1)


def test_buckets_and_pieces():
    assert buckets(1) == [1] and buckets(6) == [1, 2, 4, 6] and buckets(64)[-2:] == [32, 64]
    assert [piece_length(n, 32) for n in (1, 7, 32, 100)] == [1, 4, 32, 32]
