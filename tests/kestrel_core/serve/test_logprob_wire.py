"""A logprob of -inf or NaN on the wire: written as vLLM writes -inf (-9999.0), never as JSON's invalid ``-Infinity``
or ``NaN`` in a stream, nor as a whole answer that cannot be encoded (a 500)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from kestrel_core.model import scheduler
from kestrel_core.model.sampling import TokenLogprob, logprobs_of
from kestrel_core.serve.responses import MIN_LOGPROB, ChatShape, ChoiceResult, CompletionShape, TokenStrings

from .helpers import Letters, http

NAME = "tiny-qwen3"
NAN, INF = float("nan"), float("inf")


def strict(text: str | bytes) -> Any:
    """``text`` as JSON that RFC 8259 allows: Python's reader takes NaN and Infinity, which no other does."""
    def refuse(constant: str) -> Any:
        raise AssertionError(f"{constant} in JSON")

    return json.loads(text, parse_constant=refuse)


def test_the_shapes_write_non_finite_logprobs_as_vllm_does() -> None:
    """-inf and NaN are -9999.0 (so is a finite logprob below it), +inf 0 (no probability is above 1); the rest as
    they are."""
    entries = [TokenLogprob(0, -INF, [(0, -INF), (1, NAN)]), TokenLogprob(1, -0.25, [(1, -0.25), (2, -1e5)]),
               TokenLogprob(2, NAN, [(3, INF)])]
    chat = ChatShape("id", "m", TokenStrings(Letters())).response([ChoiceResult(["abc"], entries, "stop", 3)], 1)
    content = strict(json.dumps(chat))["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in content] == [MIN_LOGPROB, -0.25, MIN_LOGPROB]
    assert [[t["logprob"] for t in e["top_logprobs"]] for e in content] == [
        [MIN_LOGPROB, MIN_LOGPROB], [-0.25, MIN_LOGPROB], [0.0]]
    completion = CompletionShape("id", "m", TokenStrings(Letters())).delta_chunk("abc", entries)
    logprobs = strict(json.dumps(completion))["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [MIN_LOGPROB, -0.25, MIN_LOGPROB]
    assert logprobs["top_logprobs"] == [{"a": MIN_LOGPROB, "b": MIN_LOGPROB}, {"b": -0.25, "c": MIN_LOGPROB},
                                        {"d": 0.0, "c": MIN_LOGPROB}]


@pytest.fixture
def impossible(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's logprobs say each chosen token could not be chosen (-inf), its first alternative NaN."""
    def spoiled(logits: Any, token: int, top: int) -> TokenLogprob:
        real = logprobs_of(logits, token, top)
        return TokenLogprob(real.token_id, -INF, [(i, NAN if k == 0 else -INF) for k, (i, _) in enumerate(real.top)])

    monkeypatch.setattr(scheduler, "logprobs_of", spoiled)


def _sse(body: bytes) -> list[Any]:
    lines = [line[len(b"data: "):] for line in body.splitlines() if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [strict(line) for line in lines[:-1]]


@pytest.mark.usefixtures("impossible")
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_server_answers_non_finite_logprobs_in_valid_json(server: Any, route: str) -> None:
    """Whole and streamed, chat and completions: every body and every chunk is valid JSON, each logprob -9999.0."""
    if route == "chat":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2}
    else:
        body = {"prompt": "Hi", "logprobs": 2}
    body.update(model=NAME, max_tokens=3, temperature=0)
    url = f"{server.url}/v1/{'chat/completions' if route == 'chat' else 'completions'}"
    status, _, streamed = http("POST", url, {**body, "stream": True})
    assert status == 200
    choices = [c["choices"][0] for c in _sse(streamed) if c["choices"]]
    status, _, whole = http("POST", url, body)
    assert status == 200, whole[:300]
    choices.append(strict(whole)["choices"][0])
    values = []
    for choice in choices:
        logprobs = choice["logprobs"]
        if logprobs is None:
            continue
        if route == "chat":
            for entry in logprobs["content"]:
                values += [entry["logprob"], *(t["logprob"] for t in entry["top_logprobs"])]
        else:
            values += logprobs["token_logprobs"] + [v for top in logprobs["top_logprobs"] for v in top.values()]
    assert len(values) >= 2 * 3 * 3 and all(v == MIN_LOGPROB and math.isfinite(v) for v in values)
