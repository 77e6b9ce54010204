"""Reasoning answers through the Responses API (and the chat route it retells), with the official openai client:
the output items of a reasoning block and of gpt-oss's channels, whole and streamed; the reasoning tokens in the
usage; each message's logprobs. The answers are scripted in the model's own tokens (``Spoken``), each part of them
tokenized apart, so that which tokens are the reasoning's and which a message's is known."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

import kestrel_core

from .helpers import HI, Spoken, http, openai_client, running_server
from .tool_calls import HARMONY_TEMPLATE, PARIS, THINKING_TEMPLATE, WEATHER

NAME = "tiny"
# answers as the texts their tokens come from; which of them are the reasoning, which the messages
THINK = ["<think>", "\nWeigh it up.\n", "</think>", "\n\n", "Paris."]
CUT = ["<think>", "\nStill weighing it"]  # max_tokens ends it inside the block
HARMONY = ["<|channel|>analysis<|message|>", "Look it up.", "<|end|><|start|>assistant<|channel|>commentary<|message|>",
           "Let me look.", "<|end|><|start|>assistant<|channel|>analysis<|message|>", "Found it.",
           "<|end|><|start|>assistant<|channel|>final<|message|>", "Paris.", "<|return|>"]
TOOL = {"type": "function", **WEATHER["function"]}
# answers whose messages' text shares its tokens' pieces with whitespace, and with calls
SAID = {"think": ("think", ["<think>", "\nWeigh it up.\n", "</think>", "\n\nParis."], None),
        "think and call": ("think", ["<think>", "\nWeigh it up.\n", "</think>", "\n\nLet me look.\n", PARIS], [TOOL]),
        "call between": ("think", ["Let me look.\n", PARIS, "\n\nDone."], [TOOL]),
        "harmony call": ("harmony", [*HARMONY[:4], "<|end|><|start|>assistant<|channel|>commentary to=functions."
                                     'get_weather <|constrain|>json<|message|>{"city": "Paris"}', "<|call|>"], [TOOL])}
ANSWERS = {"think": ("think", THINK, [1], [4], "stop"), "cut": ("think", CUT, [1], [], "length"),
           "harmony": ("harmony", HARMONY, [1, 5], [3, 7], "stop")}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, tuple[Spoken, openai.OpenAI]]]:
    with kestrel_core.load(None, backend="cpu") as think_engine, kestrel_core.load(None, backend="cpu") as gpt_oss:
        think_engine.tokenizer.chat_template = THINKING_TEMPLATE
        gpt_oss.tokenizer.chat_template = HARMONY_TEMPLATE
        think, harmony = Spoken(think_engine), Spoken(gpt_oss)
        with running_server(think, NAME) as a, running_server(harmony, NAME) as b:
            yield {"think": (think, openai_client(a)), "harmony": (harmony, openai_client(b))}


def _spoken(servers: dict[str, tuple[Spoken, openai.OpenAI]], case: str, per_step: int, times: int
            ) -> tuple[Spoken, openai.OpenAI, list[list[int]]]:
    """The server of ``case``, answering it ``times``, ``per_step`` tokens an output; the tokens of its pieces."""
    server, pieces, _, _, finish = ANSWERS[case]
    front, client = servers[server]
    front.answers, front.per_step, front.finish = [pieces] * times, per_step, finish
    return front, client, front.tokens(pieces)


def _streamed(client: openai.OpenAI, **kw: Any) -> Any:
    """The response a stream ends with (completed or incomplete)."""
    with client.responses.stream(**kw) as stream:
        return list(stream)[-1].response


@pytest.mark.parametrize("per_step", [1, 3])
@pytest.mark.parametrize("case", ANSWERS)
def test_the_usage_counts_the_reasoning_tokens(servers: dict[str, tuple[Spoken, openai.OpenAI]], case: str,
                                               per_step: int) -> None:
    """The tokens of the reasoning (between its markers, as vLLM's reasoning parsers count them), in the
    Responses API's output_tokens_details and chat's completion_tokens_details, whole and streamed."""
    front, client, tokens = _spoken(servers, case, per_step, 4)
    want = sum(len(tokens[i]) for i in ANSWERS[case][2])
    whole = client.responses.create(model=NAME, input="Hi")
    streamed = _streamed(client, model=NAME, input="Hi")
    chat = client.chat.completions.create(model=NAME, messages=HI)
    chunks = list(client.chat.completions.create(model=NAME, messages=HI, stream=True,
                                                 stream_options={"include_usage": True}))
    assert whole.usage.output_tokens == streamed.usage.output_tokens == sum(map(len, tokens))
    assert [whole.usage.output_tokens_details.reasoning_tokens, streamed.usage.output_tokens_details.reasoning_tokens,
            chat.usage.completion_tokens_details.reasoning_tokens,
            chunks[-1].usage.completion_tokens_details.reasoning_tokens] == [want] * 4


@pytest.mark.parametrize("per_step", [1, 3])
@pytest.mark.parametrize("case", ["think", "harmony"])
def test_a_messages_logprobs_are_its_own_tokens(servers: dict[str, tuple[Spoken, openai.OpenAI]], case: str,
                                                per_step: int) -> None:
    """include message.output_text.logprobs: each output_text part has the logprobs of the tokens of its text
    (the text after ``</think>``; a harmony message's body), not the reasoning's; whole, in the stream's deltas
    and in its done events."""
    front, client, tokens = _spoken(servers, case, per_step, 2)
    places = [list(range(sum(map(len, tokens[:i])), sum(map(len, tokens[:i + 1])))) for i in range(len(tokens))]
    want = [[-(k + 1) for k in places[i]] for i in ANSWERS[case][3]]  # Spoken's logprobs: -(place + 1) / 1000

    def thousandths(logprobs: Any) -> list[int]:
        return [round(e.logprob * 1000) for e in logprobs]

    kw: dict[str, Any] = {"model": NAME, "input": "Hi", "include": ["message.output_text.logprobs"]}
    whole = client.responses.create(**kw)
    assert [thousandths(i.content[0].logprobs) for i in whole.output if i.type == "message"] == want
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    messages = [e.item.id for e in events if e.type == "response.output_item.added" and e.item.type == "message"]
    deltas = [[lp for e in events if e.type == "response.output_text.delta" and e.item_id == m for lp in e.logprobs]
              for m in messages]
    done = [e.logprobs for e in events if e.type == "response.output_text.done"]
    assert [thousandths(d) for d in deltas] == [thousandths(d) for d in done] == want


@pytest.mark.parametrize("per_step", [1, 3])
@pytest.mark.parametrize("case", SAID)
def test_a_messages_logprobs_spell_its_text(servers: dict[str, tuple[Spoken, openai.OpenAI]], case: str,
                                            per_step: int) -> None:
    """include message.output_text.logprobs where the answer also holds reasoning, whitespace around its text and
    calls: a message's logprobs are those of the tokens of its text alone, each the answer's token at its place,
    and their tokens spell its output_text; whole, streamed, and in the stream's deltas."""
    server, pieces, tools = SAID[case]
    front, client = servers[server]
    front.answers, front.per_step, front.finish = [pieces] * 2, per_step, "stop"
    ids = [t for piece in front.tokens(pieces) for t in piece]
    kw: dict[str, Any] = {"model": NAME, "input": "Hi", "include": ["message.output_text.logprobs"], "top_logprobs": 1,
                          **({"tools": tools} if tools else {})}
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    deltas = [(e.token, e.logprob) for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    for response in (whole, events[-1].response):
        texts = [i.content[0] for i in response.output if i.type == "message"]
        assert texts and [t.text for t in texts] == ["".join(e.token for e in t.logprobs) for t in texts]
        entries = [e for t in texts for e in t.logprobs]
        places = [-round(e.logprob * 1000) - 1 for e in entries]  # Spoken's logprobs: -(place + 1) / 1000
        assert [e.token for e in entries] == [front.engine.tokenizer.decode([ids[p]]) for p in places]
    assert deltas == [(e.token, e.logprob) for e in entries]


def test_gpt_oss_messages_are_items_in_order_whole_and_streamed(
        servers: dict[str, tuple[Spoken, openai.OpenAI]]) -> None:
    """Analysis, a commentary preamble, more analysis, then the final message: an output item of each message in
    its order (as vLLM's Responses API makes them), the same whole and streamed; chat's message joins the
    preamble and the final message a line apart, as vLLM's chat route does."""
    front, client, _ = _spoken(servers, "harmony", 1, 4)
    whole = client.responses.create(model=NAME, input="Hi")
    streamed = _streamed(client, model=NAME, input="Hi")
    items = [[(i.type, i.content[0].text) for i in r.output] for r in (whole, streamed)]
    assert items[0] == items[1] == [("reasoning", "Look it up."), ("message", "Let me look."),
                                    ("reasoning", "Found it."), ("message", "Paris.")]
    message = client.chat.completions.create(model=NAME, messages=HI).choices[0].message
    deltas = [c.choices[0].delta for c in client.chat.completions.create(model=NAME, messages=HI, stream=True)
              if c.choices]
    streamed_chat = ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
                     "".join(d.content or "" for d in deltas))
    assert (message.reasoning_content, message.content) == streamed_chat == ("Look it up.\nFound it.",
                                                                             "Let me look.\nParis.")


@pytest.mark.parametrize(("answer", "kinds"), [
    (SAID["harmony call"][1], ["reasoning", "message", "function_call"]),  # reasoning, a preamble, a call
    (HARMONY, ["reasoning", "message", "reasoning", "message"]),  # analysis, preamble, analysis, final message
])
def test_an_answers_items_sent_back_render_as_its_chat_message(servers: dict[str, tuple[Spoken, openai.OpenAI]],
                                                              answer: list[str], kinds: list[str]) -> None:
    """gpt-oss's output items (a preamble a message item before the call's, as vLLM's Responses API makes them,
    whole and streamed) sent back as the input, as store: false agent loops send them, render without a 400 as the
    chat route renders its answer's message sent back: one assistant turn, its reasoning the analysis that the
    template shows before a call (the preamble it has no place for)."""
    front, client = servers["harmony"]
    final = ["<|channel|>final<|message|>", "Sunny.", "<|return|>"]
    front.answers, front.per_step, front.finish = [answer, answer, final, answer, final], 1, "stop"
    got = client.responses.create(model=NAME, input=HI, tools=[TOOL])
    streamed = _streamed(client, model=NAME, input=HI, tools=[TOOL])
    assert [i.type for i in got.output] == [i.type for i in streamed.output] == kinds
    items: list[Any] = [*HI, *(i.model_dump(exclude_none=True) for i in got.output)]
    call = next((i for i in got.output if i.type == "function_call"), None)
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "22 C"} if call
                 else {"role": "user", "content": "Thanks."})
    assert client.responses.create(model=NAME, input=items, tools=[TOOL]).output_text == "Sunny."
    sent_back = front.prompts[-1]
    message = client.chat.completions.create(model=NAME, messages=HI, tools=[WEATHER]).choices[0].message
    history = [*HI, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "22 C"} if call
               else {"role": "user", "content": "Thanks."}]
    client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER])
    assert sent_back == front.prompts[-1]
    analysis = "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant to=functions.get_weather"
    assert (analysis in sent_back) == bool(call)


@pytest.mark.parametrize("case", ANSWERS)
def test_every_event_and_response_is_the_sdks_own(servers: dict[str, tuple[Spoken, openai.OpenAI]],
                                                  case: str) -> None:
    """Each event of a stream and each whole response validates as the openai SDK's strict models; a reasoning
    item's reasoning_text deltas come between content_part.added and content_part.done of its reasoning_text part,
    as a message's output_text deltas do."""
    front, client, _ = _spoken(servers, case, 1, 2)
    url = f"{str(client.base_url).rstrip('/')}/responses"
    body = {"model": NAME, "input": "Hi", "include": ["message.output_text.logprobs"]}
    status, _, raw = http("POST", url, {**body, "stream": True})
    events = [json.loads(line[len("data: "):]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event, strict=True)
    status_whole, _, whole = http("POST", url, body)
    Response.model_validate(json.loads(whole), strict=True)
    assert status == status_whole == 200
    reasoning = next(e["item"]["id"] for e in events if e["type"] == "response.output_item.added"
                     and e["item"]["type"] == "reasoning")
    kinds = [e["type"] for e in events if e.get("item_id", e.get("item", {}).get("id")) == reasoning]
    deltas = kinds.count("response.reasoning_text.delta")
    assert deltas and kinds == ["response.output_item.added", "response.content_part.added",
                                *["response.reasoning_text.delta"] * deltas, "response.reasoning_text.done",
                                "response.content_part.done", "response.output_item.done"]
    parts = [e["part"] for e in events if e["type"].startswith("response.content_part") and e["item_id"] == reasoning]
    assert [p["type"] for p in parts] == ["reasoning_text"] * 2 and parts[1]["text"] and not parts[0]["text"]
