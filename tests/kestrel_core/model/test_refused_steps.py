"""A device's whole steps whose results are refused midway (a bad result, or raising) while the device runs the
engine's steps, batched, pipelined (the next step fed with the device's tokens before the last is taken) or decoding
greedily on its own: the step is a decline with its reason, the host computes it, the device is offered the sequence
again from what it is known to hold, and every answer is the CPU backend's. The device (a fixture backend) gives the
CPU's exact logits and records each call against the contract of a step still running."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kestrel_core import load
from kestrel_core.model.presets import synthetic_model
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.scheduler import Scheduler
from kestrel_core.model.weights import Model

from .conftest import make_tiny_config

MIRROR = Path(__file__).resolve().parents[2] / "fixtures" / "backends" / "authors" / "mirror.py"
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
REASONS = {"id": "bad result: token ids outside [0, 320)", "nan": "bad result: non-finite values",
           "shape": "bad result: token ids of shape [0], expected [1]",
           "dtype": "bad result: token ids of dtype int32, expected int64", "raise": "error: DeviceFault"}
GREEDY_REASONS = {"id": "bad result: token 1000000 outside [0, 320)", "nan": "bad result: a token of type float",
                  "shape": "bad result: a token of type ndarray", "dtype": "bad result: a token of type float32",
                  "raise": "error: DeviceFault"}


@pytest.fixture(scope="module")
def model() -> Model:
    return synthetic_model(make_tiny_config("qwen3"), "q8", seed=6)


@pytest.fixture(scope="module")
def cpu(model: Model) -> Iterator[Any]:
    with load(model, backend="cpu", activations="q8") as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(model: Model) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, model.config.vocab_size, n).tolist() for n in (4, 30, 11)]


def serve_all(engine: Any, prompts: list[list[int]]) -> list[list[int]]:
    sched = Scheduler(engine)
    ids = [sched.add(p, GREEDY).request_id for p in prompts]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while sched.has_work:
        for out in sched.step():
            got[out.request_id].extend(out.new_token_ids)
    return [got[i] for i in ids]


def on_mirror(model: Model, cpu: Any, prompts: list[list[int]], spoil: dict[str, Any]
              ) -> tuple[list[list[int]], dict[str, Any], Any]:
    """Each prompt's answer on the mirror device spoiling ``spoil``; the offload counters; the backend module."""
    with load(model, backend="mirror") as engine:
        plugin = engine.backend.plugin
        plugin.REF[:] = [cpu]
        plugin.SPOIL.clear()
        plugin.SPOIL.update(spoil)
        got = serve_all(engine, prompts)
        return got, engine.stats["offload"], plugin


@pytest.fixture
def mirror(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(MIRROR))
    monkeypatch.setenv("KESTREL_PROBE", "0")


@pytest.mark.usefixtures("mirror")
@pytest.mark.parametrize("kind", list(REASONS))
@pytest.mark.parametrize(("api", "late"), [("1.4", True), ("1.6", True), ("1.6", False)])
def test_a_refused_batched_step_leaves_every_answer_the_cpus(monkeypatch: pytest.MonkeyPatch, model: Model, cpu: Any,
                                                             prompts: list[list[int]], api: str, late: bool,
                                                             kind: str) -> None:
    """The third step (decode rows, fed ones where the steps run late) refused. Before API 1.6 the device forgets
    the sequences it ran that step for, once no step still running uses them (the step after it, which ran on the
    tokens the device chose, is waited for first); from 1.6 it is offered them again from where the host took over."""
    monkeypatch.setenv("MIRROR_API", api)
    want = serve_all(cpu, prompts)
    got, offload, plugin = on_mirror(model, cpu, prompts, {"batch": {3: kind}, "late": late})
    assert got == want
    counters = offload["kestrel_forward_batch"]
    reasons = dict(counters["declined_reasons"])
    assert reasons.pop(REASONS[kind]) == 1 and counters["accepted"] >= 4
    assert set(reasons) <= {"declined by backend"}  # a fed step on a sequence the device has forgotten
    assert plugin.VIOLATIONS == []
    assert (plugin.CALLS["fed"] > 0) == late  # the steps were pipelined where they run late


@pytest.mark.usefixtures("mirror")
@pytest.mark.parametrize("kind", list(GREEDY_REASONS))
def test_a_bad_token_midway_through_a_pipelined_greedy_decode_leaves_the_cpus_answer(model: Model, cpu: Any,
                                                                                    prompts: list[list[int]],
                                                                                    kind: str) -> None:
    """The device's third token bad: the two before it stand, the engine decodes on from them step by step."""
    want = serve_all(cpu, prompts[1:2])
    got, offload, plugin = on_mirror(model, cpu, prompts[1:2], {"greedy": {1: (2, kind)}})
    assert got == want
    counters = offload["kestrel_decode_greedy"]
    assert counters["accepted"] == 1 and counters["declined_reasons"] == {GREEDY_REASONS[kind]: 1}
    assert plugin.VIOLATIONS == []


def test_the_answers_are_ones_a_wrong_token_would_show(cpu: Any, prompts: list[list[int]]) -> None:
    """Not one token over and over (tiny random models loop): the decode rows' logits decide each answer."""
    answers = serve_all(cpu, prompts)
    assert len(set(answers[1])) > 2 and all(len(set(answer)) > 1 for answer in answers)
