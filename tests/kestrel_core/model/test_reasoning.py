"""model/reasoning.py: an answer's reasoning block split from its content, whole and however a stream cuts it."""

from __future__ import annotations

import pytest

from kestrel_core.model.reasoning import ReasoningStream, opens_in_prompt, split, thinks

CASES = [
    ("<think>\nLet me think.\n</think>\n\nParis.", False, ("Let me think.", "Paris.")),
    ("  <think>a b</think>c", False, ("a b", "c")),
    ("Paris.", False, (None, "Paris.")),
    ("\n\nParis.", False, (None, "\n\nParis.")),  # no block: the content as it came
    ("  <thi", False, (None, "  <thi")),
    ("<thinking>x", False, (None, "<thinking>x")),
    ("<think>\ncut off here", False, ("cut off here", "")),
    ("<think>a</thi", False, ("a</thi", "")),
    ("<think></think>Answer", False, (None, "Answer")),
    ("<think>a </think> b </think> c", False, ("a", "b </think> c")),
    ("I reason.\n</think>\nAnswer", True, ("I reason.", "Answer")),
    ("no end to it", True, ("no end to it", "")),
    ("", False, (None, "")),
    # a call ends the reasoning without its </think> (Qwen3.5): the call is content
    ("I should look it up.\n<tool_call>\n<function=f>\n</function>\n</tool_call>", True,
     ("I should look it up.", "<tool_call>\n<function=f>\n</function>\n</tool_call>")),
    ("<think>a<tool_call>x</tool_call></think>b", False, ("a", "<tool_call>x</tool_call></think>b")),
    ("<think>a</think>b<tool_call>x</tool_call>", False, ("a", "b<tool_call>x</tool_call>")),
    ("thinking <tool_ca", True, ("thinking <tool_ca", "")),
    ("<think>\nHmm.\n</think>\n\nSunny.", True, ("Hmm.", "Sunny.")),  # the prompt's tag written again
    ("  <thi", True, ("<thi", "")),
]


@pytest.mark.parametrize(("text", "open_in_prompt", "expected"), CASES)
def test_split(text: str, open_in_prompt: bool, expected: tuple[str | None, str]) -> None:
    assert split(text, open_in_prompt) == expected


@pytest.mark.parametrize(("text", "open_in_prompt", "expected"), CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_a_stream_sends_the_whole_answers_parts(text: str, open_in_prompt: bool, expected: tuple[str | None, str],
                                                size: int) -> None:
    """Whatever goes out is the start of the whole answer's part, and it all adds up to them."""
    reasoning, content = expected[0] or "", expected[1]
    stream = ReasoningStream(open_in_prompt)
    sent = ["", ""]
    for i in range(0, len(text), size):
        r, c = stream.feed(text[i:i + size])
        sent = [sent[0] + r, sent[1] + c]
        assert reasoning.startswith(sent[0]) and content.startswith(sent[1])
    r, c = stream.finish()
    assert (sent[0] + r, sent[1] + c) == (reasoning, content)


def test_reasoning_goes_out_as_it_comes() -> None:
    stream = ReasoningStream()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>\nStep one") == ("Step one", "")
    assert stream.feed(", two.\n</th") == (", two.", "")
    assert stream.feed("ink>\n\nDone") == ("", "Done")


def test_which_templates_think() -> None:
    assert thinks("{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}")
    assert not thinks("{{ messages }}") and not thinks(None)
    assert opens_in_prompt("<|im_start|>assistant\n<think>\n") and not opens_in_prompt("<think>\n\n</think>\n\n")
