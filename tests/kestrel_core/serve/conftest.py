"""The server fixtures a test module shares: its ``async_engine`` fixture served as its ``NAME``, and a client."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.serve.server import KestrelServer

from .helpers import openai_client, running_server

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"


@pytest.fixture(autouse=True)
def serve_logger_as_found() -> Iterator[None]:
    """``kestrel serve`` run in the test process sets up the ``kestrel.serve`` logger (its own stderr handler, no
    propagation): put it back after each test, so that the tests after it still see its records through caplog."""
    logger = logging.getLogger("kestrel.serve")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    """tiny-qwen3 on the CPU (a module may serve another engine: its own ``engine`` fixture)."""
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3"), backend="cpu") as e:
        yield e


@pytest.fixture(scope="module")
def async_engine(engine: Any) -> AsyncEngine:
    return AsyncEngine(engine, max_batch=8)


@pytest.fixture(scope="module")
def server(async_engine: AsyncEngine, request: pytest.FixtureRequest) -> Iterator[KestrelServer]:
    with running_server(async_engine, request.module.NAME) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: KestrelServer) -> openai.OpenAI:
    return openai_client(server)
