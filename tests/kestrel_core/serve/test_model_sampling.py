"""The sampling a model recommends (``Engine.sampling_defaults``) as the default of every API's requests, through a
real server and the official clients: a field a request leaves unset takes the model's value, else the API's."""

from __future__ import annotations

from typing import Any

import anthropic
import ollama
import openai
import pytest

from kestrel_core.serve.server import KestrelServer

from .helpers import http

NAME = "tiny"
HI = [{"role": "user", "content": "Tell me about the sea"}]
RECOMMENDED = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.3}
# greedy with a strong repetition penalty: what a recommendation does to a request without a seed stays comparable
GREEDY_PENALIZED = {"temperature": 0.0, "repetition_penalty": 3.0}


@pytest.fixture
def recommends(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Let the served model recommend ``sampling`` for one test."""
    return lambda sampling: monkeypatch.setattr(engine, "sampling_defaults", dict(sampling))


def _chat(client: openai.OpenAI, **kw: Any) -> str:
    extra = {k: kw.pop(k) for k in ("top_k", "min_p", "repetition_penalty") if k in kw}
    answer = client.chat.completions.create(model=NAME, messages=HI, max_tokens=12, seed=5, extra_body=extra, **kw)
    return answer.choices[0].message.content or ""


def test_unset_fields_take_the_models_recommendation(client: openai.OpenAI, recommends: Any) -> None:
    recommends(RECOMMENDED)
    implicit = _chat(client)
    assert implicit == _chat(client, **RECOMMENDED)
    openai_defaults = _chat(client, temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    assert implicit != openai_defaults
    assert _chat(client, temperature=0.0) == _chat(client, **{**RECOMMENDED, "temperature": 0.0})  # one overridden
    recommends({})  # kestrel serve --no-model-sampling
    assert _chat(client) == openai_defaults


def test_completions_take_it_too(client: openai.OpenAI, recommends: Any) -> None:
    def complete(**extra: Any) -> str:
        return client.completions.create(model=NAME, prompt="The sea", max_tokens=12, temperature=0,
                                         extra_body=extra).choices[0].text

    recommends({"repetition_penalty": 3.0})
    assert complete() == complete(repetition_penalty=3.0) != complete(repetition_penalty=1.0)


def test_stop_token_ids_and_min_tokens_reach_the_engine(client: openai.OpenAI, engine: Any) -> None:
    """vLLM's extensions, which a client sends in extra_body: neither is ignored."""
    def complete(**extra: Any) -> Any:
        return client.completions.create(model=NAME, prompt="The sea", max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True, **extra})

    (first,) = engine.generate(engine.tokenizer.encode("The sea"), max_tokens=1, stop_at_eos=False)
    free = complete()
    assert free.usage.completion_tokens == 10
    stopped = complete(stop_token_ids=[first])
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].text == ""  # the stop token's text is left out, as the end of text's is
    kept = complete(stop_token_ids=[first], include_stop_str_in_output=True)  # vLLM's: then it is kept
    assert kept.choices[0].text and free.choices[0].text.startswith(kept.choices[0].text)
    assert kept.usage.completion_tokens == 1
    held = complete(stop_token_ids=[first], min_tokens=4)
    assert held.usage.completion_tokens >= 4 and held.choices[0].text != free.choices[0].text
    as_string = complete(stop=[free.choices[0].text[:1]])  # the answer's first character: an empty answer
    assert as_string.choices[0].text == ""
    assert complete(stop=[free.choices[0].text[:1]], min_tokens=4).choices[0].text[:1] == free.choices[0].text[:1]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 1},
                                      {"temperature": 0.8, "top_k": 3, "seed": 1}])
def test_min_tokens_that_holds_back_the_whole_vocabulary_is_a_400(client: openai.OpenAI, engine: Any,
                                                                  sampling: dict[str, Any]) -> None:
    """Every logit at -inf leaves nothing to sample: such a request can never keep to min_tokens."""
    every = list(range(engine.config.vocab_size))
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=NAME, prompt="The sea", max_tokens=8,
                                  extra_body={"min_tokens": 2, "stop_token_ids": every, **sampling})
    assert caught.value.body["param"] == "min_tokens"
    # the end of text left free (with ignore_eos min_tokens holds back only the stop token ids): answered
    for extra in ({"stop_token_ids": [t for t in every if t not in engine.eos_token_ids], "ignore_eos": True},
                  {"stop_token_ids": every[1:], "ignore_eos": True}):
        answer = client.completions.create(model=NAME, prompt="The sea", max_tokens=8,
                                           extra_body={"min_tokens": 2, **extra, **sampling})
        assert answer.usage.completion_tokens >= 1


def test_completions_max_tokens_left_out_is_openais_16(client: openai.OpenAI, engine: Any) -> None:
    """OpenAI's and vLLM's default on the legacy route (chat's is what the context leaves); null asks for that."""
    def complete(**kw: Any) -> Any:
        return client.completions.create(model=NAME, prompt="The sea", temperature=0,
                                         extra_body={"ignore_eos": True}, **kw)

    left_out = complete()
    assert left_out.usage.completion_tokens == 16 and left_out.choices[0].finish_reason == "length"
    context_left = engine.config.max_position - len(engine.tokenizer.encode("The sea"))
    assert complete(max_tokens=None).usage.completion_tokens == context_left


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("min_p", 1.5, "min_p must be in [0, 1]"), ("repetition_penalty", 0, "repetition_penalty must be in (0, 10]"),
    ("min_p", "0.1", "min_p"),
])
def test_bad_extension_values_are_400_naming_the_field(server: KestrelServer, field: str, value: Any,
                                                       needle: str) -> None:
    status, _, raw = http("POST", f"{server.url}/v1/chat/completions",
                          {"model": NAME, "messages": HI, "max_tokens": 2, field: value})
    assert status == 400 and needle in raw.decode() and field in raw.decode()


def test_anthropic_and_responses_requests_take_it(server: KestrelServer, client: openai.OpenAI,
                                                  recommends: Any) -> None:
    recommends(GREEDY_PENALIZED)
    want = _chat(client, **GREEDY_PENALIZED)
    assert want != _chat(client, temperature=0.0, repetition_penalty=1.0)
    an = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    message = an.messages.create(model=NAME, max_tokens=12, messages=HI)
    assert message.content[0].text == want  # type: ignore[union-attr]
    response = client.responses.create(model=NAME, input=HI[0]["content"], max_output_tokens=12)
    assert response.output_text == want


def test_ollama_options_default_to_the_recommendation_then_ollamas(server: KestrelServer, recommends: Any) -> None:
    ol = ollama.Client(host=server.url)

    def chat(**options: Any) -> str:
        return ol.chat(model=NAME, messages=HI, options={"seed": 5, "num_predict": 12, **options}).message.content

    recommends(RECOMMENDED)
    assert ol.show(NAME).parameters == "temperature 0.7\ntop_p 0.9\ntop_k 5\nrepeat_penalty 1.3"
    implicit = chat()
    assert implicit == chat(temperature=0.7, top_p=0.9, top_k=5, repeat_penalty=1.3)
    recommends({})
    assert ol.show(NAME).parameters in ("", None)
    assert chat() == chat(temperature=0.8, top_k=40, top_p=0.9) != implicit  # Ollama's own defaults


def test_a_response_says_the_temperature_and_top_p_it_ran_with(client: openai.OpenAI, recommends: Any) -> None:
    """As OpenAI's Responses API: the response's temperature and top_p are those its answer sampled with, also
    where the request left them out (the model's recommendation, else the chat request's 1 and 1), whole and in
    the stream's first and last events."""
    kw: dict[str, Any] = {"model": NAME, "input": "Hi", "max_output_tokens": 2}

    def said(**more: Any) -> tuple[float | None, float | None]:
        got = client.responses.create(**kw, **more)
        with client.responses.stream(**kw, **more) as stream:
            events = list(stream)
        assert (events[0].type, events[-1].type) == ("response.created", "response.incomplete")  # 2 tokens
        created, final = events[0].response, events[-1].response
        assert (created.temperature, created.top_p) == (final.temperature, final.top_p) == (got.temperature,
                                                                                             got.top_p)
        return got.temperature, got.top_p

    recommends(RECOMMENDED)
    assert said() == (0.7, 0.9)
    assert said(temperature=0.2) == (0.2, 0.9) and said(top_p=0.5) == (0.7, 0.5)
    recommends({})
    assert said() == (1.0, 1.0)
