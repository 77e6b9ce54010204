"""Where clients written for OpenAI's API expect what OpenAI does, through a real server and the official client: a
prompt past the context is OpenAI's ``context_length_exceeded`` (clients and agent frameworks recognise it by that code
and by "maximum context length" in the message, and shorten the conversation), ``usage`` says how many of the prompt's
tokens came from the prefix cache (``prompt_tokens_details.cached_tokens``), and a ``top_p`` of 0 is taken."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from kestrel_core.model.kv_pool import BLOCK_SIZE
from kestrel_core.serve.server import KestrelServer

from .helpers import http

NAME = "tiny-qwen3"
CONTEXT = 256  # tiny-qwen3's
LONG = "hi " * 300  # past the context


def _context_error(caught: pytest.ExceptionInfo[openai.BadRequestError], param: str) -> None:
    error = caught.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    assert error["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens."), error


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_past_the_context_is_context_length_exceeded(client: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": LONG}], max_tokens=2,
                                       stream=stream)
    _context_error(caught, "messages")


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_past_the_context_is_context_length_exceeded(client: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=NAME, prompt=LONG, max_tokens=2, stream=stream)
    _context_error(caught, "prompt")


def test_a_prompt_that_fills_the_context_is_context_length_exceeded(client: openai.OpenAI) -> None:
    """A prompt of the context's length leaves no room for an answer: the same error, which says so."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=NAME, prompt=[5] * CONTEXT, max_tokens=2)
    _context_error(caught, "prompt")
    assert "no room for an answer" in caught.value.body["message"]


def test_an_input_past_the_context_is_context_length_exceeded(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=NAME, input=["a", LONG])
    _context_error(caught, "input")


def _hits(server: KestrelServer) -> int:
    """The prefix cache's hits so far (its metric)."""
    key = f'kestrel_prefix_cache_hit_tokens_total{{model="{NAME}"}}'
    lines = http("GET", f"{server.url}/metrics")[2].decode().splitlines()
    return int(float(next(line.rsplit(" ", 1)[1] for line in lines if line.startswith(key + " "))))


def _cached(usage: Any) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(client: openai.OpenAI, server: KestrelServer) -> None:
    """A prompt sent again finds its full blocks short of its last token in the prefix cache: the usage says how
    many tokens those are, as the cache's hits count them, whole or streamed, on both routes."""
    messages = [{"role": "system", "content": "A system prompt of several blocks. " * 6},
                {"role": "user", "content": "Hi"}]
    before = _hits(server)
    first = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    assert _cached(first.usage) == _hits(server) - before
    again = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    blocks = (first.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert blocks > 0 and _cached(again.usage) == blocks
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert _cached(chunks[-1].usage) == blocks
    prompt = "Another prompt, one of a few blocks, sent twice. " * 5
    client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    text = client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    assert _cached(text.usage) == (text.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    response = client.responses.create(model=NAME, input=messages, max_output_tokens=2)
    assert response.usage.input_tokens_details.cached_tokens == blocks


def test_the_choices_of_a_prompt_count_its_cached_tokens_once(client: openai.OpenAI, server: KestrelServer) -> None:
    """``n`` choices compute their prompt once (the others attach its blocks): the usage counts the prompt once, and
    the tokens of it the cache held when it was computed."""
    prompt = "A prompt no other test sends, of a few blocks. " * 5
    fresh = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, n=3)
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, n=3)
    assert _cached(fresh.usage) == 0
    assert _cached(again.usage) == (again.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > 0


def test_a_top_p_of_0_keeps_the_most_likely_token(client: openai.OpenAI) -> None:
    """OpenAI (and llama.cpp, and Ollama) take a ``top_p`` of 0: the nucleus is the most likely token alone, so the
    answer at any temperature and seed is the greedy one."""
    messages = [{"role": "user", "content": "Name a colour."}]
    greedy = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    for seed in (1, 2):
        nucleus = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=1.5,
                                                 top_p=0, seed=seed)
        assert nucleus.choices[0].message.content == greedy.choices[0].message.content
    text = client.completions.create(model=NAME, prompt="Colours:", max_tokens=8, temperature=0)
    nucleus_text = client.completions.create(model=NAME, prompt="Colours:", max_tokens=8, top_p=0, seed=3)
    assert nucleus_text.choices[0].text == text.choices[0].text
