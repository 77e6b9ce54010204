"""OpenAI's requests for ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` (answers: responses.py).

Requests are pydantic models with OpenAI's field names; unknown fields are ignored (clients send many), and scalar
fields are strict (``"0.5"`` is not a temperature), so a wrong type is a 400 naming the field. Ranges are not repeated
here: ``SamplingParams.check`` is the one place that knows them, and its ``InvalidRequest`` names the field too. A
sampling field a request leaves unset takes the sampling the model recommends (``Engine.sampling_defaults``: its
generation_config.json, as vLLM reads it), else OpenAI's default; ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``min_tokens``, ``skip_special_tokens``, ``include_stop_str_in_output``, the structured outputs
(serve/guided.py) and ``priority`` (the scheduler's, kestrel_core.model.request_queue) are vLLM's extensions. Fields
kestrel cannot honour (image parts, a ``suffix`` for a model without fill-in-the-middle tokens...) are refused rather
than silently ignored, since ignoring them would change what the client gets. Tools are shown to the model by its chat
template and the calls it writes are read back out of its answers (serve/tools.py); a forced call and a JSON
``response_format`` are grammars the answer keeps to (``grammar``, kestrel_core.model.grammar). ``n`` choices are ``n``
sequences of one prompt (with the prefix cache, the first computes it and the others attach its blocks); with a
``seed``, choice i samples with seed + i, so the choices differ and the request is reproducible. A completions request
may hold several prompts (choice p * n + i is prompt p's i-th) and ``echo`` them, with their tokens' logprobs and, with
``max_tokens`` 0, nothing generated: what evaluation harnesses send to score text, or give a ``suffix``: each prompt is
then the prefix of a fill-in-the-middle prompt (kestrel_core.model.fim), what code editors send.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any, Literal

from pydantic import (
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from kestrel_core.errors import InvalidRequest
from kestrel_core.model import harmony as harmony_answers
from kestrel_core.model.config import SAMPLING_FIELDS
from kestrel_core.model.fim import fim_format, fim_prompt_ids
from kestrel_core.model.grammar import json_schema_grammar
from kestrel_core.model.sampling import MAX_TOP_LOGPROBS, SamplingParams
from kestrel_core.serve.bodies import Prompts, RequestBody
from kestrel_core.serve.guided import GUIDED_FIELDS, REFUSED_FIELDS, guided_grammar
from kestrel_core.serve.tool_grammar import forced_call_grammar
from kestrel_core.serve.tools import UNKNOWN, ToolCalls

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; kestrel's own SamplingParams default is greedy
MAX_CHOICES = 128  # n, at most (OpenAI's bound)
MAX_PROMPTS = 128  # prompts of one completions request, at most
MAX_INPUTS = 2048  # inputs of one embeddings request, at most (OpenAI's bound)
# the chat template's variables kestrel sets (model/tokenizer.py, ChatCompletionRequest.template_context)
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})


def unset_sampling(recommended: Mapping[str, float] | None) -> dict[str, float]:
    """What each sampling field a request leaves unset samples with: the model's ``recommended`` value, else
    OpenAI's default (temperature 1, no filters)."""
    plain = SamplingParams()
    return {**{k: getattr(plain, k) for k in SAMPLING_FIELDS}, "temperature": DEFAULT_TEMPERATURE,
            **(recommended or {})}


# -- requests -----------------------------------------------------------------------------------------


class ContentPart(RequestBody):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` parts carry meaning here."""

    type: StrictStr
    text: StrictStr | None = None


class FunctionCall(RequestBody):
    name: StrictStr
    arguments: StrictStr  # a JSON object's text, as OpenAI sends it


class AssistantToolCall(RequestBody):
    """A call an earlier assistant message made, sent back with the conversation."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """As Hugging Face templates read it: the arguments as an object (none: an empty one, as vLLM passes it;
        text that is not one stays text)."""
        try:
            arguments: Any = json.loads(self.function.arguments) if self.function.arguments.strip() else {}
        except ValueError:
            arguments = self.function.arguments
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[ContentPart] | None = Field(default=None, validate_default=True)
    name: StrictStr | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None  # an earlier answer's reasoning, which some templates show again
    reasoning: StrictStr | None = None  # the same under the name OpenAI's newer clients and vLLM also take

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: str | list[ContentPart] | None,
                         info: ValidationInfo) -> str | list[ContentPart] | None:
        if value is None and info.data.get("role") not in ("assistant", "tool", "function", None):
            raise ValueError(f"a {info.data.get('role')} message needs content")
        if isinstance(value, list):
            for k, part in enumerate(value):
                if part.type != "text":
                    raise ValueError(f"only text content parts are supported, got a {part.type!r} part")
                if part.text is None:
                    raise ValueError(f"part {k} is a text part without its text")
        return value

    def for_template(self, harmony: bool = False, thinking_blocks: bool = False) -> dict[str, Any]:
        """What the chat template sees: OpenAI's ``developer`` role is the templates' ``system``; text parts stay
        parts (the tokenizer joins them for a template that reads a string). For a ``harmony`` template (gpt-oss's),
        an assistant message with calls, reasoning and content (kestrel's own answer: its analysis, a preamble and
        the calls) keeps its reasoning alone: the template renders one analysis message before a call and refuses
        both, and the reasoning is what vLLM renders as that analysis. With ``thinking_blocks`` (a template that
        reads reasoning from content blocks only: Mistral's reasoning models'), an assistant or system message's
        reasoning is a ``thinking`` block before its text, as llama.cpp passes it."""
        role = "system" if self.role == "developer" else self.role
        content: Any = self.content or ""
        if isinstance(content, list):
            content = [{"type": "text", "text": part.text} for part in content]
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if harmony and self.tool_calls and reasoning:
            content = ""
        if thinking_blocks and reasoning is not None and role in ("assistant", "system"):
            text = content if isinstance(content, list) else [{"type": "text", "text": content}] if content else []
            content = [{"type": "thinking", "thinking": reasoning}, *text]
        message: dict[str, Any] = {"role": role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if reasoning is not None:  # under each name templates read it by: Qwen's, gpt-oss's, Seed-OSS's and Solar's
            message["reasoning_content"] = message["thinking"] = message["reasoning"] = reasoning
            message |= {"tool_plan": reasoning} if self.tool_calls else {}  # Cohere's plan before its calls
        return message


class FunctionTool(RequestBody):
    name: StrictStr = Field(min_length=1)  # no format's call of an empty name reads back as a call
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """The keys the call formats read by name must have their JSON Schema types."""
        if value is None:
            return value
        properties, required = value.get("properties", {}), value.get("required", [])
        if not isinstance(properties, dict) or not all(isinstance(p, dict | bool) for p in properties.values()):
            raise ValueError("parameters.properties must be an object of schemas")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError("parameters.required must be a list of strings")
        return value


class Tool(RequestBody):
    type: Literal["function"]
    function: FunctionTool

    def for_template(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True, exclude={"strict"})}


class NamedFunction(RequestBody):
    name: StrictStr


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(RequestBody):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None  # vLLM's extension: every chunk's running usage


GUIDED_REQUEST_FIELDS = (*GUIDED_FIELDS, "structured_outputs", *REFUSED_FIELDS)


class _Generation(RequestBody):
    """The fields both endpoints share."""

    model: StrictStr | None = None  # None: the served model
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None  # an extension (vLLM has it too): 0 = off
    min_p: StrictFloat | StrictInt | None = None  # vLLM's extension
    repetition_penalty: StrictFloat | StrictInt | None = None  # vLLM's extension: 1 = off
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictInt | StrictFloat] | None = None  # token id (as a string) -> bias
    ignore_eos: StrictBool | None = None  # an extension: generate max_tokens even past the end of text
    stop_token_ids: list[StrictInt] | None = None  # vLLM's extension: token ids that end the answer
    min_tokens: StrictInt | None = None  # vLLM's extension: no end of text, stop token or stop string before
    skip_special_tokens: StrictBool | None = None  # vLLM's extension: special tokens' text left out (default)
    include_stop_str_in_output: StrictBool | None = None  # vLLM's extension: the stop string ends the text
    priority: StrictInt | None = None  # vLLM's extension: the scheduler's, lower first (--scheduling-policy priority)
    # vLLM's structured outputs and the fields of vLLM's kestrel refuses (serve/guided.py)
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    use_beam_search: Any = None
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None
    user: StrictStr | None = None

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_off(cls, value: Any) -> Any:
        return 0 if value == -1 and isinstance(value, int) else value  # vLLM's -1: off, as 0

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_in_range(cls, value: Any) -> Any:
        """vLLM takes any int64 seed: a negative one is taken modulo 2^63, the range kestrel's seeds span."""
        if isinstance(value, int) and not isinstance(value, bool) and -2 ** 63 <= value < 0:
            return value % 2 ** 63
        return value

    @property
    def sets_guided(self) -> bool:
        """Whether the request sets any of vLLM's structured-output fields (or those kestrel refuses)."""
        return any(getattr(self, name) is not None for name in GUIDED_REQUEST_FIELDS)

    def guided(self) -> str | None:
        """The grammar of vLLM's structured-output fields (serve/guided.py), None where none is set."""
        return guided_grammar({name: getattr(self, name) for name in GUIDED_REQUEST_FIELDS})

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

    def _params(self, max_tokens: int, logprobs: bool, top_logprobs: int,
                recommended: Mapping[str, float] | None) -> SamplingParams:
        """The request's SamplingParams: a sampling field it leaves unset takes the model's ``recommended`` value,
        else OpenAI's default (temperature 1, no filters)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        given = {k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) is not None}
        given |= {"top_p": 1.0, "top_k": 1} if self.top_p == 0 else {}  # OpenAI's 0: the likeliest token alone
        sampling = {**unset_sampling(recommended), **given}
        params = SamplingParams(
            max_tokens=max_tokens,
            **sampling,
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=self.min_tokens or 0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            ignore_eos=bool(self.ignore_eos),
            logit_bias=self._logit_bias(),
            skip_special_tokens=self.skip_special_tokens is not False,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
        )
        return params.check()

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or len(key) > 10:  # int() refuses 4,300 digits and more
                raise InvalidRequest(f"logit_bias keys must be token ids, got {key[:40]!r}", param="logit_bias")
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
    add_generation_prompt: StrictBool | None = None  # vLLM's extension: false ends the prompt after the messages
    continue_final_message: StrictBool | None = None  # vLLM's extension: the answer continues the last message
    # OpenAI's: the template sees it as reasoning_effort (gpt-oss reads it); none or minimal also turn Qwen3's
    # enable_thinking off, unless chat_template_kwargs set it
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # OpenAI's, refused: what they ask for (a call in the deprecated shape, audio) kestrel does not answer with
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[StrictStr] | None = None
    audio: Any = None

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated_functions(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("the deprecated functions and function_call are not supported: send tools and "
                             "tool_choice")
        return value

    @field_validator("modalities", "audio")
    @classmethod
    def _text_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and (info.field_name == "audio" or set(value) - {"text"}):
            raise ValueError("kestrel answers with text only")
        return value

    def template_messages(self, harmony: bool = False, thinking_blocks: bool = False) -> list[dict[str, Any]]:
        """The messages as the chat template sees them (``ChatMessage.for_template``'s)."""
        if not self.messages:
            raise InvalidRequest("messages must hold at least one message", param="messages")
        return [m.for_template(harmony, thinking_blocks) for m in self.messages]

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
                                 "reads calls in (<tool_call> blocks of JSON, <function=...> or <arg_key>, "
                                 "<minimax:tool_call> blocks, <tool_calls> lists, Mistral's [TOOL_CALLS], "
                                 "Cohere's <|START_ACTION|> or Action: lists, Llama 3's JSON)", param="tools")
        return ToolCalls(fmt, self.parallel_tool_calls is not False,
                         {t.function.name: t.function.parameters or {} for t in self.tools or ()},
                         named=isinstance(self.tool_choice, NamedToolChoice))

    @property
    def sets_grammar(self) -> bool:
        """Whether the request asks for a grammar (``grammar`` gives it, or the error of a bad one): cheap, so
        that a request of free text does not wait its turn behind other requests' grammars."""
        return self.sets_guided or self.tool_choice not in (None, "auto", "none") \
            or (self.response_format or {}).get("type", "text") != "text"

    def grammar(self, tools: ToolCalls | None, control_ids: Mapping[str, int] | None = None,
                harmony: bool = False) -> str | None:
        """The grammar the answer keeps to (kestrel_core.model.grammar): calls of the tools where ``tool_choice``
        is "required" or names a function (``tools``: ``tool_calls``' answer; ``control_ids``: the ids of
        Mistral's control tokens), else the JSON ``response_format`` asks for; None for free text."""
        kind = (self.response_format or {}).get("type", "text")
        guided = self.guided()
        if guided is not None:
            if kind != "text" or self.tool_choice not in (None, "auto", "none"):
                raise InvalidRequest("vLLM's structured outputs and a response_format or a forced tool call cannot "
                                     "both shape the answer", param="response_format")
            return guided
        if self.tool_choice not in (None, "auto", "none"):
            if tools is None or not self.tools:
                raise InvalidRequest("tool_choice forces a call, but the request offers no tools", param="tool_choice")
            if kind != "text":
                raise InvalidRequest("a forced tool call and a JSON response_format cannot both shape the answer",
                                     param="response_format")
            name = None if isinstance(self.tool_choice, str) else self.tool_choice.function.name
            functions = {k: t.function.model_dump(exclude_none=True) for k, t in enumerate(self.tools)
                         if name is None or t.function.name == name}
            if not functions:
                raise InvalidRequest(f"tool_choice names the function {name!r}, which is not one of the tools",
                                     param="tool_choice")
            return forced_call_grammar(tools.fmt, functions, tools.parallel and name is None, control_ids)
        if kind == "text":
            return None
        if kind == "json_object":
            if harmony:
                return harmony_answers.json_grammar({"type": "object"})
            return json_schema_grammar({"type": "object"}, param="response_format")
        spec = (self.response_format or {}).get("json_schema")
        if kind != "json_schema" or not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequest('response_format must be {"type": "text"}, {"type": "json_object"} or '
                                 '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                                 param="response_format")
        if harmony:
            return harmony_answers.json_grammar(spec.get("schema", {}))
        return json_schema_grammar(spec.get("schema", {}), param="response_format")

    def template_context(self) -> dict[str, Any]:
        """What the chat template sees beside the messages: the tools as Hugging Face templates read them
        (None where the model is not shown them), ``reasoning_effort`` and ``chat_template_kwargs`` (e.g. Qwen3's
        ``enable_thinking``), which may not replace a variable kestrel sets."""
        extra = self.chat_template_kwargs or {}
        taken = sorted(set(extra) & TEMPLATE_VARIABLES)
        if taken:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(taken)}: kestrel sets it",
                                 param="chat_template_kwargs")
        tools = [tool.for_template() for tool in self.tools or ()] if self._shows_tools else None
        effort: dict[str, Any] = {}
        if self.reasoning_effort is not None:
            effort["reasoning_effort"] = self.reasoning_effort
            if self.reasoning_effort in ("none", "minimal"):
                effort["enable_thinking"] = False
        return {**effort, **extra, "tools": tools}

    @property
    def _shows_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def sampling_params(self, default_max_tokens: int,
                        recommended: Mapping[str, float] | None = None) -> SamplingParams:
        """SamplingParams for this request (``default_max_tokens``: the context left after the prompt;
        ``recommended``: the model's sampling, for the fields it leaves unset)."""
        self._refuse_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.max_completion_tokens is not None:
            max_tokens = self._max_tokens(self.max_completion_tokens, "max_completion_tokens", default_max_tokens)
        else:
            max_tokens = self._max_tokens(self.max_tokens, "max_tokens", default_max_tokens)
        return self._params(max_tokens, bool(self.logprobs), self.top_logprobs or 0, recommended)


COMPLETIONS_MAX_TOKENS = 16  # /v1/completions' max_tokens when a request leaves it out


class CompletionRequest(_Generation):
    prompt: Prompts
    logprobs: StrictInt | None = None  # 0..20 alternatives per token; 0 = the chosen token's only
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

    def prompt_ids(self, tokenizer: Any, ending: Collection[int] = ()) -> tuple[list[list[int]], tuple[int, ...]]:
        """Each prompt's token ids, and the stop token ids a fill-in-the-middle answer adds (``ending``: the ids
        that end an answer already, left out: ``fim_prompt_ids``). With a ``suffix``,
        each text prompt is the prefix of a fill-in-the-middle prompt (kestrel_core.model.fim); an empty suffix
        where a non-empty one is refused (a model without that format, token-id prompts, ``echo``) is a plain
        completion (nothing comes after the prompt)."""
        prompts = self.prompts()
        texts = all(isinstance(p, str) for p in prompts)
        if not self.suffix and (self.suffix is None or not fim_format(tokenizer) or not texts or self.echo):
            return [list(tokenizer.encode(p)) if isinstance(p, str) else p for p in prompts], ()
        if not texts:
            raise InvalidRequest("a suffix needs text prompts, not token ids", param="suffix")
        built = [fim_prompt_ids(tokenizer, p, self.suffix, ending) for p in prompts]  # type: ignore[arg-type]
        return [ids for ids, _ in built], built[0][1]

    def sampling_params(self, default_max_tokens: int,
                        recommended: Mapping[str, float] | None = None) -> SamplingParams | None:
        """SamplingParams for one prompt (``default_max_tokens``: the context left after it; ``recommended``:
        the model's sampling); None where nothing is generated (``echo`` with ``max_tokens`` 0)."""
        self._refuse_unsupported()
        self._check_fields()
        if self.echo and self.max_tokens == 0:
            return None
        max_tokens = self._max_tokens(self.max_tokens, "max_tokens", default_max_tokens)
        return self._params(max_tokens, self.logprobs is not None, self.logprobs or 0, recommended)

    def _check_fields(self) -> None:
        if self.best_of is not None and self.best_of != self.choices:
            raise InvalidRequest(f"best_of must equal n ({self.choices}), got {self.best_of}", param="best_of")
        if self.suffix and self.echo:
            raise InvalidRequest("suffix and echo together are not supported", param="suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}",
                                 param="logprobs")


class EmbeddingRequest(RequestBody):
    """``/v1/embeddings``: one input or a list, each text or token ids; the vectors as floats or base64."""

    input: Prompts
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs, each text or token ids: one, or a list of up to MAX_INPUTS."""
        p = self.input
        if not p:
            raise InvalidRequest("the input is empty", param="input")
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if len(p) > MAX_INPUTS:
            raise InvalidRequest(f"at most {MAX_INPUTS} inputs a request, got {len(p)}", param="input")
        empty = next((i for i, x in enumerate(p) if not x), None)  # type: ignore[arg-type]
        if empty is not None:
            raise InvalidRequest(f"input {empty} is empty", param="input")
        return list(p)  # type: ignore[arg-type]


__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "ContentPart", "EmbeddingRequest",
           "StreamOptions"]
