"""vLLM's ``/tokenize`` and ``/detokenize`` through a real server: the ids are the ones the chat and completion
routes read (their ``usage`` counts), the tokenizer's own encoding, and they read back as the text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

import kestrel_core
from kestrel_core.serve.server import KestrelServer

from .helpers import http, running_server
from .tool_calls import HERMES_TEMPLATE

NAME = "tiny"
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
HI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    """tiny-qwen3 with a template that renders tools (its own renders none)."""
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3"), backend="cpu") as e:
        e.tokenizer.chat_template = HERMES_TEMPLATE
        yield e


def post(server: KestrelServer, path: str, body: dict[str, Any], key: str | None = None) -> tuple[int, Any]:
    status, _, raw = http("POST", f"{server.url}{path}", body, {"Authorization": f"Bearer {key}"} if key else None)
    return status, json.loads(raw)


def test_a_prompt_is_the_tokenizers_encoding_as_completions_read_it(server: KestrelServer, client: openai.OpenAI,
                                                                   engine: Any) -> None:
    text = "The sea, the sea: 12 ships."
    status, got = post(server, "/tokenize", {"model": NAME, "prompt": text, "return_token_strs": True})
    assert status == 200 and got["tokens"] == engine.tokenizer.encode(text)
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == engine.config.max_position
    assert got["token_strs"] == [engine.tokenizer.decode([t]) for t in got["tokens"]]
    done = client.completions.create(model=NAME, prompt=text, max_tokens=1, temperature=0)
    assert done.usage is not None and done.usage.prompt_tokens == got["count"]
    bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})[1]["tokens"]
    assert bare == engine.tokenizer.encode(text, add_special_tokens=False)
    assert post(server, "/detokenize", {"model": NAME, "tokens": got["tokens"]}) == (200, {"prompt": text})


@pytest.mark.parametrize("tools", [None, [TOOL]])
def test_messages_are_the_chat_routes_prompt(server: KestrelServer, client: openai.OpenAI, engine: Any,
                                             tools: list | None) -> None:
    status, got = post(server, "/tokenize", {"messages": HI, "tools": tools})
    assert status == 200
    done = client.chat.completions.create(model=NAME, messages=HI, tools=tools or openai.NOT_GIVEN, max_tokens=1,
                                          temperature=0)
    assert done.usage is not None and done.usage.prompt_tokens == got["count"]
    assert got["tokens"] == engine.tokenizer.encode_chat(HI, tools=tools)
    bare = post(server, "/tokenize", {"messages": HI, "tools": tools, "add_generation_prompt": False})[1]
    assert got["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < got["count"]  # no assistant header


def test_a_continued_final_message_is_the_chat_routes_prompt(server: KestrelServer, client: openai.OpenAI) -> None:
    """``continue_final_message`` (vLLM's TokenizeChatRequest takes it) ends the prompt with the last message's
    text, as the chat route ends it: no end of turn, no new turn."""
    prefill = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello, my name"}]
    status, got = post(server, "/tokenize", {"messages": prefill, "continue_final_message": True,
                                             "add_generation_prompt": False})
    assert status == 200
    done = client.chat.completions.create(model=NAME, messages=prefill, max_tokens=1, temperature=0,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert done.usage is not None and done.usage.prompt_tokens == got["count"]
    text = post(server, "/detokenize", {"tokens": got["tokens"]})[1]["prompt"]
    assert text.endswith("<|im_start|>assistant\nHello, my name"), text  # ChatML, cut after the text
    closed = post(server, "/tokenize", {"messages": prefill, "add_generation_prompt": False})[1]
    assert closed["count"] > got["count"] and closed["tokens"][:got["count"]] == got["tokens"]
    status, both = post(server, "/tokenize", {"messages": prefill, "continue_final_message": True,
                                              "add_generation_prompt": True})
    assert status == 400 and both["error"]["param"] == "continue_final_message", both


@pytest.mark.parametrize(("path", "body", "param", "needle"), [
    ("/tokenize", {}, "prompt", "either prompt or messages"),
    ("/tokenize", {"prompt": "a", "messages": HI}, "prompt", "either prompt or messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "Hi"}]}, "messages.[0].role", "role"),
    ("/tokenize", {"prompt": 3}, "prompt", "string"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens", "token id -1 is outside the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, "tokens", "tokens must be an array"),
])
def test_bad_requests_are_400_naming_the_field(server: KestrelServer, path: str, body: dict, param: str,
                                               needle: str) -> None:
    status, got = post(server, path, body)
    assert status == 400 and got["error"]["param"] == param and needle in got["error"]["message"], got


def test_another_model_is_a_404_and_the_api_key_guards_them(server: KestrelServer, async_engine: Any) -> None:
    status, got = post(server, "/tokenize", {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and got["error"]["code"] == "model_not_found"
    with running_server(async_engine, NAME, api_key="sekrit") as keyed:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert post(keyed, path, body)[0] == 401
            assert post(keyed, path, body, key="sekrit")[0] == 200
