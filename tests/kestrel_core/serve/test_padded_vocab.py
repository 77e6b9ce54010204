"""A model whose logits outnumber its tokenizer's tokens (Qwen2.5's and Qwen3's padded vocabularies), served through
a real server and the official client: an id past the tokenizer's tokens is a token of no text and no bytes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import openai
import pytest

import kestrel_core

from .conftest import FIXTURES

NAME = "tiny-qwen3-padded"
TOKENIZER_TOKENS = 502  # of the model's 512 logits


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """tiny-qwen3 with the last 10 tokens of its tokenizer (and the merges that make them) taken out."""
    model = tmp_path_factory.mktemp("padded") / "tiny-qwen3"
    shutil.copytree(FIXTURES / "tiny-qwen3", model)
    tokenizer = json.loads((model / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = {token: i for token, i in tokenizer["model"]["vocab"].items() if i < TOKENIZER_TOKENS}
    tokenizer["model"]["vocab"] = vocab
    tokenizer["model"]["merges"] = [[a, b] for a, b in tokenizer["model"]["merges"]
                                    if a in vocab and b in vocab and a + b in vocab]
    (model / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    with kestrel_core.load(str(model), backend="cpu") as e:
        assert e.config.vocab_size > e.tokenizer.vocab_size == TOKENIZER_TOKENS
        yield e


def test_a_token_past_the_tokenizers_has_no_bytes(client: openai.OpenAI) -> None:
    """Each logprob's ``bytes`` add up to its ``token``, as OpenAI's do: none for a token of no text."""
    padding = TOKENIZER_TOKENS + 3
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       temperature=0, logit_bias={str(padding): 100}, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert content[0].token == "" and content[0].bytes == []
    for entry in content:
        for candidate in (entry, *entry.top_logprobs):
            assert bytes(candidate.bytes).decode() == candidate.token
