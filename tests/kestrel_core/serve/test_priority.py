"""vLLM's ``priority`` request field through a real server and the official openai client: under the default fcfs
policy any but 0 is a 400 in vLLM's words; under ``--scheduling-policy priority`` the chat, completions and Responses
routes queue each of the request's sequences (and echoed prompts' scorings) at it; one that is not an integer is a 400
naming it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from kestrel_core.model.async_engine import AsyncEngine

from .helpers import HI, openai_client, running_server

NAME = "tiny-qwen3"


@pytest.fixture(scope="module")
def prioritized(engine: Any) -> Iterator[tuple[AsyncEngine, openai.OpenAI]]:
    """The module's engine served again, under the priority policy: its front and a client of it."""
    front = AsyncEngine(engine, max_batch=8, policy="priority")
    with running_server(front, NAME) as server:
        yield front, openai_client(server)


def _ask(client: openai.OpenAI, route: str, **extra: Any) -> Any:
    if route == "chat":
        return client.chat.completions.create(model=NAME, messages=HI, max_tokens=2, extra_body=extra)
    if route == "completions":
        return client.completions.create(model=NAME, prompt="Hi", max_tokens=2, extra_body=extra)
    return client.responses.create(model=NAME, input="Hi", max_output_tokens=2, extra_body=extra)


ROUTES = ["chat", "completions", "responses"]


@pytest.mark.parametrize("route", ROUTES)
def test_fcfs_refuses_a_priority_as_vllm_does(client: openai.OpenAI, route: str) -> None:
    with pytest.raises(openai.BadRequestError, match="Got priority 3 but Priority scheduling is not enabled") as info:
        _ask(client, route, priority=3)
    assert info.value.body["param"] == "priority"
    assert _ask(client, route, priority=0)  # the default is taken


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("priority", ["1", 1.5, True, [1]])
def test_a_priority_that_is_not_an_integer_is_a_400_naming_it(
    prioritized: tuple[AsyncEngine, openai.OpenAI], route: str, priority: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _ask(prioritized[1], route, priority=priority)
    assert info.value.body["param"] == "priority"


def test_the_priority_policy_queues_every_sequence_at_the_request_priority(
    prioritized: tuple[AsyncEngine, openai.OpenAI], monkeypatch: pytest.MonkeyPatch
) -> None:
    front, client = prioritized
    added: list[tuple[str, int]] = []
    add = front.scheduler.add

    def recording(prompt_ids: Any, params: Any, request_id: Any = None, constraint: Any = None, priority: int = 0):
        added.append((type(params).__name__, priority))
        return add(prompt_ids, params, request_id, constraint, priority)

    monkeypatch.setattr(front.scheduler, "add", recording)
    chat = client.chat.completions.create(model=NAME, messages=HI, max_tokens=2, n=2, extra_body={"priority": -4})
    assert len(chat.choices) == 2 and added == [("SamplingParams", -4)] * 2
    added.clear()
    client.completions.create(
        model=NAME, prompt="Hi there", max_tokens=2, echo=True, logprobs=1, extra_body={"priority": 7}
    )
    assert added == [("Scoring", 7), ("SamplingParams", 7)]
    added.clear()
    assert _ask(client, "responses", priority=2).status in ("completed", "incomplete")
    assert added == [("SamplingParams", 2)]
    added.clear()
    _ask(client, "chat")
    assert added == [("SamplingParams", 0)]
