"""Sampling: greedy, temperature, top-k, top-p, min-p, seeds, penalties, logprobs, parameter checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kestrel_core.errors import InvalidRequest
from kestrel_core.model.sampling import Sampler as _Sampler
from kestrel_core.model.sampling import SamplingParams, logprobs_of


def Sampler(temperature: float = 0.0, **kwargs: object) -> _Sampler:  # noqa: N802
    return _Sampler(SamplingParams(temperature=temperature, **kwargs))  # type: ignore[arg-type]

LOGITS = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15], dtype=np.float32))  # probabilities at temperature 1


def _frequencies(sampler: Sampler, logits: np.ndarray, n: int = 8000) -> np.ndarray:
    counts = np.bincount([sampler(logits) for _ in range(n)], minlength=len(logits))
    return counts / n


def test_greedy_is_the_first_argmax() -> None:
    logits = np.array([0.0, 2.0, -1.0, 2.0], np.float32)
    assert Sampler(0.0)(logits) == 1
    assert Sampler(1.5, top_k=1, seed=3)(logits) == 1


def test_temperature_one_samples_the_softmax() -> None:
    freq = _frequencies(Sampler(1.0, seed=1), LOGITS)
    np.testing.assert_allclose(freq, np.exp(LOGITS) / np.exp(LOGITS).sum(), atol=0.02)


def test_low_temperature_sharpens() -> None:
    freq = _frequencies(Sampler(0.25, seed=2), LOGITS, 5000)
    p = np.exp(LOGITS / 0.25)
    np.testing.assert_allclose(freq, p / p.sum(), atol=0.02)
    assert freq[1] > 0.6


@pytest.mark.parametrize("kwargs", [{}, {"top_k": 2}, {"top_p": 0.5}])
def test_a_temperature_too_small_to_divide_by_is_greedy(kwargs: dict) -> None:
    """1e-310 passes the check (> 0): the logits over it overflow, and the largest must still win."""
    logits = np.array([0.5, 2.0, -1.0, 1.9], np.float32)
    assert [Sampler(1e-310, seed=s, **kwargs)(logits) for s in range(20)] == [1] * 20


def test_a_tiny_repetition_penalty_gives_the_repeated_tokens_not_nan() -> None:
    """1e-40 divides a positive logit past float32's range: the largest finite float, not inf (inf - inf is NaN)."""
    s = _Sampler(SamplingParams(temperature=1.0, repetition_penalty=1e-40, seed=0), prompt_ids=[3])
    logits = np.array([2.0, 1.0, -1.0, 0.5], np.float32)
    assert np.isfinite(s.processed(logits)).all()
    assert {s(logits) for _ in range(20)} == {3}


def test_top_k_keeps_the_k_most_likely() -> None:
    freq = _frequencies(Sampler(1.0, top_k=2, seed=3), LOGITS, 5000)
    assert set(np.flatnonzero(freq)) == {1, 3}
    np.testing.assert_allclose(freq[[1, 3]], [0.4 / 0.7, 0.3 / 0.7], atol=0.02)


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    # sorted: 0.4, 0.3, 0.15, 0.1, 0.05 -> cumulative 0.4, 0.7, 0.85: p=0.75 keeps three tokens
    ids, probs = Sampler(1.0, top_p=0.75).distribution(LOGITS)
    assert ids.tolist() == [1, 3, 4]
    np.testing.assert_allclose(probs, np.array([0.4, 0.3, 0.15]) / 0.85, rtol=1e-5)
    ids, _ = Sampler(1.0, top_p=0.3).distribution(LOGITS)
    assert ids.tolist() == [1]  # at least the most likely token
    ids, _ = Sampler(1.0, top_k=4, top_p=0.9).distribution(LOGITS)
    assert ids.tolist() == [1, 3, 4, 2]  # top-k first, then the nucleus of what is left


def _reference_distribution(z: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[list, np.ndarray]:
    """The definition, over the whole vocabulary: softmax(z / T); the k most likely (ties: lower id); then the
    smallest most-likely-first prefix whose mass reaches top_p."""
    x = z.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    order = np.argsort(-p, kind="stable")  # most likely first, lower id first among ties
    if 0 < top_k < len(z):
        order = order[:top_k]
    elif top_p >= 1:
        return list(range(len(z))), p / p.sum()
    probs = p[order] / p[order].sum()
    if top_p < 1:
        keep = int(np.searchsorted(np.cumsum(probs), top_p, side="left")) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return order.tolist(), probs


@pytest.mark.parametrize("shape", ["peaked", "flat", "ties"])
def test_distribution_is_the_definition_on_a_large_vocabulary(shape: str) -> None:
    """The candidate search (a few hundred tokens above a floor, not a sort of the vocabulary) keeps exactly
    the tokens, order and probabilities of the definition."""
    rng = np.random.default_rng(5)
    z = {"peaked": rng.standard_normal(20_000) * 4, "flat": rng.standard_normal(20_000) * 0.05,
         "ties": np.round(rng.standard_normal(20_000) * 2)}[shape].astype(np.float32)
    for temperature, top_k, top_p in [(0.7, 0, 1.0), (0.7, 0, 0.9), (1.0, 40, 1.0), (0.8, 50, 0.95), (5.0, 40, 1.0),
                                      (1.0, 0, 0.5), (0.3, 1000, 0.99), (2.0, 0, 0.999)]:
        ids, probs = Sampler(temperature, top_k=top_k, top_p=top_p).distribution(z)
        want_ids, want = _reference_distribution(z, temperature, top_k, top_p)
        assert ids.tolist() == want_ids, (shape, temperature, top_k, top_p)
        np.testing.assert_allclose(probs, want, rtol=1e-12, atol=1e-300)


def test_the_inverse_cdf_by_blocks_picks_the_interval_of_the_draw() -> None:
    from kestrel_core.model.sampling import _inverse_cdf

    rng = np.random.default_rng(6)
    for n in (1, 7, 256, 257, 1000, 151_936):
        probs = rng.dirichlet(np.full(n, 0.3))
        probs[rng.integers(0, n, n // 3)] = 0.0  # tokens of no weight are never picked
        if not probs.any():
            probs[0] = 1.0
        probs /= probs.sum()
        cum = np.cumsum(probs)
        for u in rng.random(50):
            got = _inverse_cdf(probs, u)
            assert probs[got] > 0
            assert got == min(int(np.searchsorted(cum, u, side="right")), n - 1) or abs(cum[got] - u) < 1e-9


def test_the_same_seed_gives_the_same_tokens() -> None:
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    runs = [[s(logits) for _ in range(30)] for s in (Sampler(0.8, top_k=50, top_p=0.9, seed=seed)
                                                    for seed in (7, 7, 8))]
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": True}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"), ({"seed": -1}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("inf")}, "frequency_penalty"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"), ({"stop": ("",)}, "stop"), ({"stop": ("a",) * 65}, "stop"),
    ({"stop_token_ids": (-3,)}, "stop_token_ids"), ({"logprobs": 1}, "logprobs"),
    ({"stop": ("ok", "a\ud800")}, "stop"),  # no decoded text holds a lone surrogate: it would never stop
    ({"ignore_eos": "no"}, "ignore_eos"), ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
    ({"logit_bias": ((1, 100.5),)}, "logit_bias"), ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ({"logit_bias": ((1, float("nan")),)}, "logit_bias"), ({"logit_bias": {1: 2.0}}, "logit_bias"),
    ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 200, "max_tokens": 100}, "min_tokens"),
    ({"min_tokens": 2, "grammar": "start: /a+/"}, "min_tokens"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 11.0}, "repetition_penalty"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
])
def test_bad_parameters_name_their_field(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kwargs).check()
    assert info.value.param == param and param in str(info.value)


def test_presence_and_frequency_penalties_follow_openais_formula() -> None:
    logits = np.array([3.0, 2.9, 0.0, -1.0], np.float32)
    s = _Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    assert s(logits) == 0  # nothing generated yet: no penalty
    s.counts[0] += 1  # token 0 twice, token 1 once
    s.counts[1] += 1
    want = logits - np.array([0.5 + 2 * 0.25, 0.5 + 0.25, 0, 0], np.float32)
    np.testing.assert_array_equal(s.processed(logits), want)
    assert s(logits) == 1  # 3.0 - 1.0 < 2.9 - 0.75


def test_logit_bias_is_added_before_the_penalties_and_the_choice() -> None:
    logits = np.array([3.0, 2.9, 0.0, -1.0], np.float32)
    s = _Sampler(SamplingParams(logit_bias=((3, 5.0), (0, -100.0), (3, 4.5)), presence_penalty=1.0))
    assert SamplingParams(logit_bias=((3, 5.0),)).adjusted and not SamplingParams().adjusted
    np.testing.assert_array_equal(s.processed(logits), logits + np.array([-100, 0, 0, 4.5], np.float32))  # the last
    assert s(logits) == 3  # -1 + 4.5 beats 2.9: biased, and counted for the penalty
    assert s(logits) == 1  # 3.5 - 1 (presence) < 2.9
    free = _Sampler(SamplingParams())
    np.testing.assert_array_equal(free.processed(logits), logits)


GOLDEN = json.loads((Path(__file__).parent / "data" / "sampling_golden.json").read_text())["cases"]


@pytest.mark.parametrize("case", GOLDEN, ids=lambda c: "-".join(f"{k}={v}" for k, v in c["params"].items()))
def test_the_distribution_is_transformers_after_its_penalty_and_warpers(case: dict) -> None:
    """scripts/make_sampling_golden.py: transformers' repetition penalty, temperature, top-k, top-p and min-p."""
    logits = np.array(case["logits"], np.float32)
    s = _Sampler(SamplingParams(**case["params"]), prompt_ids=case["prompt"])
    for token in case["generated"]:
        s.count(token)
    ids, probs = s.distribution(s.processed(logits))
    got = np.zeros(len(logits))
    got[ids] = probs
    want = np.array(case["probs"])
    assert set(np.flatnonzero(got)) == set(np.flatnonzero(want))
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_min_p_drops_what_is_less_likely_than_its_share_of_the_most_likely() -> None:
    # probabilities 0.05, 0.4, 0.1, 0.3, 0.15: min_p 0.3 keeps those >= 0.12
    ids, probs = Sampler(1.0, min_p=0.3).distribution(LOGITS)
    assert set(ids[probs > 0].tolist()) == {1, 3, 4}
    np.testing.assert_allclose(probs[probs > 0].sum(), 1.0, rtol=1e-6)
    ids, probs = Sampler(1.0, top_k=2, min_p=0.3).distribution(LOGITS)
    assert ids.tolist() == [1, 3]
    freq = _frequencies(Sampler(1.0, min_p=0.3, seed=4), LOGITS, 4000)
    assert set(np.flatnonzero(freq)) == {1, 3, 4}


def test_the_repetition_penalty_counts_the_prompt_and_the_answer() -> None:
    logits = np.array([2.0, 1.9, -0.5, 1.0], np.float32)
    s = _Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 0, 2])
    np.testing.assert_array_equal(s.processed(logits), np.array([1.0, 1.9, -1.0, 1.0], np.float32))
    assert s(logits) == 1  # greedy after the penalty: 1.9 beats 2.0 / 2
    np.testing.assert_array_equal(s.processed(logits), np.array([1.0, 0.95, -1.0, 1.0], np.float32))
    assert SamplingParams(repetition_penalty=1.1).adjusted  # the device's argmax will not do
    unpenalized = _Sampler(SamplingParams(), prompt_ids=[0, 1])
    np.testing.assert_array_equal(unpenalized.processed(logits), logits)


def test_min_tokens_masks_the_end_and_the_stop_tokens_until_it_is_reached() -> None:
    logits = np.array([3.0, 2.9, 0.0, -1.0], np.float32)
    s = _Sampler(SamplingParams(min_tokens=2, stop_token_ids=(1,)), eos_ids={0})
    assert SamplingParams(min_tokens=2).adjusted  # the device's argmax will not do
    assert s(logits) == 2 and s(logits) == 2  # 0 (the end) and 1 (a stop token) are held back twice
    assert s(logits) == 0
    keeps_eos = _Sampler(SamplingParams(min_tokens=1, ignore_eos=True), eos_ids={0})
    assert keeps_eos(logits) == 0  # an end of text that does not end the answer is not held back


def test_logprobs_are_the_models_log_softmax_with_the_top_alternatives() -> None:
    lp = logprobs_of(LOGITS, 3, top=2)
    np.testing.assert_allclose(lp.logprob, np.log(0.3), rtol=1e-5)
    assert [i for i, _ in lp.top] == [1, 3]
    np.testing.assert_allclose([v for _, v in lp.top], np.log([0.4, 0.3]), rtol=1e-5)
    assert logprobs_of(LOGITS, 0, top=0).top == []
