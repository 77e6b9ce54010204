"""model/reasoning.py: an answer's reasoning block split from its content, whole and however a stream cuts it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kestrel_core.model.reasoning import (
    COHERE_THINK,
    MISTRAL_THINK,
    THINK,
    ReasoningStream,
    opens_in_prompt,
    reasoning_markers,
    split,
    split_parts,
    thinks,
)

from .streams import chunkings, expected, streamed

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
    # ... but only where no </think> comes: reasoning may mention the tag (vLLM's qwen3 reasoning parser)
    ("<think>a<tool_call>x</tool_call></think>b", False, ("a<tool_call>x</tool_call>", "b")),
    ("<think>\nThe user asks what the <tool_call> tag is for.\n</think>\n\nIt wraps a function call.", False,
     ("The user asks what the <tool_call> tag is for.", "It wraps a function call.")),
    ("<think>\nI should emit a <tool_call> block.\n</think>\n\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>", False,
     ("I should emit a <tool_call> block.", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>")),
    ("a <tool_call> b <tool_call>\nc\n</tool_call>", True, ("a", "<tool_call> b <tool_call>\nc\n</tool_call>")),
    ("<think>a</think>b<tool_call>x</tool_call>", False, ("a", "b<tool_call>x</tool_call>")),
    ("thinking <tool_ca", True, ("thinking <tool_ca", "")),
    ("<think>\nHmm.\n</think>\n\nSunny.", True, ("Hmm.", "Sunny.")),  # the prompt's tag written again
    ("  <thi", True, ("<thi", "")),
]


@pytest.mark.parametrize(("text", "open_in_prompt", "expected"), CASES)
def test_split(text: str, open_in_prompt: bool, expected: tuple[str | None, str]) -> None:
    assert split(text, open_in_prompt) == expected


# the tricky ends of a block: markers split anywhere, whitespace around them, empty blocks, a call in it, long text
STREAMED = [text for text, _, _ in CASES] + [
    "<think>\n" + " word" * 300 + "\n \n</think>\n\n" + "Answer " * 200,
    " \n<think>  \n\n  </think>  \n  Answer",
    "<think>a <</think>< b",
    "<think>a</think\n</think>b",
    "<think>x\n\n<tool_call>\n{}\n</tool_call></think>",
    "<think>\t<tool_ca</think>",
    "<think>" + "\n" * 40 + "late" + " " * 40 + "</think>" + " " * 40,
    "<think>I could write <tool_call> here.\n" + " word" * 100 + " \n</think>\n\n<tool_call>{}</tool_call>",
    "<think> <tool_call> <tool_call></think</think> <tool_call>",
    "<think>x <tool_call>\n" + " word" * 100,
]


@pytest.mark.parametrize("text", STREAMED)
@pytest.mark.parametrize("open_in_prompt", [False, True])
def test_a_stream_sends_the_whole_answers_parts(text: str, open_in_prompt: bool) -> None:
    """However the answer is cut, its parts go out in order, each as the start of the whole answer's part, and
    they add up to them (and to ``split``'s texts)."""
    whole = split_parts(text, open_in_prompt)
    for chunks in chunkings(text, random.Random(text)):
        assert streamed(ReasoningStream(open_in_prompt), chunks, whole) == expected(whole), chunks
        stream = ReasoningStream(open_in_prompt)
        sent = [stream.feed(chunk) for chunk in chunks] + [stream.finish()]
        reasoning, content = split(text, open_in_prompt)
        assert ("".join(r for r, _ in sent), "".join(c for _, c in sent)) == (reasoning or "", content)


def test_a_feed_reads_only_the_new_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long answer's feeds don't read the whole answer again (which would cost each feed its length)."""
    reads = []
    monkeypatch.setattr("kestrel_core.model.reasoning.split_parts",
                        lambda text, *a: reads.append(text) or split_parts(text, *a))
    stream = ReasoningStream()
    for chunk in ["<think>\n", *[" word"] * 500, "\n</think>\n\n", *[" answer"] * 500]:
        stream.feed(chunk)
    assert reads == []


def test_reasoning_held_after_a_tool_call_costs_a_feed_only_its_text() -> None:
    """From a ``<tool_call>`` in the block until ``</think>``, the text waits; the stream keeps no growing copy of
    it, which each feed would copy again."""
    stream = ReasoningStream()
    assert stream.feed("<think>\nI could write <tool_call>") == ("I could write", "")
    kept = []
    for _ in range(500):
        assert stream.feed(" word") == ("", "")
        kept.append(len(stream.recent))
    assert max(kept) <= stream.MARGIN + len(" word")
    reasoning, content = stream.feed("\n</think>\n\nDone.")
    assert reasoning == " <tool_call>" + " word" * 500 and content == "Done."


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
    assert opens_in_prompt("[INST]Hi[/INST][THINK]", MISTRAL_THINK) and not opens_in_prompt("[INST]Hi[/INST][THINK]")


TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "templates"


@pytest.mark.parametrize(("name", "markers"), [
    ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", MISTRAL_THINK),  # [THINK]...[/THINK], its control tokens
    ("unsloth-Apriel-1.5.jinja", None),  # "[BEGIN FINAL RESPONSE]" and an unused <thinking>: not read
    ("Apriel-1.6-15b-Thinker-fixed.jinja", None),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", COHERE_THINK),  # its special tokens
])
def test_the_reasoning_a_real_template_teaches(name: str, markers: object) -> None:
    assert reasoning_markers((TEMPLATES / name).read_text()) == markers
    assert reasoning_markers("{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}") == THINK


# Mistral's reasoning models (Magistral, Ministral 3 Reasoning), as vLLM's mistral reasoning parser reads them: the
# block ends at its [/THINK] alone
MISTRAL_CASES = [
    ("[THINK]The user greets me.[/THINK]Hello!", ("The user greets me.", "Hello!")),
    ("Hello!", (None, "Hello!")),
    ("[THINK]cut off before its end", ("cut off before its end", "")),
    ("[THINK]I will call [TOOL_CALLS] next.[/THINK][TOOL_CALLS]f[ARGS]{}",
     ("I will call [TOOL_CALLS] next.", "[TOOL_CALLS]f[ARGS]{}")),
    ("[THINK]a <tool_call> b", ("a <tool_call> b", "")),  # Qwen3.5's call tag ends no Mistral block
    ("<think>a</think>b", (None, "<think>a</think>b")),
    ("[THINK][/THINK]Answer", (None, "Answer")),
]


@pytest.mark.parametrize(("text", "expected_split"), MISTRAL_CASES)
def test_a_mistral_reasoning_block_whole_and_streamed(text: str, expected_split: tuple[str | None, str]) -> None:
    assert split(text, markers=MISTRAL_THINK) == expected_split
    whole = split_parts(text, markers=MISTRAL_THINK)
    for chunks in chunkings(text, random.Random(text)):
        assert streamed(ReasoningStream(markers=MISTRAL_THINK), chunks, whole) == expected(whole), chunks


# Cohere's Command R7B and Command A, as llama.cpp's command_r7b parser reads them: a <|START_THINKING|> block, then
# a call block or a response block, whose tags are no text of the content (the prompt may have opened either)
THINKING, RESPONSE = "<|START_THINKING|>{}<|END_THINKING|>", "<|START_RESPONSE|>{}<|END_RESPONSE|>"
ACTION = '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "parameters": {}}]<|END_ACTION|>'
COHERE_CASES = [
    (THINKING.format("I will look it up.") + ACTION, False, ("I will look it up.", ACTION)),
    (RESPONSE.format("Paris."), False, (None, "Paris.")),
    (THINKING.format("Easy.") + "\n" + RESPONSE.format("Paris is the capital."), False,
     ("Easy.", "Paris is the capital.")),
    ("Paris.<|END_RESPONSE|>", False, (None, "Paris.")),  # the prompt opened the response block
    ("Paris.", False, (None, "Paris.")),
    ("\n" + RESPONSE.format(" two  spaces "), False, (None, " two  spaces ")),
    (RESPONSE.format("a") + "after its end", False, (None, "a")),
    ("<|START_THINKING|>cut off", False, ("cut off", "")),
    ("I plan.<|END_THINKING|>" + RESPONSE.format("Done"), True, ("I plan.", "Done")),  # the prompt opened it
    (THINKING.format("a") + "<|START_RESPONSE|>cut off", False, ("a", "cut off")),
    ("<|START_RES", False, (None, "<|START_RES")),
    ("<|START_RESPONSE|", False, (None, "<|START_RESPONSE|")),
    (" \n ", False, (None, " \n ")),
    ("", False, (None, "")),
    ("<think>a</think>b", False, (None, "<think>a</think>b")),
]


@pytest.mark.parametrize(("text", "open_in_prompt", "expected_split"), COHERE_CASES)
def test_a_cohere_answer_whole_and_streamed(text: str, open_in_prompt: bool,
                                            expected_split: tuple[str | None, str]) -> None:
    """The thinking block is the reasoning; the content is what follows it, less a response block's tags, however
    a stream cuts the tags."""
    assert split(text, open_in_prompt, COHERE_THINK) == expected_split
    whole = split_parts(text, open_in_prompt, COHERE_THINK)
    for chunks in chunkings(text, random.Random(text)):
        assert streamed(ReasoningStream(open_in_prompt, COHERE_THINK), chunks, whole) == expected(whole), chunks


def test_a_cohere_response_goes_out_as_it_comes_without_its_tags() -> None:
    stream = ReasoningStream(markers=COHERE_THINK)
    assert stream.feed("<|START_") == ("", "")
    assert stream.feed("RESPONSE|>The answ") == ("", "The answ")
    assert stream.feed("er.<|END_RES") == ("", "er.")
    assert stream.feed("PONSE|>") == ("", "")
    assert stream.finish() == ("", "")
    assert opens_in_prompt("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>", COHERE_THINK)
