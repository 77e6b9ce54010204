"""Responses in OpenAI's shapes (serve/responses.py): whole, streamed chunk by chunk, with usage, logprobs,
echoes, tool calls."""

from __future__ import annotations

from kestrel_core.model.sampling import TokenLogprob
from kestrel_core.serve.protocol import CompletionRequest
from kestrel_core.serve.responses import (
    ChatShape,
    ChoiceResult,
    CompletionShape,
    Echo,
    TokenStrings,
    choice_params,
    new_id,
)
from kestrel_core.serve.tools import HERMES, ToolCalls

from .helpers import Letters, chat_request


def test_chat_choices_with_tool_calls() -> None:
    shape = ChatShape("id", "m", TokenStrings(Letters()), tools=ToolCalls(HERMES))
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    body = shape.response([ChoiceResult(["Sure. ", call], None, "stop", 9),
                           ChoiceResult([call], None, "length", 9), ChoiceResult(["plain"], None, "stop", 1)], 3)
    made, cut, plain = (c["message"] for c in body["choices"])
    assert [c["finish_reason"] for c in body["choices"]] == ["tool_calls", "length", "stop"]
    assert made["content"] == "Sure." and made["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert cut["content"] is None and len(cut["tool_calls"]) == 1
    assert plain == {"role": "assistant", "content": "plain", "refusal": None}


def test_chat_shapes() -> None:
    shape = ChatShape(new_id("chatcmpl"), "m", TokenStrings(Letters()), include_usage=True)
    lp = [TokenLogprob(0, -0.1, [(0, -0.1), (1, -2.0)])]
    body = shape.response([ChoiceResult(["a"], lp, "length", 1)], 3)
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "a", "refusal": None},
                                "finish_reason": "length", "logprobs": {"refusal": None, "content": [
                                    {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": [
                                        {"token": "a", "logprob": -0.1, "bytes": [97]},
                                        {"token": "b", "logprob": -2.0, "bytes": [98]}]}]}, "stop_reason": None}]
    stopped = shape.response([ChoiceResult(["a"], None, "stop", 1, stop_reason="\n\n")], 3)["choices"][0]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", "\n\n")
    assert shape.finish_chunk("stop", 0, 7)["choices"][0]["stop_reason"] == 7  # a stop token id
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    assert shape.first_chunks()[0]["choices"][0]["delta"]["role"] == "assistant"
    assert shape.delta_chunk("a", None)["usage"] is None  # include_usage: null on every chunk but the last
    assert shape.finish_chunk("abort")["choices"][0]["finish_reason"] is None
    assert shape.usage_chunk(3, 1)["choices"] == []


def test_continuous_usage_chunks_carry_their_choices_counts() -> None:
    """Each chunk its own choice's prompt tokens and tokens sent so far, as vLLM's; the usage chunk the request's."""
    shape = ChatShape("chatcmpl-x", "m", TokenStrings(Letters()), include_usage=True, continuous_usage=True)
    shape.start_usage([3, 6])
    assert [c["usage"] for c in shape.first_chunks(2)] == \
        [{"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3},
         {"prompt_tokens": 6, "completion_tokens": 0, "total_tokens": 6}]
    shape.add_sent(0, 2)
    shape.add_sent(1, 1)
    shape.add_sent(0, 3)
    first = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert shape.delta_chunk("a", None, 0)["usage"] == shape.finish_chunk("stop", 0)["usage"] == first
    assert shape.delta_chunk("a", None, 1)["usage"] == shape.finish_chunk("stop", 1)["usage"] == \
        {"prompt_tokens": 6, "completion_tokens": 1, "total_tokens": 7}
    assert shape.usage_chunk(3, 6)["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    echoed = CompletionShape("cmpl-x", "m", TokenStrings(Letters()), True, [None, Echo("b", 1, None)],
                             continuous_usage=True)
    echoed.start_usage([4, 2])
    (echo,) = echoed.first_chunks(2)
    assert echo["choices"][0]["index"] == 1 and echo["usage"] == \
        {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}
    alone = CompletionShape("cmpl-x", "m", TokenStrings(Letters()), continuous_usage=True)  # no include_usage
    assert "usage" not in alone.delta_chunk("a", None)
    on = {"include_usage": True, "continuous_usage_stats": True}
    assert chat_request(stream=True, stream_options=on).continuous_usage
    assert not chat_request(stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage
    assert not chat_request(stream=False, stream_options=on).continuous_usage
    assert CompletionRequest.model_validate({"prompt": "x", "stream": True, "stream_options": on}).continuous_usage


def test_choices_in_one_response_and_their_seeds() -> None:
    shape = ChatShape("chatcmpl-x", "m", TokenStrings(Letters()))
    body = shape.response([ChoiceResult(["a", "b"], None, "stop", 2), ChoiceResult(["c"], None, "length", 1)], 5)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == \
        [(0, "ab", "stop"), (1, "c", "length")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert [c["index"] for c in shape.first_chunks(2)[0]["choices"] + shape.first_chunks(2)[1]["choices"]] == [0, 1]
    params = chat_request(seed=2 ** 63 - 1).sampling_params(10)
    assert [choice_params(params, i).seed for i in range(3)] == [2 ** 63 - 1, 0, 1]  # wrapped below 2^63
    unseeded = chat_request().sampling_params(10)
    assert choice_params(unseeded, 1).seed is None and choice_params(params, 1).max_tokens == params.max_tokens


def test_completion_logprobs_offsets_run_on_across_chunks() -> None:
    shape = CompletionShape("cmpl-x", "m", TokenStrings(Letters()))
    first = shape.delta_chunk("ab", [TokenLogprob(0, -1.0, [(0, -1.0)]), TokenLogprob(1, -2.0, [])])
    second = shape.delta_chunk("c", [TokenLogprob(2, -3.0, [(2, -3.0), (3, -4.0)])])
    assert first["object"] == "text_completion" and "usage" not in first
    assert first["choices"][0]["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0],
                                               "top_logprobs": [{"a": -1.0}, {"b": -2.0}], "text_offset": [0, 1]}
    assert second["choices"][0]["logprobs"]["text_offset"] == [2]
    assert second["choices"][0]["logprobs"]["top_logprobs"] == [{"c": -3.0, "d": -4.0}]
    other = shape.delta_chunk("a", [TokenLogprob(0, -1.0, [])], index=1)  # another choice's offsets start at 0
    assert other["choices"][0]["index"] == 1 and other["choices"][0]["logprobs"]["text_offset"] == [0]


def test_echoed_prompt_comes_first_with_no_logprob_for_its_first_token() -> None:
    echo = Echo("ab", 0, [TokenLogprob(1, -0.5, [(1, -0.5)])])
    shape = CompletionShape("cmpl-x", "m", TokenStrings(Letters()), echoes=[echo, None])
    body = shape.response([ChoiceResult(["c"], [TokenLogprob(2, -1.0, [])], "length", 1),
                           ChoiceResult(["d"], [TokenLogprob(3, -2.0, [])], "length", 1)], 2)
    first, second = body["choices"]
    assert first["text"] == "abc" and second["text"] == "d"
    assert first["logprobs"] == {"tokens": ["a", "b", "c"], "token_logprobs": [None, -0.5, -1.0],
                                 "top_logprobs": [None, {"b": -0.5}, {"c": -1.0}], "text_offset": [0, 1, 2]}
    assert second["logprobs"]["text_offset"] == [0]
    streamed = CompletionShape("cmpl-y", "m", TokenStrings(Letters()), echoes=[echo, None])
    (chunk,) = streamed.first_chunks(2)  # the echoed choice's prompt, before any token
    assert chunk["choices"][0]["text"] == "ab" and chunk["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.5]
    assert streamed.delta_chunk("c", [TokenLogprob(2, -1.0, [])])["choices"][0]["logprobs"]["text_offset"] == [2]


def test_token_strings_without_a_tokenizer() -> None:
    from kestrel_core.model.tokenizer import NoTokenizer

    tokens = TokenStrings(NoTokenizer("none shipped", vocab_size=10))
    assert tokens(7) == "token_id:7" and tokens.bytes(7) == list(b"token_id:7")
