"""vLLM's request extensions: structured outputs, include_stop_str_in_output, its values of top_k and seed, and
the fields kestrel refuses by name rather than ignore."""

from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest

from kestrel_core.serve.guided import REFUSED_FIELDS
from kestrel_core.serve.server import KestrelServer

NAME = "tiny-qwen3"
HI = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(**{"model": NAME, "messages": HI, "max_tokens": 24, "seed": 1,
                                             "temperature": 1.0, **kwargs})


def _text(client: openai.OpenAI, **extra: Any) -> str:
    return _chat(client, extra_body=extra).choices[0].message.content


@pytest.mark.parametrize("extra", [{"guided_choice": ["yes", "no", "maybe not"]},
                                   {"structured_outputs": {"choice": ["yes", "no", "maybe not"]}}])
def test_a_choice_is_one_of_the_choices(client: openai.OpenAI, extra: dict[str, Any]) -> None:
    answers = {_chat(client, seed=seed, extra_body=extra).choices[0].message.content for seed in range(6)}
    assert answers <= {"yes", "no", "maybe not"}


@pytest.mark.parametrize("extra", [{"guided_regex": "[0-9]{3}-[a-z]{2}"},
                                   {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}])
def test_a_regex_is_matched_whole(client: openai.OpenAI, extra: dict[str, Any]) -> None:
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", _text(client, **extra))


@pytest.mark.parametrize("extra", [{"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)},
                                   {"structured_outputs": {"json": SCHEMA}}])
def test_a_json_schema_is_kept_to(client: openai.OpenAI, extra: dict[str, Any]) -> None:
    answer = _chat(client, max_tokens=40, extra_body=extra).choices[0]
    if answer.finish_reason == "stop":
        value = json.loads(answer.message.content)
        assert set(value) == {"n"} and isinstance(value["n"], int)
    else:  # cut by max_tokens: still the start of such an object
        assert re.fullmatch(r'\{\s*("(n"?)?(\s*:\s*-?[0-9]*)?)?', answer.message.content)


def test_completions_take_structured_outputs_too(client: openai.OpenAI) -> None:
    text = client.completions.create(model=NAME, prompt="The answer:", max_tokens=8, seed=3,
                                     extra_body={"guided_regex": "[a-c]{4}"}).choices[0].text
    assert re.fullmatch("[a-c]{4}", text)


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_regex": "[0-9]", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1]}, "guided_json"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= \"a\""}}, "structured_outputs.grammar"),
    ({"guided_regex": "[0-9]", "response_format": {"type": "json_object"}}, "response_format"),
    *[({name: True if name == "use_beam_search" else [1]}, name) for name in REFUSED_FIELDS],
])
def test_what_cannot_be_honoured_is_a_400_naming_it(client: openai.OpenAI, extra: dict[str, Any],
                                                    param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, extra_body=extra)
    assert caught.value.body["param"] == param


def test_use_beam_search_false_is_no_request_for_it(client: openai.OpenAI) -> None:
    assert _chat(client, extra_body={"use_beam_search": False}).choices[0].message.content is not None


def test_the_stop_string_ends_the_text_with_include_stop_str_in_output(client: openai.OpenAI) -> None:
    free = _chat(client, temperature=0).choices[0].message.content
    stop = free[len(free) // 2:len(free) // 2 + 2]
    assert stop.strip(), free
    cut = free[:free.index(stop)]
    without = _chat(client, temperature=0, stop=[stop])
    assert without.choices[0].message.content == cut
    for stream in (False, True):
        answer = _chat(client, temperature=0, stop=[stop], stream=stream,
                       extra_body={"include_stop_str_in_output": True})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        else:
            text = answer.choices[0].message.content
        assert text == cut + stop


def test_vllms_top_k_of_minus_one_is_off_and_a_negative_seed_is_a_seed(client: openai.OpenAI) -> None:
    assert _text(client, top_k=-1) == _text(client, top_k=0)
    negative = [_chat(client, seed=-7).choices[0].message.content for _ in range(2)]
    assert negative[0] == negative[1]
    with pytest.raises(openai.BadRequestError):
        _text(client, top_k=-2)


def test_a_server_without_them_answers_as_before(server: KestrelServer, client: openai.OpenAI) -> None:
    assert _text(client) == _text(client, guided_regex=None, structured_outputs=None)
