"""Anthropic's Messages API through a real server and the official ``anthropic`` client, against kestrel's own
OpenAI answers (greedy on tiny-qwen3); tool use and thinking from scripted answers over the real templates."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from kestrel_core.errors import Overloaded
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.kv_pool import BLOCK_SIZE
from kestrel_core.model.request import RequestOutput
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.serve.server import KestrelServer

from ..waits import wait_until
from .helpers import Scripted, http, running_server
from .tool_calls import PARIS, THINKING_TEMPLATE, WEATHER

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
NAME = "tiny"
HI = [{"role": "user", "content": "Hi"}]
GREEDY = {"extra_body": {"temperature": 0}}  # the current SDK no longer sends temperature itself
TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
CALL = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                         "input": {"city": "Paris"}}]}
RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "22 C"}]}


@pytest.fixture(scope="module")
def an(server: KestrelServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_a_message_is_the_openai_answer(an: anthropic.Anthropic, client: openai.OpenAI) -> None:
    want = client.chat.completions.create(model=NAME, messages=HI, temperature=0, max_tokens=10)
    got = an.messages.create(model=NAME, max_tokens=10, messages=HI, **GREEDY)
    assert [b.type for b in got.content] == ["text"] and got.content[0].text == want.choices[0].message.content
    assert (got.stop_reason, got.role, got.model) == ("max_tokens", "assistant", NAME)
    assert (got.usage.input_tokens, got.usage.output_tokens) == (want.usage.prompt_tokens, 10)
    assert an.messages.count_tokens(model=NAME, messages=HI).input_tokens == want.usage.prompt_tokens
    system = an.messages.count_tokens(model=NAME, messages=HI, system="Answer in French.").input_tokens
    assert system > want.usage.prompt_tokens


def test_a_stream_is_its_message_in_events(an: anthropic.Anthropic) -> None:
    whole = an.messages.create(model=NAME, max_tokens=10, messages=HI, **GREEDY)
    with an.messages.stream(model=NAME, max_tokens=10, messages=HI, **GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, 10)


def test_a_json_schema_output_shapes_the_answer(an: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    got = an.messages.create(model=NAME, max_tokens=40, messages=HI,
                             output_config={"format": {"type": "json_schema", "schema": schema}})
    assert got.stop_reason == "end_turn" and set(json.loads(got.content[0].text)) == {"ok"}


def test_a_last_assistant_turn_is_continued(an: anthropic.Anthropic, client: openai.OpenAI, engine: Any) -> None:
    """Anthropic's prefill: the answer continues the assistant's text, the template's end of turn after it
    dropped; the chat route does the same with vLLM's continue_final_message."""
    turns = [*HI, {"role": "assistant", "content": "Sure, here is "}]
    rendered = engine.tokenizer.apply_chat_template(turns, add_generation_prompt=False)
    prompt = rendered[:rendered.rindex("Sure, here is ") + len("Sure, here is ")]  # its trailing space kept
    assert rendered != prompt and prompt.endswith("Sure, here is ")
    want = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=8)
    got = an.messages.create(model=NAME, max_tokens=8, messages=turns, **GREEDY)
    assert got.content[0].text == want.choices[0].text and got.usage.input_tokens == want.usage.prompt_tokens
    assert an.messages.count_tokens(model=NAME, messages=turns).input_tokens == want.usage.prompt_tokens
    chat = client.chat.completions.create(model=NAME, messages=turns, temperature=0, max_tokens=8,
                                          extra_body={"continue_final_message": True})
    assert chat.choices[0].message.content == want.choices[0].text
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        client.chat.completions.create(model=NAME, messages=turns, max_tokens=8, extra_body={
            "continue_final_message": True, "add_generation_prompt": True})


@pytest.mark.parametrize(("body", "status", "kind", "needle"), [
    ({"model": "claude-sonnet-4-5", "max_tokens": 5, "messages": HI}, 404, "not_found_error", "claude-sonnet-4-5"),
    ({"model": NAME, "messages": HI}, 400, "invalid_request_error", "max_tokens"),
    ({"model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}]}]},
     400, "invalid_request_error", "'image' block"),
    ({"model": NAME, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error", "role"),
    # errors name Anthropic's fields, not the chat request's they become
    ({"model": NAME, "max_tokens": 5, "messages": HI, "stop_sequences": [""]}, 400, "invalid_request_error",
     "stop_sequences"),
    ({"model": NAME, "max_tokens": 5, "messages": HI, "tool_choice": {"type": "tool"}}, 400,
     "invalid_request_error", "tool_choice.name is required"),
    ({"model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": []}]}, 400, "invalid_request_error",
     "messages.[0].content must hold at least one block"),
    # what Anthropic's API refuses and the chat request would take
    ({"model": NAME, "max_tokens": 5, "messages": HI, "temperature": 1.5}, 400, "invalid_request_error",
     "temperature: range: 0..1"),
    ({"model": NAME, "max_tokens": 5, "messages": HI, "temperature": -0.5}, 400, "invalid_request_error",
     "temperature: range: 0..1"),
    ({"model": NAME, "max_tokens": 5, "messages": HI, "top_p": 1.5}, 400, "invalid_request_error",
     "top_p: range: 0..1"),
    ({"model": NAME, "max_tokens": 5, "messages": HI, "top_k": -1}, 400, "invalid_request_error",
     "top_k: must be at least 0"),
    ({"model": NAME, "max_tokens": 5, "messages": HI, "stop_sequences": ["\n"]}, 400, "invalid_request_error",
     "stop_sequences: each stop sequence must contain non-whitespace"),
    ({"model": NAME, "max_tokens": 5, "messages": HI, "thinking": {"type": "enabled"}}, 400, "invalid_request_error",
     "thinking.enabled.budget_tokens: Field required"),
    ({"model": NAME, "max_tokens": 5, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 512}}, 400,
     "invalid_request_error", "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"),
    ({"model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": ""}, {"role": "assistant",
                                                                                   "content": "x"}, *HI]},
     400, "invalid_request_error", "messages.[0]: all messages must have non-empty content"),
    ({"model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "invalid_request_error", "messages.[0].content.[0].text: Field required"),
    ({"model": NAME, "max_tokens": 5, "messages": HI, "system": [{"type": "text"}]}, 400, "invalid_request_error",
     "system.[0].text: Field required"),
    ({"model": NAME, "max_tokens": 5, "messages": [*HI, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "input": {}}]}, RESULT]}, 400, "invalid_request_error",
     "messages.[1].content.[0].name: Field required"),
    ({"model": NAME, "max_tokens": 5, "messages": [*HI, CALL, {"role": "user", "content": [
        {"type": "tool_result", "content": "22 C"}]}]}, 400, "invalid_request_error",
     "messages.[2].content.[0].tool_use_id: Field required"),
    ({"model": NAME, "max_tokens": 5, "messages": [*HI, CALL]}, 400, "invalid_request_error",
     "messages.[1]: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_1."),
    ({"model": NAME, "max_tokens": 5, "messages": [*HI, CALL, *HI]}, 400, "invalid_request_error",
     "messages.[1]: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_1."),
    ({"model": NAME, "max_tokens": 5, "messages": [*HI, CALL, RESULT, {"role": "assistant", "content": "x"}, RESULT]},
     400, "invalid_request_error", "messages.[4].content.[0]: unexpected `tool_use_id` found in `tool_result` blocks: "
     "toolu_1."),
])
def test_bad_requests_get_anthropics_error(server: KestrelServer, body: dict[str, Any], status: int, kind: str,
                                           needle: str) -> None:
    got, _, raw = http("POST", f"{server.url}/v1/messages", body)
    error = json.loads(raw)
    assert got == status and error["type"] == "error" and error["error"]["type"] == kind
    assert needle in error["error"]["message"]


def test_calls_answered_in_the_next_turn_are_taken(an: anthropic.Anthropic) -> None:
    """Anthropic's consecutive messages of one role are one turn: results in two user messages answer the calls of
    two assistant messages before them."""
    second = {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}
    messages = [*HI, CALL, {"role": "assistant", "content": [second]}, RESULT, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "18 C"}, {"type": "text", "text": "And?"}]}]
    assert an.messages.count_tokens(model=NAME, messages=messages).input_tokens > 0


def test_a_client_that_leaves_a_stream_frees_its_sequence(an: anthropic.Anthropic, async_engine: AsyncEngine,
                                                          engine: Any) -> None:
    with an.messages.stream(model=NAME, max_tokens=200, messages=HI, **GREEDY) as stream:
        events = iter(stream)
        for _ in range(4):
            next(events)
        assert async_engine.num_running == 1
    wait_until(lambda: not async_engine.num_running and engine.pool.free_blocks == engine.pool.num_blocks,
               "the sequence freed")


def test_the_api_key_is_read_from_x_api_key(engine: Any) -> None:
    with running_server(AsyncEngine(engine), NAME, api_key="sekrit") as server:
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
                model=NAME, max_tokens=2, messages=HI)
        keyed = anthropic.Anthropic(base_url=server.url, api_key="sekrit", max_retries=0)
        assert keyed.messages.create(model=NAME, max_tokens=2, messages=HI, **GREEDY).usage.output_tokens == 2


class Full(Scripted):
    """Scripted answers, the next ``refusals`` requests refused as a server at capacity refuses them."""

    refusals = 0

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None, places: Any = None,
                       priority: int = 0, constraint: Any = None) -> AsyncIterator[RequestOutput]:
        if self.refusals:
            self.refusals -= 1
            raise Overloaded("the server is at capacity (1 requests in flight); retry later")
        async for out in super().generate(prompt_ids, params, request_id, places, priority, constraint):
            yield out


def test_a_server_at_capacity_is_anthropics_529_which_the_sdk_retries(engine: Any) -> None:
    """Anthropic's API answers a request it cannot take now with 529 overloaded_error (its 429 is an account's
    rate limit); the SDK retries it after Retry-After. The OpenAI routes keep their 429."""
    front = Full(engine)
    with running_server(front, NAME) as server:
        once = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        for stream in (False, True):
            front.refusals = 1
            with pytest.raises(anthropic.OverloadedError) as info:
                once.messages.create(model=NAME, max_tokens=5, messages=HI, stream=stream)
            assert info.value.body["error"]["type"] == "overloaded_error"
            assert info.value.response.headers["retry-after"] == "1"
        front.refusals, front.answers = 1, ["Hello."]
        retrying = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=1)
        assert retrying.messages.create(model=NAME, max_tokens=5, messages=HI).content[0].text == "Hello."
        front.refusals = 1
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0).chat.completions.create(
                model=NAME, messages=HI, max_tokens=5)


def test_tool_use_and_thinking_blocks(engine: Any) -> None:
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = THINKING_TEMPLATE
    try:
        front = Scripted(engine)
        with running_server(front, NAME) as server:
            an = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
            ask = [{"role": "user", "content": "Weather in Paris?"}]
            front.answers.append(f"<think>Paris is a city.</think>\n{PARIS}")
            got = an.messages.create(model=NAME, max_tokens=100, messages=ask, tools=[TOOL])
            assert [b.type for b in got.content] == ["thinking", "tool_use"] and got.stop_reason == "tool_use"
            thought, call = got.content
            assert thought.thinking == "Paris is a city." and (call.name, call.input) == ("get_weather",
                                                                                        {"city": "Paris"})
            front.answers.append(f"<think>Again.</think>\n{PARIS}")
            with an.messages.stream(model=NAME, max_tokens=100, messages=ask, tools=[TOOL]) as stream:
                final = stream.get_final_message()
            assert [b.type for b in final.content] == ["thinking", "tool_use"]
            assert final.content[0].thinking == "Again." and final.content[1].input == {"city": "Paris"}
            assert final.stop_reason == "tool_use"
            # the call and its result go back as the template writes them
            front.answers.append("Sunny.")
            history = [*ask, {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Paris is a city.", "signature": ""},
                {"type": "tool_use", "id": call.id, "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": "22 C, sunny"}]}]
            reply = an.messages.create(model=NAME, max_tokens=100, messages=history, tools=[TOOL],
                                       thinking={"type": "disabled"})
            assert reply.content[0].text == "Sunny." and reply.stop_reason == "end_turn"
            prompt = front.prompts[-1]
            assert '"arguments": {"city": "Paris"}' in prompt and "<tool_response>\n22 C, sunny" in prompt
            assert prompt.rstrip().endswith("<think>\n\n</think>")  # thinking disabled: enable_thinking false
    finally:
        engine.tokenizer.chat_template = template


@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}, {"type": "auto"}])
def test_a_call_stops_with_tool_use_whatever_chose_it(engine: Any, tool_choice: dict[str, Any]) -> None:
    """Anthropic's answer that ends in calls is ``tool_use``, a forced tool's too (the OpenAI answer it is made from,
    a named function's, finishes with "stop"), whole and streamed."""
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = THINKING_TEMPLATE
    try:
        front = Scripted(engine)
        with running_server(front, NAME) as server:
            an = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
            ask = {"model": NAME, "max_tokens": 100, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                   "tools": [TOOL], "tool_choice": tool_choice, "thinking": {"type": "disabled"}}
            front.answers += [PARIS, PARIS]
            got = an.messages.create(**ask)
            with an.messages.stream(**ask) as stream:
                final = stream.get_final_message()
            for message in (got, final):
                assert [b.type for b in message.content] == ["tool_use"] and message.stop_reason == "tool_use"
    finally:
        engine.tokenizer.chat_template = template


def test_a_stop_sequence_is_named(an: anthropic.Anthropic, client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "The quick brown fox"}]  # tiny-qwen3 answers it with two characters
    text = an.messages.create(model=NAME, max_tokens=12, messages=ask, **GREEDY).content[0].text
    stop = next(c for c in text if c != text[0])
    plain = client.chat.completions.create(model=NAME, messages=ask, temperature=0, max_tokens=12, stop=[stop])
    assert plain.choices[0].model_extra["stop_reason"] == stop  # vLLM's field: what stopped it
    got = an.messages.create(model=NAME, max_tokens=12, messages=ask, stop_sequences=[stop, "zzz"], **GREEDY)
    assert (got.stop_reason, got.stop_sequence) == ("stop_sequence", stop)
    assert got.content[0].text == plain.choices[0].message.content == text[:text.index(stop)]
    with an.messages.stream(model=NAME, max_tokens=12, messages=ask, stop_sequences=[stop], **GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    whole = an.messages.create(model=NAME, max_tokens=12, messages=ask, **GREEDY)
    assert (whole.stop_reason, whole.stop_sequence) == ("max_tokens", None)


# MiniMax-M2's way: parts looped over, joined with nothing between; strings written as they are
PARTS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
                  "{% for p in m.content %}{{ p.text }}|{% endfor %}{% endif %}{% endfor %}")


def test_text_parts_reach_a_template_that_loops_over_them_on_every_api(engine: Any) -> None:
    """OpenAI's content parts, Anthropic's text blocks and the Responses API's input parts stay parts for such a
    template (as transformers and vLLM pass them); consecutive Anthropic turns of one role are one turn."""
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = PARTS_TEMPLATE
    try:
        front = Scripted(engine)
        with running_server(front, NAME) as server:
            chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            an = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
            parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
            front.answers += ["x", "x", "x"]
            chat.chat.completions.create(model=NAME, max_tokens=4, messages=[{"role": "user", "content": parts}])
            an.messages.create(model=NAME, max_tokens=4, messages=[
                {"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}])
            chat.responses.create(model=NAME, max_output_tokens=4, input=[{"role": "user", "content": [
                {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}])
            assert front.prompts == ["<user>a|b|", "<user>a|b|<assistant>c<user>d", "<user>a|b|"]
    finally:
        engine.tokenizer.chat_template = template


def test_a_stop_at_the_contexts_end_is_not_a_max_tokens_stop(an: anthropic.Anthropic, engine: Any) -> None:
    """Asking again would not get past it: model_context_window_exceeded, whole and streamed."""
    kwargs: dict[str, Any] = {"model": NAME, "max_tokens": 5000, "messages": HI,
                              "extra_body": {"temperature": 0, "ignore_eos": True}}
    whole = an.messages.create(**kwargs)
    assert whole.usage.input_tokens + whole.usage.output_tokens == engine.config.max_position
    assert whole.stop_reason == "model_context_window_exceeded"
    with an.messages.stream(**kwargs) as stream:
        assert stream.get_final_message().stop_reason == "model_context_window_exceeded"
    assert an.messages.create(**{**kwargs, "max_tokens": 3}).stop_reason == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_reads_the_prompt_and_answers_nothing(an: anthropic.Anthropic, stream: bool) -> None:
    counted = an.messages.count_tokens(model=NAME, messages=HI).input_tokens
    if stream:
        with an.messages.stream(model=NAME, max_tokens=0, messages=HI) as s:
            message = s.get_final_message()
    else:
        message = an.messages.create(model=NAME, max_tokens=0, messages=HI)
    assert (message.content, message.stop_reason) == ([], "max_tokens")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (counted, 0)


def test_an_empty_final_assistant_message_is_no_turn(an: anthropic.Anthropic) -> None:
    """Anthropic's optional empty final assistant message: the prompt is the one without it."""
    alone = an.messages.count_tokens(model=NAME, messages=HI).input_tokens
    for empty in ("", [{"type": "text", "text": ""}]):
        messages = [*HI, {"role": "assistant", "content": empty}]
        assert an.messages.count_tokens(model=NAME, messages=messages).input_tokens == alone
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        an.messages.create(model=NAME, max_tokens=2, messages=[*HI, {"role": "assistant", "content": "  "}])


def test_errors_have_anthropics_types_and_field_names(an: anthropic.Anthropic, server: KestrelServer) -> None:
    with pytest.raises(anthropic.BadRequestError, match=r"tools\.\[0\]\.input_schema"):
        an.messages.create(model=NAME, max_tokens=2, messages=HI, tool_choice={"type": "any"},
                           tools=[{"name": "f", "input_schema": {"type": "object", "properties": 5}}])
    foreign = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                                  default_headers={"Origin": "https://elsewhere.example"})
    with pytest.raises(anthropic.PermissionDeniedError) as caught:
        foreign.messages.create(model=NAME, max_tokens=2, messages=HI)
    assert caught.value.body["error"]["type"] == "permission_error"


CONTEXT = 256  # tiny-qwen3's
LONG = [{"role": "user", "content": "hi " * 300}]


def _too_long(caught: pytest.ExceptionInfo[anthropic.BadRequestError], tokens: int, maximum: int) -> None:
    """Anthropic's error for a prompt past the context, which Claude Code matches to compact the conversation."""
    assert caught.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": f"prompt is too long: {tokens} tokens > {maximum} maximum"}}


@pytest.mark.parametrize(("max_tokens", "stream"), [(5, False), (5, True), (0, False)])
def test_a_prompt_past_the_context_is_anthropics_prompt_is_too_long(an: anthropic.Anthropic, max_tokens: int,
                                                                    stream: bool) -> None:
    tokens = an.messages.count_tokens(model=NAME, messages=LONG).input_tokens
    assert tokens > CONTEXT
    with pytest.raises(anthropic.BadRequestError) as caught:
        an.messages.create(model=NAME, max_tokens=max_tokens, messages=LONG, stream=stream)
    _too_long(caught, tokens, CONTEXT)


def test_a_prompt_that_fills_the_context_is_one_token_too_long(an: anthropic.Anthropic) -> None:
    """It leaves no room for an answer: the longest prompt taken is a token shorter than the context."""
    def tokens(text: str) -> int:
        return an.messages.count_tokens(model=NAME, messages=[{"role": "user", "content": text}]).input_tokens

    fills = next(text for k in range(100, 130) for text in ("hi " * k, "hi" * k) if tokens(text) == CONTEXT)
    with pytest.raises(anthropic.BadRequestError) as caught:
        an.messages.create(model=NAME, max_tokens=5, messages=[{"role": "user", "content": fills}])
    _too_long(caught, CONTEXT, CONTEXT - 1)


def _hits(server: KestrelServer) -> int:
    """The prefix cache's hits so far (its metric)."""
    key = f'kestrel_prefix_cache_hit_tokens_total{{model="{NAME}"}}'
    lines = http("GET", f"{server.url}/metrics")[2].decode().splitlines()
    return int(float(next(line.rsplit(" ", 1)[1] for line in lines if line.startswith(key + " "))))


def _inputs(usage: Any) -> tuple[int, int, int]:
    return usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens


def test_usage_counts_cache_reads_apart_from_the_input(an: anthropic.Anthropic, server: KestrelServer) -> None:
    """As Anthropic's: input_tokens leaves out the prompt tokens read from the cache (cache_read_input_tokens, the
    prefix cache's hits), and the three input counts add up to the prompt's tokens, whole, streamed (message_start
    and message_delta) and for max_tokens 0; the cache fills implicitly, so nothing is written to it on request
    (cache_creation_input_tokens 0; a cache_control breakpoint is ignored). count_tokens stays the whole prompt's."""
    messages = [{"role": "user", "content": "A prompt of several blocks that the Anthropic route sends twice. " * 4}]
    total = an.messages.count_tokens(model=NAME, messages=messages).input_tokens
    blocks = (total - 1) // BLOCK_SIZE * BLOCK_SIZE  # a prompt sent again: its full blocks short of its last token
    assert blocks > 0
    before = _hits(server)
    first = an.messages.create(model=NAME, max_tokens=2, messages=messages, **GREEDY)
    read = _hits(server) - before
    assert _inputs(first.usage) == (total - read, read, 0)
    marked = [{"role": "user", "content": [{"type": "text", "text": messages[0]["content"],
                                             "cache_control": {"type": "ephemeral"}}]}]  # Claude Code's breakpoints
    again = an.messages.create(model=NAME, max_tokens=2, messages=marked, **GREEDY)  # the same prompt
    assert _inputs(again.usage) == (total - blocks, blocks, 0)
    with an.messages.stream(model=NAME, max_tokens=2, messages=messages, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start").message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    assert _inputs(start) == _inputs(delta) == _inputs(final.usage) == (total - blocks, blocks, 0)
    assert delta.output_tokens == final.usage.output_tokens == again.usage.output_tokens
    warmed = an.messages.create(model=NAME, max_tokens=0, messages=messages)
    assert _inputs(warmed.usage) == (total - blocks, blocks, 0)
    assert an.messages.count_tokens(model=NAME, messages=messages).input_tokens == total
