"""The grammars of forced tool calls (``tool_choice`` "required" or a named function): answers that are calls of the
offered functions in the format the chat template teaches (serve/tools.py), each with arguments its ``parameters``
schema accepts, spelled as the template writes an earlier turn's calls, so that ``tools.parse`` reads them back.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kestrel_core.errors import InvalidRequest
from kestrel_core.model import harmony
from kestrel_core.model.grammar import json_schema_grammar, lark_grammar, lark_json
from kestrel_core.serve.tools import (
    APRIEL,
    APRIEL_CLOSE,
    APRIEL_OPEN,
    ARGS,
    COHERE,
    COHERE_ARGUMENTS,
    COHERE_NAME,
    COMMAND_R,
    COMMAND_R_OPEN,
    DEF_PREFIXES,
    END_ACTION,
    FENCE,
    GLM,
    GLM_COMPACT,
    HARMONY,
    HERMES,
    HERMES_CLOSE,
    HERMES_OPEN,
    LLAMA3,
    MINIMAX,
    MINIMAX_CLOSE,
    MINIMAX_OPEN,
    MISTRAL_ARGS,
    START_ACTION,
    TOOL_CALLS,
    XML,
    dereferenced,
    is_composite,
    schema_defs,
)


def _hoisted(schema: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """``schema`` without its definitions, its ``$ref``s renamed ``#/$defs/<prefix><name>``, and those definitions so
    renamed: to sit under one root ``$defs`` beside other functions' (the grammar's root is not the schema's)."""

    def rename(node: Any) -> Any:
        if isinstance(node, list):
            return [rename(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rename(v) for k, v in node.items() if k not in ("$defs", "definitions")}
        ref = node.get("$ref")
        for p in DEF_PREFIXES:
            if isinstance(ref, str) and ref.startswith(p):
                out["$ref"] = f"#/$defs/{prefix}{ref[len(p) :]}"
        return out

    return rename(schema), {f"{prefix}{name}": rename(d) for name, d in schema_defs(schema).items()}


def forced_call_grammar(
    fmt: str, functions: Mapping[int, dict[str, Any]], many: bool, control_ids: Mapping[str, int] | None = None
) -> str:
    """``call_grammar`` of the ``functions`` (by their places in the request's tools), harmony's where ``fmt`` is
    harmony. A grammar llguidance refuses names the function whose ``parameters`` it refuses on its own, where one
    does: the combined grammar's error quotes kestrel's grammar text, which the client never wrote."""
    listed = list(functions.values())
    try:
        if fmt == HARMONY:  # one call a turn, in harmony's shape
            return harmony.call_grammar(listed)
        return call_grammar(fmt, listed, many, control_ids)
    except InvalidRequest as exc:
        for k, f in functions.items():
            json_schema_grammar(f.get("parameters") or {"type": "object"}, param=f"tools.[{k}].function.parameters")
        raise exc from None


def call_grammar(
    fmt: str, functions: Sequence[dict[str, Any]], many: bool, control_ids: Mapping[str, int] | None = None
) -> str:
    """The grammar of answers that are calls, in format ``fmt``, of the ``functions`` (OpenAI's ``function``
    objects: a name, and a JSON Schema of its arguments as ``parameters``): one call, or with ``many`` one or
    more. ``control_ids``: the ids of the special tokens the format spells its calls with (CONTROL_TOKENS) that the
    vocabulary has (one it lacks is text)."""

    def control(token: str) -> str:
        return f"<[{control_ids[token]}]>" if control_ids and token in control_ids else json.dumps(token)

    if fmt in _MARKUP:
        return lark_grammar(_markup_grammar(_MARKUP[fmt], functions, many), param="tool_choice")
    if fmt == MISTRAL_ARGS:
        return lark_grammar(_mistral_args_grammar(functions, many, control), param="tool_choice")
    name, key = (
        (COHERE_NAME, COHERE_ARGUMENTS)
        if fmt in (COHERE, COMMAND_R)
        else ("name", "parameters" if fmt == LLAMA3 else "arguments")
    )
    members, defs = [], {}
    for i, f in enumerate(functions):
        parameters, own = _hoisted(f.get("parameters") or {"type": "object"}, f"f{i}_")
        # Cohere's count of the turn's calls, which its template writes as a string of digits (llama.cpp's grammar)
        count = {"tool_call_id": {"type": "string", "pattern": "^[0-9]{1,10}$"}} if fmt == COHERE else {}
        properties = {**count, name: {"const": f["name"]}, key: parameters}
        members.append(
            {"type": "object", "additionalProperties": False, "required": list(properties), "properties": properties}
        )
        defs.update(own)
    call = lark_json({"anyOf": members, **({"$defs": defs} if defs else {})})
    more = ' (", " call)*' if many else ""  # the list's further calls
    if fmt == HERMES:
        start = 'block ("\\n" block)*' if many else "block"
        rules = f'block: "{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}"\n'
    elif fmt == APRIEL:  # one block of the list, as the template writes an earlier turn's calls
        start, rules = f'"{APRIEL_OPEN}[" call{more} "]{APRIEL_CLOSE}"', ""
    elif fmt == COHERE:  # one block of the list, as the template writes an earlier turn's calls
        start, rules = f'{control(START_ACTION)} "[" call{more} "]" {control(END_ACTION)}', ""
    elif fmt == COMMAND_R:  # as the template's instructions spell the list
        opener, closer = json.dumps(f"{COMMAND_R_OPEN} {FENCE}json\n["), json.dumps(f"]\n{FENCE}")
        start, rules = f"{opener} call{more} {closer}", ""
    elif fmt == LLAMA3:
        start, rules = ('call ("; " call)*' if many else "call"), ""
    else:
        start, rules = f'{control(TOOL_CALLS)} " "? "[" call{more} "]"', ""
    return lark_grammar(f"start: {start}\n{rules}call: {call}\n", param="tool_choice")


def _mistral_args_grammar(functions: Sequence[dict[str, Any]], many: bool, control: Callable[[str], str]) -> str:
    """The Lark text of mistral-args calls of ``functions``, spelled as their templates write them, less the call
    id that Mistral-Small-3.2's writes before ``[ARGS]`` (the server gives each call its own)."""
    rules, calls = [], []
    for i, f in enumerate(functions):
        parameters, defs = _hoisted(f.get("parameters") or {"type": "object"}, "")
        rules.append(f"call{i}: {control(TOOL_CALLS)} {json.dumps(f['name'])} {control(ARGS)} args{i}")
        rules.append(f"args{i}: {lark_json({**parameters, '$defs': defs} if defs else parameters)}")
        calls.append(f"call{i}")
    return f"start: call{'+' if many else ''}\ncall: {' | '.join(calls)}\n" + "\n".join(rules) + "\n"


@dataclass(frozen=True)
class _Markup:
    """How the xml, glm and minimax formats spell a call: a block's start and end around its call, the call's start
    (with the function's name) and end, a parameter's start (with its key) and the end after a JSON or literal
    value; a string value runs to ``stop`` (the end's first tag), then ``newline``, which also separates blocks."""

    block_open: str
    block_close: str
    call_open: str
    call_close: str
    param_open: str
    param_close: str
    stop: str
    newline: str = "\n"


_MARKUP = {
    XML: _Markup(
        f"{HERMES_OPEN}\n",
        f"\n{HERMES_CLOSE}",
        "<function={name}>\n",
        "</function>",
        "<parameter={key}>\n",
        "\n</parameter>\n",
        "</parameter>",
    ),
    GLM: _Markup(
        "",
        "",
        f"{HERMES_OPEN}{{name}}\n",
        HERMES_CLOSE,
        "<arg_key>{key}</arg_key>\n<arg_value>",
        "</arg_value>\n",
        "</arg_value>",
    ),
    GLM_COMPACT: _Markup(
        "",
        "",
        f"{HERMES_OPEN}{{name}}",
        HERMES_CLOSE,
        "<arg_key>{key}</arg_key><arg_value>",
        "</arg_value>",
        "</arg_value>",
        "",
    ),
    MINIMAX: _Markup(
        f"{MINIMAX_OPEN}\n",
        f"\n{MINIMAX_CLOSE}",
        '<invoke name="{name}">\n',
        "</invoke>",
        '<parameter name="{key}">',
        "</parameter>\n",
        "</parameter>",
    ),
}


def _markup_grammar(m: _Markup, functions: Sequence[dict[str, Any]], many: bool) -> str:
    """The Lark text of the call blocks of ``functions`` spelled as ``m``: each function's parameters in its schema's
    order, the required ones always; a string's value one of its enum, else text up to the first ``m.stop`` (as
    ``parse`` reads it) of at most its maxLength (other string keywords are not kept), another's JSON of its
    schema."""

    def lit(text: str) -> str:
        return json.dumps(text, ensure_ascii=False)

    nl = f" {lit(m.newline)}" if m.newline else ""
    rules, calls = [], []
    for i, f in enumerate(functions):
        schema, defs = _hoisted(f.get("parameters") or {}, "")
        required = set(schema.get("required") or ())
        items = []
        for j, (key, prop) in enumerate((schema.get("properties") or {}).items()):
            prop = dereferenced(prop, defs)  # an enum's or a model's own type
            kind = prop.get("type") if isinstance(prop, dict) else None
            choices = prop.get("enum") if isinstance(prop, dict) else None
            start = lit(m.param_open.format(key=key))
            if kind == "string" and choices and all(isinstance(c, str) for c in choices):
                item = f"{start} ({' | '.join(lit(c) for c in choices)}) {lit(m.param_close)}"
            elif kind == "string" and isinstance(prop.get("maxLength"), int) and prop["maxLength"] >= 0:
                rules.append(f"v{i}_{j}[stop={lit(m.stop)}]: /(.|\\n){{0,{prop['maxLength'] + 1}}}/")
                item = f"{start} v{i}_{j}{nl}"  # the value, and the newline after its end
            elif (
                kind == "string"
                or kind is None
                and not is_composite(prop, defs)
                or isinstance(kind, list)
                and "string" in kind
            ):
                item = f"{start} text{nl}"
            else:
                rules.append(f"v{i}_{j}: {lark_json({**prop, '$defs': defs} if defs else prop)}")
                item = f"{start} v{i}_{j} {lit(m.param_close)}"
            items.append(item if key in required else f"({item})?")
        rules.append(f"call{i}: {lit(m.call_open.format(name=f['name']))} {' '.join(items)} {lit(m.call_close)}")
        calls.append(f"call{i}")
    start = ("block+" if not nl else f"block ({nl.strip()} block)*") if many else "block"
    block = f"({' | '.join(calls)})"
    if m.block_open:
        block = f"{lit(m.block_open)} {block} {lit(m.block_close)}"
    return f"start: {start}\nblock: {block}\n" + "\n".join(rules) + f"\ntext[stop={lit(m.stop)}]: /(.|\\n)*/\n"
