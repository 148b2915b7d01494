"""Sampling: argmax, hand-computed distributions, seeded draws, and a filter property (the fields' validation is
tested with the rest of the request validation, in test_protocol)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp_worker.worker import sampling
from pp_worker.worker.sampling import SamplingParams, argmax_sample, distribution, sample

LN2, LN4 = math.log(2), math.log(4)
VOCAB = 10


def probs_of(logits: list[float], params: SamplingParams) -> dict[int, float]:
    """{token id: probability} of what the filters keep, independent of the order `distribution` returns."""
    ids, p = distribution(np.array(logits), params)
    return {int(i): float(q) for i, q in zip(ids, p, strict=True)}


def assert_probs(got: dict[int, float], want: dict[int, float]) -> None:
    assert got.keys() == want.keys()
    for tok, q in want.items():
        assert got[tok] == pytest.approx(q, abs=1e-12)


# --- argmax -------------------------------------------------------------------------------------------------------


def test_argmax_picks_the_max_from_arrays_and_lists() -> None:
    assert argmax_sample(np.array([0.1, 3.0, -2.0], dtype=np.float32)) == 1
    assert argmax_sample([0.1, 3.0, 5.0]) == 2
    assert argmax_sample([-np.inf, 1.0, np.inf]) == 2


def test_argmax_ties_go_to_the_lowest_index() -> None:
    assert argmax_sample([1.0, 7.0, 7.0, 7.0]) == 1
    assert argmax_sample([-np.inf, -np.inf]) == 0


def test_argmax_treats_nan_as_minus_inf() -> None:
    assert argmax_sample([np.nan, 1.0, np.nan, 2.0]) == 3
    assert argmax_sample([np.nan, -1e30]) == 1
    assert argmax_sample([np.nan, -np.inf]) == 0  # NaN ties with -inf, and ties go to the lowest index


@pytest.mark.parametrize("logits", [[], np.array([], dtype=np.float32), [np.nan], [np.nan, np.nan, np.nan]])
def test_argmax_rejects_empty_and_all_nan(logits: list[float]) -> None:
    with pytest.raises(ValueError):
        argmax_sample(logits)


def test_argmax_of_a_large_float32_vocabulary_equals_the_masked_argmax() -> None:
    """The one-pass path (no NaN) and the masked one (NaN before, after or at the max; ties) against numpy's argmax
    of the float64 logits with NaN as -inf."""
    rng = np.random.default_rng(0)
    for case in range(40):
        x = rng.standard_normal(128_256).astype(np.float32)
        if case % 4 == 1:
            x[rng.integers(0, x.size, 3)] = np.nan
        if case % 4 == 2:
            x[rng.integers(0, x.size, 5)] = x.max()  # ties with the max
        if case % 4 == 3:
            x[int(np.argmax(x))] = np.nan
        ref = np.where(np.isnan(x), -np.inf, x.astype(np.float64))
        assert argmax_sample(x) == int(np.argmax(ref))


def test_argmax_rejects_a_2d_array() -> None:
    with pytest.raises(ValueError, match="1-D"):
        argmax_sample(np.zeros((2, 3)))


# --- greedy ---------------------------------------------------------------------------------------------------------


def test_no_params_and_zero_temperature_are_argmax() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=50).astype(np.float32)
        want = argmax_sample(logits)
        assert sample(logits, None) == want
        assert sample(logits, SamplingParams()) == want
        assert sample(logits, SamplingParams(seed=3, top_k=5, top_p=0.1)) == want


def test_greedy_still_applies_the_repetition_penalty() -> None:
    logits = np.array([2.0, 1.5], dtype=np.float32)
    assert sample(logits, SamplingParams(repetition_penalty=2.0, recent_tokens=(0,))) == 1  # 2.0 / 2 < 1.5
    assert logits[0] == 2.0  # the caller's array is not modified


def test_logit_bias_is_added_before_the_penalty_and_the_argmax() -> None:
    logits = np.array([2.0, 1.5, -1.0], dtype=np.float32)
    assert sample(logits, SamplingParams(logit_bias=((0, -1.0),))) == 1  # 1.0 < 1.5
    assert sample(logits, SamplingParams(logit_bias=((2, 3.5),))) == 2  # 2.5 > 2.0
    assert sample(logits, SamplingParams(logit_bias=((0, -100.0), (1, -100.0)))) == 2  # OpenAI's "ban"
    # bias first, then the penalty: 2.0 + 2.0 = 4.0, halved to 2.0, ties 1.5 + 0.5 = 2.0; the lower id wins
    assert sample(logits, SamplingParams(logit_bias=((0, 2.0), (1, 0.5)), repetition_penalty=2.0,
                                         recent_tokens=(0,))) == 0
    assert sample(logits, SamplingParams(logit_bias=((0, 2.0), (1, 0.6)), repetition_penalty=2.0,
                                         recent_tokens=(0,))) == 1
    assert logits[0] == 2.0  # the caller's array is not modified


def test_logit_bias_shifts_the_distribution() -> None:
    got = probs_of([0.0, 0.0, 0.0], SamplingParams(temperature=1.0, logit_bias=((1, LN2), (2, LN4))))
    assert_probs(got, {0: 1 / 7, 1: 2 / 7, 2: 4 / 7})
    with pytest.raises(ValueError, match="logit_bias"):
        sample(np.zeros(4), SamplingParams(logit_bias=((4, 1.0),)))


# --- hand-computed distributions --------------------------------------------------------------------------------


def test_softmax_of_log_probabilities() -> None:
    assert_probs(probs_of([0, LN2, LN4], SamplingParams(temperature=1.0)), {0: 1 / 7, 1: 2 / 7, 2: 4 / 7})


def test_empirical_frequencies_match_within_binomial_tolerance() -> None:
    logits = np.array([0, LN2, LN4], dtype=np.float32)
    params = SamplingParams(temperature=1.0, seed=1234)
    n = 20_000
    counts = np.bincount([sample(logits, params, step_key=i) for i in range(n)], minlength=3)
    for tok, p in enumerate([1 / 7, 2 / 7, 4 / 7]):
        assert abs(counts[tok] - n * p) <= 5 * math.sqrt(n * p * (1 - p)), (tok, counts)


def test_temperature_reshapes_the_distribution() -> None:
    assert_probs(probs_of([0, LN4], SamplingParams(temperature=2.0)), {0: 1 / 3, 1: 2 / 3})  # [1, 4] ** 0.5
    assert_probs(probs_of([0, LN2], SamplingParams(temperature=0.5)), {0: 1 / 5, 1: 4 / 5})  # [1, 2] ** 2


def test_tiny_temperature_keeps_only_the_max() -> None:
    assert_probs(probs_of([1.0, 3.0, 2.0], SamplingParams(temperature=1e-300)), {1: 1.0})


def test_top_k_keeps_the_k_highest() -> None:
    assert_probs(probs_of([0, LN2, LN4], SamplingParams(temperature=1.0, top_k=2)), {1: 1 / 3, 2: 2 / 3})
    w = np.exp([4.0, 0.0, 0.0])  # three tied 1.0s: the two lowest ids survive top_k=3 next to the 5.0
    assert_probs(probs_of([5.0, 1.0, 1.0, 1.0], SamplingParams(temperature=1.0, top_k=3)), dict(enumerate(w / w.sum())))
    assert probs_of([0.0, 1.0], SamplingParams(temperature=1.0, top_k=99)).keys() == {0, 1}


def test_top_k_one_is_argmax() -> None:
    rng = np.random.default_rng(1)
    for seed in range(30):
        logits = rng.normal(size=40).astype(np.float32)
        assert sample(logits, SamplingParams(temperature=1.5, top_k=1, seed=seed)) == argmax_sample(logits)
        assert sample(logits, SamplingParams(temperature=1.5, top_k=1)) == argmax_sample(logits)


P3 = [math.log(0.5), math.log(0.3), math.log(0.2)]  # softmax -> [.5, .3, .2]


@pytest.mark.parametrize(
    "top_p, want",
    [(0.4, {0: 1.0}), (0.7, {0: 0.5 / 0.8, 1: 0.3 / 0.8}), (0.81, {0: 0.5, 1: 0.3, 2: 0.2}),
     (1.0, {0: 0.5, 1: 0.3, 2: 0.2})],
)
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(top_p: float, want: dict[int, float]) -> None:
    assert_probs(probs_of(P3, SamplingParams(temperature=1.0, top_p=top_p)), want)


def test_top_p_ranks_by_probability_not_by_id() -> None:
    logits = [math.log(0.2), math.log(0.5), math.log(0.3)]
    assert_probs(probs_of(logits, SamplingParams(temperature=1.0, top_p=0.7)), {1: 0.5 / 0.8, 2: 0.3 / 0.8})


def test_top_p_stops_at_a_prefix_whose_mass_equals_top_p() -> None:
    # four equal logits give exactly .25 each, so the cumulative mass hits .5 exactly at the second token
    assert_probs(probs_of([0.0] * 4, SamplingParams(temperature=1.0, top_p=0.5)), {0: 0.5, 1: 0.5})


@pytest.mark.parametrize(
    "min_p, want",
    [(0.3, {0: 0.5, 1: 0.3, 2: 0.2}), (0.5, {0: 0.5 / 0.8, 1: 0.3 / 0.8}), (0.7, {0: 1.0})],  # cut at min_p * 0.5
)
def test_min_p_drops_tokens_below_a_fraction_of_the_max(min_p: float, want: dict[int, float]) -> None:
    assert_probs(probs_of(P3, SamplingParams(temperature=1.0, min_p=min_p)), want)


@pytest.mark.parametrize("spread", [0.05, 1.0, 8.0])  # flat (the whole vocabulary's sort) to peaked (one round)
def test_top_p_prefix_is_the_full_sorts_prefix(spread: float) -> None:
    """The prefix found by sorting the best few first equals the one a full stable sort gives, ties included."""
    rng = np.random.default_rng(int(spread * 100))
    for _ in range(5):
        xs = np.round(rng.standard_normal(40_000) * spread, 2)  # rounded: many ties
        p = np.exp(xs - xs.max())
        p /= p.sum()
        order = np.argsort(-xs, kind="stable")
        mass = np.cumsum(p[order])
        for top_p in (0.05, 0.5, 0.9, 0.999):
            want = order[:int(np.searchsorted(mass, top_p)) + 1]
            assert np.array_equal(sampling._top_p_prefix(xs, p, top_p), want)


def test_top_p_runs_before_min_p() -> None:
    # p = [.4, .3, .2, .1]. top_p first: cum .4, .7, .9 keeps {0, 1, 2}; then min_p .3 (cut .12) keeps them all.
    # The other order would drop 3, renormalise to cum .44, .78 and stop at {0, 1}.
    logits = [math.log(q) for q in (0.4, 0.3, 0.2, 0.1)]
    got = probs_of(logits, SamplingParams(temperature=1.0, top_p=0.75, min_p=0.3))
    assert_probs(got, {0: 0.4 / 0.9, 1: 0.3 / 0.9, 2: 0.2 / 0.9})


def test_temperature_runs_before_top_p() -> None:
    # At T=0.5 the probabilities become [.25, .09, .04] / .38, so token 0 alone already holds .66 >= .55.
    assert_probs(probs_of(P3, SamplingParams(temperature=0.5, top_p=0.55)), {0: 1.0})
    assert probs_of(P3, SamplingParams(temperature=1.0, top_p=0.55)).keys() == {0, 1}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = [2.0, -1.0, 0.5, 0.0]
    penalised = np.exp([1.0, -2.0, 0.5, 0.0])  # tokens 0 and 1 penalised once each, though 1 repeats
    got = probs_of(logits, SamplingParams(temperature=1.0, repetition_penalty=2.0, recent_tokens=(0, 1, 1)))
    assert_probs(got, dict(enumerate(penalised / penalised.sum())))
    boosted = np.exp([4.0, -0.5, 0.5, 0.0])  # a penalty below 1 favours the recent tokens instead
    got = probs_of(logits, SamplingParams(temperature=1.0, repetition_penalty=0.5, recent_tokens=(0, 1, 3)))
    assert_probs(got, dict(enumerate(boosted / boosted.sum())))


def test_penalty_rejects_token_ids_outside_the_vocab() -> None:
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="recent_tokens"):
            sample(np.zeros(4), SamplingParams(temperature=1.0, repetition_penalty=1.5, recent_tokens=(bad,)))


def test_unusable_logits_are_never_drawn() -> None:
    assert probs_of([np.nan, 0.0, -np.inf, np.nan], SamplingParams(temperature=1.0)).keys() == {1}
    assert_probs(probs_of([0.0, np.inf, np.inf], SamplingParams(temperature=1.0)), {1: 0.5, 2: 0.5})
    with pytest.raises(ValueError, match="finite"):
        sample(np.array([-np.inf, np.nan]), SamplingParams(temperature=1.0))


# --- seeding --------------------------------------------------------------------------------------------------------

UNIFORM = np.zeros(VOCAB, dtype=np.float32)


def test_same_seed_and_step_give_the_same_token() -> None:
    for seed in (0, 1, 2**63 - 1):
        params = SamplingParams(temperature=1.0, seed=seed)
        assert len({sample(UNIFORM, params, step_key=5) for _ in range(10)}) == 1


def test_different_seeds_and_steps_differ() -> None:
    assert len({sample(UNIFORM, SamplingParams(temperature=1.0, seed=s)) for s in range(50)}) > 1
    assert len({sample(UNIFORM, SamplingParams(temperature=1.0, seed=9), step_key=k) for k in range(50)}) > 1


def test_no_seed_draws_fresh_entropy() -> None:
    assert len({sample(UNIFORM, SamplingParams(temperature=1.0)) for _ in range(50)}) > 1


# --- property ---------------------------------------------------------------------------------------------------


@st.composite
def cases(draw: st.DrawFn) -> tuple[np.ndarray, SamplingParams, int]:
    n = draw(st.integers(1, 40))
    logits = np.array(draw(st.lists(st.floats(-1e4, 1e4, width=32), min_size=n, max_size=n)), dtype=np.float32)
    params = SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), st.floats(1e-3, 100.0))),
        top_k=draw(st.integers(0, n + 2)),
        top_p=draw(st.floats(1e-6, 1.0)),
        min_p=draw(st.floats(0.0, 0.999)),
        repetition_penalty=draw(st.floats(0.01, 100.0)),
        recent_tokens=tuple(draw(st.lists(st.integers(0, n - 1), max_size=8))),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**63 - 1))),
        logit_bias=tuple(draw(st.dictionaries(st.integers(0, n - 1), st.floats(-100, 100), max_size=4)).items()),
    )
    return logits, params, draw(st.integers(0, 2**40))


def reference_penalty(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The biased, then penalised logits (filters 0 and 1 of the module's docstring)."""
    y = logits.astype(np.float64)
    for tok, bias in params.logit_bias:
        y[tok] += bias
    for tok in set(params.recent_tokens):
        y[tok] = y[tok] / params.repetition_penalty if y[tok] > 0 else y[tok] * params.repetition_penalty
    return y


@settings(max_examples=400, deadline=None)
@given(cases())
def test_sampled_token_always_passes_every_filter(case: tuple[np.ndarray, SamplingParams, int]) -> None:
    logits, params, step_key = case
    tok = sample(logits, params, step_key)
    assert 0 <= tok < logits.size
    y = reference_penalty(logits, params)
    if params.greedy:
        assert tok == int(np.argmax(y))
        return
    # rank under "higher logit first, ties to the lower id"; top_k keeps ranks below k
    rank = np.array([np.sum(y > y[i]) + np.sum(y[:i] == y[i]) for i in range(y.size)])
    assert params.top_k == 0 or rank[tok] < params.top_k
    kept = rank < params.top_k if params.top_k else np.ones(y.size, bool)
    q = np.where(kept, np.exp((y - y[kept].max()) / params.temperature), 0.0)
    q /= q.sum()
    assert q[(rank < rank[tok]) & kept].sum() < params.top_p + 1e-9  # top_p stops once the mass is reached
    assert q[tok] >= params.min_p * q.max() * (1 - 1e-9)
    ids, p = distribution(logits, params)
    assert tok in ids and len(set(ids.tolist())) == ids.size and p.sum() == pytest.approx(1.0)


# --- presence and frequency penalties -------------------------------------------------------------------------------


def test_frequency_and_presence_penalties_subtract_per_count_and_once() -> None:
    params = SamplingParams(temperature=1.0, recent_tokens=(1, 1, 2), frequency_penalty=0.5, presence_penalty=0.25)
    # id 1 seen twice: 0 - 2 * 0.5 - 0.25; id 2 once: 0 - 0.5 - 0.25; ids 0 and 3 unseen
    weights = {0: 1.0, 1: math.exp(-1.25), 2: math.exp(-0.75), 3: 1.0}
    total = sum(weights.values())
    assert_probs(probs_of([0.0] * 4, params), {i: w / total for i, w in weights.items()})


def test_penalties_change_a_greedy_choice_and_a_negative_one_favours_repeats() -> None:
    assert sample(np.array([1.0, 1.2]), SamplingParams(recent_tokens=(1,), frequency_penalty=0.5)) == 0
    assert sample(np.array([1.0, 1.2]), SamplingParams(recent_tokens=(1,), presence_penalty=0.3)) == 0
    assert sample(np.array([1.2, 1.0]), SamplingParams(recent_tokens=(1,), presence_penalty=-0.3)) == 1
    assert sample(np.array([1.0, 1.2]), SamplingParams(frequency_penalty=2.0)) == 1  # nothing seen: no change


def test_the_repetition_penalty_runs_before_the_frequency_penalty() -> None:
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0, frequency_penalty=1.0, recent_tokens=(0,))
    # 4 / 2 - 1 = 1 (the other order would give (4 - 1) / 2 = 1.5)
    assert_probs(probs_of([4.0, 0.0], params), {0: math.e / (math.e + 1), 1: 1 / (math.e + 1)})


# --- log-probabilities ----------------------------------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax_with_the_most_probable_first() -> None:
    logits = [1.0, 3.0, 2.0, math.nan, -math.inf, 3.0]
    lse = math.log(math.exp(1) + 2 * math.exp(3) + math.exp(2))
    logprob, top = sampling.token_logprobs(np.array(logits), 2, 3)
    assert logprob == pytest.approx(2 - lse, abs=1e-7)
    assert [i for i, _ in top] == [1, 5, 2]  # a tie goes to the lower id first
    assert [lp for _, lp in top] == pytest.approx([3 - lse, 3 - lse, 2 - lse], abs=1e-7)
    assert sampling.token_logprobs(logits, 3, 0) == (sampling.LOGPROB_FLOOR, [])  # NaN: no chance, no -inf
    assert sampling.token_logprobs(logits, 4, 0)[0] == sampling.LOGPROB_FLOOR


def test_top_logprobs_of_a_large_vocabulary_equal_a_full_sort() -> None:
    logits = np.random.default_rng(3).normal(size=150_000).astype(np.float32)
    logits[[10, 20, 30]] = logits.max()  # ties at the top
    _, top = sampling.token_logprobs(logits, 0, 20)
    full = np.argsort(-logits.astype(np.float64), kind="stable")[:20]
    assert [i for i, _ in top] == full.tolist()
    ref = logits.astype(np.float64)
    ref -= ref.max() + np.log(np.exp(ref - ref.max()).sum())
    assert [lp for _, lp in top] == pytest.approx(ref[full].tolist(), abs=1e-7)


def test_logprobs_ignore_the_sampling_filters() -> None:
    """The model's distribution: what a biased, penalised, hot request reports equals a plain one's."""
    logits = np.array([0.5, 1.5, -1.0])
    params = SamplingParams(temperature=0.3, top_k=1, logit_bias=((0, 5.0),), recent_tokens=(1,),
                            frequency_penalty=2.0)
    token = sample(logits, params)
    assert token == 0
    assert sampling.token_logprobs(logits, token, 2) == sampling.token_logprobs(logits.tolist(), 0, 2)
    assert sampling.token_logprobs(logits, token, 2)[0] < sampling.token_logprobs(logits, 1, 0)[0]


@pytest.mark.parametrize("size", [1, 5, 21, 1023, 1025, 4097, 70_000])
@pytest.mark.parametrize("k", [1, 3, 20])
def test_top_logprobs_with_many_ties_equal_a_full_sort(size: int, k: int) -> None:
    logits = np.random.default_rng(size + k).integers(-3, 4, size).astype(np.float32)  # 7 values: ties everywhere
    logits[1::7] = -np.inf
    _, top = sampling.token_logprobs(logits, 0, k)
    assert [i for i, _ in top] == np.argsort(-logits.astype(np.float64), kind="stable")[:k].tolist()
