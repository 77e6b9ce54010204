"""Constrained generation (model/grammar.py): the default model's answers keep to a JSON Schema, a regular
expression and a Lark grammar, greedy and sampled, and a bad grammar is a one-line InvalidRequest."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kestrel_core
from kestrel_core.errors import InvalidRequest, KestrelError
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.engine_load import load_preset
from kestrel_core.model.grammar import (
    Constraint,
    check_grammar,
    grammar_vocab,
    json_schema_grammar,
    lark_grammar,
    prepare_masks,
)
from kestrel_core.model.sampling import Sampler, SamplingParams
from kestrel_core.model.scheduler import Scheduler

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population", "country"],
        "properties": {"city": {"type": "string", "maxLength": 30}, "population": {"type": "integer"},
                       "country": {"enum": ["France", "Italy", "Spain"]}}}


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    with kestrel_core.load(None, backend="cpu") as e:
        yield e


def _answer(engine: Any, question: str, **params: Any) -> tuple[str, str | None]:
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": question}])
    outs = list(engine.stream(ids, SamplingParams(**params)))
    return "".join(o.new_text for o in outs), outs[-1].finish_reason


def _check_city(value: Any) -> None:
    assert isinstance(value, dict) and set(value) == {"city", "population", "country"}
    assert isinstance(value["city"], str) and len(value["city"]) <= 30
    assert isinstance(value["population"], int) and value["country"] in ("France", "Italy", "Spain")


QUESTION = "Describe Paris as a JSON object with its population and country."


@pytest.mark.default_model
def test_without_a_grammar_the_answer_is_not_that_json(engine: Any) -> None:
    """The reference point: the same question unconstrained is prose, so the tests below can fail."""
    text, _ = _answer(engine, QUESTION, max_tokens=40)
    with pytest.raises(ValueError):
        _check_city(json.loads(text))


@pytest.mark.default_model
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 7}, {"temperature": 1.5, "top_p": 0.9,
                                                                          "seed": 11}])
def test_answers_keep_to_a_json_schema(engine: Any, sampling: dict[str, Any]) -> None:
    text, reason = _answer(engine, QUESTION, max_tokens=80, grammar=json_schema_grammar(CITY), **sampling)
    assert reason == "stop", text
    _check_city(json.loads(text))


@pytest.mark.default_model
def test_answers_keep_to_a_regex_and_a_lark_grammar(engine: Any) -> None:
    text, reason = _answer(engine, "Is Paris in France? Answer yes or no.", max_tokens=8,
                           grammar=kestrel_core.regex_grammar(r"(yes|no)\."))
    assert reason == "stop" and text in ("yes.", "no.")
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    text, reason = _answer(engine, "What is 12 times 3?", max_tokens=12, temperature=1.0, seed=1,
                           grammar=lark_grammar(lark))
    assert reason == "stop" and re.fullmatch(r"The answer is [0-9]{1,3}\.", text), text


@pytest.mark.default_model
def test_a_grammar_ends_where_it_is_complete_or_at_max_tokens(engine: Any) -> None:
    text, reason = _answer(engine, "Say hi.", max_tokens=30, grammar=kestrel_core.regex_grammar("hi"))
    assert (text, reason) == ("hi", "stop")
    text, reason = _answer(engine, QUESTION, max_tokens=3, grammar=json_schema_grammar(CITY))
    assert reason == "length" and text.startswith('{"')


@pytest.mark.default_model
def test_a_constraint_masks_and_consumes(engine: Any) -> None:
    vocab = grammar_vocab(engine.tokenizer.to_json_str(), engine.config.vocab_size, [2])
    c = Constraint(vocab, kestrel_core.regex_grammar("ab"))
    allowed = c.allowed()
    assert allowed.shape == (engine.config.vocab_size,) and 0 < allowed.sum() < 10
    assert {engine.tokenizer.decode([int(i)]) for i in np.flatnonzero(allowed)} <= {"a", "ab"}
    z = np.zeros(engine.config.vocab_size, np.float32)
    assert np.isneginf(c.allow(z)[~allowed]).all() and (c.allow(z)[allowed] == 0).all()
    c.accept(engine.tokenizer.encode("ab", add_special_tokens=False)[0])
    sampler = Sampler(SamplingParams(), c)
    while not c.matcher.is_stopped():
        sampler(np.random.default_rng(0).standard_normal(engine.config.vocab_size).astype(np.float32))
    assert np.flatnonzero(c.allowed()).tolist() == [2]  # complete: only the end of text
    c.accept(5)  # a token the grammar refuses: it fails, and the request with it
    with pytest.raises(InvalidRequest, match="the grammar failed while generating"):
        c.allowed()
    assert c.failed


def test_a_grammar_is_not_an_argmax_for_the_device() -> None:
    assert SamplingParams(grammar="x").adjusted and not SamplingParams().adjusted


@pytest.mark.parametrize(("make", "says"), [
    (lambda: json_schema_grammar("{not json"), "invalid JSON Schema"),
    (lambda: json_schema_grammar({"type": "object", "properties": {"a": {"type": "nonsense"}}}), "invalid"),
    (lambda: lark_grammar("start: missing_rule"), "invalid grammar"),
    (lambda: kestrel_core.regex_grammar("(unclosed"), "invalid grammar"),
    (lambda: check_grammar("not a grammar at all {"), "invalid grammar"),
    (lambda: SamplingParams(grammar=5).check(), "grammar"),  # type: ignore[arg-type]
    # what llguidance refuses with a TypeError or a UnicodeEncodeError naming nothing
    (lambda: kestrel_core.regex_grammar(None), "a regular expression is a str, got NoneType"),
    (lambda: kestrel_core.regex_grammar(b"a+"), "a regular expression is a str, got bytes"),
    (lambda: lark_grammar(None), "a Lark grammar is a str, got NoneType"),
    (lambda: kestrel_core.regex_grammar("a\ud800"), r"a regular expression is not valid UTF-8 \(character 1\)"),
    (lambda: lark_grammar('start: "\udfff"'), "a Lark grammar is not valid UTF-8"),
    (lambda: check_grammar('start: "\ud800"'), "a grammar is not valid UTF-8"),
])
def test_bad_grammars_are_one_line_errors(make: Any, says: str) -> None:
    with pytest.raises(InvalidRequest, match=says) as info:
        make()
    assert info.value.param == "grammar" and "\n" not in str(info.value)


def test_a_model_without_its_own_tokenizer_takes_no_grammar() -> None:
    with load_preset("smollm2-135m", backend="cpu", num_layers=1, vocab_size=512) as engine, \
            pytest.raises(InvalidRequest, match="tokenizer"):
        list(engine.stream([1, 2, 3], SamplingParams(max_tokens=2, grammar=kestrel_core.regex_grammar("a"))))


def test_a_tokenizer_llguidance_cannot_read_is_one_line() -> None:
    with pytest.raises(KestrelError, match="llguidance cannot read this model's tokenizer") as info:
        grammar_vocab("{}", 16, [1])
    assert "\n" not in str(info.value)


MODELS = Path(__file__).resolve().parents[2] / "fixtures" / "models"


@pytest.mark.parametrize("name", sorted(p.name for p in MODELS.glob("tiny-*")  # the models (not an adapter)
                                         if "embed" not in p.name and (p.is_file() or (p / "config.json").is_file())))
def test_every_architectures_tokenizer_takes_a_grammar(name: str) -> None:  # the generative ones
    """llguidance reads the tokenizers kestrel builds from Hugging Face directories and GGUF vocabularies
    (byte-level BPE and SentencePiece): a random model's sampled answer keeps to the grammar, whole where it
    stopped, else a start of it."""
    with kestrel_core.load(str(MODELS / name), backend="cpu") as engine:
        outs = list(engine.stream(engine.tokenizer.encode("hello"), SamplingParams(
            max_tokens=12, temperature=1.0, seed=1, grammar=kestrel_core.regex_grammar("(ab|cd)+x"))))
    text = "".join(o.new_text for o in outs)
    # stopped: a whole match; cut at max_tokens: a start of one, or a whole one whose end had no token left
    assert re.fullmatch(r"(ab|cd)+x" if outs[-1].finish_reason == "stop" else r"(ab|cd)*(a|c)?|(ab|cd)+x", text), text


def test_an_async_request_builds_its_constraint_off_the_steps_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling a client's grammar may take a while: AsyncEngine does it on a worker thread, and a grammar that
    fails to compile is an InvalidRequest before the first output."""
    threads: list[str] = []
    with kestrel_core.load(str(MODELS / "tiny-qwen3"), backend="cpu") as engine:
        build = engine.constraint

        def recorded(grammar: str) -> Constraint:
            threads.append(threading.current_thread().name)
            return build(grammar)

        monkeypatch.setattr(engine, "constraint", recorded)

        async def main() -> tuple[str, str]:
            front = AsyncEngine(engine, max_batch=2)
            front.start()
            try:
                params = SamplingParams(max_tokens=8, grammar=kestrel_core.regex_grammar("(ab)+x"))
                text = "".join([out.new_text async for out in front.generate(engine.tokenizer.encode("hi"), params)])
                with pytest.raises(InvalidRequest) as info:
                    async for _ in front.generate([1, 2], SamplingParams(grammar="%llguidance {}\nstart: nope")):
                        pass
                return text, str(info.value)
            finally:
                await front.shutdown(grace_s=1)

        text, error = asyncio.run(main())
    assert re.fullmatch(r"(ab)*a?|(ab)+x", text), text
    assert "grammar" in error and len(threads) == 2
    assert all(name.startswith("kestrel-grammar") for name in threads), threads  # the grammars' own threads


def test_a_copy_is_a_place_of_its_own_in_the_same_grammar() -> None:
    """A copy starts where its original is and goes on apart from it, each allowing what a constraint compiled
    afresh allows after the same tokens."""
    with kestrel_core.load(str(MODELS / "tiny-qwen3"), backend="cpu") as engine:
        text = kestrel_core.regex_grammar("(ab|cd)+x")
        token = {s: engine.tokenizer.encode(s, add_special_tokens=False) for s in ("a", "b", "c", "d", "x")}
        assert all(len(ids) == 1 for ids in token.values()), token

        def after(*pieces: str, c: Constraint | None = None) -> Constraint:
            c = c or engine.constraint(text)
            for piece in pieces:
                c.allowed()
                c.accept(token[piece][0])
            return c

        original = after("a")
        copied = original.copy()
        after("b", "c", c=original)
        after("b", "a", "b", c=copied)
        for c, pieces in ((original, "abc"), (copied, "abab")):
            assert (c.allowed() == after(*pieces).allowed()).all() and not c.failed
        assert not (original.allowed() == copied.allowed()).all() and copied.grammar == original.grammar == text


@pytest.mark.default_model
def test_a_steps_masks_at_once_are_each_ones_own(engine: Any) -> None:
    """prepare_masks (llguidance's thread pool) gives each constraint the mask it would compute alone."""
    grammars = [kestrel_core.regex_grammar(r) for r in ("ab(c|d)", "[0-9]+", "(yes|no)")]
    eos = sorted(engine.eos_token_ids)
    together = [engine.constraint(g) for g in grammars]
    alone = [engine.constraint(g) for g in grammars]
    for c in (together[0], alone[0]):
        c.accept(engine.tokenizer.encode("ab", add_special_tokens=False)[0])
    prepare_masks(together)
    for a, b in zip(together, alone, strict=True):
        assert a._ready and (a.allowed() == b.allowed()).all() and not a._ready
    assert len(eos) and not (together[1].allowed() == together[2].allowed()).all()


@pytest.mark.default_model
def test_constrained_requests_batched_answer_as_they_do_alone(engine: Any) -> None:
    prompts = ["Count to five.", "Is water wet?", "Name a color."]
    grammars = [r"[0-9](, [0-9]){0,5}\.", r"(Yes|No)\.", r"(red|green|blue)"]
    alone = [_answer(engine, q, max_tokens=20, grammar=kestrel_core.regex_grammar(g))
             for q, g in zip(prompts, grammars, strict=True)]
    scheduler = Scheduler(engine, max_batch=3)
    texts: dict[str, str] = {}
    for i, (q, g) in enumerate(zip(prompts, grammars, strict=True)):
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": q}])
        scheduler.add(ids, SamplingParams(max_tokens=20, grammar=kestrel_core.regex_grammar(g)), f"r{i}")
    while scheduler.has_work:
        for out in scheduler.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
    assert [texts[f"r{i}"] for i in range(3)] == [text for text, _ in alone]


def test_a_grammar_that_does_not_compile_is_refused_before_it_is_queued() -> None:
    with kestrel_core.load(str(MODELS / "tiny-qwen3"), backend="cpu") as engine:
        scheduler = Scheduler(engine)
        with pytest.raises(InvalidRequest, match="invalid grammar") as info:
            scheduler.add([1, 2], SamplingParams(grammar="%llguidance {}\nstart: nope"))
        assert info.value.param == "grammar" and not scheduler.has_work
