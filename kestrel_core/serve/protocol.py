"""OpenAI's request and response shapes for ``/v1/chat/completions`` and ``/v1/completions``.

Requests are pydantic models with OpenAI's field names; unknown fields are ignored (clients send many), and
scalar fields are strict (``"0.5"`` is not a temperature), so a wrong type is a 400 naming the field. Ranges
are not repeated here: ``SamplingParams.check`` is the one place that knows them, and its ``InvalidRequest``
names the field too. Fields kestrel cannot honour (``suffix``, image parts...) are refused rather than
silently ignored, since ignoring them would change what the client gets. Tools are shown to the model by its
chat template and the calls it writes are read back out of its answers (serve/tools.py); a forced call and a
JSON ``response_format`` are grammars the answer keeps to (``grammar``, kestrel_core.model.grammar).
``n`` choices are ``n`` sequences of one prompt (with the prefix cache, the first computes it and the others
attach its blocks); with a ``seed``, choice i samples with seed + i, so the choices differ and the request is
reproducible. A completions request may hold several prompts (choice p * n + i is prompt p's i-th) and ``echo``
them, with their tokens' logprobs and, with ``max_tokens`` 0, nothing generated: what evaluation harnesses send
to score text.

Responses are plain dicts built to OpenAI's shapes (ids ``chatcmpl-...`` / ``cmpl-...``, object names,
``created``, ``model``, ``choices``, ``usage``) by ``ChatShape`` and ``CompletionShape``, which both the
streaming and the non-streaming paths use.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from kestrel_core.errors import InvalidRequest, KestrelError
from kestrel_core.model.grammar import json_schema_grammar
from kestrel_core.model.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob
from kestrel_core.serve.reasoning import Reasoning, ReasoningStream, split
from kestrel_core.serve.tools import UNKNOWN, ToolCalls, ToolStream, call_grammar, parse

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; kestrel's own SamplingParams default is greedy
MAX_CHOICES = 128  # n, at most (OpenAI's bound)
MAX_PROMPTS = 128  # prompts of one completions request, at most
# the chat template's variables kestrel sets (model/tokenizer.py, ChatCompletionRequest.template_context)
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})


def new_id(prefix: str) -> str:
    """A response id the way OpenAI spells them: ``chatcmpl-<hex>``, ``cmpl-<hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


# -- requests -----------------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Request):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` parts carry meaning here."""

    type: StrictStr
    text: StrictStr | None = None


class FunctionCall(_Request):
    name: StrictStr
    arguments: StrictStr  # a JSON object's text, as OpenAI sends it


class AssistantToolCall(_Request):
    """A call an earlier assistant message made, sent back with the conversation."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """As Hugging Face templates read it: the arguments as an object (text that is not one stays text)."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[ContentPart] | None = Field(default=None, validate_default=True)
    name: StrictStr | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None  # an earlier answer's reasoning, which some templates show again

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: str | list[ContentPart] | None,
                         info: ValidationInfo) -> str | list[ContentPart] | None:
        if value is None and info.data.get("role") not in ("assistant", "tool", "function", None):
            raise ValueError(f"a {info.data.get('role')} message needs content")
        if isinstance(value, list):
            for part in value:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"only text content parts are supported, got a {part.type!r} part")
        return value

    def text(self) -> str:
        """The content as one string (text parts joined by newlines; none for an assistant tool call)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """What the chat template sees: OpenAI's ``developer`` role is the templates' ``system``."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class FunctionTool(_Request):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema
    strict: StrictBool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionTool

    def for_template(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True, exclude={"strict"})}


class NamedFunction(_Request):
    name: StrictStr


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Request):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None  # vLLM's extension: every chunk's running usage


class _Generation(_Request):
    """The fields both endpoints share."""

    model: StrictStr | None = None  # None: the served model
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None  # an extension (vLLM has it too): 0 = off
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictInt | StrictFloat] | None = None  # token id (as a string) -> bias
    ignore_eos: StrictBool | None = None  # an extension: generate max_tokens even past the end of text
    user: StrictStr | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM's ``continuous_usage_stats``; only with include_usage)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def choices(self) -> int:
        """How many choices to answer with (``n``)."""
        return 1 if self.n is None else self.n

    def _refuse_unsupported(self) -> None:
        if not 1 <= self.choices <= MAX_CHOICES:
            raise InvalidRequest(f"n must be an integer in [1, {MAX_CHOICES}], got {self.n}", param="n")

    def _max_tokens(self, value: int | None, name: str, default: int) -> int:
        if value is None:
            return max(1, default)
        if value < 1:
            raise InvalidRequest(f"{name} must be at least 1, got {value}", param=name)
        return value

    def _params(self, max_tokens: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=stop,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            ignore_eos=bool(self.ignore_eos),
            logit_bias=self._logit_bias(),
        )
        return params.check()

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
            pairs.append((int(key), float(bias)))
        return tuple(pairs)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension: more variables for the template

    def template_messages(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise InvalidRequest("messages must hold at least one message", param="messages")
        return [m.for_template() for m in self.messages]

    def tool_calls(self, fmt: str | None) -> ToolCalls | None:
        """How this request's answers carry tool calls, given the format the model's template teaches (None:
        its template renders no tools); None where the request offers none (or ``tool_choice`` is "none": the
        model is not shown them)."""
        if not self._shows_tools:
            return None
        if fmt is None:
            raise InvalidRequest("this model's chat template does not render tools", param="tools")
        if fmt == UNKNOWN:
            raise InvalidRequest("this model's chat template renders tools, but in none of the formats kestrel "
                                 "reads calls in (<tool_call> blocks, Mistral's [TOOL_CALLS], Llama 3's JSON)",
                                 param="tools")
        return ToolCalls(fmt, self.parallel_tool_calls is not False)

    def grammar(self, tools: ToolCalls | None, tool_calls_id: int | None = None) -> str | None:
        """The grammar the answer keeps to (kestrel_core.model.grammar): calls of the tools where ``tool_choice``
        is "required" or names a function (``tools``: ``tool_calls``' answer; ``tool_calls_id``: the id of
        Mistral's control token), else the JSON ``response_format`` asks for; None for free text."""
        kind = (self.response_format or {}).get("type", "text")
        if self.tool_choice not in (None, "auto", "none"):
            if tools is None or not self.tools:
                raise InvalidRequest("tool_choice forces a call, but the request offers no tools", param="tool_choice")
            if kind != "text":
                raise InvalidRequest("a forced tool call and a JSON response_format cannot both shape the answer",
                                     param="response_format")
            name = None if isinstance(self.tool_choice, str) else self.tool_choice.function.name
            functions = [t.function.model_dump(exclude_none=True) for t in self.tools
                         if name is None or t.function.name == name]
            if not functions:
                raise InvalidRequest(f"tool_choice names the function {name!r}, which is not one of the tools",
                                     param="tool_choice")
            return call_grammar(tools.fmt, functions, tools.parallel and name is None, tool_calls_id)
        if kind == "text":
            return None
        if kind == "json_object":
            return json_schema_grammar({"type": "object"}, param="response_format")
        spec = (self.response_format or {}).get("json_schema")
        if kind != "json_schema" or not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequest('response_format must be {"type": "text"}, {"type": "json_object"} or '
                                 '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                                 param="response_format")
        return json_schema_grammar(spec.get("schema", {}), param="response_format")

    def template_context(self) -> dict[str, Any]:
        """What the chat template sees beside the messages: the tools as Hugging Face templates read them
        (None where the model is not shown them) and ``chat_template_kwargs`` (e.g. Qwen3's
        ``enable_thinking``), which may not replace a variable kestrel sets."""
        extra = self.chat_template_kwargs or {}
        taken = sorted(set(extra) & TEMPLATE_VARIABLES)
        if taken:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(taken)}: kestrel sets it",
                                 param="chat_template_kwargs")
        tools = [tool.for_template() for tool in self.tools or ()] if self._shows_tools else None
        return {**extra, "tools": tools}

    @property
    def _shows_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """SamplingParams for this request (``default_max_tokens``: the context left after the prompt)."""
        self._refuse_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.max_completion_tokens is not None:
            max_tokens = self._max_tokens(self.max_completion_tokens, "max_completion_tokens", default_max_tokens)
        else:
            max_tokens = self._max_tokens(self.max_tokens, "max_tokens", default_max_tokens)
        return self._params(max_tokens, bool(self.logprobs), self.top_logprobs or 0)


class CompletionRequest(_Generation):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = None  # 0..5 alternatives per token; 0 = the chosen token's only
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids: one, or a list of up to MAX_PROMPTS."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if len(p) > MAX_PROMPTS:
            raise InvalidRequest(f"at most {MAX_PROMPTS} prompts a request, got {len(p)}", param="prompt")
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self, default_max_tokens: int) -> SamplingParams | None:
        """SamplingParams for one prompt (``default_max_tokens``: the context left after it); None where
        nothing is generated (``echo`` with ``max_tokens`` 0)."""
        self._refuse_unsupported()
        self._check_fields()
        if self.echo and self.max_tokens == 0:
            return None
        max_tokens = self._max_tokens(self.max_tokens, "max_tokens", default_max_tokens)
        return self._params(max_tokens, self.logprobs is not None, self.logprobs or 0)

    def _check_fields(self) -> None:
        if self.best_of is not None and self.best_of != self.choices:
            raise InvalidRequest(f"best_of must equal n ({self.choices}), got {self.best_of}", param="best_of")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}",
                                 param="logprobs")


# -- responses ----------------------------------------------------------------------------------------


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


@dataclass
class Echo:
    """A completions prompt repeated before its choices' text (``echo``): its text, its first token (no
    logprob: nothing comes before it) and the other tokens' logprobs (None: none were asked for)."""

    text: str
    first_token: int
    logprobs: list[TokenLogprob] | None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish reasons are "stop", "length" and "tool_calls"; an abort never reaches a client as one."""
    return reason if reason in ("stop", "length", "tool_calls") else None


def _calls_reason(reason: str | None) -> str | None:
    """An answer that made tool calls: "tool_calls" where the model stopped by itself, else its reason."""
    return "tool_calls" if reason == "stop" else reason


class TokenStrings:
    """Each token's own text (decoded alone, special tokens by name) and its UTF-8 bytes, cached per id.

    A model without a tokenizer still serves token-id prompts; its tokens are then named ``token_id:<id>``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            try:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            except KestrelError:  # NoTokenizer: no text at all
                text = f"token_id:{token_id}"
            self._cache[token_id] = text
        return text

    def bytes(self, token_id: int) -> list[int]:
        return list(self(token_id).encode("utf-8"))


class _Shape:
    """What the two endpoints' responses share: the id, the creation time and the model name.

    With ``continuous_usage`` every chunk's usage is its choice's, as vLLM's: the choice's prompt tokens and the
    tokens the stream has sent of that choice so far, which the stream counts (``start_usage``, ``add_sent``),
    so a client can count each chunk's tokens."""

    object: str = ""
    chunk_object: str = ""

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

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        body = self._envelope(self.chunk_object, [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def response(self, results: list[ChoiceResult], prompt_tokens: int) -> dict[str, Any]:
        """The whole answer: a choice per result, in order; usage counts the prompt once."""
        body = self._envelope(self.object, [self.choice(i, r) for i, r in enumerate(results)])
        body["usage"] = usage(prompt_tokens, sum(r.completion_tokens for r in results))
        return body

    def choice(self, index: int, result: ChoiceResult) -> dict[str, Any]:
        raise NotImplementedError

    def stream_text(self, index: int, text: str) -> tuple[str, str]:
        """What of choice ``index``'s new ``text`` a stream sends now: (reasoning, content)."""
        return "", text

    def finish_chunks(self, reason: str | None, index: int = 0) -> list[dict[str, Any]]:
        """The chunks that end choice ``index``'s stream."""
        return [self.finish_chunk(reason, index)]

    def finish_chunk(self, reason: str | None, index: int = 0) -> dict[str, Any]:
        raise NotImplementedError

    def reasoning_chunk(self, text: str, entries: list[TokenLogprob] | None, index: int = 0) -> dict[str, Any]:
        raise NotImplementedError  # only chat answers reason (stream_text gives none otherwise)


class ChatShape(_Shape):
    """``tools``: the request's tool calls (None: its answers are text), read out of each choice's content;
    ``reasoning``: its answers' reasoning block (None: they have none), answered as ``reasoning_content``."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, response_id: str, model: str, tokens: TokenStrings, include_usage: bool = False,
                 continuous_usage: bool = False, tools: ToolCalls | None = None,
                 reasoning: Reasoning | None = None) -> None:
        super().__init__(response_id, model, tokens, include_usage, continuous_usage)
        self.tools = tools
        self.reasoning = reasoning
        self._streams: dict[int, tuple[ReasoningStream | None, ToolStream | None]] = {}

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        t = self.tokens
        return {"content": [
            {"token": t(e.token_id), "logprob": e.logprob, "bytes": t.bytes(e.token_id),
             "top_logprobs": [{"token": t(i), "logprob": lp, "bytes": t.bytes(i)} for i, lp in e.top]}
            for e in entries], "refusal": None}

    def choice(self, index: int, result: ChoiceResult) -> dict[str, Any]:
        text, reason = "".join(result.text), finish_reason(result.finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if self.reasoning is not None:
            thought, text = split(text, self.reasoning.open_in_prompt)
            message["content"] = text
            if thought is not None:
                message["reasoning_content"] = thought
        if self.tools is not None:
            parsed = parse(self.tools.fmt, text, self.tools.parallel)
            if parsed.calls:
                message["content"] = parsed.content
                message["tool_calls"] = self.tools.message_calls(parsed.calls)
                reason = _calls_reason(reason)
        return {"index": index, "message": message, "logprobs": self.logprobs(result.logprobs),
                "finish_reason": reason}

    def stream_text(self, index: int, text: str) -> tuple[str, str]:
        if self.reasoning is None and self.tools is None:
            return "", text
        thinking, tools = self._streams.get(index) or self._streams.setdefault(index, (
            None if self.reasoning is None else ReasoningStream(self.reasoning.open_in_prompt),
            None if self.tools is None else ToolStream(self.tools.fmt, self.tools.parallel)))
        reasoning = ""
        if thinking is not None:
            reasoning, text = thinking.feed(text)
        return reasoning, text if tools is None else tools.feed(text)

    def finish_chunks(self, reason: str | None, index: int = 0) -> list[dict[str, Any]]:
        thinking, tools = self._streams.pop(index, (None, None))
        reasoning, rest = thinking.finish() if thinking is not None else ("", "")
        chunks = [self.reasoning_chunk(reasoning, None, index)] if reasoning else []
        calls: tuple[Any, ...] = ()
        if tools is not None:
            rest = tools.feed(rest)
            tail, calls = tools.finish()
            rest += tail
        if rest:
            chunks.append(self.delta_chunk(rest, None, index))
        if calls:
            assert self.tools is not None
            deltas = [{"index": k, **call} for k, call in enumerate(self.tools.message_calls(calls))]
            chunks.append(self.chunk({"index": index, "delta": {"tool_calls": deltas}, "logprobs": None,
                                      "finish_reason": None}))
            reason = _calls_reason(reason)
        return chunks + [self.finish_chunk(reason, index)]

    def reasoning_chunk(self, text: str, entries: list[TokenLogprob] | None, index: int = 0) -> dict[str, Any]:
        return self.chunk({"index": index, "delta": {"reasoning_content": text}, "logprobs": self.logprobs(entries),
                           "finish_reason": None})

    def first_chunks(self, choices: int = 1) -> list[dict[str, Any]]:
        return [self.chunk({"index": i, "delta": {"role": "assistant", "content": "", "refusal": None},
                            "logprobs": None, "finish_reason": None}) for i in range(choices)]

    def delta_chunk(self, text: str, entries: list[TokenLogprob] | None, index: int = 0) -> dict[str, Any]:
        return self.chunk({"index": index, "delta": {"content": text}, "logprobs": self.logprobs(entries),
                           "finish_reason": None})

    def finish_chunk(self, reason: str | None, index: int = 0) -> dict[str, Any]:
        return self.chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason(reason)})


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
                top.setdefault(t(i), lp)  # two ids with one text: the likelier one
            rows.append((e.token_id, e.logprob, top))
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
                "finish_reason": finish_reason(result.finish_reason)}

    def first_chunks(self, choices: int = 1) -> list[dict[str, Any]]:
        """A chunk of each echoed choice's prompt."""
        return [self.chunk({"text": echo.text, "index": i, "logprobs": self._echo_logprobs(echo, i),
                            "finish_reason": None})
                for i in range(choices) if (echo := self._echo(i)) is not None]

    def delta_chunk(self, text: str, entries: list[TokenLogprob] | None, index: int = 0) -> dict[str, Any]:
        return self.chunk({"text": text, "index": index, "logprobs": self.logprobs(entries, index),
                           "finish_reason": None})

    def finish_chunk(self, reason: str | None, index: int = 0) -> dict[str, Any]:
        return self.chunk({"text": "", "index": index, "logprobs": None, "finish_reason": finish_reason(reason)})


Shape = ChatShape | CompletionShape

__all__ = ["ChatCompletionRequest", "ChatMessage", "ChatShape", "ChoiceResult", "CompletionRequest",
           "CompletionShape", "ContentPart", "Echo", "Shape", "StreamOptions", "TokenStrings", "choice_params",
           "finish_reason", "new_id", "usage"]
