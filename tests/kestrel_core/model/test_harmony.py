"""Harmony answers (gpt-oss): the channels read out whole and streamed."""

from __future__ import annotations

import random

import pytest

from kestrel_core.model.harmony import HarmonyStream, ToolCall, call_grammar, is_harmony, json_grammar, parse

from .streams import chunkings, expected, streamed

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
    # a preamble and the final message are the content a line apart, as vLLM's chat route joins them
    "a preamble, more analysis, then the final message": (
        "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>commentary<|message|>Let me look."
        "<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Done.<|return|>", "One.\nTwo.", "Let me look.\nDone.", ()),
    "no harmony at all": ("Just text <b>here</b>.", None, "Just text <b>here</b>.", ()),
    # a call that does not parse is text, as the other formats' are: a body that is not a JSON object, or one
    # max_tokens cut
    "a call not in JSON": ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                           '{city: Paris}<|call|>', None, "{city: Paris}", ()),
    "a call cut short": ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                         '{"city": "Pa', None, '{"city": "Pa', ()),
    "a call whose arguments are not JSON (NaN)": (
        '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": NaN}<|call|>', None,
        '{"a": NaN}', ()),
    # thousands of "[": that text, not a RecursionError (a 500)
    "a call nested past the JSON parser's depth": (
        '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": ' + "[" * 100_000 + "<|call|>",
        None, '{"a": ' + "[" * 100_000, ()),
}


@pytest.mark.parametrize("case", CASES)
def test_a_whole_answer_splits_into_reasoning_content_and_calls(case: str) -> None:
    text, reasoning, content, calls = CASES[case]
    answer = parse(text)
    assert (answer.reasoning, answer.content, answer.calls) == (reasoning, content, calls)


# long messages, end tokens split anywhere, an empty body, text between a message's end and the next
STREAMED = [case[0] for case in CASES.values()] + [
    f"<|channel|>analysis<|message|>{' word' * 300}<|end|><|start|>assistant<|channel|>final<|message|>"
    f"{' answer' * 300}<|return|>",
    "<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|>a <|<|end|>",
    "<|channel|>analysis<|message|>x<|end|> stray <|start|>assistant<|channel|>final<|message|>y<|return|>",
    "  \n<|channel|>final<|message|>Only this.",
]


@pytest.mark.parametrize("text", STREAMED)
def test_a_streams_parts_are_the_whole_answers_in_any_chunking(text: str) -> None:
    whole = list(parse(text).parts)
    for chunks in chunkings(text, random.Random(text)):
        assert streamed(HarmonyStream(), chunks, whole) == expected(whole), chunks


def test_a_feed_reads_only_the_new_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long answer's feeds don't read the whole answer again (which would cost each feed its length)."""
    reads = []
    monkeypatch.setattr("kestrel_core.model.harmony._read", lambda text, final: reads.append(text) or ([], []))
    stream = HarmonyStream()
    for chunk in ["<|channel|>analysis<|message|>", *[" word"] * 500, "<|end|><|start|>assistant<|channel|>final",
                  "<|message|>", *[" answer"] * 500]:
        stream.feed(chunk)
    assert reads == []


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
        reasoning, content = stream.finish()
        calls = stream.calls()
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


SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


@pytest.fixture(scope="module")
def harmony_vocab():  # type: ignore[no-untyped-def]
    """The tiny models' tokenizer with harmony's special tokens added, as llguidance sees it; <|return|> and
    <|call|> end a text (gpt-oss's generation_config)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    from kestrel_core.model.grammar import grammar_vocab

    tok = Tokenizer.from_file(str(Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-gpt-oss"
                                  / "tokenizer.json"))
    tok.add_special_tokens(list(SPECIALS))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    return tok, ids, grammar_vocab(tok.to_str(), tok.get_vocab_size(), [ids["<|return|>"], ids["<|call|>"]])


def _keeps_to(harmony_vocab, grammar: str, pieces: list[str]) -> str:  # type: ignore[no-untyped-def]
    """'done' where the grammar takes ``pieces`` (special tokens by name, text tokenized) and may end there."""
    from kestrel_core.model.grammar import Constraint

    tok, ids, vocab = harmony_vocab
    constraint = Constraint(vocab, grammar)
    for piece in pieces:
        for token in [ids[piece]] if piece in ids else tok.encode(piece, add_special_tokens=False).ids:
            if not constraint.allowed()[token]:
                return f"refused {piece!r}"
            constraint.accept(token)
    return "done" if constraint.allowed()[ids["<|return|>"]] else "not done"


FINAL = ["<|channel|>", "final", "<|message|>"]
THINKING = ["<|channel|>", "analysis", "<|message|>", "Plan.\nThen answer.", "<|end|>", "<|start|>", "assistant"]


def test_a_json_answer_keeps_harmonys_shape(harmony_vocab) -> None:  # type: ignore[no-untyped-def]
    """A JSON response format on gpt-oss: reasoning may come first, the final message is the JSON."""
    grammar = json_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert _keeps_to(harmony_vocab, grammar, [*FINAL, '{"a": 1}']) == "done"
    assert _keeps_to(harmony_vocab, grammar, [*THINKING, *FINAL, '{"a": 1}']) == "done"
    assert _keeps_to(harmony_vocab, grammar, [*FINAL, '{"a": "x"}']).startswith("refused")
    assert _keeps_to(harmony_vocab, grammar, ['{"a": 1}']).startswith("refused")  # no channel: not harmony


def test_a_forced_call_keeps_harmonys_shape(harmony_vocab) -> None:  # type: ignore[no-untyped-def]
    weather = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}
    grammar = call_grammar([weather, {"name": "get_time"}])
    call = ["<|channel|>", "commentary to=functions.get_weather ", "<|constrain|>", "json", "<|message|>"]
    assert _keeps_to(harmony_vocab, grammar, [*THINKING, *call, '{"city": "Paris"}']) == "done"
    assert _keeps_to(harmony_vocab, grammar, [*call, "{}"]).startswith("refused")  # city is required
    assert _keeps_to(harmony_vocab, grammar, ["<|channel|>", "commentary to=functions.get_news "]).startswith(
        "refused")
    assert _keeps_to(harmony_vocab, grammar, [*FINAL, "Sunny."]).startswith("refused")
