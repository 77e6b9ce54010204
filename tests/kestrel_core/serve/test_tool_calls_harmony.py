"""gpt-oss's harmony format through a real server (tool_calls.py's setup): its channels are the reasoning, the
content and the calls, whole and streamed, a preamble and a call go back as they came, and a forced call or a JSON
format keeps harmony's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from .helpers import Scripted
from .tool_calls import ASK, HARMONY_CALL, HARMONY_TEMPLATE, NAME, WEATHER, _answer, _fresh, _served

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def harmony_server() -> Iterator[tuple[Scripted, openai.OpenAI]]:
    """A scripted server with HARMONY_TEMPLATE."""
    with _served(HARMONY_TEMPLATE) as pair:
        yield pair


@pytest.fixture
def harmony(harmony_server: tuple[Scripted, openai.OpenAI]) -> tuple[Scripted, openai.OpenAI]:
    return _fresh(harmony_server), harmony_server[1]


def test_harmony_channels_are_reasoning_content_and_calls(harmony: tuple[Scripted, openai.OpenAI]) -> None:
    """gpt-oss's analysis channel is the reasoning, its final channel the content, a message to functions.NAME a
    call; the channels are special tokens, so the server keeps their text in the answer it reads."""
    scripted, client = harmony
    message = _answer(scripted, client, HARMONY_CALL).choices[0].message
    assert scripted.params[-1].skip_special_tokens is False
    assert "namespace functions" in scripted.prompts[-1] and scripted.prompts[-1].endswith("<|start|>assistant")
    assert message.reasoning_content == "Need the weather in Paris." and not message.content
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    choice = _answer(scripted, client, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>"
                     "final<|message|>Sunny.<|return|>", tools=None).choices[0]
    assert (choice.message.reasoning_content, choice.message.content, choice.finish_reason) == \
        ("Easy.", "Sunny.", "stop")
    assert _answer(scripted, client, "Sunny, no channels.", tools=None).choices[0].message.content == \
        "Sunny, no channels."


def test_a_harmony_answer_with_a_preamble_and_a_call_goes_back_as_it_came(
        harmony: tuple[Scripted, openai.OpenAI]) -> None:
    """gpt-oss's answer of reasoning, a preamble (content) and a call, sent back unchanged with the call's result
    (as agent loops send it), renders: the template takes one analysis message before a call, the reasoning."""
    scripted, client = harmony
    preamble = "<|start|>assistant<|channel|>commentary<|message|>Let me check the weather.<|end|>"
    answer = HARMONY_CALL.replace("<|start|>", preamble + "<|start|>", 1)
    first = _answer(scripted, client, answer).choices[0].message
    assert (first.reasoning_content, first.content) == ("Need the weather in Paris.", "Let me check the weather.")
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "22 C, sunny"}]
    reply = _answer(scripted, client, "<|channel|>final<|message|>Sunny.<|return|>", messages=history)
    assert reply.choices[0].message.content == "Sunny."
    rendered = "<|channel|>analysis<|message|>Need the weather in Paris.<|end|><|start|>assistant to=functions."
    assert rendered + "get_weather" in scripted.prompts[-1]


def test_harmony_streams_reasoning_then_content_then_calls(harmony: tuple[Scripted, openai.OpenAI]) -> None:
    scripted, client = harmony
    scripted.answers.append("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
                            "commentary<|message|>Let me look.<|end|>" + HARMONY_CALL.split("<|end|>", 1)[1])
    chunks = [c for c in client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], stream=True)
              if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == ("Need the weather.", "Let me look.") and "<|" not in reasoning + content
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"] and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_harmony_forced_calls_and_json_keep_harmonys_shape(harmony: tuple[Scripted, openai.OpenAI]) -> None:
    """A forced call and a JSON response format constrain gpt-oss's answer in its own shape (the grammars are
    kestrel_core.model.harmony's, tested there): the answer is still read by its channels."""
    scripted, client = harmony
    choice = _answer(scripted, client, HARMONY_CALL, tool_choice="required").choices[0]
    assert scripted.params[-1].grammar is not None and scripted.params[-1].skip_special_tokens is False
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    reply = _answer(scripted, client, '<|channel|>final<|message|>{"a": 1}', tools=None,
                    response_format={"type": "json_object"})
    assert scripted.params[-1].grammar is not None and reply.choices[0].message.content == '{"a": 1}'
