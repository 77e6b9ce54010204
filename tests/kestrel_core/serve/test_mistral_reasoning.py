"""Mistral's reasoning models (Magistral, Ministral 3 Reasoning) through a real server and the official clients: the
``[THINK]...[/THINK]`` block their real chat template teaches comes back as the answer's reasoning (chat's
``reasoning_content`` whole and streamed, the Responses API's reasoning item, Anthropic's thinking block, Ollama's
``thinking``) with the calls after it read, and an earlier answer's reasoning goes back to the template as the
``thinking`` content block it reads.

The answers are spoken in the default model's tokens (``Spoken``), its tokenizer given Mistral's control tokens as
special tokens, as Mistral's vocabularies have them: each token's text is decoded as the engine decodes it, so the
tags' text is in the answer only where the server keeps special tokens' text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import ollama
import pytest

import kestrel_core
from kestrel_core.serve.server import KestrelServer

from .helpers import Spoken, answering, running_server
from .tool_calls import reply_parts

pytestmark = pytest.mark.default_model

NAME = "ministral"
TEMPLATE = (Path(__file__).resolve().parents[2] / "fixtures" / "templates" /
            "mistralai-Ministral-3-14B-Reasoning-2512.jinja").read_text()
THOUGHT = "The user wants the weather in Paris."
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# answers as the texts their tokens come from: the control tokens each one token
REASONED = ["[THINK]", THOUGHT, "[/THINK]", "Sunny in Paris."]
CALLED = ["[THINK]", THOUGHT, "[/THINK]", "Let me look.", "[TOOL_CALLS]", "get_weather", "[ARGS]", '{"city": "Paris"}']


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Spoken, KestrelServer]]:
    """The default model with Ministral 3 Reasoning's template and Mistral's control tokens, its answers spoken two
    tokens an output, and its server."""
    with kestrel_core.load(None, backend="cpu") as engine:
        engine.tokenizer.chat_template = TEMPLATE
        engine.tokenizer.backend.add_special_tokens(["[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]"])
        front = Spoken(engine, per_step=2)
        with running_server(front, NAME) as server:
            yield front, server



@pytest.mark.parametrize("stream", [False, True])
def test_chat_reasoning_is_reasoning_content_and_the_calls_after_it_are_calls(served: tuple[Spoken, KestrelServer],
                                                                              stream: bool) -> None:
    front, client = answering(served, REASONED, CALLED)
    reply = client.chat.completions.create(model=NAME, messages=ASK, stream=stream)
    assert reply_parts(reply, stream) == (THOUGHT, "Sunny in Paris.", None if not stream else [], "stop")
    reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], stream=stream)
    reasoning, content, calls, reason = reply_parts(reply, stream)
    assert (reasoning, content, reason) == (THOUGHT, "Let me look.", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert front.answers == []


def test_the_responses_api_anthropic_and_ollama_carry_the_reasoning(served: tuple[Spoken, KestrelServer]) -> None:
    _, client = answering(served, REASONED, REASONED, REASONED)
    response = client.responses.create(model=NAME, input="Weather in Paris?")
    assert [(i.type, i.content[0].text) for i in response.output] == [("reasoning", THOUGHT),
                                                                        ("message", "Sunny in Paris.")]
    an = anthropic.Anthropic(base_url=served[1].url, api_key="unused", max_retries=0)
    message = an.messages.create(model=NAME, max_tokens=100, messages=ASK)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", THOUGHT), ("text", "Sunny in Paris.")]
    ol = ollama.Client(host=served[1].url)
    assert "thinking" in ol.show(NAME).capabilities
    said = ol.chat(model=NAME, messages=ASK).message
    assert (said.thinking, said.content) == (THOUGHT, "Sunny in Paris.")


def test_an_earlier_answers_reasoning_goes_back_as_its_thinking_block(served: tuple[Spoken, KestrelServer]) -> None:
    """An assistant message's reasoning_content (its content and call beside it), sent back with the call's result
    as agent loops send it, renders as Ministral's template writes a thinking block: [THINK]...[/THINK] before
    the text and the call, as llama.cpp passes it."""
    front, client = answering(served, REASONED)
    call = {"id": "a1b2c3d4e", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history: list[Any] = [*ASK, {"role": "assistant", "content": "Let me look.", "reasoning_content": THOUGHT,
                                 "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": call["id"], "content": "22 C, sunny"}]
    client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER])
    written = f'[INST]Weather in Paris?[/INST][THINK]{THOUGHT}[/THINK]Let me look.[TOOL_CALLS]get_weather[ARGS]' \
              '{"city": "Paris"}'
    assert written in front.prompts[-1] and "[TOOL_RESULTS]22 C, sunny[/TOOL_RESULTS]" in front.prompts[-1]
