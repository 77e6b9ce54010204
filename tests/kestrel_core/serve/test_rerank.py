"""``/v1/rerank`` and ``/v1/score`` over a reranker, through a real server: tiny-qwen3 made a Qwen3-Reranker (its
tokenizer given "yes" and "no"; ``kestrel serve --rerank``), and a qwen3 GGUF of llama.cpp's conversion.

A pair's score is checked against the model card's computation: the prompt built and tokenized as the card does
(prefix, the instruction, query and document, suffix), the same checkpoint's logits from a plain forward over it
(kestrel's logits for tiny-qwen3 are checked against transformers in the parity tests), and the softmax of the
last position's "yes" and "no" logits, in numpy. A GGUF's score: its last hidden state times the cls.output rows
the test wrote."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kestrel_core
from kestrel_core.cli import main
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.serve.server import KestrelServer

from ..model.test_rerank import PROMPT, rank_gguf, with_yes_and_no
from .helpers import http, running_server

NAME = "reranker"
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
          "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QUERY = "What is the capital of France?"
DOCS = ["The capital of France is Paris.", "Quantization maps weights.", "Italy"]  # the context is 256 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_yes_and_no(tmp_path_factory.mktemp("rerank") / "tiny-qwen3-reranker")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Any]:
    with kestrel_core.load(str(model_dir), backend="cpu", rerank=True) as e:
        yield e


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> Iterator[Any]:
    """The same checkpoint as the model that generates it is."""
    with kestrel_core.load(str(model_dir), backend="cpu") as e:
        yield e


def _post(server: KestrelServer, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, raw = http("POST", f"{server.url}{path}", body)
    return status, json.loads(raw)


def _card_prompt(tokenizer: Any, query: str, document: str) -> list[int]:
    """The model card's: the prefix's and the suffix's tokens around those of the instruction, query and document."""
    body = f"<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return [t for text in (PREFIX, body, SUFFIX) for t in tokenizer.encode(text, add_special_tokens=False)]


def _card_scores(plain: Any, query: str, documents: list[str]) -> tuple[np.ndarray, int]:
    """Each document's probability of "yes" against "no" at the last position, and the prompts' tokens."""
    yes, no = (plain.tokenizer.backend.token_to_id(t) for t in ("yes", "no"))
    scores, tokens = [], 0
    for document in documents:
        ids = _card_prompt(plain.tokenizer, query, document)
        last = plain.logits(ids)[-1].astype(np.float64)
        pair = np.exp(last[[yes, no]] - last[[yes, no]].max())
        scores.append(pair[0] / pair.sum())
        tokens += len(ids)
    return np.array(scores), tokens


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_rerank_scores_are_the_probability_of_yes_against_no(server: KestrelServer, plain: Any, path: str) -> None:
    want, tokens = _card_scores(plain, QUERY, DOCS)
    status, body = _post(server, path, {"query": QUERY, "documents": [DOCS[0], {"text": DOCS[1]}, DOCS[2]]})
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == list(np.argsort(-want, kind="stable"))
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, rtol=1e-5)
    assert all(r["document"]["text"] == DOCS[r["index"]] for r in body["results"])
    assert body["usage"]["prompt_tokens"] == tokens
    status, top = _post(server, path, {"query": QUERY, "documents": DOCS, "top_n": 1, "return_documents": False})
    first = {k: v for k, v in body["results"][0].items() if k != "document"}
    assert top["results"] == [first]


def test_score_reads_text_1_as_the_query(server: KestrelServer, plain: Any) -> None:
    want, tokens = _card_scores(plain, QUERY, DOCS)
    status, body = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert status == 200 and [d["index"] for d in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, rtol=1e-5)
    assert body["usage"]["prompt_tokens"] == tokens
    pairs = {"text_1": [QUERY, DOCS[2], QUERY], "text_2": [DOCS[1], QUERY, DOCS[1]]}  # the last is the first again
    status, body = _post(server, "/v1/score", pairs)
    want = np.array([_card_scores(plain, q, [d])[0][0] for q, d in zip(pairs["text_1"], pairs["text_2"])])
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, rtol=1e-5)
    prompts = [_card_prompt(plain.tokenizer, q, d) for q, d in zip(pairs["text_1"][:2], pairs["text_2"][:2])]
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))  # a pair's prompt runs once


@pytest.mark.parametrize(("path", "body", "param", "what"), [
    ("/v1/rerank", {"query": QUERY, "documents": ["Paris", "b " * 60]}, "documents", "document 1"),
    ("/v1/score", {"text_1": QUERY, "text_2": ["b " * 60]}, "text_2", "text_2 0"),
])
def test_a_prompt_past_the_context_is_a_400(server: KestrelServer, plain: Any, path: str, body: dict[str, Any],
                                            param: str, what: str) -> None:
    tokens = len(_card_prompt(plain.tokenizer, QUERY, "b " * 60))
    status, error = _post(server, path, body)
    assert status == 400 and error["error"]["param"] == param, error
    assert error["error"]["message"] == f"This model's maximum context length is 256 tokens. However, the prompt of " \
        f"{what} has {tokens} tokens."


def test_a_reranker_gives_neither_embeddings_nor_text(server: KestrelServer) -> None:
    status, error = _post(server, "/v1/embeddings", {"input": "a"})
    assert status == 400 and error["error"]["message"].startswith(f"`{NAME}` is a reranker"), error
    status, error = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})
    assert status == 400 and error["error"]["message"].startswith("this is a reranker"), error


def test_a_gguf_reranker_scores_by_its_classifier(tmp_path: Path, fmt, synth_source) -> None:
    """The file's template (llama.cpp's: {query} and {document} replaced, the whole read for special tokens), the
    last position's final hidden state times the cls.output rows (yes, no), their softmax's first."""
    path, classifier = rank_gguf(tmp_path / "r.gguf", fmt, synth_source)
    query, docs = "capital of France", ["Paris is the capital.", "the lazy dog", "numbers 0123"]
    with kestrel_core.load(str(path), backend="cpu") as engine:
        prompts = [engine.tokenizer.encode(PROMPT.replace("{query}", query).replace("{document}", d),
                                           add_special_tokens=False) for d in docs]
        outputs = np.stack([engine.embed([ids])[0] for ids in prompts]).astype(np.float64) @ classifier.T
        want = np.exp(outputs[:, 0]) / np.exp(outputs).sum(axis=1)
        with running_server(AsyncEngine(engine), "gguf") as server:
            status, body = _post(server, "/v1/rerank", {"query": query, "documents": docs})
    assert status == 200, body
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(docs))], want, rtol=1e-5)
    assert [r["index"] for r in body["results"]] == list(np.argsort(-want, kind="stable"))
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_serve_rerank_serves_the_checkpoint_as_a_reranker(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from kestrel_core.serve import server

    lines: list[str] = []
    monkeypatch.setattr(server, "serve", lambda engines, **_: lines.extend(
        server._describe("m", e, None) for e in engines))
    assert main(["serve", "--model", str(model_dir), "--port", "0", "--rerank"]) == 0
    assert lines == ["model m, a reranker (/v1/rerank, /v1/score), backend cpu"]
    assert main(["serve", "--model", str(model_dir), "--model", str(model_dir), "--port", "0", "--rerank"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --rerank makes one checkpoint a reranker; serve one --model with it (a reranker GGUF "
                   "needs no --rerank)")
