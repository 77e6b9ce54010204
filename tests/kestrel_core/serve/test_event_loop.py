"""One client's large request does not hold up the others: while the server parses, validates and decodes a body, or
builds an answer, ``/health`` still answers; and a large body is answered as a small one is, its errors included.

Not timed: each test holds the work in a function it calls (patched: the server runs in this process) until
``/health`` has answered, which it cannot while that work holds the event loop.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import urllib.request
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.serve import app, bodies, offload, ollama
from kestrel_core.serve.offload import INLINE_BODY_BYTES, json_answer
from kestrel_core.serve.protocol import ChatCompletionRequest
from kestrel_core.serve.server import KestrelServer

from ..waits import HANG_GUARD_S
from .helpers import http, openai_client, running_server

NAME = "tiny"
HI = [{"role": "user", "content": "Hi"}]


class Held:
    """``function`` that, called as ``holds`` says (the first time), waits until the test releases it (at most
    twice HANG_GUARD_S): what it is part of stays where it runs (on the event loop, or in a worker thread)
    meanwhile."""

    def __init__(self, function: Callable[..., Any], holds: Callable[..., bool] = lambda *a, **k: True) -> None:
        self.function, self.holds = function, holds
        self.entered, self.released = threading.Event(), threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.entered.is_set() and self.holds(*args, **kwargs):
            self.entered.set()
            self.released.wait(2 * HANG_GUARD_S)  # past /health's wait: a held event loop fails the test
        return self.function(*args, **kwargs)


def health_while_held(server: KestrelServer, path: str, raw: bytes, held: Held) -> tuple[int, Any]:
    """``/health`` is answered while ``raw``, posted to ``path``, is held in ``held``; that post's status and
    answer once released."""
    answered: dict[str, Any] = {}

    def post() -> None:
        answered["status"], _, answered["body"] = http("POST", f"{server.url}{path}", raw=raw)

    sender = threading.Thread(target=post)
    sender.start()
    try:
        assert held.entered.wait(HANG_GUARD_S), f"POST {path} did not reach {held.function.__name__}"
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=HANG_GUARD_S) as resp:
                health = resp.status
        except OSError as exc:
            pytest.fail(f"/health was not answered while POST {path} was held: the event loop was ({exc!r})")
    finally:
        held.released.set()
        sender.join(HANG_GUARD_S)
    assert health == 200 and not sender.is_alive()
    return answered["status"], json.loads(answered["body"])


def test_a_large_body_does_not_hold_up_health(server: KestrelServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of 8,000 token ids (past INLINE_BODY_BYTES), the last field wrong: held in its validation (the
    check of its strings every request body's model makes), ``/health`` answers; then the body's 400."""
    raw = json.dumps({"model": NAME, "prompt": [1] * 8000, "max_tokens": "x"}).encode()
    assert len(raw) > INLINE_BODY_BYTES
    held = Held(bodies._lone_surrogate, lambda data: isinstance(data, dict) and data.get("max_tokens") == "x")
    monkeypatch.setattr(bodies, "_lone_surrogate", held)
    status, answer = health_while_held(server, "/v1/completions", raw, held)
    assert status == 400 and answer["error"]["param"] == "max_tokens", answer


def test_large_bodies_take_turns_on_threads_of_their_own(server: KestrelServer,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Four large bodies at once are read on at most BODY_THREADS threads of their own (not the loop's executor,
    where the other requests' prompts are rendered), with short switches of the GIL meanwhile, the interval put
    back after; a small body (the openai client's chat) is read on the loop's thread itself: no hand-off."""
    read_on: list[tuple[str, float]] = []
    validated = offload._validated

    def recorded(model: Any, raw: bytes, content_type: str) -> Any:
        read_on.append((threading.current_thread().name, sys.getswitchinterval()))
        return validated(model, raw, content_type)

    monkeypatch.setattr(offload, "_validated", recorded)
    interval = sys.getswitchinterval()
    raw = json.dumps({"model": NAME, "prompt": [[1]] * 5000, "max_tokens": 1}).encode()
    assert len(raw) > INLINE_BODY_BYTES
    posts = [threading.Thread(target=http, args=("POST", f"{server.url}/v1/completions"), kwargs={"raw": raw})
             for _ in range(4)]
    for post in posts:
        post.start()
    for post in posts:
        post.join(HANG_GUARD_S)
    large = read_on[:]
    answer = openai_client(server).chat.completions.create(model=NAME, messages=HI, max_tokens=2)  # type: ignore
    assert answer.choices[0].message.content is not None
    assert len(large) == 4 and all(name.startswith("kestrel-body") for name, _ in large), large
    assert len({name for name, _ in large}) <= offload.BODY_THREADS
    assert {s for _, s in large} == {min(interval, offload.BODY_SWITCH_S)} and sys.getswitchinterval() == interval
    assert read_on[4:] == [("kestrel-test-server", interval)]


def test_a_long_detokenize_does_not_hold_up_health(server: KestrelServer, engine: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids past INLINE_BODY_BYTES: held in the tokenizer's decode, ``/health`` answers; then their text."""
    piece = engine.tokenizer.encode("The sea, the sea. ", add_special_tokens=False)
    ids = piece * (INLINE_BODY_BYTES // len(piece))
    raw = json.dumps({"tokens": ids}).encode()
    assert len(raw) > INLINE_BODY_BYTES
    text = engine.tokenizer.decode(ids)
    held = Held(engine.tokenizer.decode, lambda tokens, *a, **k: len(tokens) == len(ids))
    monkeypatch.setattr(engine.tokenizer, "decode", held)
    status, answer = health_while_held(server, "/detokenize", raw, held)
    assert status == 200 and answer["prompt"] == text


class KnownVectors(AsyncEngine):
    """Embeds every input at once as a vector of VECTOR_SIZE numbers (``vector(i)`` the i-th input's): answers
    known without a model computing them."""

    async def embed(self, inputs: Sequence[Sequence[int]], *, pooling: str | None = None,
                    dimensions: int | None = None) -> np.ndarray:
        return np.stack([vector(i) for i in range(len(inputs))])


VECTOR_SIZE = 16
INPUTS = 8


def vector(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(VECTOR_SIZE).astype(np.float32)


@pytest.fixture(scope="module")
def known_vectors(engine: Any) -> Iterator[KestrelServer]:
    with running_server(KnownVectors(engine, max_batch=2), NAME) as s:
        yield s


@pytest.mark.parametrize(("path", "module", "builder"), [
    ("/v1/embeddings", app, "embedding_list"),  # the answer's list of embeddings
    ("/api/embed", ollama, "_unit_vector"),  # Ollama's: the OpenAI answer read back, each vector normalized
], ids=["/v1/embeddings", "/api/embed"])
def test_a_large_answer_does_not_hold_up_health(known_vectors: KestrelServer, monkeypatch: pytest.MonkeyPatch,
                                                path: str, module: Any, builder: str) -> None:
    """Held in the building of its answer, ``/health`` answers; then the answer (built and written off the
    event loop, however large)."""
    held = Held(getattr(module, builder))
    monkeypatch.setattr(module, builder, held)
    body = {"model": NAME, "input": ["The sea"] * INPUTS}
    status, answer = health_while_held(known_vectors, path, json.dumps(body).encode(), held)
    vectors = [d["embedding"] for d in answer["data"]] if path == "/v1/embeddings" else answer["embeddings"]
    assert status == 200 and len(vectors) == INPUTS
    expected = [vector(i) for i in (0, INPUTS - 1)]
    if path == "/api/embed":
        expected = [v / np.linalg.norm(v) for v in expected]
    assert np.allclose([vectors[0], vectors[-1]], expected, atol=1e-6)


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
     {"message": "max_tokens must be an integer", "param": "max_tokens", "code": "invalid_value"}),
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
     {"message": "tokens.[1] must be an integer", "param": "tokens.[1]", "code": "invalid_value"}),
    ("/v1/embeddings", json.dumps({"input": {"a": 1}}), 400,
     {"message": "input must be a string, an array of integers, an array of strings or an array of arrays of "
                 "integers", "param": "input",
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


def test_openapi_gives_each_operation_its_own_id(async_engine: AsyncEngine) -> None:
    """Generated clients key operations by their ids: a route of several methods would repeat its id (FastAPI
    warns, and the document holds two operations of one name)."""
    served = app.create_app({NAME: async_engine})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = served.openapi()
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert not [str(w.message) for w in caught] and len(ids) == len(set(ids))
