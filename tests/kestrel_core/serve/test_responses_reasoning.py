"""Reasoning answers through the Responses API (and the chat route it retells), with the official openai client:
the reasoning tokens in the usage. The answers are scripted in the model's own tokens (``Spoken``), each part of
them tokenized apart, so that which tokens are the reasoning's and which a message's is known."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

import kestrel_core

from .helpers import HI, Spoken, openai_client, running_server
from .test_tool_calls import HARMONY_TEMPLATE, THINKING_TEMPLATE

NAME = "tiny"
# answers as the texts their tokens come from; which of them are the reasoning, which the messages
THINK = ["<think>", "\nWeigh it up.\n", "</think>", "\n\nParis."]
CUT = ["<think>", "\nStill weighing it"]  # max_tokens ends it inside the block
HARMONY = ["<|channel|>analysis<|message|>", "Look it up.", "<|end|><|start|>assistant<|channel|>commentary<|message|>",
           "Let me look.", "<|end|><|start|>assistant<|channel|>analysis<|message|>", "Found it.",
           "<|end|><|start|>assistant<|channel|>final<|message|>", "Paris.", "<|return|>"]
ANSWERS = {"think": ("think", THINK, [1], [3], "stop"), "cut": ("think", CUT, [1], [], "length"),
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
