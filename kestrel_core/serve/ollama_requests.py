"""Ollama's requests (``/api/*``), read as Ollama's Go server reads them, and their translation into the OpenAI
requests kestrel answers (serve/ollama.py has the routes and the answers).

A field sent as null is one not sent; an integer option may come as any number, its fraction dropped (Go's
conversion); ``keep_alive`` is seconds or Go's duration text, refused in Go's words otherwise; a sampling option
not given takes the model's recommendation, else Ollama's default, and one past its sampler's range is read as
Ollama's sampler reads it. Each call in the messages gets an id made from where it stands, in the shape the
template takes; a client's ids (Ollama's answers give them) say which call a result answers. A last assistant
message is continued.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BeforeValidator, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator, model_validator

from kestrel_core.model.reasoning import think_kwargs
from kestrel_core.model.sampling import MAX_TOP_LOGPROBS
from kestrel_core.serve.bodies import NullsAbsentBody
from kestrel_core.serve.errors import APIError
from kestrel_core.serve.tools import MISTRAL_FORMATS

if TYPE_CHECKING:
    from kestrel_core.serve.app import Served

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # Ollama's, where a Modelfile sets none
OLLAMA_NAMES = {"repetition_penalty": "repeat_penalty"}  # its options' names where they differ from kestrel's


class OllamaBody(NullsAbsentBody):
    """An Ollama request's object: a field sent as null is one not sent, as Go reads null (``"content": null`` is
    no content, ``"stream": null`` the default)."""


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


MAX_INT64 = (1 << 63) - 1


def _go_int(value: Any) -> Any:
    """A number as the integer Ollama's ``Options.FromMap`` makes of it: JSON's numbers reach it as float64, which
    Go converts to int by dropping the fraction (2.7 is 2, -1.5 is -1). One past int64's range is held to it, as
    arm64 converts (amd64's conversion gives the lowest int64 either way; Go leaves it to the platform)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return value
    return max(-MAX_INT64 - 1, min(MAX_INT64, int(value)))


OptionInt = Annotated[StrictInt, BeforeValidator(_go_int)]
THINK_LEVELS = ("high", "medium", "low", "max")  # in the order Ollama's error lists them
# the type of each of Ollama's options (its api.Options and api.Runner), as its Options.FromMap checks them
OPTION_TYPES = {**dict.fromkeys(("num_keep", "seed", "num_predict", "top_k", "repeat_last_n", "num_ctx", "num_batch",
                                 "num_gpu", "main_gpu", "num_thread"), "integer"),
                **dict.fromkeys(("top_p", "min_p", "typical_p", "temperature", "repeat_penalty", "presence_penalty",
                                 "frequency_penalty"), "float32"),
                "use_mmap": "boolean", "stop": "array"}


class Options(OllamaBody):
    """The options kestrel honours; the rest of Ollama's are ignored, but each of Ollama's options must be of its
    type, as Ollama refuses one that is not (a JSON number for a number, integer or not)."""

    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    top_k: OptionInt | None = None
    min_p: StrictFloat | StrictInt | None = None
    repeat_penalty: StrictFloat | StrictInt | None = None  # over the prompt and the answer (Hugging Face's)
    seed: OptionInt | None = None
    num_predict: OptionInt | None = None  # 0 or less (-1, -2): until the context ends
    stop: list[StrictStr] | None = None
    presence_penalty: StrictFloat | StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None

    @model_validator(mode="before")
    @classmethod
    def _ollamas_types(cls, data: Any) -> Any:
        for key, value in data.items() if isinstance(data, dict) else ():
            kind = OPTION_TYPES.get(key)
            if kind is None or value is None:
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not {"integer": number, "float32": number, "boolean": isinstance(value, bool),
                    "array": isinstance(value, list)}[kind]:
                raise APIError(400, f'option "{key}" must be of type {kind}', param=f"options.{key}")
            if kind == "array" and not all(isinstance(item, str) for item in value):
                raise APIError(400, f'option "{key}" must be of an array of strings', param=f"options.{key}")
        return data


class ToolFunction(OllamaBody):
    name: StrictStr
    arguments: dict[str, Any]


class ToolCall(OllamaBody):
    id: StrictStr | None = None  # as Ollama's answers give it: a result's ``tool_call_id`` names the call
    function: ToolFunction


class Message(OllamaBody):
    role: Annotated[Literal["system", "user", "assistant", "tool"], BeforeValidator(_lower)]  # Ollama lowers it
    content: StrictStr = ""
    images: list[StrictStr] | None = None
    thinking: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: StrictStr | None = None
    tool_call_id: StrictStr | None = None


GO_UNITS = {"ns": 1, "us": 10**3, "µs": 10**3, "μs": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9,
            "h": 3600 * 10**9}  # Go's time.ParseDuration's units, in nanoseconds
DIGITS = re.compile(r"[0-9]*")
UNIT = re.compile(r"[^.0-9]*")


def _go_quote(text: str) -> str:
    """``text`` quoted as Go's time package quotes it in its errors: a control or non-ASCII character as its UTF-8
    bytes in \\x escapes, ``"`` and ``\\`` escaped."""
    out = []
    for ch in text:
        if ch < " " or not ch.isascii():
            out.append("".join(f"\\x{b:02x}" for b in ch.encode()))
        else:
            out.append("\\" + ch if ch in '"\\' else ch)
    return '"' + "".join(out) + '"'


def go_duration(text: str) -> int:
    """Go's ``time.ParseDuration``: ``text`` in nanoseconds (signed decimal numbers, each with a unit: "300ms",
    "-1.5h", "2h45m"), else a ValueError in its words."""
    def invalid() -> ValueError:
        return ValueError(f"time: invalid duration {_go_quote(text)}")

    s, neg, total = text, False, 0
    if s[:1] in ("-", "+"):
        neg, s = s[0] == "-", s[1:]
    if s == "0":
        return 0
    if not s:
        raise invalid()
    while s:
        if not (s[0] == "." or "0" <= s[0] <= "9"):
            raise invalid()
        digits = DIGITS.match(s).group()  # type: ignore[union-attr]
        s = s[len(digits):]
        whole = int(digits or "0")
        if whole > 1 << 63:
            raise invalid()
        fraction, scale, places = 0, 1.0, ""
        if s.startswith("."):
            places = DIGITS.match(s, 1).group()  # type: ignore[union-attr]
            s = s[1 + len(places):]
            for digit in places:  # the digits past int64's range add no precision, as Go's leadingFraction
                more = fraction * 10 + int(digit)
                if fraction > MAX_INT64 // 10 or more > 1 << 63:
                    break
                fraction, scale = more, scale * 10
        if not digits and not places:
            raise invalid()
        unit = UNIT.match(s).group()  # type: ignore[union-attr]
        s = s[len(unit):]
        if not unit:
            raise ValueError(f"time: missing unit in duration {_go_quote(text)}")
        if unit not in GO_UNITS:
            raise ValueError(f"time: unknown unit {_go_quote(unit)} in duration {_go_quote(text)}")
        if whole > (1 << 63) // GO_UNITS[unit]:
            raise invalid()
        whole *= GO_UNITS[unit]
        if fraction:
            whole += int(fraction * (GO_UNITS[unit] / scale))  # float64, as Go computes it
            if whole > 1 << 63:
                raise invalid()
        total += whole
        if total > 1 << 63:
            raise invalid()
    if not neg and total > MAX_INT64:
        raise invalid()
    return -total if neg else total


def _keep_alive(value: Any) -> int:
    """``keep_alive`` in nanoseconds, as Ollama's ``api.Duration`` reads it: a number is seconds, a string Go's
    duration text, and either one below zero is forever (the largest duration); anything else is refused in its
    words (``Unsupported type: 'bool'``)."""
    if isinstance(value, str):
        try:
            ns = go_duration(value)
        except ValueError as exc:
            raise APIError(400, str(exc), param="keep_alive") from None
        return MAX_INT64 if ns < 0 else ns
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        ns = value * 1e9  # Go's float64 seconds times time.Second
        return MAX_INT64 if value < 0 or not ns < MAX_INT64 else int(ns)
    go_type = "bool" if isinstance(value, bool) else "[]interface {}" if isinstance(value, list) \
        else "map[string]interface {}"
    raise APIError(400, f"Unsupported type: '{go_type}'", param="keep_alive")


class KeepAliveBody(OllamaBody):
    """A request that may say how long the model stays loaded after it (``keep_alive``, in nanoseconds; None: not
    said). Ollama reads it before anything else of the request, and a model stays loaded here while the server
    runs: what it changes is the answer to a request with nothing to generate (``done_reason`` "unload")."""

    keep_alive: int | None = None

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> int:
        return _keep_alive(value)


class GenerationBody(KeepAliveBody):
    model: StrictStr = ""  # none: chat's 400 (``model_required``), generate's 404, as Ollama answers them
    format: Any = None  # "json", a JSON Schema; "": none, as Ollama reads it (``response_format``)
    options: Options | None = None
    stream: StrictBool = True
    think: StrictBool | Literal["low", "medium", "high", "max"] | None = None  # a level: the reasoning effort
    logprobs: StrictBool = False
    top_logprobs: StrictInt = 0  # each token's alternatives

    @field_validator("think", mode="before")
    @classmethod
    def _think_level(cls, value: Any) -> Any:
        """A boolean or a level, refused otherwise in Ollama's words."""
        levels = ", ".join(f'"{level}"' for level in THINK_LEVELS)
        if isinstance(value, str) and value not in THINK_LEVELS:
            raise APIError(400, f"invalid think value: {json.dumps(value, ensure_ascii=False)} (must be {levels}, "
                           "true, or false)", param="think")
        if not isinstance(value, (bool, str)):
            raise APIError(400, f"think must be a boolean or string ({levels}, true, or false)", param="think")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int) -> int:
        if not 0 <= value <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
        return value

    def chat_logprobs(self) -> dict[str, Any]:
        """The chat request's logprobs fields (Ollama's top_logprobs count only with logprobs)."""
        return {"logprobs": True, "top_logprobs": self.top_logprobs} if self.logprobs else {}

    def sampling(self, stream: bool, recommended: Mapping[str, float]) -> dict[str, Any]:
        """The OpenAI request's sampling fields: an option not given takes the model's ``recommended`` value,
        else Ollama's default (as a Modelfile's parameters override Ollama's)."""
        o = self.options or Options()
        default = {**DEFAULTS, **recommended}
        top_p = float(default["top_p"] if o.top_p is None else o.top_p)
        top_k = int(default["top_k"] if o.top_k is None else o.top_k)
        # values past a sampler's range are read as Ollama's sampler reads them: a temperature below 0 is greedy,
        # a top_p of 0 or less keeps the most likely token alone (top-k 1), and one above 1 or a top_k below 0
        # filters nothing
        fields: dict[str, Any] = {
            "temperature": max(0.0, float(default["temperature"] if o.temperature is None else o.temperature)),
            "top_p": min(top_p, 1.0) if top_p > 0 else 1.0, "top_k": max(top_k, 0) if top_p > 0 else 1,
            "seed": None if o.seed is not None and o.seed < 0 else o.seed, "stop": o.stop,  # -1: random, Ollama's
            "min_p": None if o.min_p is None else min(max(float(o.min_p), 0.0), 1.0),
            "repetition_penalty": o.repeat_penalty,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}
        if o.presence_penalty is not None:
            fields["presence_penalty"] = float(o.presence_penalty)
        if o.frequency_penalty is not None:
            fields["frequency_penalty"] = float(o.frequency_penalty)
        if o.num_predict is not None and o.num_predict > 0:  # 0 and below: no limit but the context, as Ollama's
            fields["max_tokens"] = o.num_predict
        return fields

    def response_format(self) -> dict[str, Any] | None:
        """The OpenAI request's: a JSON object for ``"json"``, the schema's for a schema; anything else is refused in
        Ollama's words, which quote the value as JSON in a Go string."""
        if self.format is None or self.format == "":
            return None
        if self.format == "json":
            return {"type": "json_object"}
        if isinstance(self.format, dict):
            return {"type": "json_schema", "json_schema": {"name": "format", "schema": self.format}}
        raw = json.dumps(json.dumps(self.format, ensure_ascii=False, separators=(",", ":")), ensure_ascii=False)
        raise APIError(400, f'invalid format: {raw}; expected "json" or a valid JSON Schema object', param="format")

    def template_kwargs(self, harmony: bool) -> dict[str, Any] | None:
        """The template's variables for ``think`` (``harmony``: the template is gpt-oss's)."""
        return think_kwargs(self.think, harmony)


class ChatBody(GenerationBody):
    messages: list[Message] = []
    tools: list[dict[str, Any]] | None = None
    truncate: StrictBool = True  # a conversation past the context loses its oldest messages, as Ollama's

    def openai(self, served: Served) -> dict[str, Any]:
        """The OpenAI chat request to ``served``: its recommended sampling, the tool format its template takes
        (which the ids of earlier calls must suit) and whether the template is gpt-oss's. A last assistant message
        of text is a prefill, which the answer continues, as Ollama's templates leave that turn open (a client's
        "continue" sends the answer so far); an empty one is the turn the answer opens."""
        if self.tools and served.tool_format is None:  # Ollama's words, which clients match to chat without tools
            raise APIError(400, f"{served.model_name} does not support tools", param="tools")
        messages = _openai_messages(self.messages, served.tool_format)
        last = messages[-1]
        prefill = last["role"] == "assistant" and "tool_calls" not in last
        if prefill and not last["content"] and len(messages) > 1:
            messages.pop()
        recommended = served.engine.sampling_defaults
        # Ollama's tools are functions whatever their ``type`` says (clients leave it out)
        tools = [{**tool, "type": "function"} for tool in self.tools] if self.tools else None
        return {"messages": messages, "tools": tools, "response_format": self.response_format(),
                "continue_final_message": prefill and bool(last["content"]) or None,
                "chat_template_kwargs": self.template_kwargs(served.harmony), **self.chat_logprobs(),
                **self.sampling(self.stream, recommended)}


class GenerateBody(GenerationBody):
    prompt: StrictStr = ""
    suffix: StrictStr | None = None
    system: StrictStr | None = None
    raw: StrictBool = False
    images: list[StrictStr] | None = None
    template: StrictStr | None = None
    context: list[StrictInt] | None = None


class EmbedBody(KeepAliveBody):
    model: StrictStr = ""  # none: the 404 of a model not found, as Ollama answers it
    input: StrictStr | list[StrictStr] = ""  # none: what clients send to load the model
    truncate: StrictBool = True
    dimensions: StrictInt | None = None  # 0 or past the model's size: none, as Ollama ignores it


class LegacyEmbeddingsBody(KeepAliveBody):
    model: StrictStr = ""  # none: as Ollama answers it (``model_required``)
    prompt: StrictStr = ""


class ShowBody(OllamaBody):
    model: StrictStr = ""
    name: StrictStr = ""  # the older field


def model_required(name: str) -> str:
    """``name``, where it names a model: Ollama's show, chat and embeddings routes answer none (empty or blanks) with
    a 400 "model is required" (its generate and embed routes with the 404 of a model not found)."""
    if not name.strip():
        raise APIError(400, "model is required", param="model")
    return name


def _openai_messages(messages: list[Message], tool_format: str | None) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's. Each call gets an id made from where it stands (the same prompt each time a
    conversation is sent again), in the shape ``tool_format``'s template takes, whatever id the client's call
    carries (Ollama's are its own, which a Mistral template refuses); a tool result answers the call its
    ``tool_call_id`` names, else the earliest unanswered call of its ``tool_name``, or the earliest unanswered
    one."""
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str, str | None]] = []  # (id, name, the client's id) of the calls not answered yet
    for i, m in enumerate(messages):
        if m.images:
            raise APIError(400, "images are not supported (kestrel serves text models)", param="messages")
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.thinking:
            message["reasoning_content"] = m.thinking
        if m.tool_calls:
            ids = [_call_id(tool_format, i, k) for k in range(len(m.tool_calls))]
            message["tool_calls"] = [{"id": id_, "type": "function", "function": {
                "name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                for id_, c in zip(ids, m.tool_calls)]
            unanswered = [(id_, c.function.name, c.id) for id_, c in zip(ids, m.tool_calls)]
        if m.role == "tool":
            match = next((c for c in unanswered if m.tool_call_id and c[2] == m.tool_call_id), None) or next(
                (c for c in unanswered if c[1] == m.tool_name), unanswered[0] if unanswered else None)
            if match is not None:
                unanswered.remove(match)
            message["tool_call_id"] = match[0] if match else _call_id(tool_format, i, 0)
            if m.tool_name:
                message["name"] = m.tool_name
        out.append(message)
    return out


def _call_id(tool_format: str | None, message: int, call: int) -> str:
    """The id of call ``call`` of message ``message``: nine letters and digits for Mistral's templates."""
    return f"c{message % 10**5:05d}{call % 10**3:03d}" if tool_format in MISTRAL_FORMATS else f"call_{message}_{call}"
