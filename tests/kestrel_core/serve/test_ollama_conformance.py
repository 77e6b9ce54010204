"""Ollama's API through a real server, field by field against Ollama's Go server (api/types.go, server/routes.go):
what its clients read (the heartbeat's text, the tool calls' ids, ``context``, the errors they match) and what they
send (ids of earlier calls, ``raw`` with ``system``, ``format`` with ``raw``)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import ollama
import openai
import pytest

from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.serve import app
from kestrel_core.serve.app import Models, Served
from kestrel_core.serve.ollama import card, show_model
from kestrel_core.serve.server import KestrelServer

from .helpers import http, scripted_ollama
from .tool_calls import PARIS, THINKING_TEMPLATE, TIME, WEATHER, _call

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
NAME = "tiny"
HI = [{"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def ol(server: KestrelServer) -> ollama.Client:
    return ollama.Client(host=server.url)


def test_the_heartbeat_is_ollamas(server: KestrelServer) -> None:
    """Ollama's CLI checks a server with HEAD / before anything else; clients that detect an Ollama server compare
    GET /'s text with "Ollama is running"; HEAD /api/version and /api/tags are Ollama's health checks too."""
    for method in ("HEAD", "GET"):
        status, _, body = http(method, f"{server.url}/")
        assert status == 200 and body == (b"" if method == "HEAD" else b"Ollama is running")
    for path in ("/api/version", "/api/tags"):
        status, _, body = http("HEAD", f"{server.url}{path}")
        assert (status, body) == (200, b"")
        status, _, body = http("GET", f"{server.url}{path}")
        assert status == 200 and json.loads(body)


# renders each call's id and each result's tool_call_id (written for this test; the comment makes its calls Hermes')
IDS_TEMPLATE = (
    "{# <tool_call> #}{% if tools %}[tools]{% endif %}{% for m in messages %}{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}[call {{ c.id }} {{ c.function.name }}]{% endfor %}{% elif m.role == 'tool' %}"
    "[result {{ m.tool_call_id }} {{ m.content }}]{% else %}[{{ m.role }}]{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}")
TWO_CALLS = PARIS + "\n" + _call("get_time", {})


def test_tool_calls_carry_ids_that_results_name(engine: Any) -> None:
    """As Ollama's answers: each call has an id and its place among the answer's calls (``function.index``), whole
    and streamed; sent back, a result's ``tool_call_id`` names the call it answers, whatever the order."""
    with scripted_ollama(engine, NAME, IDS_TEMPLATE) as (front, _, server):
        url = server.url
        ask = {"model": NAME, "messages": [{"role": "user", "content": "Weather and time?"}], "tools": [WEATHER, TIME]}
        front.answers += [TWO_CALLS, TWO_CALLS]
        status, _, raw = http("POST", f"{url}/api/chat", {**ask, "stream": False})
        calls = json.loads(raw)["message"]["tool_calls"]
        lines = [json.loads(line) for line in http("POST", f"{url}/api/chat", ask)[2].splitlines()]
        streamed = [c for line in lines for c in line["message"].get("tool_calls", ())]
        for got in (calls, streamed):
            assert [(c["function"]["index"], c["function"]["name"]) for c in got] == [(0, "get_weather"),
                                                                                      (1, "get_time")]
            assert all(isinstance(c["id"], str) and c["id"] for c in got) and len({c["id"] for c in got}) == 2
        front.answers.append("Sunny at noon.")
        history = ask["messages"] + [{"role": "assistant", "content": "", "tool_calls": calls},
                                     {"role": "tool", "content": "12:00", "tool_call_id": calls[1]["id"]},
                                     {"role": "tool", "content": "sunny", "tool_call_id": calls[0]["id"]}]
        status, _, raw = http("POST", f"{url}/api/chat", {**ask, "messages": history, "stream": False})
        assert status == 200 and json.loads(raw)["message"]["content"] == "Sunny at noon."
        called = dict(pair.split()[::-1] for pair in re.findall(r"\[call (\S+ \S+)\]", front.prompts[-1]))
        assert f"[result {called['get_time']} 12:00][result {called['get_weather']} sunny]" in front.prompts[-1]


def test_tools_are_read_as_ollama_reads_them(engine: Any, server: KestrelServer) -> None:
    """A tool without a ``type`` is a function, as Ollama's tools are; tools offered to a model whose template has
    none are a 400 in Ollama's words, which clients match to ask again without them."""
    untyped = {"function": WEATHER["function"]}
    status, _, raw = http("POST", f"{server.url}/api/chat", {"model": NAME, "messages": HI, "tools": [untyped]})
    assert status == 400 and json.loads(raw)["error"].endswith("does not support tools")
    with scripted_ollama(engine, NAME, THINKING_TEMPLATE) as (front, ol, _):
        front.answers.append(PARIS)
        (call,) = ol.chat(model=NAME, messages=HI, tools=[untyped], think=False).message.tool_calls
        assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Paris"})


def _tokenize(server: KestrelServer, **body: Any) -> list[int]:
    """vLLM's /tokenize of ``body``: a chat prompt's ids (``messages``) or a text's (``prompt``)."""
    return json.loads(http("POST", f"{server.url}/tokenize", {"model": NAME, **body})[2])["tokens"]


def test_generate_answers_its_context_and_follows_one(ol: ollama.Client, client: openai.OpenAI,
                                                      server: KestrelServer) -> None:
    """As Ollama's: a templated answer's ``context`` is the ids of its prompt and of its text, whole and streamed;
    a request's ``context`` comes before its prompt, so the model reads the earlier exchange; a raw answer has
    none, and a raw request with ``context``, ``system`` or ``template`` is a 400 in Ollama's words."""
    first = ol.generate(model=NAME, prompt="Hi", options=GREEDY)
    rendered = _tokenize(server, messages=HI)
    assert first.context == rendered + _tokenize(server, prompt=first.response, add_special_tokens=False)
    parts = list(ol.generate(model=NAME, prompt="Hi", options=GREEDY, stream=True))
    assert parts[-1].context == first.context and all(p.context is None for p in parts[:-1])
    second = ol.generate(model=NAME, prompt="Hi", options=GREEDY, context=first.context)
    want = client.completions.create(model=NAME, prompt=first.context + rendered, temperature=0, max_tokens=12)
    assert second.response == want.choices[0].text and second.prompt_eval_count == want.usage.prompt_tokens
    assert second.context[:len(first.context) + len(rendered)] == first.context + rendered
    assert ol.generate(model=NAME, prompt="The sea", raw=True, options=GREEDY).context is None
    for field in ({"context": first.context}, {"system": "Be brief."}, {"template": "{{ .Prompt }}"}):
        status, _, raw = http("POST", f"{server.url}/api/generate",
                              {"model": NAME, "prompt": "Hi", "raw": True, "stream": False, **field})
        assert (status, json.loads(raw)) == (400, {"error": "raw mode does not support template, system, or context"})


# a template that opens with the BOS (written for this test; tiny-qwen3's BOS is <|endoftext|>)
BOS_TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]"


def test_a_context_is_followed_by_the_prompt_without_its_bos(engine: Any) -> None:
    """The earlier prompt's BOS opens the context; the next prompt's own is left out after it, as Ollama's runner
    adds one BOS to the whole."""
    with scripted_ollama(engine, NAME, BOS_TEMPLATE) as (front, ol, _):
        front.answers += ["Hello.", "Bye."]
        first = ol.generate(model=NAME, prompt="Hi")
        assert front.prompts[-1] == "<|endoftext|>[user]Hi[assistant]"
        ol.generate(model=NAME, prompt="Go", context=first.context)
        assert front.prompts[-1] == "<|endoftext|>[user]Hi[assistant]Hello.[user]Go[assistant]"


def test_a_template_other_than_the_models_is_refused(ol: ollama.Client, engine: Any) -> None:
    """kestrel renders the model's own chat template, which a client may send back from /api/show; another (Ollama's
    Go templates) is a 400 rather than a prompt written in a format the client did not ask for."""
    own = ol.generate(model=NAME, prompt="Hi", options=GREEDY, template=engine.tokenizer.chat_template)
    assert own.response == ol.generate(model=NAME, prompt="Hi", options=GREEDY).response
    with pytest.raises(ollama.ResponseError, match="template is not supported") as info:
        ol.generate(model=NAME, prompt="Hi", template="{{ .System }} {{ .Prompt }}")
    assert info.value.status_code == 400


def test_a_format_shapes_a_raw_answer_too(ol: ollama.Client) -> None:
    """Ollama's format is a grammar on any generation, a raw prompt's included."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for fmt in ("json", schema):
        got = ol.generate(model=NAME, prompt="The sea", raw=True, format=fmt, options={"num_predict": 40, "seed": 3})
        assert got.done_reason == "stop" and isinstance(json.loads(got.response), dict)
    assert set(json.loads(got.response)) == {"ok"}


def test_answers_name_the_model_as_the_request_does(ol: ollama.Client) -> None:
    """Ollama's answers repeat the request's ``model`` as sent, every streamed line and a load's answer too."""
    for name in ("tiny", "TINY:latest"):
        answers = [ol.chat(model=name, messages=HI, options=GREEDY), ol.generate(model=name, prompt="Hi",
                                                                                 options=GREEDY),
                   *ol.chat(model=name, messages=HI, options=GREEDY, stream=True),
                   *ol.generate(model=name, prompt="Hi", options=GREEDY, stream=True),
                   ol.generate(model=name, prompt=""), ol.chat(model=name, messages=[], keep_alive=0),
                   ol.embed(model=name, input="Hi"), ol.embed(model=name, input=[])]
        assert {answer.model for answer in answers} == {name}


def test_models_are_listed_with_ollamas_fields(ol: ollama.Client, engine: Any, async_engine: AsyncEngine,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """/api/tags and /api/ps give each model a digest of SHA-256's shape (clients key models by it; Ollama's CLI
    shows its first 12 characters as the id, and `ollama ls` and `ollama ps` fail on a shorter one), /api/show its
    modified_at, and /api/ps the bytes a GPU holds as size_vram (the
    whole model there, none on the CPU: Ollama's CLI says "100% GPU" or "100% CPU" from it)."""
    (listed,) = ol.list().models
    (running,) = ol.ps().models
    assert re.fullmatch("[0-9a-f]{64}", listed.digest) and running.digest == listed.digest
    other = Models({"tiny": async_engine, "other": async_engine})
    assert len({card(served)["digest"] for served in other}) == 2
    assert ol.show(NAME).modified_at == listed.modified_at is not None
    assert running.size_vram == 0 and running.size == listed.size > 0
    monkeypatch.setattr(engine.backend, "info", replace(engine.backend.info, kind="gpu"))
    assert ol.ps().models[0].size_vram == listed.size


def _checkpoint_parameters(path: Path) -> int:
    """The elements of every tensor a safetensors file's header lists (its 8-byte length, then its JSON)."""
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def test_show_gives_the_parameter_count_that_ollamas_cli_prints(ol: ollama.Client, async_engine: AsyncEngine,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``ollama show`` prints ``general.parameter_count`` as the model's "parameters" (where ``details`` has no
    ``parameter_size``): every tensor's elements, the tied lm_head once, counted once per model."""
    want = _checkpoint_parameters(FIXTURES / "tiny-qwen3" / "model.safetensors")
    assert want == 328_512  # the 512x64 embedding, 3 layers of 7 projections and 4 norms, the final norm
    shown = ol.show(NAME)
    assert shown.modelinfo["general.parameter_count"] == want and shown.details.parameter_size == "0.3M"
    counted: list[Any] = []
    monkeypatch.setattr(app, "parameter_count", lambda model: counted.append(model) or want)
    served = Served(async_engine, "again")
    assert [show_model(served)["model_info"]["general.parameter_count"] for _ in range(2)] == [want] * 2
    assert card(served)["details"]["parameter_size"] == "0.3M" and len(counted) == 1


# each turn between tags, the answer's opened after the last (written for this test)
TAGS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_last_assistant_message_is_continued(engine: Any) -> None:
    """As Ollama's templates leave a last assistant turn open (a prefill, a client's "continue"): the answer goes
    on from its text; an empty one is the turn the answer opens."""
    with scripted_ollama(engine, NAME, TAGS_TEMPLATE) as (front, ol, _):
        ask = {"role": "user", "content": "JSON, please."}
        front.answers += [' "yes"}', ' "yes"}', "Hello."]
        got = ol.chat(model=NAME, messages=[ask, {"role": "assistant", "content": '{"ok":'}])
        assert got.message.content == ' "yes"}'
        assert front.prompts[-1] == '<user>JSON, please.</user><assistant>{"ok":'
        parts = list(ol.chat(model=NAME, messages=[ask, {"role": "assistant", "content": '{"ok":'}], stream=True))
        assert "".join(p.message.content for p in parts) == ' "yes"}' and front.prompts[-1].endswith('{"ok":')
        ol.chat(model=NAME, messages=[ask, {"role": "assistant", "content": ""}])
        assert front.prompts[-1] == "<user>JSON, please.</user><assistant>"
