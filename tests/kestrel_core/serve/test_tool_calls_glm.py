"""GLM's tool calls through a real server and the official openai client: GLM-4.5's ``<tool_call>NAME`` with
``<arg_key>``/``<arg_value>`` pairs a line each, and GLM-4.7's without the newlines, come back as OpenAI's
``tool_calls`` with typed values, whole and streamed, the reasoning apart; a required call keeps to its schema.

As in test_tool_calls.py: scripted answers over the default model's tokenizer with templates written for these
tests in GLM's shapes, and the default model's own answers under the call grammar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from .test_tool_calls import ASK, DAYS, NAME, _fresh, _served, reply_parts

pytestmark = pytest.mark.default_model


def _template(compact: bool) -> str:
    """GLM's way: the tools as JSON in the system turn, a call spelled as GLM-4.5 (``compact``: GLM-4.7) does."""
    nl = "" if compact else "\n"
    shape = f"<tool_call>NAME{nl}<arg_key>KEY</arg_key>{nl}<arg_value>VALUE</arg_value>{nl}</tool_call>"
    return ("[gMASK]<sop>{%- if tools %}<|system|>\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}"
            "{%- endfor %}\nCall a function as " + shape + "{%- endif %}"
            "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{%- endfor %}"
            "{%- if add_generation_prompt %}<|assistant|>{%- if enable_thinking is defined and not enable_thinking %}"
            "\n<think></think>{%- endif %}{%- endif %}")


def _call(compact: bool) -> str:
    nl = "" if compact else "\n"
    return (f"<tool_call>get_forecast{nl}<arg_key>city</arg_key>{nl}<arg_value>Saint-Étienne</arg_value>{nl}"
            f"<arg_key>days</arg_key>{nl}<arg_value>3</arg_value>{nl}</tool_call>")


@pytest.fixture(scope="module", params=[False, True], ids=["glm-4.5", "glm-4.7"])
def glm_servers(request: pytest.FixtureRequest) -> Iterator[tuple[bool, dict[str, tuple[Any, openai.OpenAI]]]]:
    template = _template(request.param)
    with _served(template) as scripted, _served(template, scripted=False) as model:
        yield request.param, {"scripted": scripted, "model": model}


def test_glm_calls_come_back_typed_with_the_reasoning_apart(glm_servers) -> None:  # type: ignore[no-untyped-def]
    compact, servers = glm_servers
    scripted, client = _fresh(servers["scripted"]), servers["scripted"][1]
    for stream in (False, True):
        scripted.answers.append("<think>Three days of Paris weather.</think>\nLet me look.\n" + _call(compact))
        reply = client.chat.completions.create(model=NAME, messages=ASK, tools=[DAYS], stream=stream)
        reasoning, content, calls, reason = reply_parts(reply, stream)
        assert (reasoning, content, reason) == ("Three days of Paris weather.", "Let me look.", "tool_calls")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_forecast", {"city": "Saint-Étienne", "days": 3})]


def test_a_required_glm_call_keeps_to_its_schema(glm_servers) -> None:  # type: ignore[no-untyped-def]
    """tool_choice "required" in GLM's format: the model's own answer is a call of the offered function, its
    integer an integer (one call: with more allowed, this small model goes on calling to max_tokens)."""
    _, servers = glm_servers
    client = servers["model"][1]
    choice = client.chat.completions.create(model=NAME, messages=ASK, tools=[DAYS], tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=200,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_forecast" and isinstance(args["city"], str) and isinstance(args["days"], int)
