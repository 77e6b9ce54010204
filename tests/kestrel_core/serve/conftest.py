"""The server fixtures a test module shares: its ``async_engine`` fixture served as its ``NAME``, and a client."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.serve.server import KestrelServer

from .helpers import openai_client, running_server


@pytest.fixture(scope="module")
def server(async_engine: AsyncEngine, request: pytest.FixtureRequest) -> Iterator[KestrelServer]:
    with running_server(async_engine, request.module.NAME) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: KestrelServer) -> openai.OpenAI:
    return openai_client(server)
