"""llama.cpp's ``POST /infill`` over the same engine: code completion between a prefix and a suffix, for the
editor plugins written against llama.cpp's server (llama.vscode, llama.vim), which call this route alone.

The request's code becomes a fill-in-the-middle prompt of token ids (kestrel_core.model.fim): the ``input_extra``
files first, in the repository-level layout, then ``input_prefix`` with ``prompt`` after it (tokenized apart, as
llama.cpp does) and ``input_suffix``, each part tokenized as text. A prompt that leaves no room for ``n_predict``
tokens of answer (at most half the context is kept for them) is cut as llama.cpp cuts one, and the answer says
``truncated``: the files lose their oldest tokens first, then the code keeps the end of its prefix and the start
of its suffix (the suffix up to a quarter of the room, where both are longer). The prompt is answered by the
completions handler (``Served.complete``, streamed), whose chunks become llama.cpp's objects: a ``{"content",
"stop": false}`` event as each piece of text comes, then one with ``stop: true``, the counts, why it stopped and
the ``timings`` (that last object alone, its ``content`` the whole text, when ``stream`` is false; no ``[DONE]``).
Two stops of llama.cpp's that the engine has not are applied to the text here, the answer then ending and its
request aborted: ``n_indent``, a line after the first whose indentation is under it (cut after its indentation),
and ``t_max_predict_ms``, a piece holding a newline once that long has passed since the first token.

``temperature``, ``top_k``, ``top_p`` and ``min_p`` not given take the model's recommendation, else llama.cpp's
defaults; so do ``repeat_penalty``, ``presence_penalty`` and ``frequency_penalty`` (llama.cpp's ``penalties``
sampler, off by default; ``repeat_last_n`` 0 turns it off, any other covers the whole context). ``samplers``
(names, or llama.cpp's letters) says which of those five samplers apply, one it leaves out being off (temperature
1, no penalty), and the samplers kestrel has not (``infill``, ``dry``, ``typ_p``, ``xtc``...) are ignored.
``logit_bias`` (llama.cpp's pairs or object, a token by id or by text) and ``json_schema`` become the completions
request's ``logit_bias`` and ``guided_json``: every one of these is applied by the completions handler's own
code. ``cache_prompt``, ``id_slot`` and ``t_max_prompt_ms`` (which llama.cpp does not implement) are taken and
ignored: the prefix cache always works. ``grammar`` (GBNF, which kestrel's grammars are not) and ``lora``, which
would change the answer, are refused. A model without fill-in-the-middle tokens is a 501, as llama.cpp answers.
Errors are llama.cpp's ``{"error": {"code", "message", "type"}}``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from kestrel_core.model.fim import FORMATS, FimPrompt, fim_format, fim_prompt
from kestrel_core.serve.access import CLIENT_CLOSED, RequestRecord, record_of
from kestrel_core.serve.bodies import NullsAbsentBody
from kestrel_core.serve.errors import APIError, llama_cpp_error, named_as, validated
from kestrel_core.serve.generation import ClientGone, EventStreamResponse, answer_chunks, sse, unless_disconnected
from kestrel_core.serve.offload import json_body, off_loop
from kestrel_core.serve.protocol import CompletionRequest

if TYPE_CHECKING:
    from kestrel_core.serve.app import Models, Served

PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
# llama.cpp's samplers that kestrel has, by llama.cpp's names, and the completions request's fields each sets
SAMPLERS = {"temperature": ("temperature",), "top_k": ("top_k",), "top_p": ("top_p",), "min_p": ("min_p",),
            "penalties": PENALTIES}
# llama.cpp's values, where the model recommends none (its penalties are off unless asked for)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0}
# the fields of a sampler that ``samplers`` leaves out
OFF = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
       "frequency_penalty": 0.0}
SAMPLER_LETTERS = {"t": "temperature", "k": "top_k", "p": "top_p", "m": "min_p", "e": "penalties"}  # llama.cpp's
# llama.cpp's names of those samplers, in any case: each as written, with dashes, without underscores, and aliases
SAMPLER_NAMES = {alias: name for name in SAMPLERS for alias in (name, name.replace("_", "-"), name.replace("_", ""))} \
    | {"temp": "temperature", "nucleus": "top_p"}
RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's default seed, which asks for a random one, as -1 does
UNSUPPORTED = ("grammar", "lora")
MAX_BIAS = 100.0  # the completions request's largest logit bias: +100 forces a token, -100 bans it
# the completions request's fields by the names /infill takes them under
REQUEST_NAMES = {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty", "guided_json": "json_schema"}


class ExtraChunk(NullsAbsentBody):
    """A file of ``input_extra`` (llama.vim sends its ``time`` too: ignored)."""

    text: StrictStr
    filename: StrictStr = "tmp"  # llama.cpp's name for a file sent without one


class InfillBody(NullsAbsentBody):
    """An ``/infill`` request: a field sent as null is one not sent, as llama.cpp reads null."""

    model: StrictStr | None = None
    input_prefix: StrictStr
    input_suffix: StrictStr
    input_extra: list[ExtraChunk] = []
    prompt: StrictStr = ""
    n_predict: StrictInt = -1  # below 0: until the context ends; 0: the prompt is read, nothing is answered
    stream: StrictBool = False
    temperature: StrictFloat | StrictInt | None = None
    top_k: StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    min_p: StrictFloat | StrictInt | None = None
    repeat_penalty: StrictFloat | StrictInt | None = None  # over the prompt and the answer (Hugging Face's)
    presence_penalty: StrictFloat | StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None
    repeat_last_n: StrictInt = 64  # 0: the penalties are off; any other: they cover the whole context
    samplers: list[StrictStr] | StrictStr | None = None
    seed: StrictInt | None = None
    stop: list[StrictStr] = []
    ignore_eos: StrictBool = False
    n_indent: StrictInt = 0
    t_max_predict_ms: StrictInt | StrictFloat = 0
    response_fields: list[StrictStr] = []
    # llama.cpp's hints about its slots and its cache, which kestrel has no use for: its prefix cache always works
    cache_prompt: StrictBool = True
    id_slot: StrictInt = -1
    t_max_prompt_ms: StrictInt | StrictFloat = 0
    logit_bias: list[Any] | dict[str, Any] | None = None  # [token id or text, bias or false] pairs, or an object
    json_schema: dict[str, Any] | StrictStr | None = None
    # llama.cpp's fields that would change the answer in ways kestrel's /infill does not: refused when given
    grammar: Any = None  # GBNF, which kestrel's grammars (llguidance's) are not
    lora: Any = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> InfillBody:
        for name in UNSUPPORTED:
            if getattr(self, name) not in (None, "", [], {}):
                raise APIError(400, f"{name} is not supported by kestrel's /infill", param=name)
        return self

    def sampling(self, recommended: Mapping[str, float]) -> dict[str, Any]:
        """The completions request's sampling: the fields of a sampler ``samplers`` names (each, without it) take
        the values given, else the model's ``recommended``, else llama.cpp's defaults; a sampler it leaves out is
        off, and so are the penalties with ``repeat_last_n`` 0."""
        named = self._samplers() - ({"penalties"} if self.repeat_last_n == 0 else set())
        given = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p,
                 "repetition_penalty": self.repeat_penalty, "presence_penalty": self.presence_penalty,
                 "frequency_penalty": self.frequency_penalty}
        value = {name: OFF[name] if sampler not in named else given[name] if given[name] is not None
                 else recommended.get(name, DEFAULTS[name]) for sampler, names in SAMPLERS.items() for name in names}
        return {"temperature": max(float(value["temperature"]), 0.0),  # below 0: greedy, as llama.cpp samples
                "top_k": max(int(value["top_k"]), 0),  # 0 and below: off, as llama.cpp reads it
                **{name: float(value[name]) for name in ("top_p", "min_p", *PENALTIES)}}

    def bias(self, tokenizer: Any) -> dict[str, float] | None:
        """``logit_bias`` as the completions request takes it (token id -> bias), read as llama.cpp reads it: a token
        given by its text biases each of the text's tokens, ``false`` bans it, a bias past +-100 is +-100 (which
        forces or bans the token already)."""
        if self.logit_bias is None:
            return None
        pairs = list(self.logit_bias.items()) if isinstance(self.logit_bias, dict) else self.logit_bias
        biases: dict[str, float] = {}
        for pair in pairs:
            token, value = pair if isinstance(pair, (list, tuple)) and len(pair) == 2 else (None, None)
            if value is False:
                value = -MAX_BIAS
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not isinstance(token, (int, str)) or isinstance(token, bool):
                raise APIError(400, "logit_bias: each entry is a token id or a text and its bias (a number, or "
                               f"false to ban it), not {json.dumps(pair)[:60]}", param="logit_bias")
            ids = [token] if isinstance(token, int) else [int(token)] if token.isdigit() \
                else tokenizer.encode_text(token)
            for token_id in ids:
                biases[str(token_id)] = min(max(float(value), -MAX_BIAS), MAX_BIAS)
        return biases or None

    def _samplers(self) -> set[str]:
        if self.samplers is None:  # llama.cpp's default chain holds them all
            return set(SAMPLERS)
        if isinstance(self.samplers, str):
            return {SAMPLER_LETTERS[c] for c in self.samplers if c in SAMPLER_LETTERS}
        return {SAMPLER_NAMES[n.lower()] for n in self.samplers if n.lower() in SAMPLER_NAMES}

    def chosen_seed(self) -> int | None:
        """The seed, None for a random one (-1 or below, or llama.cpp's default)."""
        return None if self.seed is None or self.seed < 0 or self.seed == RANDOM_SEED else self.seed

    def max_tokens(self) -> int | None:
        """The completions request's: ``n_predict``; for 0 one token, which is not answered (generating it reads
        the prompt into the prefix cache, what llama.cpp's 0 is for); None, until the context ends, below 0."""
        return 1 if self.n_predict == 0 else self.n_predict if self.n_predict > 0 else None


@dataclass(frozen=True)
class InfillPrompt:
    ids: list[int]
    stop_token_ids: tuple[int, ...]  # the format's stop tokens, to add
    truncated: bool  # it was cut to the context
    text: str  # its text, special tokens by name (llama.cpp's ``prompt``)


def infill_prompt(served: Served, body: InfillBody) -> InfillPrompt:
    """The request's prompt, cut to the model's context (``fit``)."""
    engine = served.engine
    tokenizer = engine.tokenizer
    parts = fim_prompt(tokenizer, body.input_prefix, body.input_suffix, engine.eos_token_ids,
                       [(chunk.filename, chunk.text) for chunk in body.input_extra])
    context = engine.config.max_position
    fitted, cut = fit(parts, tokenizer.encode_text(body.prompt), context, min(max(body.n_predict, 1), context // 2))
    ids = fitted.ids()
    return InfillPrompt(ids, () if body.ignore_eos else fitted.stop_token_ids, cut, tokenizer.decode(ids))


def fit(parts: FimPrompt, prompt: list[int], context: int, room: int) -> tuple[FimPrompt, bool]:
    """``parts`` with ``prompt`` after the prefix, cut as llama.cpp cuts an infill prompt so that ``room`` tokens of
    answer fit in ``context`` after it: the files first, their oldest tokens first, then the code, which keeps its
    prefix's end and its suffix's start (the suffix up to a quarter of the room, where both are longer); and
    whether anything was cut. ``prompt`` is never cut."""
    fixed = len(parts.head) + len(prompt) + 2  # the suffix and middle tokens
    code = max(context - room - fixed, 0)
    prefix, suffix = parts.prefix, parts.suffix
    if len(prefix) + len(suffix) > code:
        suffix = suffix[:max(code // 4, code - len(prefix))]
        prefix = prefix[len(prefix) - (code - len(suffix)):]
    files_room = code - len(prefix) - len(suffix)
    files = parts.files[max(len(parts.files) - files_room, 0):]
    cut = (len(files), len(prefix), len(suffix)) != (len(parts.files), len(parts.prefix), len(parts.suffix))
    return replace(parts, files=files, prefix=prefix + prompt, suffix=suffix), cut


class InfillAnswer:
    """One answer's llama.cpp objects, made from the completion stream's chunks, with the stops of llama.cpp's
    that the engine has not (``n_indent``, ``t_max_predict_ms``) applied to its text."""

    def __init__(self, served: Served, body: InfillBody, prompt: InfillPrompt, record: RequestRecord,
                 settings: dict[str, Any]) -> None:
        self.served, self.body, self.prompt, self.record, self.settings = served, body, prompt, record, settings
        self.text = ""  # what has been answered
        self.predicted = 0  # tokens generated
        self.finish: str | None = None  # the completion's finish reason
        self.stop_type, self.stopping_word = "limit", ""
        self.line: int | None = None  # where the line n_indent is to look at starts (None: still on the first)

    async def events(self, source: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The streamed answer: an event a piece of text, then the last object (an error: llama.cpp's event)."""
        try:
            async for piece in self.pieces(source):
                yield sse({"index": 0, "content": piece, "stop": False, "tokens_predicted": self.predicted,
                           "tokens_evaluated": len(self.prompt.ids)})
        except APIError as exc:
            yield sse(llama_cpp_error(exc.status, exc.message))
            return
        yield sse(self.last(""))

    async def whole(self, source: AsyncIterator[bytes]) -> dict[str, Any]:
        return self.last("".join([piece async for piece in self.pieces(source)]))

    async def pieces(self, source: AsyncIterator[bytes]) -> AsyncIterator[str]:
        """The answer's text as it comes, from the completion stream ``source`` (its server-sent events), which is
        closed however this ends (an early end aborts its request); an error in it, the APIError."""
        async with aclosing(source), aclosing(answer_chunks(source)) as chunks:
            async for chunk in chunks:
                if "error" in chunk:
                    error = chunk["error"]
                    raise APIError(503 if error.get("code") == "server_shutting_down" else 500,
                                   error.get("message") or "the engine failed")
                if not chunk.get("choices"):  # the usage: the stream is over
                    return
                choice = chunk["choices"][0]
                self.predicted = (chunk.get("usage") or {}).get("completion_tokens", self.predicted)
                piece, stopped = self._limited(choice.get("text") or "")
                if piece:
                    self.text += piece
                    yield piece
                if choice.get("finish_reason") is not None:
                    self._finished(choice["finish_reason"], choice.get("stop_reason"))
                    return
                if stopped:
                    return

    def _limited(self, piece: str) -> tuple[str, bool]:
        """``piece`` as far as llama.cpp's stops let it go, and whether one of them ended the answer."""
        if self.body.n_predict == 0:  # the token that read the prompt is not answered
            return "", False
        cut = self._under_indented(self.text + piece) if self.body.n_indent > 0 else None
        if cut is not None:
            return piece[:cut - len(self.text)], True
        since_first = time.perf_counter() - (self.record.first_token_at or time.perf_counter())
        return piece, 0 < self.body.t_max_predict_ms < since_first * 1e3 and "\n" in piece

    def _under_indented(self, text: str) -> int | None:
        """Where ``text`` is cut for ``n_indent``: after the indentation (spaces and tabs) of the first line after
        the first that is indented less, once that line shows another character (a newline too, as llama.cpp
        reads it); None while none is."""
        if self.line is None:
            newline = text.find("\n")
            if newline < 0:
                return None
            self.line = newline + 1
        while True:
            pos = self.line
            while pos < len(text) and text[pos] in " \t":
                pos += 1
            if pos == len(text):
                return None
            if pos - self.line < self.body.n_indent:
                return pos
            newline = text.find("\n", pos)
            if newline < 0:
                return None
            self.line = newline + 1

    def _finished(self, reason: str, stop_reason: str | int | None) -> None:
        self.finish = reason
        if reason == "stop":  # a stop string is llama.cpp's stopping word; a stop token, its end of generation
            self.stop_type = "word" if isinstance(stop_reason, str) else "eos"
            self.stopping_word = stop_reason if isinstance(stop_reason, str) else ""

    def last(self, content: str) -> dict[str, Any]:
        """The answer's last object (llama.cpp's ``/completion`` answer): ``content`` (the whole text, or none
        after a stream's pieces), the counts, why it stopped and the timings; with ``response_fields``, those."""
        end = time.perf_counter()
        first = self.record.first_token_at or end
        prompt_n = len(self.prompt.ids)
        predicted = 0 if self.body.n_predict == 0 else self.predicted
        ran_out = self.finish == "length" and prompt_n + self.predicted >= self.served.engine.config.max_position
        body = {"index": 0, "content": content, "tokens": [], "stop": True, "model": self.served.model_name,
                "tokens_predicted": predicted, "tokens_evaluated": prompt_n, "generation_settings": self.settings,
                "prompt": self.prompt.text, "has_new_line": "\n" in self.text,
                "truncated": self.prompt.truncated or ran_out, "stop_type": self.stop_type,
                "stopping_word": self.stopping_word,
                "tokens_cached": prompt_n + max(predicted - 1, 0),  # the context it ends with: not the last token
                "timings": _timings(prompt_n, (first - self.record.start) * 1e3, predicted, (end - first) * 1e3)}
        return _picked(body, self.body.response_fields) if self.body.response_fields else body


def _timings(prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> dict[str, float]:
    """llama.cpp's timings: the prompt's from the request's start to its first token (every prompt token counted:
    the prefix cache's share is not known here), the answer's from there to its end."""
    def rates(n: int, ms: float) -> tuple[float, float]:
        return (ms / n if n else 0.0), (1e3 * n / ms if ms > 0 else 0.0)

    prompt_per_token, prompt_per_second = rates(prompt_n, prompt_ms)
    predicted_per_token, predicted_per_second = rates(predicted_n, predicted_ms)
    return {"prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": prompt_per_token,
            "prompt_per_second": prompt_per_second, "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_per_token, "predicted_per_second": predicted_per_second}


def _picked(body: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """``response_fields``: the fields at ``paths`` ("timings/prompt_n": a field's field), each under its path as
    given; a path that names none is left out."""
    out: dict[str, Any] = {}
    for path in paths:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


def install(app: FastAPI, models: Models) -> None:
    """llama.cpp's ``/infill`` on ``app``, answered by the named model's completions handler."""

    @app.post("/infill")
    async def infill(body: Annotated[InfillBody, json_body(InfillBody)], request: Request) -> Response:
        served = models.get(body.model)
        served.check_request()
        if fim_format(served.engine.tokenizer) is None:  # llama.cpp's 501 (not_supported_error)
            known = ", ".join(t[0] for t in FORMATS)
            raise APIError(501, "Infill is not supported by this model: its vocabulary has none of the "
                           f"fill-in-the-middle tokens kestrel knows ({known})")
        prompt = await off_loop(request, lambda: infill_prompt(served, body), inline=False)
        sampling, seed = body.sampling(served.engine.sampling_defaults), body.chosen_seed()
        bias = body.bias(served.engine.tokenizer)
        with named_as(REQUEST_NAMES):  # the completions handler samples as it samples its own requests
            completion = await off_loop(request, lambda: validated(CompletionRequest, {
                "prompt": prompt.ids, "max_tokens": body.max_tokens(), **sampling, "seed": seed,
                "stop": body.stop or None, "stop_token_ids": list(prompt.stop_token_ids) or None,
                "ignore_eos": body.ignore_eos, "logit_bias": bias, "guided_json": body.json_schema, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
            response = await served.complete(completion, request)
        if not isinstance(response, EventStreamResponse):  # the client left before the first token
            return response
        settings = {"n_ctx": served.engine.config.max_position, "n_predict": body.n_predict,
                    **{REQUEST_NAMES.get(name, name): value for name, value in sampling.items()},
                    "repeat_last_n": body.repeat_last_n, "seed": RANDOM_SEED if seed is None else seed,
                    "stop": body.stop, "ignore_eos": body.ignore_eos, "n_indent": body.n_indent,
                    "t_max_predict_ms": body.t_max_predict_ms, "stream": body.stream}
        answer = InfillAnswer(served, body, prompt, record_of(request), settings)
        if body.stream:
            return EventStreamResponse(answer.events(response.body_iterator), response.on_close)
        try:
            return JSONResponse(await unless_disconnected(answer.whole(response.body_iterator), request))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            response.on_close()  # the engine's request ends with the answer, however it ends
