"""A backend's results are untrusted: each hook the engine takes arrays from, returning each kind of bad result (the
wrong shape or dtype, a NaN or an infinity, token ids where logits are due or past the vocabulary) or raising, is
declined with its reason, counted and reported once, and the engine's answer is the CPU backend's."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kestrel_core import load
from kestrel_core.model.presets import synthetic_model
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.weights import Model

from .model.conftest import make_tiny_config

LIAR = Path(__file__).resolve().parents[1] / "fixtures" / "backends" / "authors" / "liar.py"
PROMPT = list(range(5, 17))
# sampled: each step's whole row of logits decides its token, not only its argmax; greedy: the batched step may
# give token ids (argmax_only)
PARAMS = {"sampled": SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True),
          "greedy": SamplingParams(max_tokens=6, ignore_eos=True)}
KINDS = ("shape", "dtype", "nan", "inf", "id", "raise")
VOCAB = 320


@pytest.fixture(scope="module")
def model() -> Model:
    return synthetic_model(make_tiny_config("qwen3"), "q8", seed=6)


@pytest.fixture(scope="module")
def cpu_answers(model: Model) -> Iterator[dict[tuple[str, str], list[int]]]:
    answers = {}
    for activations in ("q8", "mixed"):
        with load(model, backend="cpu", activations=activations) as cpu:
            for name, params in PARAMS.items():
                answers[activations, name] = list(cpu.generate(PROMPT, params=params))
    yield answers


def _reason(hook: str, kind: str, sampling: str) -> str:
    if kind == "raise":
        return "error: DeviceFault"
    if kind in ("nan", "inf"):
        return "bad result: non-finite values"
    if kind == "dtype":
        return "bad result: dtype float64, expected float32"
    if kind == "id":
        return (f"bad result: token ids outside [0, {VOCAB})" if sampling == "greedy"  # argmax_only: ids due
                else "bad result: dtype int64, expected float32")
    return "bad result: shape"  # then the shapes, which differ a call


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("hook", "activations", "sampling"), [
    ("kestrel_gemm_q8", "q8", "sampled"), ("kestrel_gemm_fused_q8", "q8", "sampled"),
    ("kestrel_forward", "q8", "sampled"), ("kestrel_forward_batch", "q8", "sampled"),
    ("kestrel_forward_batch", "q8", "greedy"), ("kestrel_gemm_f32", "mixed", "sampled")])
def test_every_bad_result_is_a_reported_decline_and_the_answer_the_cpus(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, model: Model,
        cpu_answers: dict[tuple[str, str], list[int]], hook: str, activations: str, sampling: str, kind: str) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(LIAR))
    monkeypatch.setenv("KESTREL_PROBE", "0")
    with caplog.at_level(logging.WARNING, logger="kestrel"), load(model, backend="liar",
                                                                  activations=activations) as engine:
        engine.backend.plugin.BAD.clear()
        engine.backend.plugin.BAD[hook] = kind
        got = list(engine.generate(PROMPT, params=PARAMS[sampling]))
        counters = engine.stats["offload"][hook]
    assert got == cpu_answers[activations, sampling]
    reason = _reason(hook, kind, sampling)
    assert counters["accepted"] == 0 and counters["declined"] == counters["offered"] >= PARAMS[sampling].max_tokens
    assert counters["declined_reasons"] and all(r.startswith(reason) for r in counters["declined_reasons"])
    reported = [r.getMessage() for r in caplog.records if f"backend liar: {hook} {reason}" in r.getMessage()]
    assert reported and all("(reported once)" in m for m in reported)
    assert len(reported) == len(counters["declined_reasons"])  # once a reason, however often it came


def test_the_cpu_answer_is_one_the_tests_can_tell_apart(cpu_answers: dict[tuple[str, str], list[int]]) -> None:
    """A spoiled logit or activation would show: the answers are not one token over and over."""
    assert all(len(set(answer)) > 2 for answer in cpu_answers.values())
