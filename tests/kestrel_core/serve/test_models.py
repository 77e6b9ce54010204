"""A server of several models (a chat model and an embedding model, as retrieval setups run them): each request
goes to the model it names, the first answers requests that name none, every API lists them all."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import numpy as np
import ollama
import openai
import pytest

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.serve.server import KestrelServer, build_server

from ..waits import HANG_GUARD_S
from .helpers import http, openai_client

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Any]]:
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3"), backend="cpu") as chat, \
            kestrel_core.load(str(FIXTURES / "tiny-qwen3-embed"), backend="cpu") as embed:
        yield {"chat": chat, "embed": embed}


@pytest.fixture(scope="module")
def server(engines: dict[str, Any]) -> Iterator[KestrelServer]:
    server = build_server({name: AsyncEngine(e) for name, e in engines.items()}, host="127.0.0.1", port=0)
    thread = threading.Thread(target=server.run_forever, daemon=True)
    thread.start()
    assert server.wait_started(30)
    yield server
    server.request_shutdown()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive()


def test_each_request_goes_to_the_model_it_names(server: KestrelServer, engines: dict[str, Any]) -> None:
    client = openai_client(server)
    assert [m.id for m in client.models.list().data] == ["chat", "embed"]
    named = client.chat.completions.create(model="chat", messages=HI, max_tokens=6, temperature=0)
    unnamed = http("POST", f"{server.url}/v1/chat/completions",
                   {"messages": HI, "max_tokens": 6, "temperature": 0})  # the first model answers
    assert named.choices[0].message.content == json.loads(unnamed[2])["choices"][0]["message"]["content"]
    got = client.embeddings.create(model="embed", input=["Paris", "Rome"], encoding_format="float")
    want = engines["embed"].embed([engines["embed"].tokenizer.encode(t) for t in ("Paris", "Rome")])
    assert np.array_equal(np.array([d.embedding for d in got.data], np.float32), want)
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model="embed", messages=HI, max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="`chat`, `embed`"):
        client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2)
    assert client.responses.create(model="chat", input="Hi", max_output_tokens=3,
                                   temperature=0).usage.output_tokens == 3


def test_ollamas_and_anthropics_clients_see_every_model(server: KestrelServer) -> None:
    ol = ollama.Client(host=server.url)
    assert [m.model for m in ol.list().models] == ["chat:latest", "embed:latest"]
    assert ol.show("embed").capabilities == ["embedding"] and ol.show("chat:latest").capabilities == ["completion"]
    assert len(ol.embed(model="embed", input="Paris").embeddings[0]) == 64
    assert ol.chat(model="chat", messages=HI, options={"num_predict": 3, "temperature": 0}).eval_count == 3
    an = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    assert an.messages.create(model="chat", max_tokens=3, messages=HI,
                              extra_body={"temperature": 0}).usage.output_tokens == 3
    with pytest.raises(anthropic.BadRequestError, match="embedding model"):
        an.messages.create(model="embed", max_tokens=3, messages=HI)


def test_metrics_count_every_model(server: KestrelServer) -> None:
    client = openai_client(server)
    client.chat.completions.create(model="chat", messages=HI, max_tokens=2)
    client.embeddings.create(model="embed", input="x")
    _, _, body = http("GET", f"{server.url}/metrics")
    steps = {line.split('"')[1]: float(line.split()[-1]) for line in body.decode().splitlines()
             if line.startswith("kestrel_engine_steps_total{")}
    assert steps["chat"] >= 1 and steps["embed"] >= 1 and http("GET", f"{server.url}/health")[0] == 200
