"""Every API's routes answer any body with a status below 500 and their own error shape: a valid body with one
field replaced by any JSON value, removed, or beside an unknown one (hypothesis), through a real server."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kestrel_core.serve.server import KestrelServer

from .helpers import http

NAME = "fuzz"
HI = [{"role": "user", "content": "Hi"}]
VALID = {
    "/v1/chat/completions": {"model": NAME, "messages": HI, "max_tokens": 3, "temperature": 0.5,
                             "response_format": {"type": "json_object"}, "stream": False},
    "/v1/completions": {"model": NAME, "prompt": "The sea", "max_tokens": 3, "suffix": "", "stop": ["x"]},
    "/v1/responses": {"model": NAME, "input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 3,
                      "text": {"format": {"type": "text"}}},
    "/v1/messages": {"model": NAME, "max_tokens": 3, "messages": HI, "system": "Be brief.",
                     "stop_sequences": ["x"]},
    "/v1/embeddings": {"model": NAME, "input": ["a", "b"], "dimensions": 8},
    "/api/chat": {"model": NAME, "messages": HI, "stream": False, "options": {"num_predict": 3, "seed": 1}},
    "/api/generate": {"model": NAME, "prompt": "The sea", "raw": True, "stream": False,
                      "options": {"num_predict": 3}},
    "/api/embed": {"model": NAME, "input": "a", "truncate": True},
}
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 40, 2 ** 40) | st.floats(allow_nan=False)
                    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def _mutate(body: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    body = json.loads(json.dumps(body))
    key = data.draw(st.sampled_from(sorted(body)))
    action = data.draw(st.sampled_from(["replace", "remove", "extra"]))
    if action == "replace":
        body[key] = data.draw(JSON)
    elif action == "remove":
        del body[key]
    else:
        body[data.draw(st.text(min_size=1, max_size=6))] = data.draw(JSON)
    return body


def _error_shape(path: str, body: Any) -> bool:
    if path.startswith("/api/"):
        return isinstance(body, dict) and isinstance(body.get("error"), str)
    if path == "/v1/messages":
        return body.get("type") == "error" and isinstance(body["error"].get("message"), str)
    return isinstance(body.get("error"), dict) and isinstance(body["error"].get("message"), str)


@pytest.mark.parametrize("path", sorted(VALID))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_body_is_an_answer_or_a_clear_error(server: KestrelServer, path: str, data: st.DataObject) -> None:
    status, _, raw = http("POST", f"{server.url}{path}", _mutate(VALID[path], data))
    assert status < 500, raw[:300]
    if status >= 400:
        assert _error_shape(path, json.loads(raw)), raw[:300]
