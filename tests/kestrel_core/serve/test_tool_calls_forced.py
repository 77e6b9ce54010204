"""A forced call (``tool_choice`` "required" or a named function) and a JSON response format, written by the default
model itself through a real server with the Hermes-style template (tool_calls.py): the answer keeps to the tools'
schemas, and a call that cannot fit the context is refused before its grammar is built."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from kestrel_core.serve import protocol

from .tool_calls import ASK, HERMES_TEMPLATE, NAME, TIME, WEATHER, _served

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def model_client() -> Iterator[openai.OpenAI]:
    """A server over the default model itself, with the Hermes-style template: its answers are its own."""
    with _served(HERMES_TEMPLATE, scripted=False) as (_, model_client):
        yield model_client


def _weather_args(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str), args


def test_a_forced_call_that_cannot_fit_is_refused_before_its_grammar_is_built(
        model_client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling a client's schema may take seconds: not for a request whose prompt is over the context."""
    built: list[Any] = []
    real = protocol.forced_call_grammar
    monkeypatch.setattr(protocol, "forced_call_grammar", lambda *args: built.append(args) or real(*args))
    values = [f"value-{i}" for i in range(20_000)]
    huge = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"v": {"enum": values}}, "required": ["v"]}}}
    with pytest.raises(openai.BadRequestError, match="context"):
        model_client.chat.completions.create(model=NAME, messages=ASK, tools=[huge], tool_choice="required")
    assert built == []
    answer = model_client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=40,
                                                  tool_choice="required", temperature=0)
    assert answer.choices[0].message.tool_calls and len(built) == 1


@pytest.mark.parametrize(("temperature", "parallel"), [(0.0, None), (1.0, False), (1.0, None)])
def test_a_required_call_is_one_of_the_tools_with_its_arguments(model_client: openai.OpenAI, temperature: float,
                                                               parallel: bool | None) -> None:
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    choice = model_client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME], seed=3,
                                                  tool_choice="required", temperature=temperature,
                                                  max_tokens=250, **extra).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and (parallel is None or len(calls) == 1) and choice.message.content is None
    for call in calls:
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            _weather_args(call.function.arguments)
        else:
            assert json.loads(call.function.arguments) == {}


def test_a_named_call_streamed(model_client: openai.OpenAI) -> None:
    chunks = list(model_client.chat.completions.create(
        model=NAME, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"]
    _weather_args(calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "stop"  # a named function's, as OpenAI's
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == ""


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER["function"]["parameters"]}},
])
def test_a_json_response_format(model_client: openai.OpenAI, response_format: dict[str, Any]) -> None:
    messages = [{"role": "system", "content": "You are a helpful AI assistant."},
                {"role": "user", "content": "Give me a JSON object with the name and country of the capital of "
                                            "France."}]
    choice = model_client.chat.completions.create(model=NAME, messages=messages, max_tokens=100, temperature=0,
                                                  response_format=response_format).choices[0]
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    assert isinstance(value, dict)
    if response_format["type"] == "json_schema":
        _weather_args(json.dumps(value))
