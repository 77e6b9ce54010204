"""One client's large request does not hold up the others: while the server parses, validates and decodes a body of
megabytes, ``/health`` still answers at once; and a large body is answered as a small one is, its errors included.

The large bodies go as bytes encoded beforehand: the server runs in this process, and a client library encoding
megabytes of JSON here would hold the interpreter while the server's event loop is timed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from starlette.responses import JSONResponse

from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.serve import offload
from kestrel_core.serve.offload import INLINE_BODY_BYTES, json_answer
from kestrel_core.serve.protocol import ChatCompletionRequest, CompletionRequest
from kestrel_core.serve.server import KestrelServer

from .helpers import http, running_server

NAME = "tiny"
HI = [{"role": "user", "content": "Hi"}]


def slowest_health_while(server: KestrelServer, path: str, raw: bytes) -> tuple[float, int, Any]:
    """The slowest ``/health`` answer (seconds) while ``raw`` is posted to ``path``, and that post's status and
    answer."""
    answered: dict[str, Any] = {}

    def post() -> None:  # the answer read here, parsed once /health is no longer timed
        answered["status"], _, answered["body"] = http("POST", f"{server.url}{path}", raw=raw)

    sender = threading.Thread(target=post)
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        start = time.perf_counter()
        status, _, _ = http("GET", f"{server.url}/health")
        slowest = max(slowest, time.perf_counter() - start)
        assert status == 200
        time.sleep(0.01)
    sender.join()
    return slowest, answered["status"], json.loads(answered["body"])


def timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def test_a_large_body_does_not_hold_up_health(server: KestrelServer) -> None:
    """A prompt of 2,000,000 token ids (6 MB), the last field wrong: the answer comes once all are validated. (Ids,
    not messages: ints are outside the cyclic garbage collector, whose full collections over a body of millions of
    objects pause every thread, the event loop's too.)"""
    body = {"model": NAME, "prompt": [1] * 2_000_000, "max_tokens": "x"}
    raw = json.dumps(body).encode()

    def validate() -> None:
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(json.loads(raw))

    validating = timed(validate)
    slowest, status, answer = slowest_health_while(server, "/v1/completions", raw)
    assert status == 400 and answer["error"]["param"] == "max_tokens", answer
    assert slowest < validating / 3, f"/health took {slowest:.2f} s; validating the body takes {validating:.2f} s"


def test_a_long_detokenize_does_not_hold_up_health(server: KestrelServer, engine: Any) -> None:
    """2,000,000 ids (9 MB) decoded: the vocabulary check and the decode run off the event loop."""
    piece = engine.tokenizer.encode("The sea, the sea. ", add_special_tokens=False)
    ids = piece * (2_000_000 // len(piece))
    texts: list[str] = []
    decoding = timed(lambda: texts.append(engine.tokenizer.decode(ids)))
    slowest, status, answer = slowest_health_while(server, "/detokenize", json.dumps({"tokens": ids}).encode())
    assert status == 200 and answer["prompt"] == texts[0]
    assert slowest < decoding / 3, f"/health took {slowest:.2f} s; decoding the ids takes {decoding:.2f} s"


class LargeVectors(AsyncEngine):
    """Embeds every input at once as a vector of VECTOR_SIZE numbers (``vector(i)`` the i-th input's): answers of
    megabytes without the minutes a model would take to compute them."""

    async def embed(self, inputs: Sequence[Sequence[int]], *, pooling: str | None = None,
                    dimensions: int | None = None) -> np.ndarray:
        return np.stack([vector(i) for i in range(len(inputs))])


VECTOR_SIZE = 1024
INPUTS = 1024


def vector(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(VECTOR_SIZE).astype(np.float32)


@pytest.fixture(scope="module")
def large_vectors(engine: Any) -> Iterator[KestrelServer]:
    with running_server(LargeVectors(engine, max_batch=2), NAME) as s:
        yield s


@pytest.mark.parametrize("path", ["/v1/embeddings", "/api/embed"])
def test_a_large_answer_does_not_hold_up_health(large_vectors: KestrelServer, path: str) -> None:
    """1,024 vectors of 1,024 numbers (20 MB of JSON), written off the event loop (Ollama's read back and
    normalized there too)."""
    body = {"model": NAME, "input": ["The sea"] * INPUTS}
    slowest, status, answer = slowest_health_while(large_vectors, path, json.dumps(body).encode())
    vectors = [d["embedding"] for d in answer["data"]] if path == "/v1/embeddings" else answer["embeddings"]
    assert status == 200 and len(vectors) == INPUTS
    expected = [vector(i) for i in (0, INPUTS - 1)]
    if path == "/api/embed":
        expected = [v / np.linalg.norm(v) for v in expected]
    assert np.allclose([vectors[0], vectors[-1]], expected, atol=1e-6)
    writing = timed(lambda: json.dumps(answer, ensure_ascii=False, separators=(",", ":")))
    assert slowest < writing / 3, f"/health took {slowest:.2f} s; writing the answer's JSON takes {writing:.2f} s"


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(), lambda inner: st.lists(inner, max_size=8)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=6), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(value=JSON)
def test_an_answer_is_jsonresponses_bytes_however_it_is_written(value: Any) -> None:
    """Written in encoder calls of a few values each (JSON_STEP 3), an answer is Starlette's JSONResponse's body
    byte for byte."""
    step = offload.JSON_STEP
    offload.JSON_STEP = 3
    try:
        assert asyncio.run(json_answer(lambda: value)).body == JSONResponse(value).body
    finally:
        offload.JSON_STEP = step


@pytest.mark.parametrize("value", [
    {"data": [{"index": i, "embedding": [i / 7] * 3000} for i in range(5)], "usage": {"prompt_tokens": 5}},
    {"tokens": list(range(10_000)), "token_strs": ["é\n\"<>\u2028"] * 9000, "empty": [], "nested": [[1, 2]] * 5000},
    {"tuple": tuple(range(9000)), 1: "a key that is no string", "none": None},
    [{"a": [1.5] * 5000}, {"b": "c"}],
])
def test_a_large_answer_is_jsonresponses_bytes(value: Any) -> None:
    response = asyncio.run(json_answer(lambda: value))
    assert response.body == JSONResponse(value).body and response.headers["content-type"] == "application/json"


PAD = {"padding": ["x" * 100] * (INLINE_BODY_BYTES // 100)}  # an ignored field that takes a body over the limit


@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize(("path", "raw", "status", "error"), [
    ("/v1/chat/completions", json.dumps({"messages": HI, "max_tokens": "x"}), 400,
     {"message": "max_tokens: Input should be a valid integer", "param": "max_tokens", "code": "invalid_value"}),
    ("/v1/chat/completions", json.dumps({"max_tokens": 3}), 400,
     {"message": "messages is required", "param": "messages", "code": "missing_required_parameter"}),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     {"message": "messages.[0].content: not Unicode text (a lone UTF-16 surrogate)", "param": "messages.[0].content",
      "code": "invalid_value"}),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', 400,
     {"message": "temperature must be a number in [0, 100], got nan", "param": "temperature",
      "code": "invalid_value"}),
    ("/v1/chat/completions", '{"messages": [}', 400,
     {"message": "the request body is not valid JSON", "param": None, "code": "invalid_json"}),
    ("/v1/chat/completions", b'{"messages": "\xff"}', 400,
     {"message": "POST /v1/chat/completions: There was an error parsing the body", "param": None, "code": None}),
    ("/detokenize", json.dumps({"tokens": [1, "a"]}), 400,
     {"message": "tokens.[1]: Input should be a valid integer", "param": "tokens.[1]", "code": "invalid_value"}),
    ("/v1/embeddings", json.dumps({"input": {"a": 1}}), 400,
     {"message": "input must be one of: str, list[int], list[str], list[list[int]]", "param": "input",
      "code": "invalid_value"}),
])
def test_a_bad_body_is_the_same_400_however_large(server: KestrelServer, path: str, raw: str | bytes, status: int,
                                                   error: dict[str, Any], large: bool) -> None:
    """A body over INLINE_BODY_BYTES is read off the event loop, one under it at once: the same answer."""
    data = raw.encode() if isinstance(raw, str) else raw
    if large:  # the padding first, so the field each error names keeps its place
        data = b'{"padding": ' + json.dumps(PAD["padding"]).encode() + b", " + data[1:]
        assert len(data) > INLINE_BODY_BYTES
    got, _, answer = http("POST", f"{server.url}{path}", raw=data)
    assert got == status and json.loads(answer)["error"] == {**error, "type": "invalid_request_error"}


@pytest.mark.parametrize(("raw", "message"), [
    (b"", "the request body is missing"),
    (json.dumps([PAD, PAD]).encode(), "the request body must be a JSON object"),
    (b"[1, 2]", "the request body must be a JSON object"),
])
def test_a_body_that_is_no_object_is_a_400(server: KestrelServer, raw: bytes, message: str) -> None:
    status, _, answer = http("POST", f"{server.url}/v1/chat/completions", raw=raw)
    assert status == 400 and json.loads(answer)["error"]["message"] == message


def test_a_large_body_is_read_as_a_small_one(server: KestrelServer) -> None:
    body = {"model": NAME, "messages": HI, "max_tokens": 2, "temperature": 0}
    small = http("POST", f"{server.url}/v1/chat/completions", body)
    large = http("POST", f"{server.url}/v1/chat/completions", {**PAD, **body})
    assert small[0] == large[0] == 200
    assert json.loads(small[2])["choices"] == json.loads(large[2])["choices"]


def test_openapi_documents_each_routes_body(server: KestrelServer) -> None:
    status, _, raw = http("GET", f"{server.url}/openapi.json")
    spec = json.loads(raw)
    bodies = {path: ops["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
              for path, ops in spec["paths"].items() if "post" in ops}
    assert status == 200 and bodies == {
        "/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
        "/v1/embeddings": "EmbeddingRequest", "/v1/responses": "ResponsesBody", "/v1/messages": "MessagesBody",
        "/v1/messages/count_tokens": "MessagesBody", "/api/chat": "ChatBody", "/api/generate": "GenerateBody",
        "/api/embed": "EmbedBody", "/api/embeddings": "LegacyEmbeddingsBody", "/api/show": "ShowBody",
        "/infill": "InfillBody", "/v1/score": "ScoreBody", "/v1/rerank": "RerankBody", "/v2/rerank": "RerankBody",
        "/tokenize": "TokenizeBody", "/detokenize": "DetokenizeBody"}
    schemas = spec["components"]["schemas"]
    assert set(ChatCompletionRequest.model_fields) <= set(schemas["ChatCompletionRequest"]["properties"])
    messages = schemas["ChatCompletionRequest"]["properties"]["messages"]["items"]["$ref"].rsplit("/", 1)[1]
    assert schemas[messages]["properties"]["role"]["enum"][:3] == ["system", "developer", "user"]
