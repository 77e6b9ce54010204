"""One client's large request does not hold up the others: while the server parses, validates and decodes a body of
megabytes, ``/health`` still answers at once; and a large body is answered as a small one is, its errors included.

The large bodies go as bytes encoded beforehand: the server runs in this process, and a client library encoding
megabytes of JSON here would hold the interpreter while the server's event loop is timed.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from pydantic import ValidationError

from kestrel_core.serve.offload import INLINE_BODY_BYTES
from kestrel_core.serve.protocol import ChatCompletionRequest, CompletionRequest
from kestrel_core.serve.server import KestrelServer

from .helpers import http

NAME = "tiny"
HI = [{"role": "user", "content": "Hi"}]


def slowest_health_while(server: KestrelServer, path: str, raw: bytes) -> tuple[float, int, Any]:
    """The slowest ``/health`` answer (seconds) while ``raw`` is posted to ``path``, and that post's status and
    answer."""
    answered: dict[str, Any] = {}

    def post() -> None:
        status, _, body = http("POST", f"{server.url}{path}", raw=raw)
        answered.update(status=status, body=json.loads(body))

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
    return slowest, answered["status"], answered["body"]


def timed(work: Any) -> float:
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
