"""llama.cpp's ``/infill`` through a real server, driven with httpx as llama.vscode (src/llama-server.ts) and
llama.vim (autoload/llama.vim) send it, since llama.cpp has no client library: the prompt's tokens against ids built
here from the tokenizer in llama.cpp's layout, the answer against the engine's own for them, streams, llama.cpp's
``n_indent`` and ``t_max_predict_ms`` stops (over scripted answers, paced), the cut to the context, errors.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing
from typing import Any

import httpx
import pytest

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.fim import fim_prompt_ids
from kestrel_core.model.request import RequestOutput
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.serve.server import KestrelServer

from ..model.test_fim import QWEN, TINY, fim_engine
from ..waits import HANG_GUARD_S
from .helpers import Scripted, assert_stopped, ending_aborted, leave_once_running, running_server

NAME = "fim-infill"
SPECIALS = [*QWEN, "<|repo_name|>"]
PREFIX, PROMPT, SUFFIX = "def add(a, b):\n", "    return", "\n\nprint(add(1, 2))\n"
EXTRA = [{"text": "def sub(a, b):\n    return a - b\n", "time": 1700000000, "filename": "ops.py"}]
VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]


def vscode_body(**fields: Any) -> dict[str, Any]:
    """llama.vscode's completion request (createRequestPayload), with ``fields``."""
    return {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": PROMPT, "n_predict": 16,
            "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, **fields}


def greedy(**fields: Any) -> dict[str, Any]:
    """llama.vscode's request with the temperature sampler, at 0."""
    return vscode_body(**{"samplers": ["top_k", "top_p", "infill", "temperature"], "temperature": 0.0, **fields})


class Recording(AsyncEngine):
    """An AsyncEngine that keeps the prompts (token ids) and the sampling of the requests it runs."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine, max_batch=4)
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None, places: Any = None,
                       priority: int = 0, constraint: Any = None) -> AsyncIterator[RequestOutput]:
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        async with aclosing(super().generate(prompt_ids, params, request_id, places, priority, constraint)) as outputs:
            async for out in outputs:
                yield out


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    with fim_engine(SPECIALS) as e:
        yield e


@pytest.fixture(scope="module")
def async_engine(engine: Any) -> Recording:
    return Recording(engine)


def infill(server: KestrelServer, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/infill", json=body, timeout=HANG_GUARD_S, **kwargs)


def events(server: KestrelServer, body: dict[str, Any], **kwargs: Any) -> list[dict[str, Any]]:
    """A streamed answer's events, each line checked to be ``data: {json}`` or the blank line after one."""
    with httpx.stream("POST", f"{server.url}/infill", json={**body, "stream": True}, timeout=HANG_GUARD_S,
                      **kwargs) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    assert all(line == "" or line.startswith("data: {") for line in lines)  # no [DONE]: llama.cpp sends none
    return [json.loads(line[len("data: "):]) for line in lines if line]


def expected_ids(tok: Any, prefix: str, prompt: str, suffix: str, extra: list[dict[str, Any]]) -> list[int]:
    """llama.cpp's repository-level infill prompt (format_prompt_infill), every part tokenized as text."""
    repo, sep, pre, suf, mid = (tok.backend.token_to_id(t) for t in ("<|repo_name|>", "<|file_sep|>", *QWEN[:3]))
    ids = [repo, *tok.encode_text("myproject\n")]
    for chunk in extra:
        ids += [sep, *tok.encode_text(chunk.get("filename", "tmp") + "\n"), *tok.encode_text(chunk["text"])]
    return [*ids, sep, *tok.encode_text("filename\n"), pre, *tok.encode_text(prefix), *tok.encode_text(prompt), suf,
            *tok.encode_text(suffix), mid]


def engine_answer(engine: Any, ids: list[int], **params: Any) -> tuple[str, int, str]:
    """The engine's own answer to ``ids`` (the format's stops added): its text, tokens and finish reason."""
    stops = fim_prompt_ids(engine.tokenizer, "", "", engine.eos_token_ids)[1]
    outs = list(engine.stream(ids, SamplingParams(stop_token_ids=stops, **params)))
    return "".join(o.new_text for o in outs), sum(len(o.new_token_ids) for o in outs), outs[-1].finish_reason


def test_the_prompt_is_llama_cpps_layout_and_the_answer_the_engines_own(server: KestrelServer, engine: Any,
                                                                       async_engine: Recording) -> None:
    reply = infill(server, greedy())
    assert reply.status_code == 200
    body = reply.json()
    ids = expected_ids(engine.tokenizer, PREFIX, PROMPT, SUFFIX, EXTRA)
    assert async_engine.prompts[-1] == ids and body["tokens_evaluated"] == len(ids)
    assert body["prompt"] == engine.tokenizer.decode(ids)
    text, tokens, finish = engine_answer(engine, ids, max_tokens=16)
    assert (body["content"], body["tokens_predicted"], body["stop"]) == (text, tokens, True)
    assert body["stop_type"] == {"length": "limit", "stop": "eos"}[finish] and body["truncated"] is False
    assert body["model"] == NAME and body["tokens_cached"] == len(ids) + tokens - 1
    timings = body["timings"]
    assert (timings["prompt_n"], timings["predicted_n"]) == (len(ids), tokens)
    assert timings["prompt_ms"] > 0 and timings["predicted_per_second"] > 0


def test_llama_vscodes_samplers_apply_top_k_and_top_p_at_temperature_one(server: KestrelServer, engine: Any,
                                                                        async_engine: Recording) -> None:
    """llama.vscode names top_k, top_p and infill: no temperature sampler, so llama.cpp samples at temperature 1
    (kestrel has no infill sampler); with a seed the answer is the engine's own for that sampling."""
    body = infill(server, vscode_body(seed=7)).json()
    params = async_engine.params[-1]
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.seed) == (1.0, 40, 0.99, 0.0, 7)
    text, _, _ = engine_answer(engine, async_engine.prompts[-1], max_tokens=16, temperature=1.0, top_k=40,
                               top_p=0.99, seed=7)
    assert body["content"] == text
    infill(server, vscode_body(samplers="kt", temperature=0.5, min_p=0.2))  # llama.cpp's letters: top_k, temperature
    params = async_engine.params[-1]
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.5, 40, 1.0, 0.0)
    infill(server, vscode_body(samplers=None))  # none given: llama.cpp's default chain, with its defaults
    params = async_engine.params[-1]
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.8, 40, 0.99, 0.05)


def test_the_penalties_apply_as_llama_cpps_penalties_sampler(server: KestrelServer, async_engine: Recording) -> None:
    """repeat_penalty, presence_penalty and frequency_penalty reach the engine as the completions route's
    repetition, presence and frequency penalties where the chain has llama.cpp's penalties sampler (by default, by
    name or letter "e"); a chain without it, or repeat_last_n 0, leaves them off."""
    def penalties(**fields: Any) -> tuple[float, float, float]:
        assert infill(server, greedy(repeat_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.25,
                                     **fields)).status_code == 200
        params = async_engine.params[-1]
        return params.repetition_penalty, params.presence_penalty, params.frequency_penalty

    assert penalties(samplers=None) == penalties(samplers=["penalties", "temperature"]) == (1.3, 0.5, -0.25)
    assert penalties(samplers="et") == (1.3, 0.5, -0.25)
    assert penalties() == penalties(samplers=None, repeat_last_n=0) == (1.0, 0.0, 0.0)  # llama.vscode's chain
    infill(server, greedy(samplers=None))  # not given: llama.cpp's defaults, which are off
    params = async_engine.params[-1]
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.0, 0.0, 0.0)
    reply = infill(server, greedy(samplers=None, repeat_penalty=0))
    assert reply.status_code == 400 and "repeat_penalty" in reply.json()["error"]["message"]


def test_logit_bias_and_json_schema_apply_as_on_the_completions_route(server: KestrelServer, engine: Any,
                                                                      async_engine: Recording) -> None:
    """llama.cpp's logit_bias, pairs or an object, by token id or by text (each of its tokens), false banning the
    token, reaches the engine as the completions route's; json_schema keeps the answer to the schema, as the
    completions route's guided_json does."""
    word = engine.tokenizer.encode_text("return")
    body = greedy(logit_bias=[[15, 2.5], [16, False], ["return", -3]])
    assert infill(server, body).status_code == 200
    assert dict(async_engine.params[-1].logit_bias) == {15: 2.5, 16: -100.0, **{t: -3.0 for t in word}}
    assert infill(server, greedy(logit_bias={"15": 250, "return": False})).status_code == 200
    assert dict(async_engine.params[-1].logit_bias) == {15: 100.0, **{t: -100.0 for t in word}}
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    reply = infill(server, greedy(json_schema=schema, n_predict=40, ignore_eos=False))
    assert reply.status_code == 200 and async_engine.params[-1].grammar is not None
    if reply.json()["stop_type"] == "eos":
        assert isinstance(json.loads(reply.json()["content"])["x"], int)


def test_the_stream_joins_to_the_whole_answer(server: KestrelServer) -> None:
    whole = infill(server, greedy()).json()
    chunks = events(server, greedy())
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c["content"] for c in chunks) == whole["content"] and chunks[-1]["content"] == ""
    assert chunks[-2]["tokens_predicted"] == chunks[-1]["tokens_predicted"] == whole["tokens_predicted"]
    assert {k: chunks[-1][k] for k in ("stop_type", "tokens_evaluated", "truncated")} == {
        k: whole[k] for k in ("stop_type", "tokens_evaluated", "truncated")}


def test_response_fields_as_llama_vim_asks_for_them(server: KestrelServer) -> None:
    whole = infill(server, greedy()).json()
    picked = infill(server, greedy(response_fields=VIM_FIELDS)).json()
    assert set(picked) == set(VIM_FIELDS)  # each under its path as given
    assert (picked["content"], picked["truncated"], picked["tokens_cached"]) == (
        whole["content"], False, whole["tokens_cached"])
    assert (picked["timings/prompt_n"], picked["timings/predicted_n"]) == (
        whole["tokens_evaluated"], whole["tokens_predicted"])
    fields = ["generation_settings/n_predict", "timings/nothing", "nothing"]
    assert infill(server, greedy(response_fields=fields)).json() == {"generation_settings/n_predict": 16}
    assert events(server, greedy(response_fields=["content", "stop"]))[-1] == {"content": "", "stop": True}


def test_a_stop_string_is_the_stopping_word(server: KestrelServer) -> None:
    whole = infill(server, greedy()).json()["content"]
    stop = next(whole[i:i + 2] for i in range(1, len(whole) - 1) if whole[i:i + 2].isprintable()
                and whole[i:i + 2] not in whole[:i + 1])
    body = infill(server, greedy(stop=[stop])).json()
    assert (body["content"], body["stop_type"], body["stopping_word"]) == (whole[:whole.index(stop)], "word", stop)


def test_n_predict_0_reads_the_prompt_into_the_prefix_cache(server: KestrelServer, engine: Any) -> None:
    """llama.vim's warm-up: the ring buffer's chunks sent with nothing to predict; the completion after it
    attaches their blocks instead of computing them."""
    chunks = [{"text": f"def helper_{i}(x):\n    return x * {i} + {i * 7}\n", "time": i, "filename": "helpers.py"}
              for i in range(3)]
    warm = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": chunks, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}
    hits = engine.pool.prefix_hit_tokens
    assert infill(server, warm).json() == {}
    assert engine.pool.prefix_hit_tokens == hits  # nothing of it was cached before
    body = infill(server, greedy(input_extra=chunks)).json()
    assert engine.pool.prefix_hit_tokens - hits >= engine.pool.block_size
    assert body["tokens_predicted"] > 0
    silent = infill(server, {**warm, "response_fields": []}).json()
    assert (silent["content"], silent["tokens_predicted"], silent["timings"]["predicted_n"]) == ("", 0, 0)


def test_a_prompt_past_the_context_loses_the_oldest_files_first(server: KestrelServer, engine: Any,
                                                              async_engine: Recording) -> None:
    tok, context = engine.tokenizer, engine.config.max_position
    extra = [{"text": f"x{i} = {i}\n" * 12, "filename": f"f{i}.py"} for i in range(6)]
    full = expected_ids(tok, PREFIX, PROMPT, SUFFIX, extra)
    code = expected_ids(tok, PREFIX, PROMPT, SUFFIX, [])
    code = code[code.index(tok.backend.token_to_id(QWEN[0])):]  # from the prefix token on
    assert len(full) > context
    body = infill(server, greedy(input_extra=extra, n_predict=40)).json()
    kept = context - 40 - len(code)
    assert async_engine.prompts[-1] == full[len(full) - len(code) - kept:]  # the files' last tokens, the code
    assert (body["truncated"], body["tokens_evaluated"]) == (True, context - 40)


def test_a_long_prefix_keeps_its_end_and_the_suffix_its_start(server: KestrelServer, engine: Any,
                                                             async_engine: Recording) -> None:
    tok, context = engine.tokenizer, engine.config.max_position
    prefix = "".join(f"a{i} = {i}\n" for i in range(100))
    suffix = "".join(f"b{i} = {i}\n" for i in range(100))
    body = infill(server, greedy(input_prefix=prefix, input_suffix=suffix, input_extra=[], n_predict=16)).json()
    pre, suf, mid = (tok.backend.token_to_id(t) for t in QWEN[:3])
    prefix_ids, prompt_ids, suffix_ids = tok.encode_text(prefix), tok.encode_text(PROMPT), tok.encode_text(suffix)
    room = context - 16 - (1 + len(prompt_ids) + 2)  # the prefix, suffix and middle tokens
    assert async_engine.prompts[-1] == [pre, *prefix_ids[-(room - room // 4):], *prompt_ids, suf,
                                        *suffix_ids[:room // 4], mid]
    assert (body["truncated"], body["tokens_evaluated"]) == (True, context - 16)


def test_bad_input_is_a_400_in_llama_cpps_shape(server: KestrelServer) -> None:
    cases = [({"input_prefix": None}, "input_prefix"), ({"input_prefix": 5}, "input_prefix"),
             ({"input_extra": "x"}, "input_extra"), ({"input_extra": [{"filename": "a.py"}]}, "input_extra"),
             ({"input_extra": [{"text": "x", "filename": 3}]}, "input_extra"), ({"n_predict": "ten"}, "n_predict"),
             ({"n_predict": 1.5}, "n_predict"), ({"temperature": "hot"}, "temperature"), ({"stop": "x"}, "stop"),
             ({"samplers": 5}, "samplers"), ({"response_fields": "content"}, "response_fields"),
             ({"t_max_predict_ms": "1s"}, "t_max_predict_ms"), ({"top_p": -0.5}, "top_p"), ({"seed": 2 ** 63}, "seed"),
             ({"prompt": "x" * 400}, "prompt"), ({"grammar": "root ::= \"a\""}, "grammar"),
             ({"json_schema": {"type": "wat"}}, "json_schema"), ({"logit_bias": [[15]]}, "logit_bias"),
             ({"logit_bias": [[15, "x"]]}, "logit_bias"), ({"logit_bias": [[10 ** 7, 1]]}, "logit_bias"),
             ({"lora": [{"id": 0, "scale": 0.5}]}, "lora")]
    for fields, name in cases:
        reply = infill(server, greedy(**fields))
        error = reply.json()["error"]
        assert reply.status_code == 400 and set(error) == {"code", "message", "type"}, fields
        assert (error["code"], error["type"]) == (400, "invalid_request_error") and name in error["message"], fields
    reply = infill(server, greedy(model="another"))
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"


def test_a_model_without_fill_in_the_middle_tokens_is_a_501_as_llama_cpps() -> None:
    with kestrel_core.load(str(TINY), backend="cpu") as engine, running_server(AsyncEngine(engine), "tiny") as server:
        reply = infill(server, greedy())
    error = reply.json()["error"]
    assert (reply.status_code, error["code"], error["type"]) == (501, 501, "not_supported_error")
    assert error["message"].startswith("Infill is not supported by this model") and set(error) == {
        "code", "message", "type"}


# -- llama.cpp's stops, over scripted answers ------------------------------------------------------------------


class Paced(Scripted):
    """Scripted answers, an output every ``pause`` seconds; counts the outputs it gave and the answers closed."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.pause, self.given, self.closed = 0.0, 0, 0

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None, places: Any = None,
                       priority: int = 0, constraint: Any = None) -> AsyncIterator[RequestOutput]:
        try:
            async for out in super().generate(prompt_ids, params, request_id, places, priority, constraint):
                if self.given:
                    await asyncio.sleep(self.pause)
                self.given += 1
                yield out
        finally:
            self.closed += 1


KEY = {"Authorization": "Bearer infill-key"}


@pytest.fixture(scope="module")
def paced(engine: Any) -> Iterator[tuple[Paced, KestrelServer]]:
    front = Paced(engine)
    with running_server(front, NAME, api_key="infill-key") as server:
        yield front, server


def scripted(paced: tuple[Paced, KestrelServer], answer: str, pause: float = 0.0, stream: bool = False,
             **fields: Any) -> dict[str, Any]:
    """The answer to a request whose engine says ``answer``, 3 characters an output, ``pause`` seconds apart."""
    front, server = paced
    front.answers, front.pause, front.given, front.closed = [answer], pause, 0, 0
    if stream:
        chunks = events(server, vscode_body(**fields), headers=KEY)
        return {**chunks[-1], "content": "".join(c["content"] for c in chunks)}
    reply = infill(server, vscode_body(**fields), headers=KEY)
    assert reply.status_code == 200
    return reply.json()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("answer", "n_indent", "content"), [
    ("x = 1\n    y = 2\n  z = 3\nw = 4", 4, "x = 1\n    y = 2\n  "),
    ("x = 1\n    y = 2\n  z = 3\nw = 4", 2, "x = 1\n    y = 2\n  z = 3\n"),
    ("x = 1\n\n    y = 2", 4, "x = 1\n"),  # an empty line is under any indentation, as llama.cpp reads it
    ("x = 1\n    y = 2\n", 4, "x = 1\n    y = 2\n"),
])
def test_n_indent_cuts_the_first_line_indented_less(paced: tuple[Paced, KestrelServer], answer: str,
                                                    n_indent: int, content: str, stream: bool) -> None:
    body = scripted(paced, answer, stream=stream, n_indent=n_indent)
    assert (body["content"], body["stop_type"]) == (content, "limit" if content != answer else "eos")


def test_t_max_predict_ms_stops_at_the_first_newline_past_it(paced: tuple[Paced, KestrelServer]) -> None:
    answer = "ab\ncdefghi\njklmnop"  # outputs "ab\n" at 0 s, then "cde", "fgh", "i\nj" 0.2 s apart...
    body = scripted(paced, answer, pause=0.2, t_max_predict_ms=300)
    assert (body["content"], body["stop_type"], body["tokens_predicted"]) == ("ab\ncdefghi\nj", "limit", 4)
    assert (paced[0].given, paced[0].closed) == (4, 1)  # the answer's request ended there
    assert scripted(paced, answer, pause=0.05, t_max_predict_ms=0)["content"] == answer
    streamed = scripted(paced, answer, pause=0.2, stream=True, t_max_predict_ms=300)
    assert (streamed["content"], streamed["stop_type"]) == ("ab\ncdefghi\nj", "limit")


def test_the_api_key_guards_infill(paced: tuple[Paced, KestrelServer]) -> None:
    reply = infill(paced[1], vscode_body())
    assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"


# -- a client that leaves ----------------------------------------------------------------------------------------


def test_a_client_that_leaves_aborts_its_request() -> None:
    """4000 tokens would take seconds: the request ends when the client leaves, streamed or not."""
    with fim_engine(SPECIALS, max_position=4096) as engine:
        ae = AsyncEngine(engine, max_batch=4)
        with running_server(ae, NAME) as server:
            long = greedy(n_predict=4000, ignore_eos=True)
            with ending_aborted(ae), httpx.stream("POST", f"{server.url}/infill", json={**long, "stream": True},
                                                  timeout=HANG_GUARD_S) as r:
                lines = r.iter_lines()
                assert json.loads(next(lines)[len("data: "):])["stop"] is False
                assert ae.num_running == 1
            assert_stopped(ae, engine)
            with ending_aborted(ae):  # the client gives up and leaves
                leave_once_running(server, ae, "/infill", long)
            assert_stopped(ae, engine)
