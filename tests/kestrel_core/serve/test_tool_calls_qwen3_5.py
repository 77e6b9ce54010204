"""Qwen3.5's (and Qwen3-Coder's) calls through a real server (tool_calls.py's setup): ``<function=...>`` with a
``<parameter=...>`` block a value, typed by the schema, the reasoning apart, whole and streamed; a call without its
block end or block; and a required call the model writes itself."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from .tool_calls import ASK, DAYS, NAME, _both_served, _fresh, reply_parts

pytestmark = pytest.mark.default_model

# Qwen3.5's (and Qwen3-Coder's) way, written for these tests: the tools as JSON, a call as <function=...> with a
# <parameter=...> block a value, and the answer opening inside a reasoning block the template starts
XML_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Call a function as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n"
    "</tool_call><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{%- else %}<think>\n{%- endif %}{%- endif %}")
XML_CALL = ("<tool_call>\n<function=get_forecast>\n<parameter=city>\nSaint-Étienne\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def xml_servers() -> Iterator[dict[str, tuple[Any, openai.OpenAI]]]:
    with _both_served(XML_TEMPLATE) as both:
        yield both


@pytest.mark.parametrize("closed", [True, False], ids=["after </think>", "inside the reasoning"])
def test_qwen3_5_calls_come_back_typed_with_the_reasoning_apart(xml_servers, closed: bool) -> None:  # type: ignore[no-untyped-def]
    """A call in Qwen3.5's format, after the reasoning or in place of its </think>, is a tool call whose values
    have their schema's types, whole and streamed; the reasoning is reasoning_content."""
    scripted, client = _fresh(xml_servers["scripted"]), xml_servers["scripted"][1]
    answer = "Three days of Paris weather.\n" + ("</think>\n\n" if closed else "") + XML_CALL
    for stream in (False, True):
        scripted.answers.append(answer)
        reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[DAYS], stream=stream)
        reasoning, content, calls, reason = reply_parts(reply, stream)
        assert scripted.prompts[-1].endswith("<think>")  # the answer opens inside the block
        assert (reasoning, content, reason) == ("Three days of Paris weather.", "", "tool_calls")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_forecast", {"city": "Saint-Étienne", "days": 3})]


@pytest.mark.parametrize("call", [XML_CALL.removesuffix("</tool_call>"),
                                  XML_CALL.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")],
                         ids=["its </tool_call> cut", "no <tool_call> block"])
def test_a_qwen3_coder_call_without_its_block_end_or_block_is_a_call(xml_servers, call: str) -> None:  # type: ignore[no-untyped-def]
    """A call whose </tool_call> never comes, and Qwen3-Coder's bare <function=...>, are tool calls, whole and
    streamed, as vLLM's qwen3_coder parser reads them."""
    scripted, client = _fresh(xml_servers["scripted"]), xml_servers["scripted"][1]
    for stream in (False, True):
        scripted.answers.append("Paris.\n</think>\n\nLet me look.\n" + call)
        reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[DAYS], stream=stream)
        _, content, calls, reason = reply_parts(reply, stream)
        assert (content, reason) == ("Let me look.", "tool_calls")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_forecast", {"city": "Saint-Étienne", "days": 3})]


def test_a_required_qwen3_5_call_keeps_to_its_schema(xml_servers) -> None:  # type: ignore[no-untyped-def]
    """tool_choice "required" in Qwen3.5's format: the model's own answer is a call of the offered function, its
    integer an integer."""
    client = xml_servers["model"][1]
    choice = client.chat.completions.create(model=NAME, messages=ASK, tools=[DAYS], tool_choice="required",
                                            temperature=0, max_tokens=200).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_forecast" and isinstance(args["city"], str) and isinstance(args["days"], int)
