"""Relevance scores from an embedding model or a reranker: vLLM's ``/v1/score`` and the rerank API of Jina and Cohere
(``/v1/rerank``, ``/v2/rerank``), which retrieval pipelines call to order documents for a query.

An embedding model scores a pair by the cosine similarity of the two texts' embeddings, as vLLM scores with one (a
bi-encoder: each text embedded on its own, in one embedding job). A reranker (kestrel_core.model.rerank) reads the
query and the document together in one prompt and scores the pair by its classifier on the prompt's last hidden
state (a cross-encoder: llama.cpp's and vLLM's score of Qwen3-Reranker); the prompts run as one embedding job. A
model that generates is refused, since its last hidden state is neither.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import StrictBool, StrictInt, StrictStr

from kestrel_core.errors import KestrelError
from kestrel_core.model.embed import check_input
from kestrel_core.model.rerank import RerankPrompt, is_reranker, relevance
from kestrel_core.serve import generation
from kestrel_core.serve.bodies import RequestBody
from kestrel_core.serve.errors import APIError, from_kestrel_error
from kestrel_core.serve.offload import json_body, off_loop
from kestrel_core.serve.protocol import MAX_INPUTS
from kestrel_core.serve.responses import new_id

if TYPE_CHECKING:
    from kestrel_core.serve.app import Models, Served


class ScoreBody(RequestBody):
    model: StrictStr | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]

    def pairs(self) -> tuple[list[str], list[str]]:
        """(left, right) texts of each pair: one text against many, or two lists pair by pair; at most
        MAX_INPUTS pairs and MAX_INPUTS distinct texts (each is embedded once)."""
        left = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        right = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not right:
            raise APIError(400, "text_2 holds no texts", param="text_2")
        if len(left) != 1 and len(left) != len(right):
            raise APIError(400, f"text_1 holds {len(left)} texts and text_2 {len(right)}: give one text_1, or as "
                           "many as text_2", param="text_2")
        if len(left) == 1:
            left = left * len(right)
        if len(right) > MAX_INPUTS:
            raise APIError(400, f"at most {MAX_INPUTS} pairs a request, got {len(right)}", param="text_2")
        _check_count(len(set(left) | set(right)), "text_2")
        return left, right


class Document(RequestBody):
    text: StrictStr


class RerankBody(RequestBody):
    model: StrictStr | None = None
    query: StrictStr
    documents: list[StrictStr | Document]
    top_n: StrictInt | None = None
    return_documents: StrictBool = True

    def texts(self) -> list[str]:
        if not self.documents:
            raise APIError(400, "documents is empty", param="documents")
        _check_count(1 + len(self.documents), "documents")
        if self.top_n is not None and self.top_n < 0:
            raise APIError(400, f"top_n must be at least 0 (0: all), got {self.top_n}", param="top_n")
        return [d if isinstance(d, str) else d.text for d in self.documents]


def _check_count(n: int, param: str) -> None:
    if n > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} texts a request, got {n}", param=param)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Each row of a [N, D] against the same row of b [N, D]: the cosine similarity [N]."""
    dot = np.sum(a.astype(np.float64) * b, axis=1)
    norms = np.linalg.norm(a.astype(np.float64), axis=1) * np.linalg.norm(b.astype(np.float64), axis=1)
    return dot / np.maximum(norms, 1e-12)


# the answer of a request: its pairs' scores [pairs] and the prompt tokens it took
Shape = Callable[[np.ndarray, int], dict[str, Any]]


def _scorer(models: Models, name: str | None) -> Served:
    served = models.get(name)
    if served.engine.config.pooling is None:
        raise APIError(400, "scores need an embedding model or a reranker (kestrel serve --rerank); "
                       f"`{served.model_name}` generates text", param="model")
    return served


async def _scores(served: Served, request: Request, left: list[str], right: list[str], names: tuple[str, str, str],
                  shape: Shape) -> Response:
    """The score of each pair (left[i], right[i]), answered as ``shape`` makes it; ``names``: the params of the left
    and the right texts, and what a message calls a right one."""
    if is_reranker(served.engine.config):
        return await _cross_scores(served, request, left, right, names, shape)
    firsts = dict.fromkeys(left)  # each text once: "one against many" embeds the one once
    seconds = [text for text in dict.fromkeys(right) if text not in firsts]
    ids = (await served.tokenized(request, lambda: list(firsts), names[0])
           + await served.tokenized(request, lambda: seconds, names[1], what=names[2]))
    at = {text: i for i, text in enumerate([*firsts, *seconds])}

    def answer(vectors: np.ndarray, prompt_tokens: int) -> dict[str, Any]:
        return shape(cosines(vectors[[at[t] for t in left]], vectors[[at[t] for t in right]]), prompt_tokens)

    return await generation.embed(served.async_engine, request, ids, answer, pooling=served.pooling)


async def _cross_scores(served: Served, request: Request, left: list[str], right: list[str],
                        names: tuple[str, str, str], shape: Shape) -> Response:
    """A reranker's scores: each distinct pair's prompt once, past the context a 400 naming the right text."""
    engine = served.engine
    pairs = list(zip(left, right))
    first: dict[tuple[str, str], int] = {}  # each distinct pair: where the request first has it
    for i, pair in enumerate(pairs):
        first.setdefault(pair, i)

    def tokenize() -> list[list[int]]:
        prompt = RerankPrompt(engine.tokenizer, engine.config.rerank_template)
        return [check_input(engine, prompt.ids(*pair), f"prompt of {names[2]} {i}", names[1])
                for pair, i in first.items()]

    try:
        ids = await off_loop(request, tokenize, inline=False)
    except KestrelError as exc:
        raise from_kestrel_error(exc, param=names[1]) from None
    at = {pair: k for k, pair in enumerate(first)}

    def answer(vectors: np.ndarray, prompt_tokens: int) -> dict[str, Any]:
        return shape(relevance(engine.model.classifier, vectors)[[at[pair] for pair in pairs]], prompt_tokens)

    return await generation.embed(served.async_engine, request, ids, answer, pooling="last")


def install(app: FastAPI, models: Models) -> None:
    """The score and rerank routes on ``app``."""

    @app.post("/v1/score")
    async def score(body: Annotated[ScoreBody, json_body(ScoreBody)], request: Request) -> Response:
        served = _scorer(models, body.model)
        left, right = body.pairs()

        def shape(scores: np.ndarray, prompt_tokens: int) -> dict[str, Any]:
            return {"id": new_id("score"), "object": "list", "created": int(time.time()), "model": served.model_name,
                    "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)],
                    "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

        return await _scores(served, request, left, right, ("text_1", "text_2", "text_2"), shape)

    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: Annotated[RerankBody, json_body(RerankBody)], request: Request) -> Response:
        served = _scorer(models, body.model)
        documents = body.texts()

        def shape(scores: np.ndarray, prompt_tokens: int) -> dict[str, Any]:
            order = np.argsort(-scores, kind="stable")[:body.top_n or None]  # top_n 0: all, as vLLM reads it
            results = []
            for i in order:
                result: dict[str, Any] = {"index": int(i), "relevance_score": float(scores[i])}
                if body.return_documents:
                    result["document"] = {"text": documents[i]}
                results.append(result)
            return {"id": new_id("rerank"), "model": served.model_name, "results": results,
                    "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

        return await _scores(served, request, [body.query] * len(documents), documents,
                              ("query", "documents", "document"), shape)
