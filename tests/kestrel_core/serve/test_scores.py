"""``/v1/score`` and ``/v1/rerank`` (and ``/v2/rerank``) over an embedding model, through a real server.

No official client has these routes, so the tests speak plain HTTP; the scores are checked against cosines of
sentence-transformers' own vectors (the golden data of tiny-qwen3-embed)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.serve.server import KestrelServer

from .helpers import http, running_server

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
GOLDEN = np.load(FIXTURES / "tiny-qwen3-embed" / "golden.npz")["embeddings"]
TEXTS = ["What is the capital of France?", "The capital of France is Paris.",
         "Quantization maps each weight to a small integer; the scale brings it back."]  # golden texts 0-2
NAME = "embed"


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3-embed"), backend="cpu") as e:
        yield e


def _post(server: KestrelServer, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, raw = http("POST", f"{server.url}{path}", body)
    return status, json.loads(raw)


def test_scores_are_the_cosines_of_the_embeddings(server: KestrelServer, engine: Any) -> None:
    status, body = _post(server, "/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert status == 200 and [d["index"] for d in body["data"]] == [0, 1]
    got = np.array([d["score"] for d in body["data"]])
    want = GOLDEN[1:3] @ GOLDEN[0]  # sentence-transformers' unit vectors
    # each q8 vector is within cosine 0.9995 of its golden one: a direction error up to sqrt(2 * 0.0005) = 0.03
    np.testing.assert_allclose(got, want, atol=0.03)
    vectors = engine.embed([engine.tokenizer.encode(t) for t in TEXTS])
    np.testing.assert_allclose(got, vectors[1:] @ vectors[0], rtol=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(len(engine.tokenizer.encode(t)) for t in TEXTS)
    status, pairwise = _post(server, "/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS[1:]})
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               [vectors[0] @ vectors[1], vectors[1] @ vectors[2]], rtol=1e-5)


def test_one_text_against_many_is_embedded_once_and_counted_once(server: KestrelServer, engine: Any) -> None:
    """One text_1 against 1,100 text_2 is 1,101 texts to embed, under the 2,048 a request, as a rerank of 1,100
    documents is: the same scores, the same tokens."""
    docs = [f"doc {i}" for i in range(1100)]
    status, body = _post(server, "/v1/score", {"text_1": "query", "text_2": docs})
    assert status == 200, body
    status, ranked = _post(server, "/v1/rerank", {"query": "query", "documents": docs, "return_documents": False})
    assert status == 200 and len(body["data"]) == len(ranked["results"]) == 1100
    by_index = {r["index"]: r["relevance_score"] for r in ranked["results"]}
    np.testing.assert_allclose([d["score"] for d in body["data"]], [by_index[i] for i in range(1100)], rtol=1e-6)
    tokens = sum(len(engine.tokenizer.encode(t)) for t in ["query", *docs])
    assert body["usage"]["prompt_tokens"] == ranked["usage"]["prompt_tokens"] == tokens


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents(server: KestrelServer, path: str) -> None:
    docs = [TEXTS[2], {"text": TEXTS[1]}, "Paris"]
    status, body = _post(server, path, {"query": TEXTS[0], "documents": docs})
    assert status == 200 and sorted(r["index"] for r in body["results"]) == [0, 1, 2]
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert all(r["document"]["text"] == (d if isinstance(d, str) else d["text"])
               for r in body["results"] for d in [docs[r["index"]]])
    status, top = _post(server, path, {"query": TEXTS[0], "documents": docs, "top_n": 1, "return_documents": False})
    assert top["results"] == [{"index": body["results"][0]["index"], "relevance_score": scores[0]}]
    status, every = _post(server, path, {"query": TEXTS[0], "documents": docs, "top_n": 0})  # vLLM's default: all
    assert status == 200 and every["results"] == body["results"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": ["b"] * 2049}, "text_2"),  # pairs
    ("/v1/score", {"text_1": "a", "text_2": [f"b{i}" for i in range(2048)]}, "text_2"),  # texts, "a" with them
    ("/v1/score", {"text_1": [f"a{i}" for i in range(1025)], "text_2": [f"b{i}" for i in range(1025)]}, "text_2"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "a", "documents": ["c", "b " * 300]}, "documents"),  # past the 256-token context
    ("/v1/rerank", {"query": "b " * 300, "documents": ["a"]}, "query"),
    ("/v1/score", {"text_1": "b " * 300, "text_2": ["a"]}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": ["a", "b " * 300]}, "text_2"),
    ("/v1/score", {"text_1": ["c", "b " * 300], "text_2": ["a", "c"]}, "text_1"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "model": "bge-reranker"}, "model"),
])
def test_bad_requests_name_the_field(server: KestrelServer, path: str, body: dict[str, Any], param: str) -> None:
    status, error = _post(server, path, body)
    assert status in (400, 404) and error["error"]["param"] == param


@pytest.mark.parametrize(("body", "message"), [
    ({"text_1": "a", "text_2": []}, "text_2 holds no texts"),
    ({"text_1": ["a"], "text_2": []}, "text_2 holds no texts"),
    ({"text_1": [], "text_2": ["b"]}, "text_1 holds 0 texts and text_2 1: give one text_1, or as many as text_2"),
    ({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1 holds 2 texts and text_2 3"),
])
def test_a_pair_count_error_counts_the_texts_sent(server: KestrelServer, body: dict[str, Any], message: str) -> None:
    status, error = _post(server, "/v1/score", body)
    assert status == 400 and error["error"]["message"].startswith(message), error


def test_a_model_that_generates_gives_no_scores() -> None:
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3"), backend="cpu") as engine, \
            running_server(AsyncEngine(engine), "chat") as server:
        status, error = _post(server, "/v1/rerank", {"query": "a", "documents": ["b"]})
        assert status == 400 and "need an embedding model" in error["error"]["message"]
