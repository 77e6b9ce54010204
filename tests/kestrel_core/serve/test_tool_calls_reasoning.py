"""Reasoning beside tool calls through a real server (tool_calls.py's setup) with the Hermes-style template's thinking
variant: the reasoning is ``reasoning_content``, whole and streamed before the content, a call tag it mentions is no
call, and ``chat_template_kwargs`` reach the template."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from .helpers import Scripted
from .tool_calls import ASK, HERMES_TEMPLATE, NAME, PARIS, THINKING_TEMPLATE, WEATHER, _answer, _fresh, _served

pytestmark = pytest.mark.default_model

THOUGHT = "The user wants the weather; get_weather takes a city."


@pytest.fixture(scope="module")
def thinking_server() -> Iterator[tuple[Scripted, openai.OpenAI]]:
    """A scripted server with THINKING_TEMPLATE."""
    with _served(THINKING_TEMPLATE) as pair:
        yield pair


@pytest.fixture
def thinking(thinking_server: tuple[Scripted, openai.OpenAI]) -> Scripted:
    return _fresh(thinking_server)


@pytest.fixture
def thinking_client(thinking_server: tuple[Scripted, openai.OpenAI]) -> openai.OpenAI:
    return thinking_server[1]


def test_reasoning_is_its_own_field(thinking: Scripted, thinking_client: openai.OpenAI) -> None:
    assert THINKING_TEMPLATE != HERMES_TEMPLATE
    message = _answer(thinking, thinking_client, f"<think>\n{THOUGHT}\n</think>\n\n{PARIS}").choices[0].message
    assert message.reasoning_content == THOUGHT and message.content is None
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    message = _answer(thinking, thinking_client, "<think>\nEasy.\n</think>\n\nSunny.", tools=None).choices[0].message
    assert (message.reasoning_content, message.content) == ("Easy.", "Sunny.")
    message = _answer(thinking, thinking_client, "Sunny.").choices[0].message
    assert message.content == "Sunny." and getattr(message, "reasoning_content", None) is None


def test_streamed_reasoning_comes_before_the_content(thinking: Scripted, thinking_client: openai.OpenAI) -> None:
    thinking.answers.append(f"<think>\n{THOUGHT}\n</think>\n\nLet me look.\n{PARIS}")
    chunks = [c for c in thinking_client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                                                  stream=True) if c.choices]
    parts = [("reasoning", d.reasoning_content) if getattr(d, "reasoning_content", None) else ("content", d.content)
             for d in (c.choices[0].delta for c in chunks) if getattr(d, "reasoning_content", None) or d.content]
    kinds = [k for k, _ in parts]
    assert kinds == sorted(kinds, key=lambda k: k == "content") and len(kinds) > 3  # all reasoning first
    assert "".join(t for k, t in parts if k == "reasoning") == THOUGHT
    assert "".join(t for k, t in parts if k == "content") == "Let me look."
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"] and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_reasoning_that_mentions_the_call_tag_keeps_the_call(thinking: Scripted,
                                                             thinking_client: openai.OpenAI) -> None:
    """A ``<tool_call>`` that the reasoning mentions before its ``</think>`` is reasoning; the call after it is a
    call, whole and streamed."""
    thought = "I should emit a <tool_call> block for get_weather."
    answer = f"<think>\n{thought}\n</think>\n\n{PARIS}"
    message = _answer(thinking, thinking_client, answer).choices[0].message
    assert (message.reasoning_content, message.content) == (thought, None)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    thinking.answers.append(answer)
    chunks = [c for c in thinking_client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                                                  stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == ""
    assert [c.function.name for d in deltas for c in d.tool_calls or []] == ["get_weather"]


def test_chat_template_kwargs_reach_the_template(thinking: Scripted, thinking_client: openai.OpenAI) -> None:
    reply = _answer(thinking, thinking_client, "Sunny.", tools=None,
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thinking.prompts[-1].endswith("<|im_start|>assistant<think>\n\n</think>")  # {%- eats the rest
    assert reply.choices[0].message.content == "Sunny."
    reply = _answer(thinking, thinking_client, "I know this.\n</think>\n\nSunny.", tools=None,
                    extra_body={"chat_template_kwargs": {"open_block": True}})  # the answer starts inside it
    assert thinking.prompts[-1].endswith("<|im_start|>assistant<think>")
    assert (reply.choices[0].message.reasoning_content, reply.choices[0].message.content) == \
        ("I know this.", "Sunny.")
    reply = _answer(thinking, thinking_client, '{"a": 1}', tools=None, response_format={"type": "json_object"},
                    extra_body={"chat_template_kwargs": {"open_block": True}})  # constrained: JSON from the start
    assert reply.choices[0].message.content == '{"a": 1}'
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None
    with pytest.raises(openai.BadRequestError) as info:
        _answer(thinking, thinking_client, "x", extra_body={"chat_template_kwargs": {"tools": []}})
    assert info.value.body["param"] == "chat_template_kwargs"
