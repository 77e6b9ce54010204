"""vLLM's structured-output fields of a chat or completions request, as the grammar the answer keeps to.

vLLM takes ``structured_outputs`` (``json``, ``regex``, ``choice``, ``json_object``) and, before it, the
``guided_json``, ``guided_regex`` and ``guided_choice`` fields; clients written for vLLM send either. Each becomes an
llguidance grammar (kestrel_core.model.grammar). Fields of vLLM's that would change the answer and that kestrel does
not implement are refused by name: ignoring them would answer something the client did not ask for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kestrel_core.errors import InvalidRequest
from kestrel_core.model.grammar import json_schema_grammar, lark_grammar, regex_grammar

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice")
STRUCTURED_KEYS = ("json", "regex", "choice", "json_object")
# vLLM's request fields that change the answer, which kestrel does not implement
REFUSED_FIELDS = {
    "guided_grammar": "a grammar in vLLM's dialect (give guided_regex, guided_json or guided_choice)",
    "allowed_token_ids": "a set of allowed token ids (logit_bias bans or forces ids)",
    "bad_words": "banned words",
    "use_beam_search": "beam search",
    "truncate_prompt_tokens": "cutting the prompt",
    "prompt_logprobs": "the prompt's logprobs (completions' echo with logprobs gives them)",
}


def refuse_unsupported(fields: Mapping[str, Any]) -> None:
    """InvalidRequest naming the first of vLLM's fields kestrel does not implement that the request sets."""
    for name, what in REFUSED_FIELDS.items():
        value = fields.get(name)
        if value is not None and value is not False:
            raise InvalidRequest(f"{name} ({what}) is not supported", param=name)


def guided_grammar(fields: Mapping[str, Any]) -> str | None:
    """The grammar of the request's vLLM structured-output fields (``fields``: the request's extra fields), None
    where it sets none; InvalidRequest naming the field for a bad one or for more than one."""
    refuse_unsupported(fields)
    given = {name: (name.removeprefix("guided_"), fields[name]) for name in GUIDED_FIELDS
             if fields.get(name) is not None}
    structured = fields.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise InvalidRequest("structured_outputs must be an object", param="structured_outputs")
        unknown = [key for key, value in structured.items() if value not in (None, False) and key not in
                   (*STRUCTURED_KEYS, "disable_fallback", "disable_any_whitespace", "disable_additional_properties")]
        if unknown:
            raise InvalidRequest(f"structured_outputs.{unknown[0]} is not supported (kestrel takes "
                                 f"{', '.join(STRUCTURED_KEYS)})", param=f"structured_outputs.{unknown[0]}")
        given.update({f"structured_outputs.{key}": (key, structured[key]) for key in STRUCTURED_KEYS
                      if structured.get(key) not in (None, False)})
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(f"give one way to shape the answer, not {' and '.join(given)}", param=list(given)[1])
    (name, (kind, value)), = given.items()
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, param=name)
    if kind == "json":  # an object, or its text (json_schema_grammar reads either)
        if not isinstance(value, (dict, str)):
            raise InvalidRequest(f"{name} must be a JSON Schema object", param=name)
        return json_schema_grammar(value, param=name)
    if kind == "regex":
        if not isinstance(value, str):
            raise InvalidRequest(f"{name} must be a regular expression (a string)", param=name)
        return regex_grammar(value, param=name)
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise InvalidRequest(f"{name} must be a non-empty list of non-empty strings", param=name)
    return lark_grammar("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value), param=name)
