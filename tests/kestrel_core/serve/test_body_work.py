"""Work that grows with a request's body, done where a large body's is (serve/offload.py): on the large bodies'
threads with the GIL's short switches where the body is large, else on the loop's default executor at the switch
interval as it was. Embeddings' and scores' tokenizing, a reranker's pairs, /infill's prompt, /v1/completions'
prompts and Ollama's /api/generate prompt (its ``context`` read back as text) and the ``context`` it answers.

Each request is sent twice: its JSON padded past INLINE_BODY_BYTES with whitespace (the same request, a large
body), then as it is. Not timed: the tests record the threads the work ran on and the switch interval meanwhile.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.serve import app, llamacpp, scores
from kestrel_core.serve.offload import BODY_SWITCH_S, INLINE_BODY_BYTES
from kestrel_core.serve.protocol import CompletionRequest
from kestrel_core.serve.server import KestrelServer

from ..model.test_fim import QWEN, fim_engine
from ..model.test_rerank import with_yes_and_no
from .helpers import http, running_server

NAME = "tiny"
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
Seen = list[tuple[str, float]]  # (thread, switch interval) of each call


@pytest.fixture
def record(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Seen]:
    """``record(owner, name, when)``: each call of ``owner.name`` (where ``when`` of its arguments), as made."""

    def recording(owner: Any, name: str, when: Callable[..., bool] = lambda *a, **k: True) -> Seen:
        seen: Seen = []
        original = getattr(owner, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if when(*args, **kwargs):
                seen.append((threading.current_thread().name, sys.getswitchinterval()))
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, recorded)
        return seen

    return recording


def padded(body: dict[str, Any]) -> bytes:
    """``body``'s JSON with whitespace before its last brace, past INLINE_BODY_BYTES: a large body of the same
    request."""
    return (json.dumps(body)[:-1] + " " * INLINE_BODY_BYTES + "}").encode()


def assert_large_body_work(url: str, body: dict[str, Any], *seen: Seen, inline: Seen | None = None) -> None:
    """``body`` sent padded, then as it is: each recorded work of the first on a large bodies' thread with the
    short switch interval; of the second, on the loop's default executor at the interval as it was (``inline``'s
    on the loop's thread: work a thread's hand-off would cost more than)."""
    interval = sys.getswitchinterval()
    status, _, raw = http("POST", url, raw=padded(body))
    assert status == 200, raw
    seen = (*seen, inline) if inline is not None else seen
    large = [list(s) for s in seen]
    for s in seen:
        s.clear()
    status, _, raw = http("POST", url, body)
    assert status == 200, raw
    for calls, small in zip(large, seen, strict=True):
        assert calls and all(on.startswith("kestrel-body") and switch == min(interval, BODY_SWITCH_S)
                             for on, switch in calls), calls
        assert small and all(switch == interval for _, switch in small), small
        where = {on for on, _ in small}
        if small is inline:
            assert where == {"kestrel-test-server"}, small  # the loop's thread
        else:
            assert not any(on.startswith(("kestrel-body", "kestrel-test-server")) for on in where), small
    assert sys.getswitchinterval() == interval


def serving(engine: Any, name: str) -> Iterator[KestrelServer]:
    with running_server(AsyncEngine(engine, max_batch=4), name) as server:
        yield server


@pytest.fixture(scope="module")
def embedder() -> Iterator[KestrelServer]:
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3-embed"), backend="cpu") as engine:
        yield from serving(engine, "embed")


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KestrelServer]:
    model = with_yes_and_no(tmp_path_factory.mktemp("rerank") / "tiny-qwen3-reranker")
    with kestrel_core.load(str(model), backend="cpu", rerank=True) as engine:
        yield from serving(engine, "reranker")


@pytest.fixture(scope="module")
def fim() -> Iterator[tuple[Any, KestrelServer]]:
    with fim_engine([*QWEN, "<|repo_name|>"]) as engine:
        for server in serving(engine, "fim"):
            yield engine, server


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/embeddings", {"model": "embed", "input": ["Hi", "there"]}),
    ("/v1/score", {"model": "embed", "text_1": "Hi", "text_2": ["there", "you"]}),
], ids=["embeddings", "score"])
def test_embeddings_are_tokenized_where_a_large_body_is(embedder: KestrelServer, record: Callable[..., Seen],
                                                        path: str, body: dict[str, Any]) -> None:
    assert_large_body_work(f"{embedder.url}{path}", body, record(app, "check_input"))


def test_a_rerank_is_tokenized_where_a_large_body_is(reranker: KestrelServer, record: Callable[..., Seen]) -> None:
    assert_large_body_work(f"{reranker.url}/v1/rerank",
                           {"model": "reranker", "query": "Hi", "documents": ["there", "you"]},
                           record(scores, "check_input"))


def test_completions_prompts_are_tokenized_where_a_large_body_is(server: KestrelServer,
                                                                 record: Callable[..., Seen]) -> None:
    assert_large_body_work(f"{server.url}/v1/completions", {"model": NAME, "prompt": ["Hi", "Yes"], "max_tokens": 2},
                           record(CompletionRequest, "prompt_ids"))


def test_an_infill_prompt_is_built_where_a_large_body_is(fim: tuple[Any, KestrelServer],
                                                         record: Callable[..., Seen]) -> None:
    _, server = fim
    body = {"input_prefix": "def add(a, b):\n", "prompt": "    return", "input_suffix": "\n", "n_predict": 2}
    assert_large_body_work(f"{server.url}/infill", body, record(llamacpp, "infill_prompt"),
                           record(CompletionRequest, "prompt_ids"))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_ollama_generate_prompt_and_context_are_made_where_a_large_body_is(
        fim: tuple[Any, KestrelServer], record: Callable[..., Seen], stream: bool) -> None:
    """A fill-in-the-middle prompt after a ``context``: the context read back as text, the prompt tokenized, and the
    answer's ``context`` (the prompt's ids again, and the answer's)."""
    engine, server = fim
    context = list(engine.tokenizer.encode("x = 1\n", add_special_tokens=False))
    body = {"model": "fim", "prompt": "y =", "suffix": "\n", "context": context, "stream": stream,
            "options": {"num_predict": 2}}
    read_back = record(engine.tokenizer, "decode", lambda ids, *a, **k: list(ids) == context)
    tokenized = record(CompletionRequest, "prompt_ids")
    assert_large_body_work(f"{server.url}/api/generate", body, tokenized, inline=read_back)
    assert len(tokenized) == 2  # the prompt's, then the answer's context's
