"""``/v1/embeddings`` through a real server and the official openai client (Ollama's embedding routes, where
they differ from it, through the official ollama client).

The embedding model is tiny-qwen3-embed (a Qwen3-Embedding-style checkpoint; golden vectors from
sentence-transformers, scripts/make_embedding_golden.py); a generative model (tiny-qwen3) serves embeddings
beside a running generation stream.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import ollama
import openai
import pytest
from tokenizers import Tokenizer as TokenizersLibrary

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.serve.server import KestrelServer

from ..waits import wait_until
from .helpers import http, openai_client, running_server

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
GOLDEN = np.load(FIXTURES / "tiny-qwen3-embed" / "golden.npz")
TEXTS = ["What is the capital of France?", "The capital of France is Paris.",
         "Quantization maps each weight to a small integer; the scale brings it back."]
NAME = "embed-test"


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3-embed"), backend="cpu") as e:
        yield e


@pytest.fixture(scope="module")
def async_engine(engine: Any) -> AsyncEngine:
    return AsyncEngine(engine, max_batch=8, token_budget=64)


def _vectors(response: Any) -> np.ndarray:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return np.array([d.embedding for d in response.data], np.float32)


def test_texts_give_sentence_transformers_vectors(client: openai.OpenAI, engine: Any) -> None:
    response = client.embeddings.create(model=NAME, input=TEXTS)  # the client asks for base64
    got = _vectors(response)
    want = GOLDEN["embeddings"][:len(TEXTS)]
    assert (np.sum(got * want, axis=1)).min() >= 0.999
    assert np.array_equal(got, engine.embed([engine.tokenizer.encode(t) for t in TEXTS]))
    ids = sum(len(GOLDEN[f"ids_{i}"]) for i in range(len(TEXTS)))
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (ids, ids)
    assert response.model == NAME and response.object == "list"


def test_floats_base64_and_token_ids_agree(client: openai.OpenAI, server: KestrelServer) -> None:
    floats = _vectors(client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float"))
    assert floats.shape == (1, 64)
    ids = GOLDEN["ids_0"].tolist()
    assert np.array_equal(_vectors(client.embeddings.create(model=NAME, input=ids)), floats)
    assert np.array_equal(_vectors(client.embeddings.create(model=NAME, input=[ids, ids]))[1], floats[0])
    status, _, body = http("POST", f"{server.url}/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
    assert status == 200
    raw = json.loads(body)["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(raw), "<f4"), floats[0])


def test_dimensions(client: openai.OpenAI) -> None:
    full = _vectors(client.embeddings.create(model=NAME, input=TEXTS))
    cut = _vectors(client.embeddings.create(model=NAME, input=TEXTS, dimensions=16))
    assert cut.shape == (len(TEXTS), 16)
    np.testing.assert_allclose(cut, full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True), atol=1e-6)


def test_concurrent_requests_each_get_their_own_vectors(client: openai.OpenAI, engine: Any) -> None:
    want = engine.embed([engine.tokenizer.encode(t) for t in TEXTS])
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda k: _vectors(client.embeddings.create(model=NAME, input=TEXTS[k % 3])),
                                range(16)))
    for k, got in enumerate(results):
        assert np.array_equal(got[0], want[k % 3])


def test_concurrent_jobs_wait_for_the_blocks_the_others_hold() -> None:
    """Twelve clients embed at once into a KV cache that holds one of their inputs and a half: each waits for
    the blocks the others hold (none gets a 429, none waits for ever on another's part-way input), and each gets
    the vectors the engine gives alone."""
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3-embed"), backend="cpu", kv_cache_mb=0.08) as engine:
        text = "word " * 40
        ids = engine.tokenizer.encode(text)
        pool = engine.pool
        assert pool.blocks_for(len(ids)) <= pool.num_blocks < 2 * pool.blocks_for(len(ids))
        want = engine.embed([ids] * 3)
        async_engine = AsyncEngine(engine, token_budget=16)
        with running_server(async_engine, "small") as server:
            client = openai_client(server)
            with ThreadPoolExecutor(12) as threads:
                results = list(threads.map(lambda _: client.embeddings.create(model="small", input=[text] * 3),
                                           range(12)))
        assert all(np.array_equal(_vectors(got), want) for got in results)
        assert pool.free_blocks == pool.num_blocks and async_engine.active == 0


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [1, 100000]}, "input"),
    ({"input": [1] * 300}, "input"),  # longer than the model's context (256)
    ({"input": ["a"] * 2049}, "input"),
    ({"input": 5}, "input"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": 65}, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_requests_are_400_naming_the_field(server: KestrelServer, body: dict[str, Any], param: str) -> None:
    status, _, raw = http("POST", f"{server.url}/v1/embeddings", body)
    error = json.loads(raw)["error"]
    assert status == 400, error
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_ollama_truncation_keeps_the_end_token_the_pooling_reads(server: KestrelServer, engine: Any) -> None:
    """Ollama's routes cut a text over the context (256 tokens) as the tokenizers library truncates it: its first
    tokens and the <|endoftext|> the tokenizer appends, the token whose hidden state "last" pooling reads."""
    text = " ".join(f"word{i}" for i in range(300))
    reference = TokenizersLibrary.from_str(engine.tokenizer.to_json_str())
    reference.enable_truncation(engine.config.max_position)
    ids = reference.encode(text).ids
    assert len(ids) == 256 and ids[-1] == engine.tokenizer.encode(text)[-1]  # the end token, kept
    want = engine.embed([ids])[0]
    ol = ollama.Client(host=server.url)
    assert np.array_equal(np.array(ol.embed(model=NAME, input=text).embeddings[0], np.float32), want)
    assert np.array_equal(np.array(ol.embeddings(model=NAME, prompt=text).embedding, np.float32), want)


def test_an_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="a")


def test_an_embedding_model_does_not_chat(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)


def test_a_client_that_leaves_stops_its_job(server: KestrelServer, async_engine: AsyncEngine, engine: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """2048 long inputs take minutes: the client leaves once the job has run a few steps, its next step held until
    the server has given the job up; that step is the job's last, and its blocks come back."""
    long_text = TEXTS[2] * 6
    body = json.dumps({"model": NAME, "input": [long_text] * 2048}).encode()
    taken, holding, go = [0], threading.Event(), threading.Event()
    embed_step = async_engine._embed_step

    def held(job: Any) -> bool:
        taken[0] += 1
        if taken[0] == 6:
            holding.set()
            go.wait()  # the test lets it go, whatever happens
        return embed_step(job)

    monkeypatch.setattr(async_engine, "_embed_step", held)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            wait_until(holding.is_set, "a few steps of the job")
        wait_until(lambda: not async_engine.active, "the server giving the job up")  # its step held meanwhile
    finally:
        go.set()
    wait_until(lambda: engine.pool.free_blocks == engine.pool.num_blocks, "the job's blocks back")
    async_engine.run_sync(lambda: None)  # what was asked of the steps' thread before this has run
    # each step runs the token budget at most: the whole job takes many more
    assert taken[0] == 6 < 2048 * len(engine.tokenizer.encode(long_text)) // async_engine.scheduler.token_budget


def test_a_generative_model_embeds_between_its_generation_steps() -> None:
    """A long stream and embeddings share the engine's thread: both go on, and the vectors (pooled as the
    server's --pooling says) are the ones the engine gives alone: a row's result does not depend on the batch."""
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3"), backend="cpu") as engine:
        want = engine.embed([engine.tokenizer.encode(t) for t in TEXTS], pooling="mean")
        async_engine = AsyncEngine(engine, max_batch=4, token_budget=16)
        with running_server(async_engine, "gen", pooling="mean") as server:
            client = openai_client(server)
            stream = client.completions.create(model="gen", prompt="The sea", max_tokens=200, stream=True,
                                               extra_body={"ignore_eos": True})
            it = iter(stream)
            next(it)
            metrics = http("GET", f"{server.url}/metrics")[2].decode().splitlines()
            usage = next(ln for ln in metrics if ln.startswith('kestrel_kv_cache_usage_perc{model="gen"}'))
            assert 0 < float(usage.split()[-1]) < 1  # the running stream holds blocks of its own
            steps = async_engine.counters.steps
            got = _vectors(client.embeddings.create(model="gen", input=TEXTS))
            assert async_engine.num_running == 1  # the stream still runs
            text = "".join(chunk.choices[0].text or "" for chunk in it)
            assert len(engine.tokenizer.encode(text)) >= 150
            assert async_engine.counters.steps > steps
    assert np.array_equal(got, want)


def test_metrics_count_embedding_requests_and_their_tokens(client: openai.OpenAI, server: KestrelServer) -> None:
    def scrape() -> tuple[float, float]:
        _, _, body = http("GET", f"{server.url}/metrics")
        lines = body.decode().splitlines()
        ok = [ln for ln in lines if ln.startswith('kestrel_requests_total{endpoint="/v1/embeddings",status="200"}')]
        tokens = [ln for ln in lines if ln.startswith("kestrel_prompt_tokens_total ")]
        return (float(ok[0].split()[-1]) if ok else 0.0), float(tokens[0].split()[-1])

    requests, tokens = scrape()
    response = client.embeddings.create(model=NAME, input=TEXTS)
    assert scrape() == (requests + 1, tokens + response.usage.prompt_tokens)
