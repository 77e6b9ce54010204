"""Rerankers: a decoder that reads a query and a document in one prompt and says whether the document answers the
query (Qwen3-Reranker). ``kestrel serve`` scores pairs with one on /v1/rerank and /v1/score.

A pair's score is the final hidden state of its prompt's last token times the classifier's two rows, "yes"'s and
"no"'s, and the softmax of the two outputs' first: sigmoid(yes - no), the probability of "yes" against "no". That is
llama.cpp's rank pooling of a qwen3 GGUF (the last token, ``cls.output``, a softmax, the first output) and vLLM's
score of Qwen3-Reranker served with ``classifier_from_token ["no", "yes"]`` (one row, yes's minus no's, and a
sigmoid). The classifier is the GGUF's ``cls.output`` (llama.cpp's conversion of a Qwen3-Reranker, ``rank`` pooling)
or, for a checkpoint loaded with ``rerank`` (``kestrel serve --rerank``), the output head's rows of the tokens "yes"
and "no", as the model's own logits have them.

The prompt is the model's template with {query} and {document} replaced: the GGUF's ``tokenizer.chat_template.rerank``
(llama.cpp's), else Qwen3-Reranker's (its model card's, with its default instruction). Its special tokens are the
template's: a query or a document is read as plain text, so text that spells ``<|im_end|>`` does not end the turn.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import replace
from typing import Any

import numpy as np

from kestrel_core.errors import KestrelError
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.weights import Model

# the model card's prompt with its default instruction, as llama.cpp's converter writes it into a GGUF
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a "
    "web search query, retrieve relevant passages that answer the query\n<Query>: {query}\n<Document>: {document}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
RERANK_TOKENS = ("yes", "no")  # the classifier's rows, in order
# llama.cpp reads rank pooling as above for these architectures only (others: the first token, no softmax)
RANK_ARCHITECTURES = ("qwen3", "qwen3vl")
# what a classifier of another kind adds (a dense layer before it, a bias, a norm): llama.cpp's names
_OTHER_HEADS = ("cls.weight", "cls.bias", "cls.output.bias", "cls.norm.weight")
_PLACEHOLDER = re.compile(r"\{query\}|\{document\}")


def is_reranker(config: ModelConfig) -> bool:
    return config.rerank_template is not None


def gives_no_text(config: ModelConfig) -> str:
    """Why a model that pools (an embedding model, a reranker) answers no generation request."""
    if is_reranker(config):
        return "this is a reranker: it gives relevance scores of query-document pairs (/v1/rerank, /v1/score), not text"
    return (f"this is an embedding model ({config.pooling} pooling): it gives embeddings (kestrel embed, "
            "/v1/embeddings), not text")


def as_reranker(model: Model, tokenizer: Any) -> Model:
    """``model`` (a Qwen3 checkpoint: Qwen3-Reranker) as a reranker: Qwen3-Reranker's prompt, and the rows of the
    tokens "yes" and "no" of its output head as the classifier (vLLM's ``classifier_from_token``); a reranker
    already (a GGUF's rank pooling) as it is."""
    c = model.config
    if is_reranker(c):
        return model
    if c.pooling is not None:
        raise KestrelError(f"--rerank: this is an embedding model ({c.pooling} pooling), not a reranker")
    if c.arch != "qwen3":
        raise KestrelError(f"--rerank reads Qwen3-Reranker (its prompt, its \"yes\" and \"no\" tokens): a Qwen3 "
                           f"checkpoint, and this is {c.arch}")
    backend = getattr(tokenizer, "backend", None)
    ids = [backend.token_to_id(t) if backend is not None else None for t in RERANK_TOKENS]
    missing = [t for t, i in zip(RERANK_TOKENS, ids) if i is None or not 0 <= i < c.vocab_size]
    if missing:
        raise KestrelError(f"--rerank: the model's tokenizer has no token {missing[0]!r} (a Qwen3-Reranker scores its "
                           "\"yes\" against its \"no\")")
    rows = np.ascontiguousarray(model.lm_head.dequantize(np.array(ids)), np.float32)
    config = replace(c, pooling="last", normalize_embeddings=False, rerank_template=QWEN3_RERANK_TEMPLATE)
    return replace(model, config=config, classifier=rows)


def gguf_rank_fields(where: str, arch: str, template: Any, classifier: Any, hidden: int,
                     tensors: Collection[str]) -> dict[str, Any]:
    """The config fields of a GGUF with rank pooling (``tensors``: the names of the file's tensors;
    ``classifier``: its cls.output.weight, or None), or KestrelError where it is not a reranker kestrel reads."""
    if arch not in RANK_ARCHITECTURES:
        raise KestrelError(f"{where}: {arch}.pooling_type rank (a reranker) is read for "
                           f"{' and '.join(RANK_ARCHITECTURES)} files (llama.cpp's conversion of a Qwen3-Reranker)")
    if classifier is None:
        raise KestrelError(f"{where}: {arch}.pooling_type rank (a reranker) without its classifier (cls.output.weight)")
    others = [name for name in _OTHER_HEADS if name in tensors]
    if others:
        raise KestrelError(f"{where}: a reranker's classifier with {others[0]} is not supported (kestrel reads "
                           "cls.output.weight alone, as llama.cpp's conversion of a Qwen3-Reranker writes it)")
    shape = [int(d) for d in classifier.shape][::-1]  # ggml order [D, rows]
    if shape != [2, hidden]:
        raise KestrelError(f"{where}: cls.output.weight has shape {shape}; a reranker's is [2, {hidden}] (the rows of "
                           "\"yes\" and \"no\")")
    if not isinstance(template, str) or not {"{query}", "{document}"} <= set(_PLACEHOLDER.findall(template)):
        raise KestrelError(f"{where}: a reranker without its prompt (tokenizer.chat_template.rerank, holding {{query}} "
                           "and {document}, as llama.cpp's conversion writes it)")
    return {"pooling": "last", "normalize_embeddings": False, "rerank_template": template}


class RerankPrompt:
    """A reranker's prompt as token ids: the template's special tokens (any added token of the tokenizer) as
    themselves, the text between them, query and document in place, as plain text."""

    def __init__(self, tokenizer: Any, template: str) -> None:
        backend = getattr(tokenizer, "backend", None)
        if backend is None:
            raise KestrelError("the reranker has no tokenizer to read its prompts with")
        added = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.content}
        split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
        self.tokenizer = tokenizer
        # a special token's id, a text's ids, or a text with a placeholder, read for each pair
        self.pieces: list[list[int] | str] = [
            [added[p]] if p in added else p if _PLACEHOLDER.search(p) else tokenizer.encode_text(p)
            for p in (split.split(template) if added else [template]) if p]

    def ids(self, query: str, document: str) -> list[int]:
        texts = {"{query}": query, "{document}": document}
        out: list[int] = []
        for piece in self.pieces:
            if isinstance(piece, str):  # each placeholder replaced once: a query that spells {document} stays so
                out += self.tokenizer.encode_text(_PLACEHOLDER.sub(lambda m: texts[m.group()], piece))
            else:
                out += piece
        return out


def relevance(classifier: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """Each row of ``hidden`` [N, D] (a prompt's last final hidden state) scored by the classifier [2, D]:
    sigmoid(yes - no) [N], float64."""
    out = hidden.astype(np.float64) @ classifier.astype(np.float64).T
    return np.exp(-np.logaddexp(0.0, out[:, 1] - out[:, 0]))
