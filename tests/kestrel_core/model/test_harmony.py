"""Harmony answers (gpt-oss): the channels read out whole and streamed."""

from __future__ import annotations

import random

import pytest

from kestrel_core.model.harmony import HarmonyStream, ToolCall, is_harmony, parse

THOUGHT, ANSWER = "The user asks for the capital; it is Paris.", "The capital of France is Paris."
PLAIN = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
CALL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
CASES = {
    "analysis then final": (PLAIN + "<|return|>", THOUGHT, ANSWER, ()),
    "final cut at max_tokens": (PLAIN[:-6], THOUGHT, ANSWER[:-6], ()),
    "a call, recipient after the channel": (CALL, "Need the weather.", "",
                                            (ToolCall("get_weather", '{"city": "Paris"}'),)),
    "a call, recipient before the channel": (
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>', None, "",
        (ToolCall("get_time", "{}"),)),
    "a preamble, then a call": (
        '<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant to=functions.get_time'
        '<|channel|>commentary json<|message|>{ }<|call|>', None, "Let me look.", (ToolCall("get_time", "{}"),)),
    "two analysis messages": (
        "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done.<|end|>", "One.\nTwo.", "Done.", ()),
    "no harmony at all": ("Just text <b>here</b>.", None, "Just text <b>here</b>.", ()),
}


@pytest.mark.parametrize("case", CASES)
def test_a_whole_answer_splits_into_reasoning_content_and_calls(case: str) -> None:
    text, reasoning, content, calls = CASES[case]
    answer = parse(text)
    assert (answer.reasoning, answer.content, answer.calls) == (reasoning, content, calls)


@pytest.mark.parametrize("case", CASES)
def test_a_stream_adds_up_to_the_whole_in_any_chunking(case: str) -> None:
    text = CASES[case][0]
    rng = random.Random(case)
    for _ in range(20):
        stream, got = HarmonyStream(), [[], []]
        cuts = sorted(rng.sample(range(1, len(text)), min(8, len(text) - 1)))
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            for part, out in zip(stream.feed(text[a:b]), got):
                out.append(part)
        reasoning, content, calls = stream.finish()
        got[0].append(reasoning)
        got[1].append(content)
        whole = parse(text)
        assert ("".join(got[0]) or None, "".join(got[1]), calls) == (whole.reasoning, whole.content, whole.calls)


def test_the_reasoning_streams_before_the_answer_ends_and_no_marker_leaks() -> None:
    stream = HarmonyStream()
    early = [stream.feed(PLAIN[i:i + 4]) for i in range(0, PLAIN.index("<|end|>") + 2, 4)]
    sent = "".join(r for r, _ in early)
    assert sent and THOUGHT.startswith(sent) and "<" not in sent  # held back: "<|" may start <|end|>
    assert all(c == "" for _, c in early)


def test_a_harmony_template_is_known_by_its_channels() -> None:
    assert is_harmony("<|start|>assistant<|channel|>final<|message|>{{ content }}<|end|>")
    assert not is_harmony("<|im_start|>assistant\n{{ content }}<|im_end|>") and not is_harmony(None)
