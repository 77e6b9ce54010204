"""What OpenAI's clients read beyond the answer itself, through a real server and the official client: a prompt past
the context is OpenAI's ``context_length_exceeded`` (clients and agent frameworks recognise it by that code and by
"maximum context length" in the message, and shorten the conversation), and ``usage`` says how many of the prompt's
tokens came from the prefix cache (``prompt_tokens_details.cached_tokens``)."""

from __future__ import annotations

import openai
import pytest

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
