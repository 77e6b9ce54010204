"""ServiceNow's Apriel (1.5, 1.6) tool calls through a real server and the official openai client, with its real
chat template: the tools reach the prompt, a ``<tool_calls>[...]</tool_calls>`` block of calls comes back as
OpenAI's ``tool_calls``, whole and streamed, and ``tool_choice`` required or named forces that spelling.

As in test_tool_calls.py: scripted answers over the default model's tokenizer, and the default model's own answers
under the call grammar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from .tool_calls import ASK, DAYS, NAME, TIME, WEATHER, _both_served, _fresh, assert_one_forced_forecast, reply_parts

pytestmark = pytest.mark.default_model

TEMPLATE = (Path(__file__).resolve().parents[2] / "fixtures" / "templates" /
            "Apriel-1.6-15b-Thinker-fixed.jinja").read_text()
# Apriel 1.6 reasons first and answers after its marker (which kestrel leaves in the content: neither vLLM nor
# llama.cpp reads it), then writes its calls in one block
REASONED = "The user wants the weather in Paris.\n[BEGIN FINAL RESPONSE]\n"
CALLS = ('<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "get_time", "arguments": {}}]</tool_calls>')


@pytest.fixture(scope="module")
def apriel() -> Iterator[dict[str, tuple[Any, openai.OpenAI]]]:
    with _both_served(TEMPLATE) as both:
        yield both


@pytest.mark.parametrize("stream", [False, True])
def test_apriels_calls_come_back_as_tool_calls(apriel: dict[str, tuple[Any, openai.OpenAI]], stream: bool) -> None:
    scripted, client = _fresh(apriel["scripted"]), apriel["scripted"][1]
    scripted.answers.append(REASONED + CALLS)
    reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME], stream=stream)
    _, content, calls, reason = reply_parts(reply, stream)
    prompt = scripted.prompts[-1]
    assert "<available_tools>" in prompt and "get_weather" in prompt and "get_time" in prompt
    assert prompt.endswith("Here are my reasoning steps:\n")
    assert (content, reason) == (REASONED.rstrip(), "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("call_") for c in calls)


def test_a_conversation_with_apriels_calls_goes_back_as_its_template_writes_them(
        apriel: dict[str, tuple[Any, openai.OpenAI]]) -> None:
    scripted, client = _fresh(apriel["scripted"]), apriel["scripted"][1]
    scripted.answers.append(CALLS)
    first = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME]).choices[0].message
    history = [*ASK, first.model_dump(exclude_none=True),
               *({"role": "tool", "tool_call_id": c.id, "content": "22 C, sunny"} for c in first.tool_calls)]
    scripted.answers.append("It is sunny.")
    client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER, TIME])
    call_id = first.tool_calls[0].id
    written = f'<tool_calls>[{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{call_id}"}}'
    assert written in scripted.prompts[-1] and "<|begin_tool_result|>\n22 C, sunny" in scripted.prompts[-1]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_forecast"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_apriel_call_is_spelled_as_its_template_writes_it(apriel: dict[str, tuple[Any, openai.OpenAI]],
                                                                   tool_choice: Any, stream: bool) -> None:
    """tool_choice "required" or named: the model's own answer is one <tool_calls> block of a call of the offered
    function, read back as the call, its integer an integer."""
    client = apriel["model"][1]
    reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[DAYS, TIME], tool_choice=tool_choice,
                                           parallel_tool_calls=False, temperature=0, max_tokens=200, stream=stream)
    assert_one_forced_forecast(reply, stream, tool_choice)
