"""OpenAI's response shapes: plain dicts. Chat and text completions (ids ``chatcmpl-...`` / ``cmpl-...``,
object names, ``created``, ``model``, ``choices``, ``usage``) are built by ``ChatShape`` and ``CompletionShape``,
which both the streaming and the non-streaming paths use; a chat answer's reasoning block (kestrel_core.model.reasoning)
and tool calls (serve/tools.py) are read out of its text here, whole or as it streams. Embeddings are
``embedding_list``'s.
"""

from __future__ import annotations

import base64
import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kestrel_core.errors import KestrelError
from kestrel_core.model import harmony
from kestrel_core.model.harmony import HarmonyStream
from kestrel_core.model.parts import (
    CALL,
    CONTENT,
    REASONING,
    ContentStream,
    Part,
    PartDelta,
    PartStream,
    Stretch,
    TokenParts,
    joined,
    joined_deltas,
    shown,
)
from kestrel_core.model.reasoning import Reasoning, ReasoningStream, split_parts
from kestrel_core.model.request import RequestOutput
from kestrel_core.model.sampling import SamplingParams, TokenLogprob
from kestrel_core.serve.tools import ToolCall, ToolCalls, ToolStream, parse


def new_id(prefix: str) -> str:
    """A response id the way OpenAI spells them: ``chatcmpl-<hex>``, ``cmpl-<hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


# vLLM's floor for a logprob: -inf (a token of no probability) is written as it, JSON having no infinity, and OpenAI's
# clients reading a number
MIN_LOGPROB = -9999.0


def wire_logprob(value: float) -> float:
    """A logprob as the answers write it: at least MIN_LOGPROB, and a NaN (no token's probability) as MIN_LOGPROB too,
    so that no answer or stream holds JSON's invalid ``-Infinity`` or ``NaN``."""
    return min(value, 0.0) if value >= MIN_LOGPROB else MIN_LOGPROB  # a NaN compares false


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: seed + index with a seed (seeds wrap below 2^63), else the request's."""
    if params.seed is None or index == 0:
        return params
    return replace(params, seed=(params.seed + index) % 2 ** 63)


@dataclass
class ChoiceResult:
    """One choice's whole answer (the non-streaming response)."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    stop_reason: str | int | None = None  # the stop string or token id that ended it (vLLM's field)
    cached_tokens: int = 0  # of its prompt, those the prefix cache held
    tokens: TokenParts = field(default_factory=TokenParts)  # where each token's text starts, and its logprob


@dataclass
class Echo:
    """A completions prompt repeated before its choices' text (``echo``): its text, its first token (no
    logprob: nothing comes before it) and the other tokens' logprobs (None: none were asked for)."""

    text: str
    first_token: int
    logprobs: list[TokenLogprob] | None


def embedding_list(vectors: np.ndarray, encoding_format: str, model: str, prompt_tokens: int) -> dict[str, Any]:
    """``/v1/embeddings``' answer: each vector [D] as floats, or as base64 of its little-endian float32 bytes."""
    def encode(v: np.ndarray) -> list[float] | str:
        if encoding_format == "base64":
            return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
        return v.tolist()

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; with ``cached_tokens`` (the prompt tokens the prefix cache held), its
    ``prompt_tokens_details``, which OpenAI's answers always carry."""
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def cached_tokens(per_choice: Sequence[int], choices: int) -> int:
    """A request's prompt tokens the prefix cache held, each prompt's once: its ``choices`` choices (``per_choice``,
    choice p * choices + i prompt p's i-th) share its computation, which the first of them admitted did with the
    fewest held."""
    return sum(min(per_choice[p:p + choices]) for p in range(0, len(per_choice), choices))


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish reasons are "stop", "length" and "tool_calls"; an abort never reaches a client as one."""
    return reason if reason in ("stop", "length", "tool_calls") else None


class TokenStrings:
    """Each token's own text (decoded alone, special tokens by name) and the bytes it stands for, cached per id.

    ``token_bytes`` (Engine.token_bytes) gives a token's own bytes, so that the bytes of the tokens that each
    hold part of a character add up to it, as OpenAI's do (its text alone is U+FFFD); where it cannot (no
    vocabulary llguidance reads), the bytes are the text's UTF-8. A model without a tokenizer still serves
    token-id prompts; its tokens are then named ``token_id:<id>``.
    """

    def __init__(self, tokenizer: Any, token_bytes: Callable[[int], bytes] | None = None) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            try:
                own = getattr(self.tokenizer, "token_text", None)  # a tokenizer of the caller's own may have none
                text = own(token_id) if own else self.tokenizer.decode([token_id], skip_special_tokens=False)
            except KestrelError:  # NoTokenizer: no text at all
                text = f"token_id:{token_id}"
            self._cache[token_id] = text
        return text

    def bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            try:
                raw = list(self.token_bytes(token_id)) if self.token_bytes is not None else None
            except KestrelError:  # no vocabulary to read them from
                self.token_bytes = None
            if raw is None:
                raw = list(self(token_id).encode("utf-8"))
            self._bytes[token_id] = raw
        return raw

    def ready(self) -> None:
        """Build what ``bytes`` reads (the engine's vocabulary: a second, once), off the event loop."""
        if self.token_bytes is not None:
            with contextlib.suppress(KestrelError):
                self.token_bytes(0)


class _Shape:
    """What the two endpoints' responses share: the id, the creation time and the model name.

    With ``continuous_usage`` every chunk's usage is its choice's, as vLLM's: the choice's prompt tokens and the
    tokens the stream has sent of that choice so far, which the stream counts (``start_usage``, ``add_sent``),
    so a client can count each chunk's tokens."""

    object: str = ""
    chunk_object: str = ""
    by_parts = False  # a stream's steps are parts_chunk's (ChatShape's, for the Responses API)

    def __init__(self, response_id: str, model: str, tokens: TokenStrings, include_usage: bool = False,
                 continuous_usage: bool = False) -> None:
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.tokens = tokens
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage
        self._prompt_tokens: list[int] = []
        self._sent: list[int] = []

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def start_usage(self, prompt_tokens: Sequence[int]) -> None:
        """Each choice's prompt tokens, by index, before a stream's first chunk; no tokens sent yet."""
        self._prompt_tokens = list(prompt_tokens)
        self._sent = [0] * len(self._prompt_tokens)

    def add_sent(self, index: int, tokens: int) -> None:
        """Choice ``index``'s ``tokens`` go out with its next chunk."""
        self._sent[index] += tokens

    def choice_counts(self, index: int) -> tuple[int, int]:
        """Choice ``index``'s prompt tokens and the tokens sent of it so far."""
        return self._prompt_tokens[index], self._sent[index]

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope(self.chunk_object, [choice])
        if self.continuous_usage:
            body["usage"] = usage(*self.choice_counts(choice["index"]))
        elif self.include_usage:
            body["usage"] = None  # as OpenAI: every chunk but the last says usage: null
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
        body = self._envelope(self.chunk_object, [])
        body["usage"] = usage(prompt_tokens, completion_tokens, cached)
        return body

    def response(self, results: list[ChoiceResult], prompt_tokens: int, cached: int | None = None) -> dict[str, Any]:
        """The whole answer: a choice per result, in order; usage counts the prompt once (``cached``: the prompt
        tokens of it the prefix cache held)."""
        body = self._envelope(self.object, [self.choice(i, r) for i, r in enumerate(results)])
        body["usage"] = usage(prompt_tokens, sum(r.completion_tokens for r in results), cached)
        return body

    def choice(self, index: int, result: ChoiceResult) -> dict[str, Any]:
        raise NotImplementedError

    def stream_text(self, index: int, out: RequestOutput) -> tuple[str, str]:
        """What of choice ``index``'s new text (``out``'s) a stream sends now: (reasoning, content)."""
        return "", out.new_text

    def parts_chunk(self, index: int, out: RequestOutput) -> dict[str, Any]:
        raise NotImplementedError  # only chat answers have parts

    def finish_chunks(self, reason: str | None, index: int = 0, stop_reason: str | int | None = None
                      ) -> list[dict[str, Any]]:
        """The chunks that end choice ``index``'s stream (``stop_reason``: the stop string or token id)."""
        return [self.finish_chunk(reason, index, stop_reason)]

    def finish_chunk(self, reason: str | None, index: int = 0, stop_reason: str | int | None = None
                     ) -> dict[str, Any]:
        raise NotImplementedError

    def reasoning_chunk(self, text: str, entries: list[TokenLogprob] | None, index: int = 0) -> dict[str, Any]:
        raise NotImplementedError  # only chat answers reason (stream_text gives none otherwise)


@dataclass
class _Answer:
    """One streamed choice as it is read: its parts, its tool calls (a format in its content), its tokens."""

    reader: PartStream
    tools: ToolStream | None
    tokens: TokenParts = field(default_factory=TokenParts)


class ChatShape(_Shape):
    """``tools``: the request's tool calls (None: its answers are text), read out of each choice's content;
    ``reasoning``: its answers' reasoning block (None: they have none), answered as ``reasoning_content``;
    ``harmony``: its answers are harmony's channels (gpt-oss), which hold the reasoning, content and calls.

    Where the answers reason, the usage's ``completion_tokens_details.reasoning_tokens`` counts the tokens of
    their reasoning (kestrel_core.model.parts), as vLLM's does. ``by_parts`` (the Responses API's, which makes an
    output item of each part): each choice also says its parts (``parts``: index, type, text and the logprobs of
    the part's own tokens), a stream's steps as ``parts_chunk``'s."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, response_id: str, model: str, tokens: TokenStrings, include_usage: bool = False,
                 continuous_usage: bool = False, tools: ToolCalls | None = None,
                 reasoning: Reasoning | None = None, harmony: bool = False, by_parts: bool = False) -> None:
        super().__init__(response_id, model, tokens, include_usage, continuous_usage)
        self.tools = tools
        self.reasoning = reasoning
        self.harmony = harmony
        self.by_parts = by_parts
        self.reasons = harmony or reasoning is not None
        self.reasoning_tokens = 0  # of the choices answered so far
        self._answers: dict[int, _Answer] = {}

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        t = self.tokens
        return {"content": [
            {"token": t(e.token_id), "logprob": wire_logprob(e.logprob), "bytes": t.bytes(e.token_id),
             "top_logprobs": [{"token": t(i), "logprob": wire_logprob(lp), "bytes": t.bytes(i)} for i, lp in e.top]}
            for e in entries], "refusal": None}

    def _reader(self) -> PartStream:
        if self.harmony:
            return HarmonyStream()
        if self.reasoning is not None:
            return ReasoningStream(self.reasoning.open_in_prompt, self.reasoning.markers)
        return ContentStream()

    def choice(self, index: int, result: ChoiceResult) -> dict[str, Any]:
        text, reason = "".join(result.text), finish_reason(result.finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        answer: list[Part] = [Part(CONTENT, 0, len(text), 0, text)]
        content: tuple[tuple[int, int], ...] | None = None  # where in its text a tool format's calls leave content
        if self.harmony:
            said = harmony.parse(text)
            answer = list(said.parts)
            message["content"] = said.content
            if said.reasoning is not None:
                message["reasoning_content"] = said.reasoning
            if self.tools is not None and said.calls:
                message["content"] = said.content or None
                message["tool_calls"] = self.tools.message_calls(self._calls(said.calls))
                reason = self.tools.finish_reason(reason)
        elif self.reasoning is not None:
            answer = split_parts(text, self.reasoning.open_in_prompt, self.reasoning.markers)
            text = joined(answer, CONTENT) or ""
            message["content"] = text
            if thought := joined(answer, REASONING):
                message["reasoning_content"] = thought
        if self.tools is not None and not self.harmony:
            parsed = parse(self.tools.fmt, text, self.tools.parallel, self.tools.schemas)
            content = parsed.spans
            if parsed.calls:
                message["content"] = parsed.content
                message["tool_calls"] = self.tools.message_calls(parsed.calls)
                reason = self.tools.finish_reason(reason)
        if self.reasons:
            self.reasoning_tokens += result.tokens.count(answer, REASONING)
        body = {"index": index, "message": message, "logprobs": self.logprobs(result.logprobs),
                "finish_reason": reason, "stop_reason": result.stop_reason}
        if self.by_parts:
            deltas = [PartDelta(i, p.kind, p.text) for i, p in enumerate(answer)]
            if self.tools is not None and not self.harmony:  # the content is what the calls leave of it
                deltas = [replace(d, text=message["content"] or "") if d.kind == CONTENT else d for d in deltas]
            body["parts"] = self._parts(answer, deltas, result.tokens.release(shown(answer, content), final=True))
        return body

    def _parts(self, answer: Sequence[Stretch], deltas: list[PartDelta], entries: dict[int, list[TokenLogprob]]
               ) -> list[dict[str, Any]]:
        """The parts' new text, and their tokens' logprobs (``entries``, by part index), in the parts' order."""
        texts: dict[int, str] = {}
        for d in deltas:
            texts[d.index] = texts.get(d.index, "") + d.text
        out = []
        for i in sorted(texts.keys() | entries.keys()):
            if answer[i].kind != CALL:
                logprobs = self.logprobs(entries[i]) if i in entries else None
                out.append({"index": i, "type": answer[i].kind, "text": texts.get(i, ""),
                            "logprobs": logprobs["content"] if logprobs else None})
        return out

    def _calls(self, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
        """A harmony answer's calls, the first only where parallel calls are off."""
        assert self.tools is not None
        return calls if self.tools.parallel else calls[:1]

    def _answer(self, index: int, out: RequestOutput) -> _Answer:
        """Choice ``index``'s answer, its tokens so far ``out``'s too (their logprobs where its parts carry them)."""
        answer = self._answers.get(index)
        if answer is None:
            tools = None
            if self.tools is not None and not self.harmony:
                tools = ToolStream(self.tools.fmt, self.tools.parallel, self.tools.schemas)
            answer = self._answers[index] = _Answer(self._reader(), tools)
        answer.tokens.add(out.new_text, len(out.new_token_ids), out.text_offsets,
                          out.logprobs if self.by_parts else None)
        return answer

    def stream_text(self, index: int, out: RequestOutput) -> tuple[str, str]:
        if not self.reasons and self.tools is None:
            return "", out.new_text
        answer = self._answer(index, out)
        reasoning, content = joined_deltas(answer.reader.feed_parts(out.new_text))
        return reasoning, content if answer.tools is None else answer.tools.feed(content)

    def parts_chunk(self, index: int, out: RequestOutput) -> dict[str, Any]:
        """A streamed step as its parts' new text and tokens (``by_parts``)."""
        answer = self._answer(index, out)
        deltas = answer.reader.feed_parts(out.new_text)
        if answer.tools is not None:
            deltas = [replace(d, text=answer.tools.feed(d.text)) if d.kind == CONTENT else d for d in deltas]
        spans = shown(answer.reader.parts, answer.tools.spans() if answer.tools is not None else None)
        parts = self._parts(answer.reader.parts, deltas, answer.tokens.release(spans))
        return self.chunk({"index": index, "delta": {"parts": parts}, "logprobs": None, "finish_reason": None})

    def finish_chunks(self, reason: str | None, index: int = 0, stop_reason: str | int | None = None
                      ) -> list[dict[str, Any]]:
        answer = self._answers.pop(index, None)
        if answer is None:  # no step said anything
            answer = _Answer(self._reader(), None)
        deltas = answer.reader.finish_parts()
        whole = answer.reader.parts
        calls: tuple[Any, ...] = ()
        if isinstance(answer.reader, HarmonyStream) and self.tools is not None:
            calls = self._calls(answer.reader.calls())
        if answer.tools is not None:  # the content's last text (a call's start held back, or not a call after all)
            deltas = [replace(d, text=answer.tools.feed(d.text)) if d.kind == CONTENT else d for d in deltas]
            tail, calls = answer.tools.finish()
            content = [i for i, p in enumerate(whole) if p.kind == CONTENT]
            if tail and content:
                deltas.append(PartDelta(content[-1], CONTENT, tail))
        if self.reasons:
            self.reasoning_tokens += answer.tokens.count(whole, REASONING)
        chunks = []
        if self.by_parts:
            spans = shown(whole, answer.tools.spans() if answer.tools is not None else None)
            parts = self._parts(whole, deltas, answer.tokens.release(spans, final=True))
            if parts:
                chunks.append(self.chunk({"index": index, "delta": {"parts": parts}, "logprobs": None,
                                          "finish_reason": None}))
        else:
            thought, rest = joined_deltas(deltas)
            if thought:
                chunks.append(self.reasoning_chunk(thought, None, index))
            if rest:
                chunks.append(self.delta_chunk(rest, None, index))
        if calls:
            assert self.tools is not None
            tool_deltas = [{"index": k, **call} for k, call in enumerate(self.tools.message_calls(calls))]
            chunks.append(self.chunk({"index": index, "delta": {"tool_calls": tool_deltas}, "logprobs": None,
                                      "finish_reason": None}))
            reason = self.tools.finish_reason(reason)
        return chunks + [self.finish_chunk(reason, index, stop_reason)]

    def response(self, results: list[ChoiceResult], prompt_tokens: int, cached: int | None = None) -> dict[str, Any]:
        return self._detailed(super().response(results, prompt_tokens, cached))

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
        return self._detailed(super().usage_chunk(prompt_tokens, completion_tokens, cached))

    def _detailed(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` whose usage counts its reasoning tokens, where the answers reason."""
        if self.reasons:
            body["usage"]["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return body

    def reasoning_chunk(self, text: str, entries: list[TokenLogprob] | None, index: int = 0) -> dict[str, Any]:
        return self.chunk({"index": index, "delta": {"reasoning_content": text}, "logprobs": self.logprobs(entries),
                           "finish_reason": None})

    def first_chunks(self, choices: int = 1) -> list[dict[str, Any]]:
        return [self.chunk({"index": i, "delta": {"role": "assistant", "content": "", "refusal": None},
                            "logprobs": None, "finish_reason": None}) for i in range(choices)]

    def delta_chunk(self, text: str, entries: list[TokenLogprob] | None, index: int = 0) -> dict[str, Any]:
        return self.chunk({"index": index, "delta": {"content": text}, "logprobs": self.logprobs(entries),
                           "finish_reason": None})

    def finish_chunk(self, reason: str | None, index: int = 0, stop_reason: str | int | None = None
                     ) -> dict[str, Any]:
        return self.chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason(reason),
                           "stop_reason": stop_reason})


class CompletionShape(_Shape):
    """``echoes``: each choice's Echo (None: not echoed), or none at all."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, response_id: str, model: str, tokens: TokenStrings, include_usage: bool = False,
                 echoes: Sequence[Echo | None] = (), continuous_usage: bool = False) -> None:
        super().__init__(response_id, model, tokens, include_usage, continuous_usage)
        self.echoes = list(echoes)
        self._offsets: dict[int, int] = {}  # each choice's text_offset runs on across a stream's chunks

    def logprobs(self, entries: list[TokenLogprob] | None, index: int = 0,
                 first: int | None = None) -> dict[str, Any] | None:
        """The legacy shape: parallel lists; offsets are into the choice's text, token by token. ``first``: a
        token before the entries with no logprob (an echoed prompt's first)."""
        if entries is None:
            return None
        t = self.tokens
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        rows: list[tuple[int, float | None, dict[str, float] | None]] = [] if first is None else [(first, None, None)]
        for e in entries:
            top: dict[str, float] = {}
            for i, lp in e.top:
                top.setdefault(t(i), wire_logprob(lp))  # two ids with one text: the likelier one
            chosen = wire_logprob(e.logprob)
            top.setdefault(t(e.token_id), chosen)  # the chosen token's always: up to logprobs + 1, as OpenAI's
            rows.append((e.token_id, chosen, top))
        for token_id, logprob, top_row in rows:
            token = t(token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(top_row)
            offset = self._offsets.get(index, 0)
            out["text_offset"].append(offset)
            self._offsets[index] = offset + len(token)
        return out

    def _echo(self, index: int) -> Echo | None:
        return self.echoes[index] if index < len(self.echoes) else None

    def _echo_logprobs(self, echo: Echo, index: int) -> dict[str, Any] | None:
        return self.logprobs(echo.logprobs, index, first=echo.first_token)

    def choice(self, index: int, result: ChoiceResult) -> dict[str, Any]:
        echo = self._echo(index)
        head = self._echo_logprobs(echo, index) if echo is not None else None
        logprobs = self.logprobs(result.logprobs, index)
        if head is not None and logprobs is not None:
            logprobs = {key: head[key] + logprobs[key] for key in head}
        text = (echo.text if echo is not None else "") + "".join(result.text)
        return {"text": text, "index": index, "logprobs": logprobs,
                "finish_reason": finish_reason(result.finish_reason), "stop_reason": result.stop_reason}

    def first_chunks(self, choices: int = 1) -> list[dict[str, Any]]:
        """A chunk of each echoed choice's prompt."""
        return [self.chunk({"text": echo.text, "index": i, "logprobs": self._echo_logprobs(echo, i),
                            "finish_reason": None})
                for i in range(choices) if (echo := self._echo(i)) is not None]

    def delta_chunk(self, text: str, entries: list[TokenLogprob] | None, index: int = 0) -> dict[str, Any]:
        return self.chunk({"text": text, "index": index, "logprobs": self.logprobs(entries, index),
                           "finish_reason": None})

    def finish_chunk(self, reason: str | None, index: int = 0, stop_reason: str | int | None = None
                     ) -> dict[str, Any]:
        return self.chunk({"text": "", "index": index, "logprobs": None, "finish_reason": finish_reason(reason),
                           "stop_reason": stop_reason})


Shape = ChatShape | CompletionShape

__all__ = ["MIN_LOGPROB", "ChatShape", "ChoiceResult", "CompletionShape", "Echo", "Shape", "TokenStrings",
           "cached_tokens", "choice_params", "finish_reason", "new_id", "usage", "wire_logprob"]
