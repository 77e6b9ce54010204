"""Fill in the middle: the prompt a code model completes between a prefix and a suffix (completions' ``suffix``,
``kestrel run --suffix``, llama.cpp's ``/infill``).

The format is found from the vocabulary: the first of ``FORMATS`` whose three tokens it holds. Each is the
prefix-suffix-middle order its models were trained on, as their model cards show: the tokenizer's BOS where it
adds one, then the format's three tokens around the two parts. The parts are the user's code, tokenized as
text: a special token's text in them (a tokenizer's own source names ``<|endoftext|>``) stays text, as
llama.cpp's ``/infill`` tokenizes them. Byte-level vocabularies only: there, text joined is tokens joined.
SentencePiece formats (CodeLlama's ``▁<PRE>``, Codestral's suffix-first ``[SUFFIX]``) change tokens at the joins
and are not among them. The answer ends at the model's end of text or at any of ``STOPS`` it holds (a padding
or file-separator token).

Other files of the repository may come before the code (llama.cpp's ``/infill``), in the repository-level layout
Qwen2.5-Coder was trained on, as llama.cpp lays it out: where the vocabulary has a repository-name token, that
token and ``myproject``; each file as the file-separator token, its name and its text, and the code's own file
last, named ``filename``; without a file separator, the files' texts each after a ``--- snippet ---`` line.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
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
REPO_NAMES = ("<|repo_name|>", "<reponame>")  # the token before the repository's name: Qwen's, Granite Code's
FILE_SEPS = ("<|file_sep|>",)  # the token before each file's name: Qwen's
REPOSITORY, CURRENT_FILE = "myproject", "filename"  # the names llama.cpp's /infill gives them
SNIPPET = "\n\n--- snippet ---\n\n"  # before each file's text, where the vocabulary has no file separator


@dataclass(frozen=True)
class FimFormat:
    prefix: str  # the token before the prefix
    suffix: str  # the token before the suffix
    middle: str  # the token after which the middle is written
    stop_token_ids: tuple[int, ...]  # STOPS in this vocabulary
    repo_name: str | None = None  # the first of REPO_NAMES in this vocabulary
    file_sep: str | None = None  # the first of FILE_SEPS in this vocabulary


@dataclass(frozen=True)
class FimPrompt:
    """A fill-in-the-middle prompt's parts, each token ids: ``ids()`` joins them."""

    files: list[int]  # the repository's other files before the code (none: the code alone)
    head: list[int]  # the tokenizer's BOS, where it adds one, then the prefix token
    prefix: list[int]
    suffix_token: int
    suffix: list[int]
    middle_token: int
    stop_token_ids: tuple[int, ...]  # the stop token ids to add

    def ids(self) -> list[int]:
        return [*self.files, *self.head, *self.prefix, self.suffix_token, *self.suffix, self.middle_token]


def fim_format(tokenizer: Any) -> FimFormat | None:
    """The fill-in-the-middle format of ``tokenizer``'s vocabulary, None where it has none kestrel knows."""
    if getattr(tokenizer, "backend", None) is None:  # no tokenizer (NoTokenizer, a byte tokenizer)
        return None

    def token_id(text: str) -> int | None:
        """The token ``text`` is, where the tokenizer reads that text as that one token."""
        i = tokenizer.backend.token_to_id(text)
        return i if i is not None and tokenizer.encode(text, add_special_tokens=False) == [i] else None

    def first(texts: tuple[str, ...]) -> str | None:
        return next((t for t in texts if token_id(t) is not None), None)

    for tokens in FORMATS:
        if all(token_id(t) is not None for t in tokens):
            stops = tuple(i for i in (token_id(t) for t in STOPS) if i is not None)
            return FimFormat(*tokens, stops, first(REPO_NAMES), first(FILE_SEPS))
    return None


def fim_prompt_ids(tokenizer: Any, prefix: str, suffix: str, ending: Collection[int] = ()
                   ) -> tuple[list[int], tuple[int, ...]]:
    """(prompt token ids, the stop token ids to add) of the middle between ``prefix`` and ``suffix``:
    ``fim_prompt``'s."""
    prompt = fim_prompt(tokenizer, prefix, suffix, ending)
    return prompt.ids(), prompt.stop_token_ids


def fim_prompt(tokenizer: Any, prefix: str, suffix: str, ending: Collection[int] = (),
               files: Sequence[tuple[str, str]] | None = None) -> FimPrompt:
    """The prompt of the middle between ``prefix`` and ``suffix``; InvalidRequest (param ``suffix``) for a model
    whose vocabulary has no format kestrel knows. ``ending``: the token ids that end an answer already (the
    model's end of text), left out of the stops, so that the answer ends there as any answer does (no stop token
    reported, ``ignore_eos`` goes past it). ``files``: the repository's other files, (name, text) each, before the
    code in the repository-level layout (an empty list still names the repository and the code's file); None:
    the code alone."""
    fmt = fim_format(tokenizer)
    if fmt is None:
        known = ", ".join(t[0] for t in FORMATS)
        raise InvalidRequest(f"this model's vocabulary has no fill-in-the-middle tokens kestrel knows ({known})",
                             param="suffix")
    pre, suf, mid = (tokenizer.backend.token_to_id(t) for t in (fmt.prefix, fmt.suffix, fmt.middle))
    head = tokenizer.encode(fmt.prefix)  # the BOS the tokenizer adds, where it adds one, then the prefix token
    return FimPrompt([] if files is None else _repository(tokenizer, fmt, files), head[:head.index(pre) + 1],
                     tokenizer.encode_text(prefix), suf, tokenizer.encode_text(suffix), mid,
                     tuple(i for i in fmt.stop_token_ids if i not in ending))


def _repository(tokenizer: Any, fmt: FimFormat, files: Sequence[tuple[str, str]]) -> list[int]:
    """The repository's files before the code, each part tokenized as text (a name or a file may hold anything)."""
    ids: list[int] = []
    if fmt.repo_name is not None:
        ids += [tokenizer.backend.token_to_id(fmt.repo_name), *tokenizer.encode_text(REPOSITORY + "\n")]
    sep = None if fmt.file_sep is None else tokenizer.backend.token_to_id(fmt.file_sep)
    for name, text in files:
        ids += tokenizer.encode_text(SNIPPET) if sep is None else [sep, *tokenizer.encode_text(name + "\n")]
        ids += tokenizer.encode_text(text)
    if sep is not None:
        ids += [sep, *tokenizer.encode_text(CURRENT_FILE + "\n")]
    return ids
