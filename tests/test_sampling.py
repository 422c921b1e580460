"""The on-device sampler and SamplingConfig validation (no model needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from granite_jax import ops, sampling
from granite_jax.sampling import GenerationError, SamplingConfig, sample_tokens

# jitted once: run eagerly, every primitive would compile on its own
draw = jax.jit(sampling.draw)
filter_mask = jax.jit(sampling.filter_mask)
ordered_keys = jax.jit(sampling.ordered_keys)
sample = jax.jit(sample_tokens)

PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
N_DRAWS = 4000


@pytest.fixture(scope="module")
def draws():
    """draws(config, logits) -> frequencies of N_DRAWS tokens sampled from one logits row (one draw per step)."""
    fn = jax.jit(jax.vmap(lambda logits, params, step: sample_tokens(logits, params, step)[0], (None, None, 0)))

    def frequencies(config: SamplingConfig) -> np.ndarray:
        logits = jnp.asarray(np.log(PROBS), jnp.float32)[None]
        tokens = np.asarray(fn(logits, config.device_params(), jnp.arange(N_DRAWS, dtype=jnp.int32)))
        return np.bincount(tokens, minlength=logits.shape[-1]) / N_DRAWS

    return frequencies


def close(freq: np.ndarray, expected: np.ndarray) -> bool:
    """Within 5 standard errors of a binomial proportion, per token."""
    sigma = np.sqrt(expected * (1 - expected) / N_DRAWS)
    return bool(np.all(np.abs(freq - expected) <= 5 * sigma + 1e-12))


def renormalized(probs: np.ndarray, keep: int) -> np.ndarray:
    out = np.where(np.arange(len(probs)) < keep, probs, 0.0)
    return out / out.sum()


def test_temperature_one_samples_the_softmax(draws):
    assert close(draws(SamplingConfig(temperature=1.0)), PROBS)


def test_temperature_scales_logits(draws):
    hot = PROBS**0.5 / (PROBS**0.5).sum()  # temperature 2 = square root of the probabilities, renormalized
    assert close(draws(SamplingConfig(temperature=2.0)), hot)


def test_greedy_is_argmax(draws):
    assert draws(SamplingConfig())[0] == 1.0


# greedy_tokens under each runtime: a platform kernel where one runs, and plain JAX's two reductions
GREEDY = [ops.under(runtime, sampling.greedy_tokens) for runtime in (ops.Runtime(), ops.Runtime(kernels=False))]


@pytest.mark.parametrize("greedy", GREEDY, ids=["kernels", "plain"])
def test_greedy_tokens_equal_argmax_with_ties_infinities_and_nans(greedy):
    rows = np.random.default_rng(0).standard_normal((9, 100352)).astype(np.float32)
    rows[1, [5, 70000]] = 9.0  # a tie: the first
    rows[2] = -np.inf  # nothing finite: token 0
    rows[3, [3, 80000]] = np.inf
    rows[4, [100, 90000]] = np.nan  # a NaN wins, the first one (jnp.argmax's rule)
    rows[5, [200, 300]] = [np.inf, np.nan]
    rows[6, -1] = 50.0  # the last token
    rows[7] = 0.0  # all equal
    rows[8, :-1] = -np.inf
    rows[0, 9] = -np.float32(np.nan)  # a NaN with the sign bit set (ordered_keys alone would rank it last)
    got = jax.jit(greedy)(jnp.asarray(rows))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.argmax(rows, axis=-1))  # numpy's argmax has the same rules
    assert np.asarray(got).tolist() == [9, 5, 0, 3, 100, 300, 100351, 0, 100351]


@pytest.mark.parametrize("greedy", GREEDY, ids=["kernels", "plain"])
@pytest.mark.parametrize("vocab", [1, 5, 13, 27])  # no whole vector, and whole vectors with a tail
def test_greedy_tokens_of_short_rows_and_tails(greedy, vocab):
    rng = np.random.default_rng(vocab)
    rows = rng.standard_normal((6, vocab)).astype(np.float32)
    rows[1, -1] = 9.0  # the largest is the last
    rows[2, [0, -1]] = 9.0  # a tie between the first and the last: the first
    rows[3, -1] = np.nan  # a NaN in the tail
    rows[4] = -np.inf
    got = np.asarray(jax.jit(greedy)(jnp.asarray(rows)))
    np.testing.assert_array_equal(got, np.argmax(rows, axis=-1))
    # +0 ranks above -0 (order-preserving int keys), which numpy's argmax counts as equal
    zeros = np.array([[-0.0, 0.0] + [-1.0] * (vocab - 2)] if vocab >= 2 else [[-0.0]], np.float32)
    assert np.asarray(jax.jit(greedy)(jnp.asarray(zeros))).tolist() == [1 if vocab >= 2 else 0]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_top_k_keeps_the_k_most_likely(draws, k):
    assert close(draws(SamplingConfig(temperature=1.0, top_k=k)), renormalized(PROBS, k))


@pytest.mark.parametrize(("p", "keep"), [(0.3, 1), (0.5, 2), (0.65, 2), (0.66, 3), (0.9, 4), (1.0, 6)])
def test_top_p_keeps_the_smallest_set_reaching_p(draws, p, keep):
    assert close(draws(SamplingConfig(temperature=1.0, top_p=p)), renormalized(PROBS, keep))


def test_top_p_applies_after_top_k(draws):
    # top_k=3 renormalizes to 0.5, 0.3125, 0.1875; top_p=0.7 then needs the first two.
    assert close(draws(SamplingConfig(temperature=1.0, top_k=3, top_p=0.7)), renormalized(PROBS, 2))


def test_unordered_logits_and_ties():
    logits = jnp.array([[0.0, 3.0, -jnp.inf, 3.0, 1.0, -2.0]])
    mask = filter_mask(logits, jnp.int32(1), jnp.float32(1.0))
    assert mask.tolist() == [[False, True, False, True, False, False]]  # a tie at the cut-off keeps both
    mask = filter_mask(logits, jnp.int32(0), jnp.float32(1.0))
    assert mask.tolist() == [[True] * 6]  # no filter (the -inf token still has zero weight)


def test_ordered_keys_preserve_float_order():
    x = jnp.array([-jnp.inf, -3e38, -1.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, 3e38, jnp.inf])
    keys = np.asarray(ordered_keys(x)).astype(np.int64)
    assert np.all(np.diff(keys) >= 0) and np.all(np.diff(keys)[[0, 1, 2, 3, 5, 6, 7, 8]] > 0)


def test_draw_never_picks_a_masked_token_across_blocks():
    V = 1000  # several 256-token blocks, the last one partial
    logits = jnp.zeros((4, V))
    keep = jnp.zeros((4, V), bool).at[:, jnp.array([3, 300, 999])].set(True)
    for u in (0.0, 0.3, 0.5, 0.9, 0.99999994):
        tokens = np.asarray(draw(logits, keep, jnp.full((4,), u)))
        assert set(tokens.tolist()) <= {3, 300, 999}
    assert np.asarray(draw(logits, keep, jnp.array([0.0, 0.34, 0.67, 0.99999994]))).tolist() == [3, 300, 999, 999]


def test_large_vocabulary_top_p_matches_a_sorted_reference():
    logits = jax.random.normal(jax.random.key(0), (3, 100352)) * 4
    for p in (0.5, 0.9):
        mask = np.asarray(filter_mask(logits, jnp.int32(0), jnp.float32(p)))
        for row, m in zip(np.asarray(logits, np.float64), mask):
            probs = np.exp(row - row.max())
            probs /= probs.sum()
            order = np.argsort(-probs)
            above = np.cumsum(probs[order]) - probs[order]  # mass strictly above each token
            expected = np.zeros_like(m)
            expected[order[above < p]] = True
            assert np.array_equal(m, expected)


@pytest.mark.parametrize("temperature", [1e-3, 1e-10, 1e-30])
def test_tiny_temperature_samples_the_argmax(temperature):
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 1000)) * 5, jnp.float32)
    for top_k, top_p in ((0, 1.0), (50, 0.9)):
        params = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p).device_params()
        assert sample(logits, params, jnp.int32(1)).tolist() == jnp.argmax(logits, -1).tolist()


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = jnp.zeros((8, 320))
    a = sample(logits, SamplingConfig(temperature=1.0, seed=1).device_params(), jnp.int32(3))
    b = sample(logits, SamplingConfig(temperature=1.0, seed=1).device_params(), jnp.int32(3))
    c = sample(logits, SamplingConfig(temperature=1.0, seed=2).device_params(), jnp.int32(3))
    d = sample(logits, SamplingConfig(temperature=1.0, seed=1).device_params(), jnp.int32(4))
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist() and a.tolist() != d.tolist()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(temperature=-0.1), r"temperature must be a finite number >= 0 \(0: greedy\), got -0.1"),
        (dict(temperature=float("nan")), r"temperature must be a finite number >= 0"),
        (dict(temperature=float("inf")), r"temperature must be a finite number >= 0 \(0: greedy\), got inf"),
        (dict(top_p=0.0), r"top_p must be a number in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be a number in \(0, 1\], got 1.5"),
        (dict(top_k=5), r"top_k=5 needs temperature > 0: greedy decoding"),
        (dict(top_p=0.9), r"top_p=0.9 needs temperature > 0: greedy decoding"),
        (dict(seed=3), r"seed=3 needs temperature > 0: greedy decoding"),
        (dict(top_k=-1), r"top_k must be an integer >= 0, got -1"),
        (dict(top_k=2.5), r"top_k must be an integer >= 0"),
        (dict(top_k=2**31), r"top_k must be below 2\*\*31"),
        (dict(top_p=1e-50, temperature=1.0), r"top_p=1e-50 is 0 as a float32"),
        (dict(max_new_tokens=0), r"max_new_tokens must be an integer >= 1, got 0"),
        (dict(seed=-1), r"seed must be an integer"),
        (dict(stop_strings=("",)), r"stop_strings must be non-empty strings"),
        (dict(stop_strings=("ok", "\udcff")), r"stop_strings\[1\] is not valid UTF-8 text"),
        (dict(stop_strings="END"), r"stop_strings must be a list or tuple"),
        (dict(stop_token_ids=(-3,)), r"stop_token_ids must be integers >= 0, got -3"),
    ],
)
def test_invalid_values_are_rejected(options, message):
    with pytest.raises(GenerationError, match=message):
        SamplingConfig(**options)


def test_lists_become_tuples():
    config = SamplingConfig(stop_strings=["a", "b"], stop_token_ids=[1, 2])
    assert config.stop_strings == ("a", "b") and config.stop_token_ids == (1, 2)
    hash(config)


def test_numpy_scalars_are_numbers():
    config = SamplingConfig(
        temperature=np.float32(0.5),
        top_p=np.float64(0.9),
        top_k=np.int64(4),
        seed=np.int32(3),
        max_new_tokens=np.int64(7),
    )
    assert (config.temperature, config.top_p, config.top_k, config.seed, config.max_new_tokens) == (0.5, 0.9, 4, 3, 7)
    assert all(type(v) in (int, float) for v in (config.temperature, config.top_k, config.max_new_tokens))
    with pytest.raises(GenerationError, match="temperature must be a finite number >= 0"):
        SamplingConfig(temperature=np.bool_(True))
