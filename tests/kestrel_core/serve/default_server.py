"""The test_app modules' engine: the default model on the CPU as a module's ``engine`` and ``async_engine`` fixtures
(the serve conftest's ``server`` serves it as NAME), and a short greedy chat request.

A module imports the fixtures by their function names; pytest knows them by the names they take (``engine``,
``async_engine``, so a test's argument does not shadow an import). Module-scoped: each module that imports them
loads the model once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine

from .helpers import HI

NAME = "smol-test"


@pytest.fixture(scope="module", name="engine")
def default_engine() -> Iterator[Any]:
    with kestrel_core.load(None, backend="cpu") as e:
        yield e


@pytest.fixture(scope="module", name="async_engine")
def default_async_engine(engine: Any) -> AsyncEngine:
    return AsyncEngine(engine, max_batch=16)


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]] = HI, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=NAME, messages=messages, **kw)
