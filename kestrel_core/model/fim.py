"""Fill in the middle: the prompt a code model completes between a prefix and a suffix (completions' ``suffix``,
``kestrel run --suffix``).

The format is found from the vocabulary: the first of ``FORMATS`` whose three tokens it holds. Each is the
prefix-suffix-middle order its models were trained on, as their model cards show: the tokenizer's BOS where it
adds one, then the format's three tokens around the two parts. The parts are the user's code, tokenized as
text: a special token's text in them (a tokenizer's own source names ``<|endoftext|>``) stays text, as
llama.cpp's ``/infill`` tokenizes them. Byte-level vocabularies only: there, text joined is tokens joined.
SentencePiece formats (CodeLlama's ``▁<PRE>``, Codestral's suffix-first ``[SUFFIX]``) change tokens at the joins
and are not among them. The answer ends at the model's end of text or at any of ``STOPS`` it holds (a padding
or file-separator token).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from kestrel_core.errors import InvalidRequest

FORMATS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, Granite Code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)
STOPS = ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|endoftext|>", "<fim_pad>", "<file_sep>", "<reponame>",
         "<filename>", "<｜end▁of▁sentence｜>")


@dataclass(frozen=True)
class FimFormat:
    prefix: str  # the token before the prefix
    suffix: str  # the token before the suffix
    middle: str  # the token after which the middle is written
    stop_token_ids: tuple[int, ...]  # STOPS in this vocabulary


def fim_format(tokenizer: Any) -> FimFormat | None:
    """The fill-in-the-middle format of ``tokenizer``'s vocabulary, None where it has none kestrel knows."""
    if getattr(tokenizer, "backend", None) is None:  # no tokenizer (NoTokenizer, a byte tokenizer)
        return None

    def token_id(text: str) -> int | None:
        """The token ``text`` is, where the tokenizer reads that text as that one token."""
        i = tokenizer.backend.token_to_id(text)
        return i if i is not None and tokenizer.encode(text, add_special_tokens=False) == [i] else None

    for tokens in FORMATS:
        if all(token_id(t) is not None for t in tokens):
            stops = tuple(i for i in (token_id(t) for t in STOPS) if i is not None)
            return FimFormat(*tokens, stops)
    return None


def fim_prompt_ids(tokenizer: Any, prefix: str, suffix: str, ending: Collection[int] = ()
                   ) -> tuple[list[int], tuple[int, ...]]:
    """(prompt token ids, the stop token ids to add) of the middle between ``prefix`` and ``suffix``;
    InvalidRequest (param ``suffix``) for a model whose vocabulary has no format kestrel knows. ``ending``: the
    token ids that end an answer already (the model's end of text), left out of the stops, so that the answer
    ends there as any answer does (no stop token reported, ``ignore_eos`` goes past it)."""
    fmt = fim_format(tokenizer)
    if fmt is None:
        known = ", ".join(t[0] for t in FORMATS)
        raise InvalidRequest(f"this model's vocabulary has no fill-in-the-middle tokens kestrel knows ({known})",
                             param="suffix")
    pre, suf, mid = (tokenizer.backend.token_to_id(t) for t in (fmt.prefix, fmt.suffix, fmt.middle))
    head = tokenizer.encode(fmt.prefix)  # the BOS the tokenizer adds, where it adds one, then the prefix token
    ids = [*head[:head.index(pre) + 1], *tokenizer.encode_text(prefix), suf, *tokenizer.encode_text(suffix), mid]
    return ids, tuple(i for i in fmt.stop_token_ids if i not in ending)
