"""Requests to SamplingParams, grammars and template context; errors to OpenAI's params (no model, no server)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kestrel_core.errors import InvalidRequest, KestrelError, Overloaded
from kestrel_core.serve.errors import from_kestrel_error, param_path, validation_error
from kestrel_core.serve.protocol import ChatCompletionRequest, CompletionRequest
from kestrel_core.serve.tools import HERMES, LLAMA3, MISTRAL, MISTRAL_ARGS, UNKNOWN, ToolCalls

from .helpers import HI, chat_request


def test_defaults_follow_openai() -> None:
    p = chat_request().sampling_params(default_max_tokens=100)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.logprobs) == \
        (100, 1.0, 1.0, 0, None, (), False)


def test_fields_reach_sampling_params() -> None:
    p = chat_request(max_tokens=7, temperature=0, top_p=0.5, top_k=3, seed=9, stop="END", presence_penalty=0.5,
                     frequency_penalty=-0.5, logprobs=True, top_logprobs=4, ignore_eos=True,
                     user="u", some_future_field={"x": 1}).sampling_params(100)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (7, 0.0, 0.5, 3, 9, ("END",))
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs, p.top_logprobs, p.ignore_eos) == \
        (0.5, -0.5, True, 4, True)
    vllm = chat_request(min_p=0.1, repetition_penalty=1.1, stop_token_ids=[5, 7], min_tokens=2,
                        skip_special_tokens=False).sampling_params(100)
    assert (vllm.min_p, vllm.repetition_penalty, vllm.stop_token_ids, vllm.min_tokens) == (0.1, 1.1, (5, 7), 2)
    assert vllm.skip_special_tokens is False and chat_request().sampling_params(100).skip_special_tokens is True
    assert chat_request(max_tokens=7, max_completion_tokens=3).sampling_params(100).max_tokens == 3
    c = CompletionRequest.model_validate({"prompt": "x", "logprobs": 0, "stop": ["a", "b"]}).sampling_params(5)
    assert (c.logprobs, c.top_logprobs, c.stop, c.max_tokens) == (True, 0, ("a", "b"), 5)


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"temperature": 101.0}, "temperature"), ({"top_p": -0.1}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"logit_bias": {"1": 500}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"²": 1}}, "logit_bias"), ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"top_logprobs": 1}, "top_logprobs"), ({"stop": ""}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"), ({"min_p": 2.0}, "min_p"),
])
def test_semantic_errors_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        chat_request(**fields).sampling_params(100)
    assert info.value.param == param


def test_content_parts_and_roles() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]})
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]  # the tokenizer joins them where needed
    assert req.template_messages() == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": parts}, {"role": "assistant", "content": ""}]


def test_prompts() -> None:
    def prompts(p: Any) -> Any:
        return CompletionRequest.model_validate({"prompt": p}).prompts()

    assert prompts("hi") == ["hi"] and prompts([1, 2]) == [[1, 2]] and prompts(["hi"]) == ["hi"]
    assert prompts([[3], [4, 5]]) == [[3], [4, 5]] and prompts(["a", "b"]) == ["a", "b"]
    for bad in ([], ["a"] * 129):
        with pytest.raises(InvalidRequest):
            prompts(bad)
    echo_only = CompletionRequest.model_validate({"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 1})
    assert echo_only.sampling_params(10) is None  # scored, nothing generated
    with pytest.raises(InvalidRequest):  # without echo, max_tokens 0 asks for nothing
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": 0}).sampling_params(10)


def _validation_param(model: type, body: dict[str, Any]) -> tuple[str | None, str]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    api = validation_error(RequestValidationError(errors))
    assert api.status == 400
    return api.param, api.message


def test_validation_errors_name_the_field_the_openai_way() -> None:
    assert _validation_param(ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]})[0] == \
        "messages.[0].content"
    assert _validation_param(ChatCompletionRequest, {"messages": [{"role": "user"}]}) == \
        ("messages.[0].content", "messages.[0].content: a user message needs content")
    assert _validation_param(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "text"}]}]}) == \
        ("messages.[0].content", "messages.[0].content: part 1 is a text part without its text")
    assert _validation_param(ChatCompletionRequest, {"messages": HI, "stop": 5}) == \
        ("stop", "stop must be a string or an array of strings")
    assert _validation_param(ChatCompletionRequest, {})[1] == "messages is required"
    # a union with a model member: one field, every member named (not "and 1 more bad field"), in JSON's terms
    assert _validation_param(ChatCompletionRequest, {"messages": HI, "tool_choice": "sometimes"}) == \
        ("tool_choice", "tool_choice must be one of 'none', 'auto', 'required' or an object")
    assert _validation_param(ChatCompletionRequest, {"messages": HI, "temperature": "0.5"}) == \
        ("temperature", "temperature must be a number")
    assert _validation_param(ChatCompletionRequest, {"messages": HI, "reasoning_effort": "max"}) == \
        ("reasoning_effort", "reasoning_effort must be 'none', 'minimal', 'low', 'medium', 'high' or 'xhigh'")
    assert _validation_param(CompletionRequest, {"prompt": {"text": "Hi"}}) == \
        ("prompt", "prompt must be a string, an array of integers, an array of strings or an array of arrays of "
         "integers")
    assert _validation_param(ChatCompletionRequest, {"messages": HI, "temperature": "0.5"})[0] == "temperature"
    assert _validation_param(ChatCompletionRequest, {"messages": HI, "stream": 1})[0] == "stream"
    assert _validation_param(ChatCompletionRequest, {"messages": HI, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": "yes"}})[0] == "stream_options.continuous_usage_stats"
    assert _validation_param(CompletionRequest, {"prompt": [1, "a"]})[0] == "prompt"


def test_param_path() -> None:
    assert param_path(("body", "messages", 3, "content", "list[ContentPart]", 0)) == "messages.[3].content"
    assert param_path(("body",)) is None


def test_engine_errors_map_to_statuses() -> None:
    assert from_kestrel_error(InvalidRequest("bad", param="top_k")).status == 400
    full = from_kestrel_error(Overloaded("full"))
    assert (full.status, full.type, full.headers) == (429, "rate_limit_error", {"Retry-After": "1"})
    assert from_kestrel_error(Overloaded("bye"), accepting=False).status == 503
    assert from_kestrel_error(KestrelError("template failed"), param="messages").param == "messages"


def test_tool_calls_and_results_for_the_template() -> None:
    """Hugging Face templates read a call's arguments as an object (none: an empty one, as vLLM passes it); text
    that is not a JSON object stays text. An earlier answer's reasoning (sent as reasoning_content or reasoning)
    is there under each name templates read: Qwen's (reasoning_content), gpt-oss's (thinking), Seed-OSS's
    (reasoning)."""
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": a}}
             for i, a in enumerate(['{"x": 1}', "not json", "[1]", " "])]
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "content": "done"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "It worked."},
        {"role": "assistant", "content": "Again.", "reasoning": "Once more."}]})
    assert req.template_messages() == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "not json"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "[1]"}},
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "done", "tool_call_id": "c0"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "It worked.", "thinking": "It worked.",
         "reasoning": "It worked."},
        {"role": "assistant", "content": "Again.", "reasoning_content": "Once more.", "thinking": "Once more.",
         "reasoning": "Once more."}]


def test_a_harmony_template_gets_the_reasoning_of_a_call_with_a_preamble() -> None:
    """gpt-oss's template takes one analysis message before a call (content or thinking, not both): an answer's
    reasoning is kept and its preamble left out there; other templates see both, and a call's lone preamble stays."""
    call = [{"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "Need f.", "tool_calls": call},
        {"role": "assistant", "content": "Let me look.", "tool_calls": call},
        {"role": "assistant", "content": "Done.", "reasoning_content": "It worked."}]})
    harmony, other = req.template_messages(harmony=True), req.template_messages()
    assert (harmony[0]["content"], harmony[0]["thinking"]) == ("", "Need f.")
    assert (other[0]["content"], other[0]["thinking"]) == ("Let me look.", "Need f.")
    assert harmony[1:] == other[1:] and harmony[1]["content"] == "Let me look." and harmony[2]["content"] == "Done."


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}


@pytest.mark.parametrize(("fields", "fmt", "expected"), [
    ({}, HERMES, None),  # no tools offered
    ({"tools": [TOOL]}, HERMES, ToolCalls(HERMES, schemas={"f": {"type": "object"}})),
    ({"tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": False}, MISTRAL,
     ToolCalls(MISTRAL, False, {"f": {"type": "object"}})),
    ({"tools": [TOOL], "tool_choice": "none"}, None, None),  # not shown to the model, so no template needed
])
def test_a_requests_tool_calls(fields: dict[str, Any], fmt: str | None, expected: ToolCalls | None) -> None:
    req = chat_request(**fields)
    assert req.tool_calls(fmt) == expected
    assert req.template_context()["tools"] == (None if expected is None else [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])


@pytest.mark.parametrize(("fields", "fmt", "param", "says"), [
    ({}, None, "tools", "does not render tools"),
    ({}, UNKNOWN, "tools", "none of the formats"),
])
def test_tool_calls_kestrel_cannot_read(fields: dict[str, Any], fmt: str | None, param: str, says: str) -> None:
    with pytest.raises(InvalidRequest, match=says) as info:
        chat_request(tools=[TOOL], **fields).tool_calls(fmt)
    assert info.value.param == param


@pytest.mark.parametrize(("fields", "fmt", "needle"), [
    ({}, None, None),
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, None, '"type":"object"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "array"}}}}, None,
     '"type":"array"'),
    ({"tools": [TOOL], "tool_choice": "auto"}, HERMES, None),
    ({"tools": [TOOL], "tool_choice": "required"}, HERMES, 'block ("\\n" block)*'),
    ({"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}, LLAMA3, "start: call\n"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, MISTRAL, '<[9]> " "? "["'),
    ({"tools": [TOOL], "tool_choice": "required"}, MISTRAL_ARGS, 'call0: <[9]> "f"'),
])
def test_the_grammar_an_answer_keeps_to(fields: dict[str, Any], fmt: str | None, needle: str | None) -> None:
    req = chat_request(**fields)
    grammar = req.grammar(req.tool_calls(fmt), {"[TOOL_CALLS]": 9})
    assert (grammar is None) == (needle is None)
    if needle is not None:
        assert needle in grammar.replace(" ", "") if needle.startswith('"') else needle in grammar


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"response_format": {"type": "xml"}}, "response_format", "must be"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, "response_format", "must be"),
    ({"tool_choice": "required"}, "tool_choice", "offers no tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "'g'"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot both"),
])
def test_grammars_kestrel_cannot_make(fields: dict[str, Any], param: str, says: str) -> None:
    req = chat_request(**fields)
    with pytest.raises(InvalidRequest, match=says) as info:
        req.grammar(req.tool_calls(HERMES))
    assert info.value.param == param




def test_reasoning_effort_reaches_the_template_and_none_turns_thinking_off() -> None:
    assert chat_request(reasoning_effort="none").template_context() == {
        "reasoning_effort": "none", "enable_thinking": False, "tools": None}
    assert chat_request(reasoning_effort="high").template_context() == {"reasoning_effort": "high", "tools": None}
    asked = chat_request(reasoning_effort="minimal", chat_template_kwargs={"enable_thinking": True})
    assert asked.template_context()["enable_thinking"] is True  # the template's own variable wins


def test_a_lone_surrogate_is_found_however_deep() -> None:
    """The walk has a stack of its own: a body nested as deep as the JSON parser allows is still read whole."""
    import json

    from kestrel_core.serve.errors import APIError

    deep = json.loads('{"messages": [{"role": "user", "content": "Hi"}], "stop": ' + "[" * 900 + '"\\udc80"'
                      + "]" * 900 + "}")
    with pytest.raises(APIError) as info:
        ChatCompletionRequest.model_validate(deep)
    assert info.value.status == 400 and info.value.param.startswith("stop.[0].[0]")
    with pytest.raises(APIError, match="not Unicode text") as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}],
                                              "metadata": {"\ud800": 1}})
    assert info.value.param == "metadata.\\ud800" and info.value.response().body  # quoted: it encodes
