"""Logprobs through the server over the default model (default_server.py): chat's and completions', a character
whose bytes several tokens share, and a prompt scored by echo (lm-eval's loglikelihood), a prefill chunk a step."""

from __future__ import annotations

from typing import Any

import numpy as np
import openai
import pytest

from kestrel_core.model.async_engine import AsyncEngine

from .default_server import NAME, _chat, default_async_engine, default_engine  # noqa: F401 (fixtures)
from .helpers import HI

pytestmark = pytest.mark.default_model


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = _chat(client, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content)


def test_logprob_bytes_of_a_character_split_over_tokens_add_up_to_it(client: openai.OpenAI) -> None:
    """An answer held to one emoji, whose UTF-8 bytes take several byte-level tokens: each token's text alone is
    U+FFFD, its ``bytes`` its own part of the character (OpenAI's), so that they add up to it."""
    schema = {"type": "object", "properties": {"e": {"const": "\U0001F600"}}, "required": ["e"]}
    r = client.chat.completions.create(model=NAME, messages=HI, max_tokens=40, temperature=0, logprobs=True,
                                       top_logprobs=1, response_format={"type": "json_schema", "json_schema": {
                                           "name": "emoji", "schema": schema}})
    content = r.choices[0].logprobs.content
    assert "\U0001F600" in r.choices[0].message.content and any(e.token == "\ufffd" for e in content)
    assert b"".join(bytes(e.bytes) for e in content).decode().startswith(r.choices[0].message.content)
    assert all(bytes(t.bytes).decode(errors="replace") == t.token for e in content for t in e.top_logprobs
               if "\ufffd" not in t.token)


def test_completions_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=NAME, prompt="1, 2, 3,", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(logprob) and token in top
    chunks = list(client.completions.create(model=NAME, prompt="1, 2, 3,", max_tokens=5, temperature=0,
                                            logprobs=2, stream=True))
    streamed = [off for c in chunks if c.choices and c.choices[0].logprobs for off in c.choices[0].logprobs.text_offset]
    assert streamed == lp.text_offset  # offsets run on across chunks
    # the chosen token is always among top_logprobs (OpenAI: up to logprobs + 1), sampled or echoed
    for k in (0, 1):
        r = client.completions.create(model=NAME, prompt="Zebra quantum lettuce", max_tokens=4, temperature=2.0,
                                      seed=3, logprobs=k, echo=True)
        lp = r.choices[0].logprobs
        assert lp.top_logprobs[0] is None  # the first prompt token has no logprob
        for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert top[token] == pytest.approx(logprob) and len(top) <= k + 1


def _log_softmax(logits: Any) -> Any:
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def test_completions_echo_scores_the_prompt(client: openai.OpenAI, async_engine: AsyncEngine, engine: Any) -> None:
    """echo with logprobs and max_tokens 0 (what lm-eval's loglikelihood sends): each prompt token after the
    first scored by the model's log-softmax before it, the alternatives the likeliest; nothing generated."""
    prompt = "The capital of France is Paris"
    ids = engine.tokenizer.encode(prompt)
    r = client.completions.create(model=NAME, prompt=prompt, echo=True, max_tokens=0, logprobs=2)
    (c,) = r.choices
    assert c.text == prompt and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _log_softmax(async_engine.run_sync(lambda: engine.logits(ids)))  # float64, the engine's own logits
    assert lp.token_logprobs[1:] == pytest.approx([ref[t, ids[t + 1]] for t in range(len(ids) - 1)], abs=1e-4)
    for t, top in enumerate(lp.top_logprobs[1:]):  # the two likeliest, and the prompt's own token
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(ref[t].max(), abs=1e-4)
    assert lp.text_offset == [sum(len(tok) for tok in lp.tokens[:i]) for i in range(len(ids))]


def test_completions_echo_then_generate(client: openai.OpenAI) -> None:
    prompt = "1, 2, 3,"
    kw: dict[str, Any] = {"max_tokens": 3, "temperature": 0, "logprobs": 1}
    plain = client.completions.create(model=NAME, prompt=prompt, **kw).choices[0]
    echoed = client.completions.create(model=NAME, prompt=prompt, echo=True, **kw).choices[0]
    assert echoed.text == prompt + plain.text
    scored = client.completions.create(model=NAME, prompt=prompt, echo=True, max_tokens=0, logprobs=1).choices[0]
    n = len(scored.logprobs.tokens)  # the prompt's tokens, then the completion's
    assert echoed.logprobs.tokens == scored.logprobs.tokens + plain.logprobs.tokens
    assert echoed.logprobs.token_logprobs[:n] == scored.logprobs.token_logprobs
    assert echoed.logprobs.token_logprobs[n:] == plain.logprobs.token_logprobs
    chunks = list(client.completions.create(model=NAME, prompt=prompt, echo=True, stream=True, **kw))
    assert chunks[0].choices[0].text == prompt  # the echo comes first, as its own chunk
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == echoed.text


def test_scoring_a_long_prompt_runs_a_chunk_a_step(client: openai.OpenAI, engine: Any, monkeypatch) -> None:
    """An echo with logprobs is scored by the scheduler's steps, a prefill chunk (at most PREFILL_CHUNK tokens, all
    their logits) a step, so generation steps go on beside its chunks; its sequence goes back."""
    from kestrel_core.model.weights import PREFILL_CHUNK

    chunks: list[tuple[int, int]] = []
    start_batch = engine.start_batch

    def recorded(work: Any, *args: Any, **kwargs: Any) -> Any:
        chunks.extend((len(tokens), rows) for _, tokens, rows in work if tokens is not None and len(tokens) > 1)
        return start_batch(work, *args, **kwargs)

    monkeypatch.setattr(engine, "start_batch", recorded)
    ids = [int(i) for i in np.random.default_rng(4).integers(100, 5000, 2 * PREFILL_CHUNK + 10)]  # three chunks
    whole = engine.prompt_logprobs(ids, 1)
    chunks.clear()
    got = client.completions.create(model=NAME, prompt=ids, echo=True, max_tokens=0, logprobs=1)
    assert got.choices[0].logprobs.token_logprobs[1:] == pytest.approx([e.logprob for e in whole], abs=1e-6)
    assert chunks == [(PREFILL_CHUNK, PREFILL_CHUNK)] * 2 + [(10, 10)]
    assert engine.pool.free_blocks == engine.pool.num_blocks
