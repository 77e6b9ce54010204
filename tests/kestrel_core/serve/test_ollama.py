"""Ollama's API through a real server and the official ``ollama`` client, against kestrel's own OpenAI answers.

Generation is greedy (``temperature`` 0) on the tiny fixtures, so an Ollama answer and the OpenAI answer to the
same request are the same tokens (test_ollama_tools.py has the tool calls and the reasoning, from scripted
answers).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import ollama
import openai
import pytest

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.serve.app import Models
from kestrel_core.serve.errors import APIError
from kestrel_core.serve.ollama import model_of
from kestrel_core.serve.server import KestrelServer

from ..model.test_fim import fim_engine
from ..waits import wait_until
from .helpers import http, openai_client, running_server, scripted_ollama

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
NAME = "tiny"
HI = [{"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0, "num_predict": 12}
COPILOT_MINIMUM = "0.6.4"  # VS Code Copilot's Ollama provider refuses a server whose /api/version is below it


@pytest.fixture(scope="module")
def ol(server: KestrelServer) -> ollama.Client:
    return ollama.Client(host=server.url)


def _openai_chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=12, **kw)


# -- the model ------------------------------------------------------------------------------------------


def test_the_model_is_listed_shown_and_running(ol: ollama.Client, engine: Any) -> None:
    (model,) = ol.list().models
    assert model.model == "tiny:latest" and model.details.family == "qwen3" and model.size > 0
    shown = ol.show("tiny")
    assert shown.capabilities == ["completion"] and shown.template == engine.tokenizer.chat_template
    assert shown.modelinfo["qwen3.context_length"] == engine.config.max_position
    assert shown.modelinfo["general.basename"] == NAME
    assert [(m.model, m.context_length) for m in ol.ps().models] == [("tiny:latest", engine.config.max_position)]
    assert model.details.format == "safetensors"


def test_the_version_is_an_ollama_release_that_clients_accept(server: KestrelServer) -> None:
    status, _, raw = http("GET", f"{server.url}/api/version")
    body = json.loads(raw)

    def release(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split("."))

    assert status == 200 and release(body["version"]) >= release(COPILOT_MINIMUM)
    assert body["kestrel_version"] == kestrel_core.__version__


def test_an_unknown_model_is_404(ol: ollama.Client) -> None:
    for call in (lambda: ol.chat(model="llama3.2", messages=HI), lambda: ol.show("llama3.2"),
                 lambda: ol.embed(model="llama3.2", input="x")):
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 404 and "model 'llama3.2' not found" in info.value.error


@pytest.mark.parametrize(("route", "body", "status", "error"), [
    ("show", {}, 400, "model is required"), ("show", {"model": ""}, 400, "model is required"),
    ("chat", {"messages": HI}, 400, "model is required"), ("chat", {"model": "", "messages": HI}, 400,
                                                           "model is required"),
    ("embeddings", {"prompt": "x"}, 400, "model is required"),
    # Ollama's generate and embed routes answer it as a model not found
    ("generate", {"prompt": "x"}, 404, "model '' not found"), ("embed", {"input": "x"}, 404, "model '' not found"),
])
def test_a_request_without_a_model_is_answered_as_ollama_answers_it(server: KestrelServer, route: str,
                                                                    body: dict[str, Any], status: int,
                                                                    error: str) -> None:
    got, _, raw = http("POST", f"{server.url}/api/{route}", {"stream": False, **body})
    answer = json.loads(raw)
    assert got == status and set(answer) == {"error"} and answer["error"].startswith(error)
    shown, _, raw = http("POST", f"{server.url}/api/show", {"name": "tiny"})  # the older field names it too
    assert shown == 200 and json.loads(raw)["details"]["family"] == "qwen3"


# -- chat and generate ----------------------------------------------------------------------------------


def test_chat_is_the_openai_answer(ol: ollama.Client, client: openai.OpenAI) -> None:
    want = _openai_chat(client, HI)
    got = ol.chat(model="tiny", messages=HI, options=GREEDY)
    assert got.message.role == "assistant" and got.message.content == want.choices[0].message.content
    assert (got.done, got.done_reason) == (True, "length")
    assert (got.prompt_eval_count, got.eval_count) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    assert got.total_duration >= got.prompt_eval_duration > 0


def test_a_chat_stream_is_its_answer_in_parts(ol: ollama.Client) -> None:
    whole = ol.chat(model="tiny:latest", messages=HI, options=GREEDY)
    parts = list(ol.chat(model="tiny:latest", messages=HI, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and len(parts) > 2
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert (parts[-1].done_reason, parts[-1].eval_count) == ("length", 12)


def test_generate_is_a_chat_turn_or_raw_a_completion(ol: ollama.Client, client: openai.OpenAI) -> None:
    system = [{"role": "system", "content": "Be brief."}]
    turn = ol.generate(model="tiny", prompt="Hi", system="Be brief.", options=GREEDY)
    assert turn.response == _openai_chat(client, system + HI).choices[0].message.content
    raw = ol.generate(model="tiny", prompt="The sea", raw=True, options=GREEDY)
    plain = client.completions.create(model=NAME, prompt="The sea", temperature=0, max_tokens=12)
    assert raw.response == plain.choices[0].text and raw.prompt_eval_count == plain.usage.prompt_tokens
    parts = list(ol.generate(model="tiny", prompt="The sea", raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == raw.response and parts[-1].done
    loaded = ol.generate(model="tiny", prompt="")  # what clients send to load a model
    assert (loaded.done, loaded.done_reason, loaded.response) == (True, "load", "")
    assert ol.chat(model="tiny", messages=[]).done_reason == "load"
    assert ol.generate(model="tiny", prompt="", keep_alive=0).done_reason == "unload"


def _tokens(server: KestrelServer, messages: list[dict[str, Any]]) -> int:
    """The prompt tokens of ``messages`` as the chat route renders them (vLLM's /tokenize)."""
    return json.loads(http("POST", f"{server.url}/tokenize", {"model": NAME, "messages": messages})[2])["count"]


def test_a_conversation_past_the_context_loses_its_oldest_messages(ol: ollama.Client, client: openai.OpenAI,
                                                                   server: KestrelServer, engine: Any) -> None:
    """As Ollama's chat prompt: the system message and the latest stay, the oldest of the others go until the
    prompt leaves room for an answer; with truncate false, a 400."""
    messages = [{"role": "system", "content": "You are helpful."}]
    for i in range(40):
        messages += [{"role": "user", "content": f"question number {i} about the weather today"},
                     {"role": "assistant", "content": f"answer number {i}: it is sunny"}]
    messages.append({"role": "user", "content": "and tomorrow?"})
    context = engine.config.max_position
    assert _tokens(server, messages) >= context
    kept = next(messages[:1] + messages[i:] for i in range(1, len(messages))
                if _tokens(server, messages[:1] + messages[i:]) < context)
    want = _openai_chat(client, kept)
    for stream in (False, True):
        parts = list(ol.chat(model="tiny", messages=messages, options=GREEDY, stream=True)) if stream else [
            ol.chat(model="tiny", messages=messages, options=GREEDY)]
        assert "".join(p.message.content for p in parts) == want.choices[0].message.content
        assert parts[-1].prompt_eval_count == want.usage.prompt_tokens == _tokens(server, kept)
    status, _, raw = http("POST", f"{server.url}/api/chat",
                          {"model": "tiny", "messages": messages, "truncate": False, "stream": False})
    assert status == 400 and "context" in json.loads(raw)["error"]


# user and assistant turns in turn, as Gemma's and older Mistral templates take them (written for this test)
ALTERNATING_TEMPLATE = (
    "{% if messages[0].role == 'system' %}[system]{{ messages[0].content }}{% endif %}"
    "{% for m in messages if m.role != 'system' %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def test_a_cut_conversation_opens_where_the_template_lets_it(engine: Any) -> None:
    """A cut the template refuses (one that opens with an answer, where turns must alternate) does not fit: the
    conversation is cut at the next user turn."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris " * 300},
                {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Rome?"},
                {"role": "assistant", "content": "Rainy."}, {"role": "user", "content": "And now?"}]
    with scripted_ollama(engine, NAME, ALTERNATING_TEMPLATE) as (front, ol, _):
        front.answers.append("Still rainy.")
        assert ol.chat(model="tiny", messages=messages).message.content == "Still rainy."
        assert front.prompts[-1] == "[system]Be brief.[user]And Rome?[assistant]Rainy.[user]And now?[assistant]"


def test_options_map_onto_sampling(ol: ollama.Client) -> None:
    a = ol.generate(model="tiny", prompt="The sea", raw=True, options={"seed": 7, "num_predict": 10})
    b = ol.generate(model="tiny", prompt="The sea", raw=True, options={"seed": 7, "num_predict": 10,
                                                                         "num_ctx": 4096, "repeat_last_n": 8})
    assert a.response == b.response and a.eval_count == 10  # a seed reproduces; unknown options are ignored
    penalized = ol.generate(model="tiny", prompt="The sea", raw=True,
                            options={"seed": 7, "num_predict": 10, "repeat_penalty": 5.0, "min_p": 0.05})
    assert penalized.response != a.response
    stopped = ol.generate(model="tiny", prompt="The sea", raw=True,
                          options={"seed": 7, "num_predict": 10, "stop": [a.response[2:4]]})
    assert stopped.done_reason == "stop" and len(stopped.response) < len(a.response)
    # Ollama's own values: seed -1 (its default) is a random seed, num_predict 0 no limit, an empty format or
    # suffix none, and stop lists longer than OpenAI's 4
    loose = ol.generate(model="tiny", prompt="The sea", format="", suffix="", options={
        "seed": -1, "num_predict": 0, "stop": [f"zz{i}" for i in range(8)], "temperature": 0})
    some = ol.generate(model="tiny", prompt="The sea", options={"num_predict": 100, "temperature": 0})
    assert loose.response.startswith(some.response) and loose.eval_count > some.eval_count


def test_options_past_a_samplers_range_are_read_as_ollamas_sampler_reads_them(ol: ollama.Client) -> None:
    """Ollama's sampler takes any number: a temperature below 0 is greedy, a top_p of 0 keeps the most likely
    token alone, a top_p above 1 and a top_k below 0 filter nothing, a min_p above 1 is 1."""
    def generate(**options: Any) -> str:
        return ol.generate(model="tiny", prompt="The sea", raw=True,
                           options={"num_predict": 10, **options}).response

    greedy = generate(temperature=0)
    sampled = {"seed": 7, "temperature": 1.5}
    assert generate(**sampled) != greedy  # the seed samples another answer: the two below are greedy's
    assert generate(**sampled, top_p=0) == generate(temperature=-1) == greedy
    assert generate(**sampled, top_p=1.5, top_k=-5) == generate(**sampled, top_p=1, top_k=0)
    assert generate(**sampled, min_p=2) == generate(**sampled, min_p=1)
    assert generate(**sampled, min_p=-0.5) == generate(**sampled, min_p=0)


def test_inputs_are_read_as_ollama_reads_them(ol: ollama.Client, server: KestrelServer) -> None:
    """What Ollama's server takes: null as a field not sent, an integral float as an integer option, a role and a
    model's name in any case; each is the answer to the request written plainly."""
    def chat(body: dict[str, Any]) -> dict[str, Any]:
        status, _, raw = http("POST", f"{server.url}/api/chat", {"model": "tiny", "stream": False, **body})
        assert status == 200, raw
        return json.loads(raw)

    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "Hi"}]
    lenient = [({"messages": [{**turns[0], "role": "User"}], "options": GREEDY}, {"messages": turns[:1]}),
               ({"model": "TINY:Latest", "messages": turns[:1], "options": GREEDY}, {"messages": turns[:1]}),
               ({"messages": [turns[0], {**turns[1], "content": None}, turns[2]], "options": GREEDY, "truncate": None},
                {"messages": turns}),
               ({"messages": turns[:1], "options": {"temperature": 0, "num_predict": 12.0, "top_k": 2.0, "seed": 7.0,
                                                    "top_p": None}},
                {"messages": turns[:1], "options": {"temperature": 0, "num_predict": 12, "top_k": 2, "seed": 7}}),
               # an integer option's fraction is dropped, as Go converts Ollama's float64 to int
               ({"messages": turns[:1], "options": {"temperature": 0.5, "num_predict": 12.9, "top_k": 2.7,
                                                    "seed": 7.99}},
                {"messages": turns[:1], "options": {"temperature": 0.5, "num_predict": 12, "top_k": 2, "seed": 7}})]
    for given, plain in lenient:
        got, want = chat(given), chat({"options": GREEDY, **plain})
        assert (got["message"], got["prompt_eval_count"]) == (want["message"], want["prompt_eval_count"]), given
    for fraction, tokens in ((1.5, 1), (2.999, 2)):  # not rounded
        assert chat({"messages": HI, "options": {"num_predict": fraction}})["eval_count"] == tokens


@pytest.mark.parametrize(("keep_alive", "reason"), [(0, "unload"), ("0", "unload"), ("0s", "unload"), ("0m", "unload"),
                                                    ("0h0.0m", "unload"), (1e-10, "unload"), ("0.9ns", "unload"),
                                                    ("5m", "load"), ("1ns", "load"), (-1, "load"), (-1.5, "load"),
                                                    ("-1m", "load"), (None, "load")])
def test_a_keep_alive_of_zero_in_any_of_gos_spellings_unloads(ol: ollama.Client, keep_alive: Any,
                                                              reason: str) -> None:
    assert ol.generate(model="tiny", prompt="", keep_alive=keep_alive).done_reason == reason
    assert ol.chat(model="tiny", messages=[], keep_alive=keep_alive).done_reason == reason


@pytest.mark.parametrize(("keep_alive", "error"), [
    # Ollama's Duration.UnmarshalJSON: a string is Go's time.ParseDuration's, in its words
    ("forever", 'time: invalid duration "forever"'), ("10x", 'time: unknown unit "x" in duration "10x"'),
    ("-1", 'time: missing unit in duration "-1"'), ("", 'time: invalid duration ""'),
    ("1.5 h", 'time: unknown unit " h" in duration "1.5 h"'),
    ("3000000h", 'time: invalid duration "3000000h"'),  # past int64's nanoseconds
    (True, "Unsupported type: 'bool'"), ([5], "Unsupported type: '[]interface {}'"),
    ({"m": 5}, "Unsupported type: 'map[string]interface {}'")])
@pytest.mark.parametrize("route", ["chat", "generate", "embed", "embeddings"])
def test_a_bad_keep_alive_is_ollamas_400(server: KestrelServer, route: str, keep_alive: Any, error: str) -> None:
    body = {"chat": {"messages": HI}, "generate": {"prompt": "Hi"}, "embed": {"input": "Hi"},
            "embeddings": {"prompt": "Hi"}}[route]
    status, _, raw = http("POST", f"{server.url}/api/{route}",
                          {"model": "tiny", "stream": False, "keep_alive": keep_alive, **body})
    assert (status, json.loads(raw)) == (400, {"error": error})


def test_a_name_in_another_case_names_a_model_only_where_it_is_the_one(async_engine: AsyncEngine) -> None:
    assert model_of(Models({"tiny": async_engine, "other": async_engine}), "Tiny:LATEST").model_name == "tiny"
    with pytest.raises(APIError) as info:
        model_of(Models({"tiny": async_engine, "TINY": async_engine}), "Tiny")
    assert info.value.status == 404


def _approx_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**e, "logprob": pytest.approx(e["logprob"], abs=1e-4),
             **({"top_logprobs": _approx_logprobs(e["top_logprobs"])} if "top_logprobs" in e else {})}
            for e in entries]


def test_logprobs_come_back_in_ollamas_shape(ol: ollama.Client, client: openai.OpenAI,
                                             server: KestrelServer) -> None:
    """Each token's logprob, bytes and alternatives, as Ollama's Logprob (token, logprob, bytes, top_logprobs) at
    the answer's top level: the OpenAI answer's, whole and streamed, from chat and generate (raw too)."""
    chat = client.chat.completions.create(model=NAME, messages=HI, temperature=0, max_tokens=12, logprobs=True,
                                          top_logprobs=3).choices[0].logprobs.content
    want = [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes, "top_logprobs": [
        {"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top_logprobs]} for e in chat]
    asked = {"options": GREEDY, "logprobs": True, "top_logprobs": 3, "stream": False}
    for route, body in (("chat", {"messages": HI}), ("generate", {"prompt": "Hi"})):
        status, _, raw = http("POST", f"{server.url}/api/{route}", {"model": "tiny", **asked, **body})
        assert status == 200 and json.loads(raw)["logprobs"] == _approx_logprobs(want)
    parts = list(ol.chat(model="tiny", messages=HI, options=GREEDY, logprobs=True, top_logprobs=3, stream=True))
    assert [lp.token for p in parts for lp in p.logprobs or ()] == [e["token"] for e in want]
    bare = ol.generate(model="tiny", prompt="Hi", options=GREEDY, logprobs=True)
    assert [(lp.token, lp.top_logprobs) for lp in bare.logprobs] == [(e["token"], None) for e in want]
    assert ol.chat(model="tiny", messages=HI, options=GREEDY).logprobs is None
    plain = client.completions.create(model=NAME, prompt="The sea", temperature=0, max_tokens=12,
                                      logprobs=2).choices[0].logprobs
    for stream in (False, True):
        got = ol.generate(model="tiny", prompt="The sea", raw=True, options=GREEDY, logprobs=True, top_logprobs=2,
                          stream=stream)
        entries = [lp for p in got for lp in p.logprobs or ()] if stream else got.logprobs
        assert [(lp.token, lp.logprob) for lp in entries] == [
            (t, pytest.approx(lp, abs=1e-4)) for t, lp in zip(plain.tokens, plain.token_logprobs)]
        assert [{t.token: t.logprob for t in lp.top_logprobs} for lp in entries] == [
            pytest.approx(top, abs=1e-4) for top in plain.top_logprobs]
    status, _, raw = http("POST", f"{server.url}/api/chat", {"model": "tiny", "messages": HI, "top_logprobs": 21})
    assert status == 400 and "top_logprobs" in json.loads(raw)["error"]


def test_a_json_schema_format_shapes_the_answer(ol: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    got = ol.chat(model="tiny", messages=HI, format=schema, options={"num_predict": 40, "seed": 3})
    assert got.done_reason == "stop" and set(json.loads(got.message.content)) == {"ok"}


@pytest.mark.parametrize(("call", "needle"), [
    ({"messages": [{"role": "user", "content": "Hi", "images": ["aGk="]}]}, "images are not supported"),
    ({"messages": HI, "options": {"repeat_penalty": 11}}, "options.repeat_penalty must be in (0, 10]"),  # its names
    # an option of the wrong type, in Ollama's words (Options.FromMap's), kestrel's options and the ones it ignores
    ({"messages": HI, "options": {"temperature": "hot"}}, 'option "temperature" must be of type float32'),
    ({"messages": HI, "options": {"top_k": True}}, 'option "top_k" must be of type integer'),
    ({"messages": HI, "options": {"stop": "x"}}, 'option "stop" must be of type array'),
    ({"messages": HI, "options": {"stop": ["x", 1]}}, 'option "stop" must be of an array of strings'),
    ({"messages": HI, "options": {"num_ctx": "4k"}}, 'option "num_ctx" must be of type integer'),
    ({"messages": HI, "options": {"use_mmap": 1}}, 'option "use_mmap" must be of type boolean'),
    # a format that is neither "json" nor a schema: Ollama's words, the value quoted as Go's %q quotes its JSON
    ({"messages": HI, "format": "xml"}, 'invalid format: "\\"xml\\""; expected "json" or a valid JSON Schema object'),
    ({"messages": HI, "format": 5}, 'invalid format: "5"; expected "json" or a valid JSON Schema object'),
    ({"messages": HI, "think": "deep"},
     'invalid think value: "deep" (must be "high", "medium", "low", "max", true, or false)'),
    ({"messages": HI, "think": 1},
     'think must be a boolean or string ("high", "medium", "low", "max", true, or false)'),
    ({"messages": HI, "top_logprobs": 21}, "top_logprobs must be between 0 and 20"),
    ({"messages": HI, "top_logprobs": -1}, "top_logprobs must be between 0 and 20"),
    ({"messages": HI, "think": True}, '"tiny" does not support thinking'),  # as Ollama answers it
    ({"messages": [{"role": "robot", "content": "Hi"}]}, "role"),
])
def test_bad_chat_requests_are_400_with_ollamas_error(server: KestrelServer, call: dict[str, Any],
                                                      needle: str) -> None:
    status, _, raw = http("POST", f"{server.url}/api/chat", {"model": "tiny", "stream": False, **call})
    body = json.loads(raw)
    assert status == 400 and set(body) == {"error"} and needle in body["error"]


@pytest.mark.parametrize("raw", [False, True])
def test_generate_refuses_a_format_in_ollamas_words(server: KestrelServer, raw: bool) -> None:
    status, _, answer = http("POST", f"{server.url}/api/generate", {"model": "tiny", "prompt": "Hi", "raw": raw,
                                                                    "format": "xml", "stream": False})
    assert status == 400 and json.loads(answer) == {
        "error": 'invalid format: "\\"xml\\""; expected "json" or a valid JSON Schema object'}


def test_a_client_that_leaves_a_stream_frees_its_sequence(ol: ollama.Client, async_engine: AsyncEngine,
                                                          engine: Any) -> None:
    stream = ol.chat(model="tiny", messages=HI, options={"num_predict": 200, "temperature": 0}, stream=True)
    next(stream), next(stream)
    assert async_engine.num_running == 1
    stream.close()
    wait_until(lambda: not async_engine.num_running and engine.pool.free_blocks == engine.pool.num_blocks,
               "the sequence freed")


# -- fill in the middle, embeddings ---------------------------------------------------------------------


def test_generate_with_a_suffix_fills_the_middle() -> None:
    with fim_engine() as engine, running_server(AsyncEngine(engine), "fim") as server:
        ol, oa = ollama.Client(host=server.url), openai_client(server)
        got = ol.generate(model="fim", prompt="def f(x):\n    return", suffix="\n\nf(1)\n", options=GREEDY)
        want = oa.completions.create(model="fim", prompt="def f(x):\n    return", suffix="\n\nf(1)\n",
                                     temperature=0, max_tokens=12)
        assert got.response == want.choices[0].text and got.prompt_eval_count == want.usage.prompt_tokens
        assert "insert" in ol.show("fim").capabilities


def test_embed_is_the_openai_vectors_and_truncates_by_default() -> None:
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3-embed"), backend="cpu") as engine, \
            running_server(AsyncEngine(engine), "embed") as server:
        ol, oa = ollama.Client(host=server.url), openai_client(server)
        assert ol.show("embed").capabilities == ["embedding"]
        got = ol.embed(model="embed", input=["Paris", "Rome"], dimensions=16)
        want = oa.embeddings.create(model="embed", input=["Paris", "Rome"], dimensions=16, encoding_format="float")
        assert np.allclose(got.embeddings, [d.embedding for d in want.data], atol=1e-6)
        assert got.prompt_eval_count == want.usage.prompt_tokens
        long = "Paris " * 400  # past the 256-token context
        assert len(ol.embed(model="embed", input=long).embeddings[0]) == 64
        with pytest.raises(ollama.ResponseError, match="context") as info:
            ol.embed(model="embed", input=long, truncate=False)
        assert info.value.status_code == 400
        legacy = ol.embeddings(model="embed", prompt="Paris")
        assert np.allclose(legacy.embedding, oa.embeddings.create(model="embed", input="Paris").data[0].embedding)
        with pytest.raises(ollama.ResponseError, match="embedding model"):
            ol.chat(model="embed", messages=HI)


def _ollamas_embedding(vector: list[float], dimensions: int) -> np.ndarray:
    """What Ollama's EmbedHandler makes of a model's vector: scaled to unit length, then, where ``dimensions`` is
    between 0 and its size, cut to it and scaled again."""
    v = np.asarray(vector, np.float64) / np.linalg.norm(vector)
    return v[:dimensions] / np.linalg.norm(v[:dimensions]) if 0 < dimensions < len(v) else v


def test_embed_answers_unit_vectors_as_ollama_does_and_an_empty_input_loads() -> None:
    """Whatever the model's own vectors, /api/embed's are of unit length, before and after a cut to ``dimensions``
    (0 or past the size: none); the older /api/embeddings answers the model's own. No input answers no vectors."""
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3-embed"), backend="cpu") as engine:
        engine.config = replace(engine.config, normalize_embeddings=False)  # a checkpoint without Normalize
        with running_server(AsyncEngine(engine), "embed") as server:
            ol, oa = ollama.Client(host=server.url), openai_client(server)
            own = [d.embedding for d in oa.embeddings.create(model="embed", input=["Paris", "Rome"]).data]
            assert abs(np.linalg.norm(own[0]) - 1) > 0.1
            for dimensions, size in ((None, 64), (16, 16), (0, 64), (64, 64), (100, 64)):
                got = ol.embed(model="embed", input=["Paris", "Rome"], dimensions=dimensions).embeddings
                want = [_ollamas_embedding(v, dimensions or 0) for v in own]
                assert np.allclose(got, want, atol=1e-6) and len(got[0]) == size, dimensions
            assert np.allclose(ol.embeddings(model="embed", prompt="Paris").embedding, own[0])
            for empty in ("", []):
                assert ol.embed(model="embed", input=empty).embeddings == []
            status, _, raw = http("POST", f"{server.url}/api/embed", {"model": "embed", "input": None})
            assert status == 200 and json.loads(raw)["embeddings"] == []
            assert ol.embeddings(model="embed", prompt="").embedding == []


def test_the_api_key_guards_ollamas_routes_too(engine: Any) -> None:
    with running_server(AsyncEngine(engine), NAME, api_key="sekrit") as server:
        with pytest.raises(ollama.ResponseError) as info:
            ollama.Client(host=server.url).list()
        assert info.value.status_code == 401
        keyed = ollama.Client(host=server.url, headers={"Authorization": "Bearer sekrit"})
        assert [m.model for m in keyed.list().models] == ["tiny:latest"]


@pytest.mark.default_model
def test_a_gguf_model_is_listed_as_gguf() -> None:
    """The default model's source is "NAME (path.gguf)"."""
    with kestrel_core.load(None, backend="cpu") as engine, running_server(AsyncEngine(engine), "smol") as server:
        (model,) = ollama.Client(host=server.url).list().models
        assert model.details.format == "gguf" and str(engine.source).endswith(".gguf)")
