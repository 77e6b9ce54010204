"""The streamed chunks: DeltaEvents' bytes against encoding each chunk whole, and the usage the chunks carry."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kestrel_core.model.request import RequestOutput
from kestrel_core.model.sampling import TokenLogprob
from kestrel_core.serve.access import RequestRecord
from kestrel_core.serve.generation import DeltaEvents, _events, sse
from kestrel_core.serve.responses import ChatShape, CompletionShape, Echo, TokenStrings

from .helpers import Letters

TEXTS = ["", "a", ' "quoted" \\ back', "line\nbreak\ttab", "\u00e9\u4e2d\U0001f600", "\x00\x1f", "</script>",
         "\ue000kestrel"]


@pytest.mark.parametrize(("usage", "continuous"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("shape_type", [ChatShape, CompletionShape])
def test_delta_events_are_the_whole_chunks_bytes(shape_type: type, usage: bool, continuous: bool) -> None:
    events = DeltaEvents(shape_type("id-x", "m\"odel", TokenStrings(Letters()), include_usage=usage,
                                    continuous_usage=continuous))
    reference = shape_type("id-x", "m\"odel", TokenStrings(Letters()), include_usage=usage,
                           continuous_usage=continuous)
    reference.created = events.shape.created
    prompts = [7, 40]
    events.shape.start_usage(prompts)
    reference.start_usage(prompts)
    sent = [0, 0]
    for index in (0, 1, 0):
        for text in TEXTS:
            sent[index] += 3 + index
            events.shape.add_sent(index, 3 + index)
            reference.add_sent(index, 3 + index)
            got = events(text, None, index)
            assert got == sse(reference.delta_chunk(text, None, index))
            body = json.loads(got.decode()[len("data: "):])
            assert body["choices"][0]["index"] == index
            if continuous:  # the choice's own prompt and tokens so far
                p, c = prompts[index], sent[index]
                assert body["usage"] == {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
            else:
                assert body.get("usage", "absent") == (None if usage else "absent")
    entries = [TokenLogprob(0, -1.0, [(0, -1.0)])]
    assert events("a", entries, 0) == sse(reference.delta_chunk("a", entries, 0))  # logprobs: encoded whole


async def _outputs(outputs: list[RequestOutput]) -> AsyncIterator[RequestOutput]:
    for out in outputs:
        yield out


def _streamed(shape: Any, choices: list[list[RequestOutput]], prompt_tokens: int,
              choice_prompt_tokens: list[int]) -> list[dict[str, Any]]:
    """The chunks ``_events`` sends for these outputs of each choice (the first of each already read)."""
    async def run() -> list[bytes]:
        gens = [_outputs(outs[1:]) for outs in choices]
        return [e async for e in _events(gens, [outs[0] for outs in choices], shape, RequestRecord(),
                                         prompt_tokens, choice_prompt_tokens)]

    events = b"".join(asyncio.run(run())).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e[len("data: "):]) for e in events[:-2]]


def _out(ids: list[int], done: str | None = None) -> RequestOutput:
    return RequestOutput("r", ids, "".join(chr(ord("a") + i) for i in ids), None, done is not None, done, 5, 0)


# choice 0: a token, then three in one output (queued up while the stream was behind), then one and "length";
# choice 1: two tokens and "stop" at once
CHOICES = [[_out([1]), _out([2, 3, 4]), _out([5], "length")], [_out([1, 2], "stop")]]


@pytest.mark.parametrize("shape_type", [ChatShape, CompletionShape])
def test_continuous_usage_is_each_choices_own(shape_type: type) -> None:
    """As vLLM's: a chunk's usage is its choice's prompt and that choice's tokens sent so far (here two prompts,
    of 5 and 9 tokens, a choice each); the last chunk's, the request's."""
    echoes = [Echo("ab", 0, None), Echo("c", 2, None)]
    shape = (ChatShape("id-x", "m", TokenStrings(Letters()), include_usage=True, continuous_usage=True)
             if shape_type is ChatShape else
             CompletionShape("id-x", "m", TokenStrings(Letters()), True, echoes, continuous_usage=True))
    chunks = _streamed(shape, CHOICES, 14, [5, 9])
    firsts = [(0, 5, 0), (1, 9, 0)]  # (choice, prompt tokens, completion tokens so far): the roles, the echoes
    assert [(c["choices"][0]["index"], c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"])
            for c in chunks[:-1]] == \
        firsts + [(0, 5, 1), (1, 9, 2), (1, 9, 2), (0, 5, 4), (0, 5, 5), (0, 5, 5)]  # each finish repeats its count
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == \
        {"prompt_tokens": 14, "completion_tokens": 7, "total_tokens": 21, "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize(("usage", "continuous"), [(True, False), (False, True), (False, False)])
def test_without_continuous_usage_chunks_say_null_or_nothing(usage: bool, continuous: bool) -> None:
    shape = CompletionShape("id-x", "m", TokenStrings(Letters()), include_usage=usage, continuous_usage=continuous)
    chunks = _streamed(shape, CHOICES, 14, [5, 9])
    if usage:
        assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 7
    else:  # continuous_usage_stats alone is ignored, as vLLM does
        assert len(chunks) == 6 and all("usage" not in c for c in chunks)
