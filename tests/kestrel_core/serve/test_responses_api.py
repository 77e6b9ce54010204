"""OpenAI's Responses API through a real server and the official openai client (``client.responses``), against
kestrel's own chat answers (greedy on tiny-qwen3); function calls and reasoning from scripted answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from kestrel_core.serve.server import KestrelServer

from .helpers import Scripted, http, openai_client, running_server
from .tool_calls import PARIS, THINKING_TEMPLATE, WEATHER

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
NAME = "tiny"
HI = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", **WEATHER["function"]}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


class Ok(BaseModel):
    ok: bool


def test_a_response_is_the_chat_answer(client: openai.OpenAI) -> None:
    want = client.chat.completions.create(model=NAME, messages=HI, temperature=0, max_tokens=10)
    got = client.responses.create(model=NAME, input="Hi", temperature=0, max_output_tokens=10)
    assert got.output_text == want.choices[0].message.content and got.object == "response"
    assert (got.status, got.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (got.usage.input_tokens, got.usage.output_tokens) == (want.usage.prompt_tokens, 10)
    (item,) = got.output
    assert (item.type, item.role, item.content[0].type) == ("message", "assistant", "output_text")


def test_a_stream_is_its_response_in_events(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=NAME, input=HI, temperature=0, max_output_tokens=10)
    with client.responses.stream(model=NAME, input=HI, temperature=0, max_output_tokens=10) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output[0].content[0].text == whole.output_text


def test_logprobs_come_with_the_text_when_included(client: openai.OpenAI) -> None:
    """include message.output_text.logprobs and top_logprobs: the chat answer's, whole and in the stream's deltas."""
    chat = client.chat.completions.create(model=NAME, messages=HI, temperature=0, max_tokens=6, logprobs=True,
                                          top_logprobs=2)
    want = [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in chat.choices[0].logprobs.content]
    kw: dict[str, Any] = {"model": NAME, "input": "Hi", "temperature": 0, "max_output_tokens": 6,
                          "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = client.responses.create(**kw).output[0].content[0].logprobs
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in whole] == want
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    deltas = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    done = next(ev for ev in events if ev.type == "response.output_text.done").logprobs
    assert [(e.token, e.logprob) for e in deltas] == [(e.token, e.logprob) for e in done] == [w[:2] for w in want]


def test_a_json_schema_format_is_parsed(client: openai.OpenAI) -> None:
    got = client.responses.parse(model=NAME, input="Hi", max_output_tokens=40, text_format=Ok)
    assert got.status == "completed" and isinstance(got.output_parsed, Ok)
    with client.responses.stream(model=NAME, input="Hi", max_output_tokens=40, text_format=Ok) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(final.output_parsed, Ok)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "Hi", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"input": "Hi", "conversation": "conv_1"}, 400, "conversation"),  # state kestrel does not keep: refused
    ({"input": "Hi", "prompt": {"id": "pmpt_1"}}, 400, "prompt"),
    ({"input": "Hi", "background": True}, 400, "background"),  # nothing to retrieve later
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input.[0].content"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools.[0]"),
    ({"input": [{"type": "computer_call"}]}, 400, "input.[0]"),
    # an input item's fields as the API requires them, named as it names them
    ({"input": [{"role": "user", "content": "Hi"}, {**CALL, "arguments": {"city": "Paris"}}]}, 400,
     "input.[1].arguments"),
    ({"input": [{"role": "user", "content": "Hi"}, {k: v for k, v in CALL.items() if k != "call_id"}]}, 400,
     "input.[1].call_id"),
    ({"input": [{"role": "user", "content": "Hi"}, {k: v for k, v in CALL.items() if k != "name"}]}, 400,
     "input.[1].name"),
    ({"input": [{"type": "function_call_output", "output": "22 C"}]}, 400, "input.[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1"}]}, 400, "input.[0].output"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": {"oops": 1}}]}]}, 400,
     "input.[0].content.[0].text"),
    ({"input": [{"role": "user"}]}, 400, "input.[0].content"),
    ({"input": [{"type": "reasoning", "content": "x"}]}, 400, "input.[0].content"),  # a reasoning item's text parts
    ({"input": [{"type": "reasoning", "content": [{"type": "summary_text", "text": "x"}]}]}, 400,
     "input.[0].content.[0]"),
    ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text"}]}]}, 400, "input.[0].content.[0].text"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, 400, "input.[0].role"),
    ({"input": "hello " * 200}, 400, "input"),  # past tiny-qwen3's context: the prompt the input makes
    ({"input": "Hi", "model": "gpt-5"}, 404, "model"),
    ({"input": "Hi", "max_output_tokens": 0}, 400, "max_output_tokens"),  # the Responses API's names, not chat's
    ({"input": "Hi", "text": {"format": {"type": "wat"}}}, 400, "text.format.type"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {"type": "wat"}}}}, 400, "text.format"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"input": "Hi", "include": ["message.output_text.logprobs", "bogus"]}, 400, "include.[1]"),
    # a function tool's fields are the tool's own in this API (chat's sit under "function")
    ({"input": "Hi", "tools": [{**TOOL, "name": ""}]}, 400, "tools.[0].name"),
    ({"input": "Hi", "tools": [{**TOOL, "parameters": "x"}]}, 400, "tools.[0].parameters"),
])
def test_bad_requests_name_the_field(server: KestrelServer, body: dict[str, Any], status: int, param: str) -> None:
    got, _, raw = http("POST", f"{server.url}/v1/responses", body)
    error = json.loads(raw)["error"]
    assert got == status and error["param"] == param, error
    assert not {"max_tokens", "response_format"} & set(error["message"].replace(":", " ").split())  # chat's names


@pytest.mark.parametrize(("fields", "param"), [
    ({"context_management": [{"type": "compaction", "compact_threshold": 1000}]}, "context_management"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                       "tools": [{"type": "function", "name": "get_weather"}]}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice.name"),
])
def test_a_field_asking_for_what_kestrel_does_not_do_is_refused(client: openai.OpenAI, fields: dict[str, Any],
                                                                param: str) -> None:
    """As the chat route refuses its fields that ask for what kestrel does not answer with, the Responses API's own
    (the openai client's parameters) are a 400 naming the field, its message one line."""
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=NAME, input="Hi", max_output_tokens=2, **fields)
    assert info.value.body["param"] == param and "\n" not in info.value.body["message"], info.value.body


def test_fields_that_tune_openais_service_and_unknown_fields_are_ignored(client: openai.OpenAI) -> None:
    got = client.responses.create(model=NAME, input="Hi", max_output_tokens=2, service_tier="flex",
                                  prompt_cache_key="k", safety_identifier="u", context_management=[],
                                  include=["reasoning.encrypted_content"], extra_body={"not_a_field": 1})
    assert got.status == "incomplete" and got.usage.output_tokens == 2


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_cache_prewarm_reads_the_input_into_the_prefix_cache(client: openai.OpenAI, engine: Any,
                                                                     stream: bool) -> None:
    """prompt_cache_options.prewarm: the input is read into the prefix cache and nothing is generated (a completed
    response without output); the same input then attaches its blocks instead of computing them."""
    text = f"Prewarm ({stream}): " + "the quick brown fox jumps over the lazy dog " * 6
    kw: dict[str, Any] = {"model": NAME, "input": text, "max_output_tokens": 8,
                          "prompt_cache_options": {"prewarm": True, "ttl": "30m"}}
    hits = engine.pool.prefix_hit_tokens
    if stream:
        with client.responses.stream(**kw) as events:
            kinds = [e.type for e in events]
            got = events.get_final_response()
        assert kinds == ["response.created", "response.in_progress", "response.completed"]
    else:
        got = client.responses.create(**kw)
    assert (got.status, got.output, got.usage.output_tokens) == ("completed", [], 0)
    assert engine.pool.prefix_hit_tokens == hits  # nothing of it was cached before
    answer = client.responses.create(model=NAME, input=text, max_output_tokens=2)
    assert got.usage.input_tokens == answer.usage.input_tokens
    assert engine.pool.prefix_hit_tokens - hits >= engine.pool.block_size


def test_truncation_auto_drops_the_oldest_input_items(client: openai.OpenAI) -> None:
    """truncation "auto": a conversation past the model's context (tiny-qwen3's 256 tokens) keeps its latest
    items, as OpenAI's drops the oldest; "disabled" (the default) refuses it."""
    turns = [{"role": "user", "content": f"Turn {i}: " + "hello " * 20} for i in range(8)]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=NAME, input=turns, max_output_tokens=2)
    got = client.responses.create(model=NAME, input=turns, max_output_tokens=2, truncation="auto")
    assert got.truncation == "auto" and 0 < got.usage.input_tokens < 256


def test_nothing_is_stored(server: KestrelServer) -> None:
    for method in ("GET", "DELETE"):
        status, _, raw = http(method, f"{server.url}/v1/responses/resp_123")
        assert status == 404 and "stores no responses" in json.loads(raw)["error"]["message"]


def test_function_calls_reasoning_and_their_outputs(engine: Any) -> None:
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = THINKING_TEMPLATE
    try:
        front = Scripted(engine)
        with running_server(front, NAME) as server:
            client = openai_client(server)
            ask = [{"role": "user", "content": "Weather in Paris?"}]
            front.answers.append(f"<think>Paris is a city.</think>\n{PARIS}")
            got = client.responses.create(model=NAME, input=ask, tools=[TOOL], instructions="Use the tools.")
            assert [i.type for i in got.output] == ["reasoning", "function_call"] and got.status == "completed"
            reasoning, call = got.output
            assert reasoning.content[0].text == "Paris is a city."
            assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
            assert "<|im_start|>system\nUse the tools.<|im_end|>" in front.prompts[-1]
            front.answers.append(f"<think>Again.</think>\n{PARIS}")
            with client.responses.stream(model=NAME, input=ask, tools=[TOOL]) as stream:
                kinds = [e.type for e in stream]
                final = stream.get_final_response()
            assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
            assert [i.type for i in final.output] == ["reasoning", "function_call"]
            # the call and its output go back as the template writes them
            front.answers.append("Sunny.")
            history = [*ask, {"type": "function_call", "call_id": call.call_id, "name": "get_weather",
                              "arguments": call.arguments},
                       {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}]
            reply = client.responses.create(model=NAME, input=history, tools=[TOOL], reasoning={"effort": "none"})
            assert reply.output_text == "Sunny."
            prompt = front.prompts[-1]
            assert '"arguments": {"city": "Paris"}' in prompt and "<tool_response>\n22 C, sunny" in prompt
            assert prompt.rstrip().endswith("<think>\n\n</think>")  # effort none: enable_thinking false
            # text before a call is one assistant turn, as the chat route renders it; an output of text parts is
            # its text
            parts = [{"type": "input_text", "text": "22 C"}, {"type": "input_text", "text": "sunny"}]
            said = [*ask, {"role": "assistant", "content": "Let me check."}, *history[1:2],
                    {"type": "function_call_output", "call_id": call.call_id, "output": parts}]
            front.answers += ["Sunny.", "Sunny."]
            client.responses.create(model=NAME, input=said, tools=[TOOL])
            chat = [*ask, {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "22 C\nsunny"}]
            client.chat.completions.create(model=NAME, messages=chat, tools=[WEATHER])
            assert front.prompts[-2] == front.prompts[-1] and "Let me check.<tool_call>" in front.prompts[-1]
            front.answers += ["", ""]  # an empty answer: one empty message, whole or streamed
            empty = client.responses.create(model=NAME, input=ask)
            with client.responses.stream(model=NAME, input=ask) as stream:
                streamed = stream.get_final_response()
            assert [(i.type, i.content[0].text) for i in streamed.output] == \
                [(i.type, i.content[0].text) for i in empty.output] == [("message", "")]
            image = [*said[:-1], {**said[-1], "output": [{"type": "input_image", "image_url": "x"}]}]
            with pytest.raises(openai.BadRequestError) as refused:
                client.responses.create(model=NAME, input=image, tools=[TOOL])
            assert refused.value.body["param"] == "input.[3].output"
    finally:
        engine.tokenizer.chat_template = template
