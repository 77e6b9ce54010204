"""Fields the imitated APIs refuse are refused through a real server, each error worded in the API's terms (the
field as the client named it, no Python tuple or type names)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kestrel_core.serve.server import KestrelServer

from .helpers import HI, http

NAME = "tiny"


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    # an empty stop string: refused, as vLLM refuses it, in its words
    ("/v1/chat/completions", {"messages": HI, "stop": [""]}, "stop", "stop cannot contain an empty string"),
    ("/v1/chat/completions", {"messages": HI, "stop": ["x", ""]}, "stop", "stop cannot contain an empty string"),
    ("/v1/completions", {"prompt": "Hi", "stop": ""}, "stop", "stop cannot contain an empty string"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"5": 101}}, "logit_bias",
     "logit_bias values must be in [-100, 100], got 101 for token 5"),
])
def test_openai_fields_are_refused_in_the_apis_terms(server: KestrelServer, path: str, body: dict[str, Any],
                                                     param: str, message: str) -> None:
    status, _, raw = http("POST", f"{server.url}{path}", {"model": NAME, "max_tokens": 2, **body})
    error = json.loads(raw)["error"]
    assert status == 400 and (error["param"], error["message"]) == (param, message)


def test_an_empty_ollama_stop_string_is_named_as_ollama_names_it(server: KestrelServer) -> None:
    status, _, raw = http("POST", f"{server.url}/api/chat", {"model": NAME, "messages": HI, "stream": False,
                                                             "options": {"stop": [""]}})
    assert status == 400 and json.loads(raw) == {"error": "options.stop cannot contain an empty string"}
