"""A hybrid model (Qwen3.5: linear attention beside gated attention) served: concurrent chat requests, each with
its own recurrent state, answer as each does alone, streamed or not, and the server says it shares no prefix."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

import kestrel_core

from .conftest import FIXTURES

NAME = "tiny-qwen3_5"


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3_5"), backend="cpu") as e:
        yield e


def _ask(client: openai.OpenAI, text: str, stream: bool = False) -> str:
    messages = [{"role": "user", "content": text}]
    if stream:
        chunks = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0,
                                                stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0)
    return out.choices[0].message.content or ""


def test_concurrent_requests_answer_as_each_alone(client: openai.OpenAI, engine: Any) -> None:
    texts = [f"question {i}: " + "the zen of python " * (i + 1) for i in range(6)]
    alone = [_ask(client, t) for t in texts]
    assert len(set(alone)) > 1  # different prompts, different answers
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda t: _ask(client, t[1], stream=t[0] % 2 == 1), enumerate(texts)))
    assert together == alone
    assert engine.prefix_cache and engine.pool.states is not None


def test_a_repeated_prompt_starts_from_the_state_the_first_left(client: openai.OpenAI, engine: Any) -> None:
    """The same conversation twice: the second attaches the first's whole blocks and the recurrent state kept at
    their end, and gives the same answer."""
    text = "tell me about the zen of python " * 4
    hits = engine.pool.prefix_hit_tokens
    first, second = _ask(client, text), _ask(client, text)
    assert first == second and engine.pool.prefix_hit_tokens > hits
