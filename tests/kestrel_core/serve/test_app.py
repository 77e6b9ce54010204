"""The server end to end: a real uvicorn server over the default model on the CPU, the official openai client.

Two servers, one engine each, for the module: the main one, and a tiny one (one running sequence, one
waiting, an API key) for the capacity and authentication tests. Generation is greedy and short.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.request import RequestOutput
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.serve.server import KestrelServer

from ..waits import HANG_GUARD_S, wait_until
from .helpers import (
    Scripted,
    assert_stopped,
    ending_aborted,
    http,
    leave_once_running,
    openai_client,
    running_server,
    wait_idle,
)

pytestmark = pytest.mark.default_model

NAME = "smol-test"
KEY = "sekrit-key"
SMALL_BODY = 20_000
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    with kestrel_core.load(None, backend="cpu") as e:
        yield e


@pytest.fixture(scope="module")
def async_engine(engine: Any) -> AsyncEngine:
    return AsyncEngine(engine, max_batch=16)


@pytest.fixture(scope="module")
def small_server() -> Iterator[KestrelServer]:
    """One running sequence, one waiting: the third concurrent request is refused. With an API key, and request
    bodies of at most ``SMALL_BODY`` bytes."""
    with kestrel_core.load(None, backend="cpu", kv_cache_mb=64) as e:
        with running_server(AsyncEngine(e, max_batch=1, max_waiting=1), NAME, api_key=KEY,
                            max_request_bytes=SMALL_BODY) as s:
            yield s


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]] = HI, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=NAME, messages=messages, **kw)


# -- models, chat, completions -----------------------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI, engine: Any) -> None:
    models = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(NAME, "model", "kestrel")]
    assert models[0].model_extra == {"max_model_len": engine.config.max_position}
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_completion(client: openai.OpenAI, engine: Any) -> None:
    started = int(time.time())
    r = _chat(client)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == NAME
    assert started <= r.created <= time.time()
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert choice.logprobs is None
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode_chat(HI))
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 12


def test_chat_stream_is_the_same_answer_in_chunks(client: openai.OpenAI) -> None:
    whole = _chat(client, max_tokens=16)
    chunks = list(_chat(client, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == NAME for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # the usage chunk comes last
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_without_usage_and_raw_sse(server: KestrelServer) -> None:
    status, headers, body = http("POST", f"{server.url}/v1/chat/completions",
                                 {"messages": HI, "max_tokens": 4, "temperature": 0, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line for line in body.decode().split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"][0]["delta"] == {}


def test_prompts_are_tokenized_off_the_event_loop(client: openai.OpenAI, engine: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt's tokenization must not hold up every other request: it runs in a worker thread."""
    threads, encode = [], engine.tokenizer.encode

    def recorded(*args: Any, **kwargs: Any) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", recorded)
    client.chat.completions.create(model=NAME, messages=HI, max_tokens=1)
    client.completions.create(model=NAME, prompt="Hi", max_tokens=1)
    http("POST", f"{client.base_url}".removesuffix("/v1/") + "/tokenize", {"prompt": "Hi"})
    assert len(threads) >= 3 and "kestrel-test-server" not in threads, threads


class _FailsMidStream(Scripted):
    """Its answer's first piece, then a bug (not a KestrelError)."""

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None, places: Any = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        async for out in super().generate(prompt_ids, params, request_id, places, priority):
            yield out
            raise RuntimeError("boom")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/v1/messages"])
def test_a_stream_that_fails_mid_way_says_so_and_ends(engine: Any, path: str) -> None:
    front = _FailsMidStream(engine)
    front.answers.append("Paris is the capital.")
    body = {"model": NAME, "messages": HI, "max_tokens": 8, "stream": True}
    with running_server(front, NAME) as server:
        status, _, raw = http("POST", f"{server.url}{path}", body)
    # each API's own way to end a stream on an error: its last event or line names it
    last = {"/v1/chat/completions": -2, "/api/chat": -1, "/v1/messages": -1}[path]
    lines = [line for line in raw.decode().split("\n") if line]
    assert status == 200 and "internal error: RuntimeError: boom" in lines[last], raw
    assert path != "/v1/chat/completions" or lines[-1] == "data: [DONE]"


class _ShutBeforeAnyToken(Scripted):
    """A shutdown's abort before the first token (the request queued or still in its prompt)."""

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None, places: Any = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        yield RequestOutput(request_id or "r", [], "", None, True, "abort", len(prompt_ids), 0)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/v1/messages", "/v1/responses"])
def test_a_stream_a_shutdown_ends_before_its_first_token_is_a_503(engine: Any, path: str) -> None:
    """Its headers are not sent yet, so the status says it, as a whole answer's does."""
    body: dict[str, Any] = {"model": NAME, "messages": HI, "max_tokens": 8, "stream": True}
    if path == "/v1/responses":
        body = {"model": NAME, "input": "Hi", "stream": True}
    with running_server(_ShutBeforeAnyToken(engine), NAME) as server:
        status, _, raw = http("POST", f"{server.url}{path}", body)
    assert status == 503 and b"shut down before the request finished" in raw, raw


def test_completions_stream_and_not(client: openai.OpenAI, engine: Any) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == NAME
    (choice,) = r.choices
    assert choice.text and choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [choice.finish_reason]
    assert chunks[-1].usage == r.usage
    ids = client.completions.create(model=NAME, prompt=engine.tokenizer.encode(prompt), max_tokens=8,
                                    temperature=0)
    assert ids.choices[0].text == choice.text  # a token-id prompt is the same prompt


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def _running(chunks: list[Any]) -> list[int]:
    """Each chunk's completion tokens so far (continuous usage: every chunk has a usage)."""
    assert all(c.usage is not None for c in chunks)
    return [c.usage.completion_tokens for c in chunks]


def test_chat_stream_with_continuous_usage(client: openai.OpenAI, engine: Any) -> None:
    """Every chunk's usage counts the tokens sent so far: a delta chunk's rise is its tokens (as many as its
    logprobs entries), a finish chunk's none, and the last delta's count is the final usage's."""
    whole = _chat(client, max_tokens=16, logprobs=True)
    chunks = list(_chat(client, max_tokens=16, logprobs=True, stream=True, stream_options=CONTINUOUS))
    running = _running(chunks)
    prompt = len(engine.tokenizer.encode_chat(HI))
    assert all(c.usage.prompt_tokens == prompt and c.usage.total_tokens == prompt + c.usage.completion_tokens
               for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and running[0] == 0
    deltas = [k for k, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason is None][1:]
    assert [running[k] - running[k - 1] for k in deltas] == [len(chunks[k].choices[0].logprobs.content)
                                                             for k in deltas]
    assert running[deltas[-1]] == running[-2] == running[-1] == whole.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert "".join(chunks[k].choices[0].delta.content for k in deltas) == whole.choices[0].message.content


def test_completions_stream_with_continuous_usage(client: openai.OpenAI, server: KestrelServer,
                                                  engine: Any) -> None:
    """Two prompts of different lengths, n = 2: each chunk's usage is its choice's (vLLM's), its prompt's tokens
    and its own tokens so far; each text chunk adds its tokens, a finish chunk none; the last chunk the totals."""
    prompts = ["1, 2, 3,", "The capital of France is"]
    lengths = [len(engine.tokenizer.encode(p)) for p in prompts]
    assert lengths[0] != lengths[1]
    kw: dict[str, Any] = {"prompt": prompts, "max_tokens": 10, "temperature": 0, "n": 2, "stream": True}
    chunks = list(client.completions.create(model=NAME, **kw, stream_options=CONTINUOUS,
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == sum(lengths)
    assert chunks[-1].usage.completion_tokens == 40 and chunks[-1].usage.total_tokens == sum(lengths) + 40
    running = _running(chunks[:-1])
    for i in range(4):
        mine = [k for k, c in enumerate(chunks[:-1]) if c.choices[0].index == i]
        assert all(chunks[k].usage.prompt_tokens == lengths[i // 2] and
                   chunks[k].usage.total_tokens == lengths[i // 2] + running[k] for k in mine)
        counts = [running[k] for k in mine]
        rises = [b - a for a, b in zip([0] + counts, counts)]
        texts = [n for n, k in enumerate(mine) if chunks[k].choices[0].finish_reason is None]
        assert texts == list(range(len(mine) - 1)) and all(rises[n] >= 1 for n in texts)
        assert rises[-1] == 0 and counts[-1] == 10  # the finish chunk: the choice's 10 tokens again
    for options, usage in (({"include_usage": True}, None), ({"continuous_usage_stats": True}, "absent")):
        status, _, body = http("POST", f"{server.url}/v1/completions",
                               {"model": NAME, **kw, "ignore_eos": True, "stream_options": options})
        events = [json.loads(e[len("data: "):]) for e in body.decode().split("\n\n") if e and "[DONE]" not in e]
        with_choices = [e for e in events if e["choices"]]
        assert status == 200 and len(with_choices) >= 6
        assert all(e.get("usage", "absent") == usage for e in with_choices)  # null; no key without include_usage


def test_continuous_usage_stats_must_be_a_boolean(server: KestrelServer) -> None:
    status, _, raw = http("POST", f"{server.url}/v1/chat/completions",
                          {"messages": HI, "max_tokens": 4, "stream": True,
                           "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}})
    assert status == 400 and json.loads(raw)["error"]["param"] == "stream_options.continuous_usage_stats"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = _chat(client, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content)


def test_logprob_bytes_of_a_character_split_over_tokens_add_up_to_it(client: openai.OpenAI) -> None:
    """An answer held to one emoji, whose UTF-8 bytes take several byte-level tokens: each token's text alone is
    U+FFFD, its ``bytes`` its own part of the character (OpenAI's), so that they add up to it."""
    schema = {"type": "object", "properties": {"e": {"const": "\U0001F600"}}, "required": ["e"]}
    r = client.chat.completions.create(model=NAME, messages=HI, max_tokens=40, temperature=0, logprobs=True,
                                       top_logprobs=1, response_format={"type": "json_schema", "json_schema": {
                                           "name": "emoji", "schema": schema}})
    content = r.choices[0].logprobs.content
    assert "\U0001F600" in r.choices[0].message.content and any(e.token == "\ufffd" for e in content)
    assert b"".join(bytes(e.bytes) for e in content).decode().startswith(r.choices[0].message.content)
    assert all(bytes(t.bytes).decode(errors="replace") == t.token for e in content for t in e.top_logprobs
               if "\ufffd" not in t.token)


def test_completions_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=NAME, prompt="1, 2, 3,", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(logprob) and token in top
    chunks = list(client.completions.create(model=NAME, prompt="1, 2, 3,", max_tokens=5, temperature=0,
                                            logprobs=2, stream=True))
    streamed = [off for c in chunks if c.choices and c.choices[0].logprobs for off in c.choices[0].logprobs.text_offset]
    assert streamed == lp.text_offset  # offsets run on across chunks
    # the chosen token is always among top_logprobs (OpenAI: up to logprobs + 1), sampled or echoed
    for k in (0, 1):
        r = client.completions.create(model=NAME, prompt="Zebra quantum lettuce", max_tokens=4, temperature=2.0,
                                      seed=3, logprobs=k, echo=True)
        lp = r.choices[0].logprobs
        assert lp.top_logprobs[0] is None  # the first prompt token has no logprob
        for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert top[token] == pytest.approx(logprob) and len(top) <= k + 1


def test_logit_bias_forces_a_token(client: openai.OpenAI, engine: Any) -> None:
    (paris,) = engine.tokenizer.encode("Paris")
    r = _chat(client, max_tokens=3, logit_bias={str(paris): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == "ParisParisParis"


def test_stop_string_is_cut(client: openai.OpenAI) -> None:
    full = _chat(client, max_tokens=12).choices[0].message.content
    assert " " in full
    word = full.split(" ")[1]
    r = _chat(client, max_tokens=12, stop=[word])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(word)]


def test_n_choices_whole_and_streamed(client: openai.OpenAI, engine: Any) -> None:
    """n = 3 sampled choices: choice i is the request alone with seed + i; streamed, the same texts by index."""
    kw: dict[str, Any] = {"max_tokens": 8, "temperature": 1.0, "seed": 5}
    whole = _chat(client, n=3, **kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    alone = [_chat(client, **{**kw, "seed": 5 + i}) for i in range(3)]
    assert [c.message.content for c in whole.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in whole.choices}) > 1  # the seeds differ, so do the choices
    assert whole.usage.prompt_tokens == len(engine.tokenizer.encode_chat(HI))  # the prompt counted once
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    chunks = list(_chat(client, n=3, stream=True, stream_options={"include_usage": True}, **kw))
    texts, roles, reasons = ["", "", ""], [0, 0, 0], [[], [], []]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        roles[choice.index] += choice.delta.role == "assistant"
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            reasons[choice.index].append(choice.finish_reason)
    assert texts == [c.message.content for c in whole.choices] and roles == [1, 1, 1]
    assert reasons == [[c.finish_reason] for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_completions_n_choices(client: openai.OpenAI) -> None:
    r = client.completions.create(model=NAME, prompt="1, 2, 3,", max_tokens=4, temperature=0, n=2, best_of=2,
                                  logprobs=1)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == r.choices[1].text  # greedy: the same tokens twice
    assert r.choices[0].logprobs.text_offset == r.choices[1].logprobs.text_offset  # each from its own 0
    assert r.choices[0].logprobs.text_offset[0] == 0 and r.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="x", max_tokens=4, n=2, best_of=3)
    assert info.value.body["param"] == "best_of"


def test_completions_several_prompts(client: openai.OpenAI, engine: Any) -> None:
    """Choice p * n + i is prompt p's i-th; each as that prompt alone gets it; the prompts counted once each."""
    prompts = ["The capital of France is", "1, 2, 3,"]
    kw: dict[str, Any] = {"max_tokens": 4, "temperature": 0}
    alone = [client.completions.create(model=NAME, prompt=p, **kw) for p in prompts]
    r = client.completions.create(model=NAME, prompt=prompts, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(engine.tokenizer.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    texts = ["", "", "", ""]
    for chunk in client.completions.create(model=NAME, prompt=prompts, n=2, stream=True, **kw):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in r.choices]
    scored = client.completions.create(model=NAME, prompt=prompts, echo=True, max_tokens=0, logprobs=1)
    singly = [client.completions.create(model=NAME, prompt=p, echo=True, max_tokens=0, logprobs=1).choices[0]
              for p in prompts]
    assert [c.text for c in scored.choices] == prompts
    assert [c.logprobs.token_logprobs for c in scored.choices] == [c.logprobs.token_logprobs for c in singly]


def _log_softmax(logits: Any) -> Any:
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def test_completions_echo_scores_the_prompt(client: openai.OpenAI, async_engine: AsyncEngine, engine: Any) -> None:
    """echo with logprobs and max_tokens 0 (what lm-eval's loglikelihood sends): each prompt token after the
    first scored by the model's log-softmax before it, the alternatives the likeliest; nothing generated."""
    prompt = "The capital of France is Paris"
    ids = engine.tokenizer.encode(prompt)
    r = client.completions.create(model=NAME, prompt=prompt, echo=True, max_tokens=0, logprobs=2)
    (c,) = r.choices
    assert c.text == prompt and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _log_softmax(async_engine.run_sync(lambda: engine.logits(ids)))  # float64, the engine's own logits
    assert lp.token_logprobs[1:] == pytest.approx([ref[t, ids[t + 1]] for t in range(len(ids) - 1)], abs=1e-4)
    for t, top in enumerate(lp.top_logprobs[1:]):  # the two likeliest, and the prompt's own token
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(ref[t].max(), abs=1e-4)
    assert lp.text_offset == [sum(len(tok) for tok in lp.tokens[:i]) for i in range(len(ids))]


def test_completions_echo_then_generate(client: openai.OpenAI) -> None:
    prompt = "1, 2, 3,"
    kw: dict[str, Any] = {"max_tokens": 3, "temperature": 0, "logprobs": 1}
    plain = client.completions.create(model=NAME, prompt=prompt, **kw).choices[0]
    echoed = client.completions.create(model=NAME, prompt=prompt, echo=True, **kw).choices[0]
    assert echoed.text == prompt + plain.text
    scored = client.completions.create(model=NAME, prompt=prompt, echo=True, max_tokens=0, logprobs=1).choices[0]
    n = len(scored.logprobs.tokens)  # the prompt's tokens, then the completion's
    assert echoed.logprobs.tokens == scored.logprobs.tokens + plain.logprobs.tokens
    assert echoed.logprobs.token_logprobs[:n] == scored.logprobs.token_logprobs
    assert echoed.logprobs.token_logprobs[n:] == plain.logprobs.token_logprobs
    chunks = list(client.completions.create(model=NAME, prompt=prompt, echo=True, stream=True, **kw))
    assert chunks[0].choices[0].text == prompt  # the echo comes first, as its own chunk
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == echoed.text


# -- concurrency and disconnects ---------------------------------------------------------------------


def test_concurrent_streams_match_one_at_a_time(client: openai.OpenAI, async_engine: AsyncEngine) -> None:
    topics = ["cats", "the sea", "Paris", "numbers", "music", "rain", "bread", "stars"]
    prompts = [[{"role": "user", "content": f"Say something about {t}."}] for t in topics]
    alone = [_chat(client, p).choices[0].message.content for p in prompts]

    def stream(p: list[dict[str, Any]]) -> str:
        return "".join(c.choices[0].delta.content or "" for c in _chat(client, p, stream=True) if c.choices)

    steps0, rows0 = async_engine.counters.steps, async_engine.counters.step_rows
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(stream, prompts))
    assert together == alone
    steps, rows = async_engine.counters.steps - steps0, async_engine.counters.step_rows - rows0
    assert steps < rows, f"{rows} tokens in {steps} steps: the requests were not batched"


def test_client_disconnect_mid_stream_frees_the_sequence(client: openai.OpenAI, async_engine: AsyncEngine,
                                                         engine: Any) -> None:
    stream = _chat(client, max_tokens=4000, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it), next(it)  # the role chunk and two tokens
    assert async_engine.num_running == 1
    with ending_aborted(async_engine):  # the 4000 tokens would take half a minute
        stream.close()
    assert_stopped(async_engine, engine)


def test_client_disconnect_mid_stream_frees_every_choice(client: openai.OpenAI, async_engine: AsyncEngine,
                                                         engine: Any) -> None:
    stream = _chat(client, max_tokens=4000, n=2, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    for _ in range(6):  # two role chunks and some tokens
        next(it)
    assert async_engine.num_running == 2
    with ending_aborted(async_engine, 2):
        stream.close()
    assert_stopped(async_engine, engine)


def test_client_disconnect_while_waiting_for_a_whole_answer(server: KestrelServer, async_engine: AsyncEngine,
                                                            engine: Any) -> None:
    with ending_aborted(async_engine):  # the client gives up and leaves
        leave_once_running(server, async_engine, "/v1/chat/completions",
                           {"model": NAME, "messages": HI, "max_tokens": 4000, "ignore_eos": True})
    assert_stopped(async_engine, engine)


# -- bad requests ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a"] * 65}, "stop"),
    ({"seed": -2 ** 63 - 1}, "seed"),  # past int64, which vLLM takes
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.[0].content"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.[0].content"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias"),  # outside the vocabulary
    ({"extra_body": {"stop_token_ids": [1, 10000000]}}, "stop_token_ids"),  # likewise (vLLM's field)
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    # what kestrel does not answer with is refused, not ignored: a call in the deprecated shape, audio
    ({"functions": [{"name": "f", "parameters": {}}], "function_call": {"name": "f"}}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"reasoning_effort": "bogus"}, "reasoning_effort"),
    ({"extra_body": {"stop_token_ids": list(range(1025))}}, "stop_token_ids"),  # each token is looked up in them
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # int() refuses it: a 400, not a 500
])
def test_bad_chat_request_is_a_400_naming_the_field(client: openai.OpenAI, kwargs: dict[str, Any],
                                                     param: str) -> None:
    args: dict[str, Any] = {"model": NAME, "messages": HI, "max_tokens": 4}
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    error = info.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"] and "Traceback" not in error["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": 4}, "messages"),  # no messages at all
    ({"messages": "Hi"}, "messages"),
    ({"messages": HI, "stream": "yes"}, "stream"),
])
def test_malformed_chat_body(server: KestrelServer, body: dict[str, Any], param: str) -> None:
    status, _, raw = http("POST", f"{server.url}/v1/chat/completions", body)
    assert status == 400
    assert json.loads(raw)["error"]["param"] == param


LONE = "\ud800 hi"  # JSON's escape of half a UTF-16 pair: valid JSON, not Unicode text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages.[0].content"),
    ("/v1/chat/completions", {"model": LONE, "messages": HI}, "model"),
    ("/v1/completions", {"prompt": ["Hi", LONE]}, "prompt.[1]"),
    ("/v1/embeddings", {"input": LONE}, "input"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/detokenize", {"model": LONE, "tokens": [1]}, "model"),
    ("/v1/responses", {"input": LONE}, "input"),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": LONE}]}, None),
    ("/api/generate", {"model": NAME, "prompt": LONE}, None),
    ("/v1/messages", {"model": LONE, "max_tokens": 4, "messages": HI}, None),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server: KestrelServer, path: str, body: dict[str, Any],
                                                     param: str | None) -> None:
    body = {"model": NAME, **body} if path.startswith("/v1/") and path != "/v1/messages" else body
    status, _, raw = http("POST", f"{server.url}{path}", body)
    answer = json.loads(raw)
    assert status == 400, answer
    error = answer["error"]  # Ollama's a string, OpenAI's and Anthropic's an object
    assert "lone UTF-16 surrogate" in (error if isinstance(error, str) else error["message"])
    if param is not None:
        assert answer["error"]["param"] == param
    status, _, _ = http("POST", f"{server.url}/v1/chat/completions", {"model": NAME, "messages": HI, "max_tokens": 1})
    assert status == 200


def test_body_that_is_not_json(server: KestrelServer) -> None:
    status, _, raw = http("POST", f"{server.url}/v1/chat/completions", raw=b"{not json")
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] is None and error["code"] == "invalid_json"


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_sent_as_curl_d_sends_it_is_read(server: KestrelServer, content_type: str) -> None:
    """``curl -d '{...}'`` (a form's content type), as Ollama's examples send it."""
    body = json.dumps({"messages": HI, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(f"{server.url}/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": content_type})
    with urllib.request.urlopen(req, timeout=HANG_GUARD_S) as resp:
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"logprobs": 21}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10**7]}, "prompt"),
    ({"prompt": ["a"] * 129}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"suffix": "end"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    # an echoed prompt is checked as a generated one, its error the same
    ({"prompt": [[]], "echo": True}, "prompt"),
    ({"prompt": "", "echo": True, "max_tokens": 0}, "prompt"),
    ({"prompt": [10**7], "echo": True, "logprobs": 1}, "prompt"),
])
def test_bad_completions_request(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    args: dict[str, Any] = {"model": NAME, "prompt": "Hi", "max_tokens": 4}
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    assert (info.value.body["param"], info.value.body["code"]) == (param, "invalid_value"), info.value.body


def test_unknown_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=4)
    assert info.value.body["code"] == "model_not_found"


def test_unknown_route_is_an_openai_404(server: KestrelServer) -> None:
    status, _, raw = http("POST", f"{server.url}/v1/audio/speech", {"input": "x"})
    assert status == 404 and "error" in json.loads(raw)


# -- capacity, authentication, probes ----------------------------------------------------------------


def test_a_burst_over_capacity_gets_429s(small_server: KestrelServer) -> None:
    client = openai_client(small_server, KEY)
    barrier = threading.Barrier(6)

    def one(_: int) -> str:
        barrier.wait()
        try:
            _chat(client, max_tokens=16, extra_body={"ignore_eos": True})
            return "ok"
        except openai.RateLimitError as exc:
            assert exc.status_code == 429 and "capacity" in exc.body["message"]
            return "429"

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    assert results.count("ok") >= 1 and results.count("429") >= 1, results
    assert results.count("ok") <= 2, results  # one running plus one waiting
    wait_idle(small_server.async_engines[0])


def test_choices_over_capacity_get_a_400_or_a_429_and_leave_nothing_running(small_server: KestrelServer) -> None:
    """One running and one waiting fit. Three choices never can: a 400 before anything is queued (a 429 would be
    retried for ever). Two while another request runs: refused whole with a 429, its admitted choice aborted."""
    client = openai_client(small_server, KEY)
    with pytest.raises(openai.BadRequestError) as never:
        _chat(client, n=3, max_tokens=4)
    assert never.value.body["param"] == "n" and "--max-batch + --max-waiting" in never.value.body["message"]
    busy = client.chat.completions.create(model=NAME, messages=HI, max_tokens=4000, stream=True,
                                          extra_body={"ignore_eos": True})
    next(iter(busy))
    with pytest.raises(openai.RateLimitError) as info:
        _chat(client, n=2, max_tokens=4)
    assert "capacity" in info.value.body["message"]
    busy.close()
    wait_idle(small_server.async_engines[0])
    assert len(_chat(client, n=2, max_tokens=4).choices) == 2  # two fit


def test_api_key_is_required_on_v1_only(small_server: KestrelServer) -> None:
    wrong = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.body["code"] == "invalid_api_key"
    status, _, body = http("POST", f"{small_server.url}/v1/chat/completions", {"messages": HI})  # no header
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    good = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key=KEY, max_retries=0)
    assert good.models.list().data[0].id == NAME
    assert http("GET", f"{small_server.url}/health")[0] == 200
    assert http("GET", f"{small_server.url}/metrics")[0] == 200


def test_a_body_over_the_limit_is_a_413_in_each_apis_shape(small_server: KestrelServer) -> None:
    """Refused whether the body says its length or comes in chunks without one; the server goes on."""
    client = openai_client(small_server, KEY)
    with pytest.raises(openai.APIStatusError) as info:
        _chat(client, [{"role": "user", "content": "x" * SMALL_BODY}])
    assert info.value.status_code == 413 and "--max-request-mb" in info.value.body["message"]
    anthropic_client = anthropic.Anthropic(base_url=small_server.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as refused:
        anthropic_client.messages.create(model=NAME, max_tokens=4,
                                         messages=[{"role": "user", "content": "x" * SMALL_BODY}])
    assert refused.value.status_code == 413 and refused.value.body["error"]["type"] == "request_too_large"
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    chunks = (b'{"model": "x", "prompt": "' + b"x" * 1000 for _ in range(SMALL_BODY // 1000 + 1))
    answer = httpx.post(f"{small_server.url}/api/generate", content=chunks, headers=auth, timeout=HANG_GUARD_S)
    assert answer.status_code == 413 and "--max-request-mb" in answer.json()["error"]
    assert "content-length" not in answer.request.headers  # sent in chunks
    assert _chat(client, max_tokens=2).usage.completion_tokens == 2


def test_health(server: KestrelServer) -> None:
    status, _, body = http("GET", f"{server.url}/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})


def test_a_client_that_leaves_while_sending_its_body_counts_as_gone(server: KestrelServer) -> None:
    """Counted as 499 (the client left), not as the 400 its cut body gets."""
    def count(status: str) -> float:
        text = http("GET", f"{server.url}/metrics")[2].decode()
        return _samples(text).get(f'kestrel_requests_total{{endpoint="/v1/messages",status="{status}"}}', 0.0)

    gone, bad = count("499"), count("400")
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HANG_GUARD_S) as conn:
        conn.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5000\r\n\r\n" + b'{"model": "x", "messages": [' + b" " * 20)
    wait_until(lambda: count("499") > gone, "the request counted as gone")
    assert count("499") == gone + 1 and count("400") == bad


def test_metrics(server: KestrelServer, client: openai.OpenAI) -> None:
    _chat(client, max_tokens=4)
    list(_chat(client, max_tokens=4, stream=True))
    with pytest.raises(openai.BadRequestError):
        _chat(client, top_p=-0.1)
    status, headers, body = http("GET", f"{server.url}/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = body.decode()
    for name in ("kestrel_requests_total", "kestrel_prompt_tokens_total", "kestrel_generation_tokens_total",
                 "kestrel_num_requests_waiting", "kestrel_num_requests_running",
                 "kestrel_time_to_first_token_seconds_bucket", "kestrel_inter_token_latency_seconds_bucket",
                 "kestrel_request_duration_seconds_bucket", "kestrel_engine_steps_total",
                 "kestrel_offload_offered_total", "kestrel_offload_accepted_total", "kestrel_offload_declined_total"):
        assert name in text, name
    samples = _samples(text)
    assert samples['kestrel_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 2
    assert samples['kestrel_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 1
    assert samples[f'kestrel_num_requests_running{{model="{NAME}"}}'] == 0
    assert samples[f'kestrel_kv_cache_usage_perc{{model="{NAME}"}}'] == 0  # nothing runs: every block is free
    assert samples["kestrel_generation_tokens_total"] >= 8
    assert samples["kestrel_time_to_first_token_seconds_count"] >= 2


def test_a_conversation_sent_again_attaches_its_prefix(server: KestrelServer, client: openai.OpenAI) -> None:
    """A chat's second turn resends the first: the server's engine attaches the first turn's prompt blocks
    (the prefix cache's hits grow by at least one block) and the answer to the same turn is the same."""
    system = {"role": "system", "content": "You are a terse assistant. " * 12}  # a prompt of several blocks
    turn = [system, {"role": "user", "content": "Name a colour."}]

    def hits() -> float:
        text = http("GET", f"{server.url}/metrics")[2].decode()
        return _samples(text)[f'kestrel_prefix_cache_hit_tokens_total{{model="{NAME}"}}']

    first = _chat(client, turn, max_tokens=6)
    before = hits()
    again = _chat(client, turn, max_tokens=6)
    assert again.choices[0].message.content == first.choices[0].message.content
    follow_up = turn + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "Another."}]
    _chat(client, follow_up, max_tokens=6)
    assert hits() >= before + 2 * 32


def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_a_web_pages_requests_are_refused_unless_its_origin_is_allowed(server: KestrelServer, engine: Any) -> None:
    """A page on another site can make the browser POST here (text/plain: no preflight) and, by DNS rebinding
    its own name to 127.0.0.1, read the answer: a foreign Host or Origin is a 403 before anything runs. API
    clients send no Origin; the loopback's own pages are answered."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    url = f"{server.url}/v1/completions"
    plain = {"Content-Type": "text/plain"}
    for headers in ({"Host": "rebind.evil.example"}, {"Host": "127.0.0.1.evil.example"},
                    {"Origin": "https://evil.example"}, {"Origin": "null"}, {"Origin": "http://127.0.0.1.evil.example"}):
        status, _, raw = http("POST", url, raw=body, headers={**plain, **headers})
        assert status == 403 and json.loads(raw)["error"]["code"] == "forbidden", headers
    for headers in ({}, {"Origin": "http://localhost:5173"}, {"Host": "localhost:8000"}, {"Host": "[::1]:8000"},
                    {"Origin": "http://127.0.0.2:3000"}):
        assert http("POST", url, raw=body, headers={**plain, **headers})[0] == 200, headers
    with running_server(AsyncEngine(engine), NAME, allowed_origins=["https://app.example"]) as other:
        ok = http("POST", f"{other.url}/v1/completions", raw=body, headers={**plain, "Origin": "https://app.example"})
        refused = http("POST", f"{other.url}/v1/completions", raw=body, headers={**plain, "Origin": "https://b.example"})
        assert (ok[0], refused[0]) == (200, 403)


def _cors_allows(response: httpx.Response, origin: str, method: str = "", headers: Sequence[str] = ()) -> bool:
    """The Fetch standard's CORS check, as a browser makes it: the answer names the page's origin and, for a
    preflight (``method`` given), is a 2xx allowing the method and every header it asked for."""
    if response.headers.get("access-control-allow-origin") != origin:
        return False
    if not method:
        return True
    allowed_methods = {m.strip().upper() for m in response.headers.get("access-control-allow-methods", "").split(",")}
    allowed_headers = {h.strip().lower() for h in response.headers.get("access-control-allow-headers", "").split(",")}
    return (response.is_success and method.upper() in allowed_methods
            and all(h.lower() in allowed_headers for h in headers))


def test_an_allowed_pages_preflights_are_answered_and_its_requests_carry_cors_headers(server: KestrelServer,
                                                                                        engine: Any) -> None:
    """A page's browser reads an answer only when it names the page's origin, and sends a JSON POST (or one with
    an API key) only after a preflight allowed it; the preflight carries no key, so it is answered before the
    key is asked for. A refused page's preflight stays a 403."""
    asked = ["authorization", "content-type", "x-api-key", "anthropic-version"]
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": ", ".join(asked)}
    body = {"prompt": "Hi", "max_tokens": 1}
    page = "https://app.example"
    with running_server(AsyncEngine(engine), NAME, api_key=KEY, allowed_origins=[page]) as keyed:
        with httpx.Client(base_url=keyed.url, timeout=HANG_GUARD_S) as browser:
            answer = browser.options("/v1/chat/completions", headers={"Origin": page, **preflight})
            assert _cors_allows(answer, page, "POST", asked), (answer.status_code, answer.headers)
            answer = browser.post("/v1/completions", json=body,
                                  headers={"Origin": page, "Authorization": f"Bearer {KEY}"})
            assert answer.status_code == 200 and _cors_allows(answer, page), answer.headers
            assert "origin" in answer.headers.get("vary", "").lower()
            unkeyed = browser.get("/v1/models", headers={"Origin": page})
            assert unkeyed.status_code == 401 and _cors_allows(unkeyed, page)  # the page can read why
            refused = browser.options("/v1/chat/completions", headers={"Origin": "https://b.example", **preflight})
            assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers
    loopback_page = "http://localhost:5173"
    with httpx.Client(base_url=server.url, timeout=HANG_GUARD_S) as browser:
        answer = browser.options("/v1/completions", headers={"Origin": loopback_page, **preflight})
        assert _cors_allows(answer, loopback_page, "POST", asked), (answer.status_code, answer.headers)
        answer = browser.post("/v1/completions", json=body, headers={"Origin": loopback_page})
        assert answer.status_code == 200 and _cors_allows(answer, loopback_page), answer.headers


def test_scoring_a_long_prompt_runs_a_chunk_a_step(client: openai.OpenAI, engine: Any, monkeypatch) -> None:
    """An echo with logprobs is scored by the scheduler's steps, a prefill chunk (at most PREFILL_CHUNK tokens, all
    their logits) a step, so generation steps go on beside its chunks; its sequence goes back."""
    from kestrel_core.model.weights import PREFILL_CHUNK

    chunks: list[tuple[int, int]] = []
    start_batch = engine.start_batch

    def recorded(work: Any, *args: Any, **kwargs: Any) -> Any:
        chunks.extend((len(tokens), rows) for _, tokens, rows in work if tokens is not None and len(tokens) > 1)
        return start_batch(work, *args, **kwargs)

    monkeypatch.setattr(engine, "start_batch", recorded)
    ids = [int(i) for i in np.random.default_rng(4).integers(100, 5000, 2 * PREFILL_CHUNK + 10)]  # three chunks
    whole = engine.prompt_logprobs(ids, 1)
    chunks.clear()
    got = client.completions.create(model=NAME, prompt=ids, echo=True, max_tokens=0, logprobs=1)
    assert got.choices[0].logprobs.token_logprobs[1:] == pytest.approx([e.logprob for e in whole], abs=1e-6)
    assert chunks == [(PREFILL_CHUNK, PREFILL_CHUNK)] * 2 + [(10, 10)]
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_a_schema_past_the_grammar_engines_limits_is_an_error_not_a_cut_answer(client: openai.OpenAI) -> None:
    """1,000 optional properties: llguidance gives up after "{" (a parser row over its 2,000 items). The answer
    was "{" with finish_reason "stop", which the schema does not describe; now the request fails, alone."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}
    with pytest.raises(openai.BadRequestError, match="the grammar failed while generating"):
        _chat(client, max_tokens=8, response_format=fmt)
    assert _chat(client, max_tokens=4).choices[0].message.content  # the server goes on
