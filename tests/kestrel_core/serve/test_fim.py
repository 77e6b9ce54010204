"""Completions with a ``suffix`` (fill in the middle) through a real server and the official openai client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.fim import fim_prompt_ids
from kestrel_core.model.sampling import SamplingParams

from ..model.test_fim import TINY, fim_engine
from .helpers import openai_client, running_server

NAME = "fim-test"
PREFIX, SUFFIX = "def add(a, b):\n    return", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    with fim_engine() as e:
        yield e


@pytest.fixture(scope="module")
def async_engine(engine: Any) -> AsyncEngine:
    return AsyncEngine(engine, max_batch=4)


def test_a_suffix_fills_the_middle(client: openai.OpenAI, engine: Any) -> None:
    ids, stops = fim_prompt_ids(engine.tokenizer, PREFIX, SUFFIX)
    want = "".join(out.new_text for out in engine.stream(ids, SamplingParams(max_tokens=8, stop_token_ids=stops)))
    reply = client.completions.create(model=NAME, prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0)
    assert reply.usage.prompt_tokens == len(ids) and reply.choices[0].text == want
    plain = client.completions.create(model=NAME, prompt=PREFIX, max_tokens=8, temperature=0)
    assert plain.usage.prompt_tokens == len(engine.tokenizer.encode(PREFIX)) < len(ids)


def test_the_answer_ends_at_the_formats_padding_token(client: openai.OpenAI, engine: Any) -> None:
    pad = engine.tokenizer.backend.token_to_id("<|fim_pad|>")
    reply = client.completions.create(model=NAME, prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0,
                                      logit_bias={str(pad): 100})
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("stop", 1)
    plain = client.completions.create(model=NAME, prompt=PREFIX, max_tokens=8, temperature=0,
                                      logit_bias={str(pad): 100})
    assert (plain.choices[0].finish_reason, plain.usage.completion_tokens) == ("length", 8)  # not a stop there


@pytest.mark.parametrize("forced", ["eos", "<|fim_pad|>"])
def test_ignore_eos_goes_past_the_ends_of_text(client: openai.OpenAI, engine: Any, forced: str) -> None:
    """The model's end of text ends a middle as any answer (no stop token reported); with ignore_eos neither it
    nor the format's ends stop the answer, as llama.cpp's ignore_eos takes every end-of-generation token."""
    token = min(engine.eos_token_ids) if forced == "eos" else engine.tokenizer.backend.token_to_id(forced)
    kwargs: dict[str, Any] = {"model": NAME, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4, "temperature": 0,
                              "logit_bias": {str(token): 100}}
    ended = client.completions.create(**kwargs)
    assert (ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("stop", 1)
    assert ended.choices[0].model_extra["stop_reason"] == (None if forced == "eos" else token)
    past = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert (past.choices[0].finish_reason, past.usage.completion_tokens) == ("length", 4)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"prompt": [1, 2, 3]}, "needs text prompts"),
    ({"prompt": PREFIX, "echo": True}, "suffix and echo"),
])
def test_bad_suffix_requests_are_400(client: openai.OpenAI, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(openai.BadRequestError, match=match) as info:
        client.completions.create(model=NAME, suffix=SUFFIX, max_tokens=2, **kwargs)
    assert info.value.body["param"] == "suffix"


@pytest.mark.parametrize("kwargs", [{"prompt": [1, 2, 3]}, {"prompt": PREFIX, "echo": True}])
def test_an_empty_suffix_where_a_suffix_is_refused_is_a_plain_completion(client: openai.OpenAI,
                                                                        kwargs: dict[str, Any]) -> None:
    plain = client.completions.create(model=NAME, max_tokens=4, temperature=0, **kwargs)
    reply = client.completions.create(model=NAME, suffix="", max_tokens=4, temperature=0, **kwargs)
    assert reply.choices[0].text == plain.choices[0].text and reply.usage == plain.usage


def test_a_model_without_the_tokens_refuses_a_suffix_but_not_an_empty_one() -> None:
    with kestrel_core.load(str(TINY), backend="cpu") as engine, running_server(AsyncEngine(engine), "tiny") as server:
        client = openai_client(server)
        with pytest.raises(openai.BadRequestError, match="no fill-in-the-middle tokens"):
            client.completions.create(model="tiny", prompt="a", suffix="b", max_tokens=2)
        reply = client.completions.create(model="tiny", prompt="a", suffix="", max_tokens=2)
        assert reply.usage.prompt_tokens == len(engine.tokenizer.encode("a"))
