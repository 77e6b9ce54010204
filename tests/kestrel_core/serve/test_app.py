"""The server end to end: a real uvicorn server over the default model on the CPU, the official openai client.

Models, chat and completions, whole and streamed: usage (continuous too), several choices and prompts, a stop
string, a logit bias; concurrent streams batched together, and clients that leave mid-answer. Logprobs, errors,
limits and metrics have test_app modules of their own. Generation is greedy and short.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.serve.server import KestrelServer

from .default_server import NAME, _chat, default_async_engine, default_engine  # noqa: F401 (fixtures)
from .helpers import HI, assert_stopped, ending_aborted, http, leave_once_running

pytestmark = pytest.mark.default_model


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
