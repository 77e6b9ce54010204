"""Tool calls written as markup, through a real server and the official openai client: GLM-4.5's ``<tool_call>NAME``
with ``<arg_key>``/``<arg_value>`` pairs a line each, GLM-4.7's without the newlines, and MiniMax-M2's
``<minimax:tool_call>`` blocks of ``<invoke name=...>`` calls come back as OpenAI's ``tool_calls`` with typed values,
whole and streamed, the reasoning apart; a required call keeps to its schema.

As in test_tool_calls.py: scripted answers over the default model's tokenizer with templates written for these
tests in each model's shape, and the default model's own answers under the call grammar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from .tool_calls import ASK, DAYS, NAME, _both_served, _fresh, reply_parts

pytestmark = pytest.mark.default_model


def _glm_template(compact: bool) -> str:
    """GLM's way: the tools as JSON in the system turn, a call spelled as GLM-4.5 (``compact``: GLM-4.7) does."""
    nl = "" if compact else "\n"
    shape = f"<tool_call>NAME{nl}<arg_key>KEY</arg_key>{nl}<arg_value>VALUE</arg_value>{nl}</tool_call>"
    return ("[gMASK]<sop>{%- if tools %}<|system|>\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}"
            "{%- endfor %}\nCall a function as " + shape + "{%- endif %}"
            "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{%- endfor %}"
            "{%- if add_generation_prompt %}<|assistant|>{%- if enable_thinking is defined and not enable_thinking %}"
            "\n<think></think>{%- endif %}{%- endif %}")


def _glm_call(compact: bool) -> str:
    nl = "" if compact else "\n"
    return (f"<tool_call>get_forecast{nl}<arg_key>city</arg_key>{nl}<arg_value>Saint-Étienne</arg_value>{nl}"
            f"<arg_key>days</arg_key>{nl}<arg_value>3</arg_value>{nl}</tool_call>")


# MiniMax-M2's way: the tools as JSON in the system turn, then how to call them; an assistant turn's reasoning in a
# <think> block, and every answer opening one
MINIMAX_TEMPLATE = (
    "{%- if tools %}]~!b[]~b]system\n<tools>\n{%- for tool in tools %}\n<tool>{{ tool.function | tojson }}</tool>"
    "{%- endfor %}\n</tools>\nCall tools as\n<minimax:tool_call>\n<invoke name=\"tool-name\">\n"
    "<parameter name=\"param-key\">param-value</parameter>\n</invoke>\n</minimax:tool_call>[e~[\n{%- endif %}"
    "{%- for m in messages %}]~b]{{ m.role }}\n{%- if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n"
    "</think>\n\n{%- endif %}{{ m.content }}[e~[\n{%- endfor %}{%- if add_generation_prompt %}]~b]ai\n<think>\n"
    "{%- endif %}")
MINIMAX_CALL = ('<minimax:tool_call>\n<invoke name="get_forecast">\n<parameter name="city">Saint-Étienne</parameter>\n'
                '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>')
# by format: (its template, the scripted answer's reasoning as the model writes it, a call of get_forecast)
FORMATS = {
    "glm-4.5": (_glm_template(False), "<think>Three days of Paris weather.</think>\n", _glm_call(False)),
    "glm-4.7": (_glm_template(True), "<think>Three days of Paris weather.</think>\n", _glm_call(True)),
    "minimax-m2": (MINIMAX_TEMPLATE, "Three days of Paris weather.</think>\n\n", MINIMAX_CALL),  # opened by the prompt
}


@pytest.fixture(scope="module", params=list(FORMATS))
def markup_servers(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, tuple[Any, openai.OpenAI]]]]:
    template = FORMATS[request.param][0]
    with _both_served(template) as both:
        yield request.param, both


def test_calls_come_back_typed_with_the_reasoning_apart(markup_servers) -> None:  # type: ignore[no-untyped-def]
    fmt, servers = markup_servers
    _, reasoning_text, call = FORMATS[fmt]
    scripted, client = _fresh(servers["scripted"]), servers["scripted"][1]
    for stream in (False, True):
        scripted.answers.append(reasoning_text + "Let me look.\n" + call)
        reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[DAYS], stream=stream)
        reasoning, content, calls, reason = reply_parts(reply, stream)
        assert (reasoning, content, reason) == ("Three days of Paris weather.", "Let me look.", "tool_calls")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_forecast", {"city": "Saint-Étienne", "days": 3})]


def test_a_required_call_keeps_to_its_schema(markup_servers) -> None:  # type: ignore[no-untyped-def]
    """tool_choice "required" in the template's format: the model's own answer is a call of the offered function, its
    integer an integer (one call: with more allowed, this small model goes on calling to max_tokens)."""
    _, servers = markup_servers
    client = servers["model"][1]
    choice = client.chat.completions.create(model=NAME, messages=ASK, tools=[DAYS], tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=200,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_forecast" and isinstance(args["city"], str) and isinstance(args["days"], int)


# the newer Mistral templates' way (Ministral-3's, Devstral's, trimmed): the tools before the last user turn, each
# call its own [TOOL_CALLS] with the name and its arguments after [ARGS]
MISTRAL_ARGS_TEMPLATE = (
    "<s>{%- for m in messages %}{%- if m.role == 'user' %}{%- if tools and loop.last %}[AVAILABLE_TOOLS]"
    "{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}[INST]{{ m.content }}[/INST]{%- elif m.role == 'assistant' %}"
    "{{ m.content or '' }}{%- for c in m.tool_calls or [] %}"
    "{{- '[TOOL_CALLS]' + c.function.name + '[ARGS]' + c.function.arguments | tojson }}{%- endfor %}</s>"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{%- endif %}{%- endfor %}")


@pytest.fixture(scope="module")
def mistral_args_servers() -> Iterator[dict[str, tuple[Any, openai.OpenAI]]]:
    with _both_served(MISTRAL_ARGS_TEMPLATE) as both:
        yield both


def test_mistral_args_calls_come_back_whole_and_streamed(mistral_args_servers) -> None:  # type: ignore[no-untyped-def]
    """Calls as the newer Mistral templates write them (one with the call id Mistral-Small-3.2's writes) are
    tool calls with Mistral's nine-character ids, whole and streamed; the control tokens' text is kept for them."""
    scripted, client = _fresh(mistral_args_servers["scripted"]), mistral_args_servers["scripted"][1]
    answer = ('Let me look.[TOOL_CALLS]get_forecast[ARGS]{"city": "Paris", "days": 3}'
              '[TOOL_CALLS]get_forecast[CALL_ID]a1b2c3d4e[ARGS]{"city": "Lyon", "days": 1}')
    for stream in (False, True):
        scripted.answers.append(answer)
        reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[DAYS], stream=stream)
        _, content, calls, reason = reply_parts(reply, stream)
        assert (content, reason) == ("Let me look.", "tool_calls")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_forecast", {"city": "Paris", "days": 3}), ("get_forecast", {"city": "Lyon", "days": 1})]
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
        assert scripted.params[-1].skip_special_tokens is False


def test_a_required_mistral_args_call_is_spelled_as_the_template_writes_it(  # type: ignore[no-untyped-def]
        mistral_args_servers) -> None:
    """tool_choice "required": the model's own answer is [TOOL_CALLS]NAME[ARGS]{...}, read back as the call (its
    arguments held to the schema's properties: this small model goes on inventing others)."""
    client = mistral_args_servers["model"][1]
    strict = {"type": "function", "function": {**DAYS["function"], "parameters": {
        **DAYS["function"]["parameters"], "additionalProperties": False}}}
    choice = client.chat.completions.create(model=NAME, messages=ASK, tools=[strict], tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=200).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_forecast" and isinstance(args["city"], str) and isinstance(args["days"], int)
