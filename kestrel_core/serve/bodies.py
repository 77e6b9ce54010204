"""The base of every API's request bodies: pydantic models that ignore unknown fields and take Unicode text only
(serve/protocol.py has OpenAI's requests; the other APIs' modules theirs), and ``Prompts``, the type of the
prompts or inputs that OpenAI's completions and embeddings take."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    StrictInt,
    StrictStr,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)

from kestrel_core.serve.errors import APIError, param_path


class RequestBody(BaseModel):
    """A request body: unknown fields ignored (clients send many); every API's requests are these."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        """Every string is Unicode text: JSON's escapes can spell a lone UTF-16 surrogate ("\\ud800"), which
        neither a tokenizer nor UTF-8 takes. The outermost body looks first, so the field is named from the top."""
        where = _lone_surrogate(data)
        if where is not None:
            param = param_path(where) or "body"
            raise APIError(400, f"{param}: not Unicode text (a lone UTF-16 surrogate)", param=param,
                           code="invalid_value")
        return data


class NullsAbsentBody(RequestBody):
    """A request body whose fields sent as null are fields not sent, as Go's JSON reader (Ollama's) and llama.cpp's
    read null."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a string (or an object's key) of a request's raw JSON value holds a lone surrogate: the values alone
    on the walk's stack (a body of millions of numbers takes about a second, not half a minute)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(v, dict):
            stack.extend(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _lone_surrogate(value: Any) -> tuple[int | str, ...] | None:
    """Where in a request's raw JSON value a string (or an object's key) holds a lone surrogate, or None; a walk
    of its own stack, as deep as the JSON parser let the body nest, paths built only for a body that has one."""
    if not _has_lone_surrogate(value):
        return None
    stack: list[tuple[Any, tuple[int | str, ...]]] = [(value, ())]
    while stack:
        v, loc = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return loc
        elif isinstance(v, (dict, list)):
            items = list(v.items() if isinstance(v, dict) else enumerate(v))
            for key, item in reversed(items):  # the first field first
                stack.append((item, loc + (key,)))
                if isinstance(key, str):
                    stack.append((key, loc + (key,)))
    return None


# items of a long list validated in one call of pydantic's (compiled code, which holds the GIL throughout): ~2 ms
# of one-token prompts
PROMPTS_STEP = 4096


def _in_steps(value: Any, validate: ValidatorFunctionWrapHandler) -> Any:
    """``value`` validated as the union ``Prompts`` is, a long list PROMPTS_STEP items at a time: on one call a
    million one-token prompts hold the GIL, and so the server's event loop, for about a second (each of the
    union's list members refusing each item is an error pydantic builds). The members take disjoint kinds of
    item (integers, strings, lists), so the whole list is valid only where every piece is valid as the same
    member; where two pieces are not, an item of each is a list that no member takes, refused as the whole
    would be."""
    if not isinstance(value, list) or len(value) <= PROMPTS_STEP:
        return validate(value)
    pieces = [validate(value[start:start + PROMPTS_STEP]) for start in range(0, len(value), PROMPTS_STEP)]
    kinds = [type(piece[0]) for piece in pieces]
    other = next((i for i, kind in enumerate(kinds) if kind is not kinds[0]), None)
    if other is not None:
        return validate([value[0], value[other * PROMPTS_STEP]])  # refused: no member takes both
    return [item for piece in pieces for item in piece]


# a text, token ids, or a list of either (OpenAI's completions' prompt, embeddings' input)
Prompts = Annotated[StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]],
                    WrapValidator(_in_steps)]
