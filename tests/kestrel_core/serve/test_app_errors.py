"""Errors through the server over the default model (default_server.py): a bad request is a 400 naming its field
(a 404 for an unknown model or route), a stream that fails or is shut down mid-way says so, and a schema past the
grammar engine's limits fails its request alone."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import AsyncIterator, Sequence
from typing import Any

import openai
import pytest

from kestrel_core.model.request import RequestOutput
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.serve.server import KestrelServer

from ..waits import HANG_GUARD_S
from .default_server import NAME, _chat, default_async_engine, default_engine  # noqa: F401 (fixtures)
from .helpers import HI, Scripted, http, running_server

pytestmark = pytest.mark.default_model


class _FailsMidStream(Scripted):
    """Its answer's first piece, then a bug (not a KestrelError)."""

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None, places: Any = None,
                       priority: int = 0, constraint: Any = None) -> AsyncIterator[RequestOutput]:
        async for out in super().generate(prompt_ids, params, request_id, places, priority, constraint):
            yield out
            raise RuntimeError("boom")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/v1/messages"])
def test_a_stream_that_fails_mid_way_says_so_and_ends(engine: Any, path: str) -> None:
    front = _FailsMidStream(engine)
    front.answers.append("Paris is the capital.")
    body = {"model": NAME, "messages": HI, "max_tokens": 8, "stream": True}
    with running_server(front, NAME) as server:
        status, _, raw = http("POST", f"{server.url}{path}", body)
    # each API's own way to end a stream on an error: its last event or line names it
    last = {"/v1/chat/completions": -2, "/api/chat": -1, "/v1/messages": -1}[path]
    lines = [line for line in raw.decode().split("\n") if line]
    assert status == 200 and "internal error: RuntimeError: boom" in lines[last], raw
    assert path != "/v1/chat/completions" or lines[-1] == "data: [DONE]"


class _ShutBeforeAnyToken(Scripted):
    """A shutdown's abort before the first token (the request queued or still in its prompt)."""

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None, places: Any = None,
                       priority: int = 0, constraint: Any = None) -> AsyncIterator[RequestOutput]:
        yield RequestOutput(request_id or "r", [], "", None, True, "abort", len(prompt_ids), 0)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/v1/messages", "/v1/responses"])
def test_a_stream_a_shutdown_ends_before_its_first_token_is_a_503(engine: Any, path: str) -> None:
    """Its headers are not sent yet, so the status says it, as a whole answer's does."""
    body: dict[str, Any] = {"model": NAME, "messages": HI, "max_tokens": 8, "stream": True}
    if path == "/v1/responses":
        body = {"model": NAME, "input": "Hi", "stream": True}
    with running_server(_ShutBeforeAnyToken(engine), NAME) as server:
        status, _, raw = http("POST", f"{server.url}{path}", body)
    assert status == 503 and b"shut down before the request finished" in raw, raw


# -- bad requests ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a"] * 65}, "stop"),
    ({"seed": -2 ** 63 - 1}, "seed"),  # past int64, which vLLM takes
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.[0].content"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.[0].content"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias"),  # outside the vocabulary
    ({"extra_body": {"stop_token_ids": [1, 10000000]}}, "stop_token_ids"),  # likewise (vLLM's field)
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    # what kestrel does not answer with is refused, not ignored: a call in the deprecated shape, audio
    ({"functions": [{"name": "f", "parameters": {}}], "function_call": {"name": "f"}}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"reasoning_effort": "bogus"}, "reasoning_effort"),
    ({"extra_body": {"stop_token_ids": list(range(1025))}}, "stop_token_ids"),  # each token is looked up in them
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # int() refuses it: a 400, not a 500
])
def test_bad_chat_request_is_a_400_naming_the_field(client: openai.OpenAI, kwargs: dict[str, Any],
                                                     param: str) -> None:
    args: dict[str, Any] = {"model": NAME, "messages": HI, "max_tokens": 4}
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    error = info.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"] and "Traceback" not in error["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": 4}, "messages"),  # no messages at all
    ({"messages": "Hi"}, "messages"),
    ({"messages": HI, "stream": "yes"}, "stream"),
])
def test_malformed_chat_body(server: KestrelServer, body: dict[str, Any], param: str) -> None:
    status, _, raw = http("POST", f"{server.url}/v1/chat/completions", body)
    assert status == 400
    assert json.loads(raw)["error"]["param"] == param


LONE = "\ud800 hi"  # JSON's escape of half a UTF-16 pair: valid JSON, not Unicode text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages.[0].content"),
    ("/v1/chat/completions", {"model": LONE, "messages": HI}, "model"),
    ("/v1/completions", {"prompt": ["Hi", LONE]}, "prompt.[1]"),
    ("/v1/embeddings", {"input": LONE}, "input"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/detokenize", {"model": LONE, "tokens": [1]}, "model"),
    ("/v1/responses", {"input": LONE}, "input"),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": LONE}]}, None),
    ("/api/generate", {"model": NAME, "prompt": LONE}, None),
    ("/v1/messages", {"model": LONE, "max_tokens": 4, "messages": HI}, None),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server: KestrelServer, path: str, body: dict[str, Any],
                                                     param: str | None) -> None:
    body = {"model": NAME, **body} if path.startswith("/v1/") and path != "/v1/messages" else body
    status, _, raw = http("POST", f"{server.url}{path}", body)
    answer = json.loads(raw)
    assert status == 400, answer
    error = answer["error"]  # Ollama's a string, OpenAI's and Anthropic's an object
    assert "lone UTF-16 surrogate" in (error if isinstance(error, str) else error["message"])
    if param is not None:
        assert answer["error"]["param"] == param
    status, _, _ = http("POST", f"{server.url}/v1/chat/completions", {"model": NAME, "messages": HI, "max_tokens": 1})
    assert status == 200


def test_body_that_is_not_json(server: KestrelServer) -> None:
    status, _, raw = http("POST", f"{server.url}/v1/chat/completions", raw=b"{not json")
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] is None and error["code"] == "invalid_json"


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_sent_as_curl_d_sends_it_is_read(server: KestrelServer, content_type: str) -> None:
    """``curl -d '{...}'`` (a form's content type), as Ollama's examples send it."""
    body = json.dumps({"messages": HI, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(f"{server.url}/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": content_type})
    with urllib.request.urlopen(req, timeout=HANG_GUARD_S) as resp:
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"logprobs": 21}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10**7]}, "prompt"),
    ({"prompt": ["a"] * 129}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"suffix": "end"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    # an echoed prompt is checked as a generated one, its error the same
    ({"prompt": [[]], "echo": True}, "prompt"),
    ({"prompt": "", "echo": True, "max_tokens": 0}, "prompt"),
    ({"prompt": [10**7], "echo": True, "logprobs": 1}, "prompt"),
])
def test_bad_completions_request(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    args: dict[str, Any] = {"model": NAME, "prompt": "Hi", "max_tokens": 4}
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    assert (info.value.body["param"], info.value.body["code"]) == (param, "invalid_value"), info.value.body


def test_unknown_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=4)
    assert info.value.body["code"] == "model_not_found"


def test_unknown_route_is_an_openai_404(server: KestrelServer) -> None:
    status, _, raw = http("POST", f"{server.url}/v1/audio/speech", {"input": "x"})
    assert status == 404 and "error" in json.loads(raw)


def test_a_schema_past_the_grammar_engines_limits_is_an_error_not_a_cut_answer(client: openai.OpenAI) -> None:
    """1,000 optional properties: llguidance gives up after "{" (a parser row over its 2,000 items). The answer
    was "{" with finish_reason "stop", which the schema does not describe; now the request fails, alone."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}
    with pytest.raises(openai.BadRequestError, match="the grammar failed while generating"):
        _chat(client, max_tokens=8, response_format=fmt)
    assert _chat(client, max_tokens=4).choices[0].message.content  # the server goes on
