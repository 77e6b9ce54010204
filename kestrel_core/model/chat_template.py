"""The chat-template sandbox: templates come from model files, which are untrusted programs.

A template renders in ``BoundedSandbox``, a subclass of jinja2's ImmutableSandboxedEnvironment with limits on
loop iterations and calls, on the size of every string or list an operator, filter or method builds, on the
output, and a wall-clock deadline, and with the helpers Hugging Face offers templates (raise_exception,
strftime_now, tojson). Any template error or exceeded limit is a one-line KestrelError (``render_chat``).
The ``MAX_TEMPLATE_*`` limits are read at each render, so a test or the fuzzer can lower them.
"""

from __future__ import annotations

import collections
import contextvars
import functools
import json
import math
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from kestrel_core.errors import KestrelError


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines too) made one space: error messages are one line."""
    return " ".join(str(text).split())


# -- limits -------------------------------------------------------------------------------------------------

MAX_TEMPLATE_CHARS = 1 << 22  # 4 Mi characters (a million-token context): the prompt, any string or list on the way
MAX_TEMPLATE_STEPS = 1_000_000  # loop iterations + calls + operators per render
MAX_TEMPLATE_SECONDS = 5.0  # wall clock per render (real templates take well under a millisecond)
MAX_TEMPLATE_INT_ARG = 1 << 20  # widths, counts and other int arguments of filters and methods
MAX_TEMPLATE_INT_BITS = 1 << 16  # integers a template computes (2**10**9 would run for ever)
MAX_JSON_INDENT = 64


class TemplateLimitError(SecurityError):
    """A chat template asked for more work or memory than a prompt can need."""


class _Budget:
    """What one render may still spend; every loop step, call, operator and output chunk ticks it."""

    def __init__(self, steps: int | None = None, seconds: float | None = None, chars: int | None = None) -> None:
        self.limit = MAX_TEMPLATE_STEPS if steps is None else steps  # the module's limits, read now
        self.seconds = MAX_TEMPLATE_SECONDS if seconds is None else seconds
        self.chars = MAX_TEMPLATE_CHARS if chars is None else chars
        self.steps, self.deadline = self.limit, time.monotonic() + self.seconds

    def tick(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise TemplateLimitError(f"more than {self.limit} loop iterations, calls and operations")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"rendering took more than {self.seconds:g} s")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("kestrel_template_budget", default=None)


def _tick() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.tick()


def _check_size(value: Any) -> Any:
    """``value`` unless it is a string or container longer than MAX_TEMPLATE_CHARS."""
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"a value of {len(value)} items (the limit is {MAX_TEMPLATE_CHARS})")
    return value


def _text_size(value: Any, per_item: int = 4) -> int:
    """About the characters ``value`` takes as text (str() or JSON): its strings' lengths plus ``per_item`` a
    container's item (punctuation, indent), 24 a number or other scalar. The walk stops once past
    MAX_TEMPLATE_CHARS, so measuring ``[s] * 4000000`` costs no more than the limit, unlike printing it."""
    total, stack = 0, [value]
    while stack and total <= MAX_TEMPLATE_CHARS:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, (list, tuple, set, frozenset, dict)):
            total += 2 + per_item * len(v)
            if total <= MAX_TEMPLATE_CHARS:
                stack.extend(v.items() if isinstance(v, dict) else v)
        else:
            total += 24
    return total


def _check_text(value: Any, per_item: int = 4) -> Any:
    """``value`` unless it would print as more than MAX_TEMPLATE_CHARS characters (checked before printing)."""
    if not isinstance(value, str) and _text_size(value, per_item) > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"a value that prints as more than {MAX_TEMPLATE_CHARS} characters")
    return value


def _check_int_args(args: Iterable[Any]) -> None:
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_TEMPLATE_INT_ARG:
            raise TemplateLimitError(f"an argument of {a} (the limit is {MAX_TEMPLATE_INT_ARG})")


_WIDE_FORMAT = re.compile(r"\d{7,}")  # a width or precision of a million or more, in % or {} formats
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?")
_DIGITS = re.compile(r"\d+")


def _format_fields(fmt: str, percent: bool) -> tuple[int, int]:
    """(the number of fields, the sum of their widths and precisions) of a ``%`` or ``str.format`` format."""
    if percent:
        fields = [(w, p) for w, p in _PERCENT_FIELD.findall(fmt.replace("%%", ""))]
        return len(fields), sum(int(w or 0) + int(p or 0) for w, p in fields)
    specs = [spec or "" for _, name, spec, _ in string.Formatter().parse(fmt) if name is not None]
    return len(specs), sum(int(d) for spec in specs for d in _DIGITS.findall(spec))


def _check_format(fmt: Any, args: Any, percent: bool = True) -> None:
    """``%`` and ``str.format``: no huge widths, literal or passed as arguments, and a result (at most every
    field's width plus the longest argument's text) that fits the limit, checked before formatting."""
    if isinstance(fmt, str) and _WIDE_FORMAT.search(fmt):
        raise TemplateLimitError("a format width of a million or more")
    values = args.values() if isinstance(args, Mapping) else args if isinstance(args, (tuple, list)) else (args,)
    _check_int_args(values)
    _check_text(list(values))
    if isinstance(fmt, str):
        fields, widths = _format_fields(fmt, percent)
        longest = max((_text_size(v) for v in values), default=0)
        if len(fmt) + widths + fields * longest > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(f"a format making more than {MAX_TEMPLATE_CHARS} characters")


def _guard_iter(iterable: Any) -> Any:
    """Every ``{% for %}`` iterates through this (the template's loops are rewritten to): each step ticks."""
    return _GuardedIterable(iterable)


class _GuardedIterable:
    def __init__(self, iterable: Any) -> None:
        self._it = iterable

    def __len__(self) -> int:
        return len(self._it)  # TypeError when it has none: jinja's loop.length then counts it

    def __iter__(self) -> Iterator[Any]:
        for item in self._it:
            _tick()
            yield item


def _guard_concat(*parts: Any) -> str:
    """``a ~ b ~ c`` (rewritten to call this): the joined length is checked before joining."""
    _tick()
    texts = [p if isinstance(p, str) else str(_check_text(p)) for p in parts]
    if sum(map(len, texts)) > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"a string longer than {MAX_TEMPLATE_CHARS} characters")
    return "".join(texts)


class _Rewrite(NodeTransformer):
    """Route every for-loop's iterable and every ``~`` through the guards (names a template cannot rebind)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.ImportedName(f"{__name__}._guard_iter"), [node.iter], [], None, None,
                               lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(nodes.ImportedName(f"{__name__}._guard_concat"), list(node.nodes), [], None, None,
                          lineno=node.lineno)


def _seq_len(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_binop(op: str, left: Any, right: Any) -> None:
    """Refuse an operator whose result would be huge, before computing it."""
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            size = _seq_len(seq)
            if size is not None and _is_int(n) and size * max(n, 0) > MAX_TEMPLATE_CHARS:
                raise TemplateLimitError(f"a repetition of {size} x {n} items (the limit is {MAX_TEMPLATE_CHARS})")
        if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > MAX_TEMPLATE_INT_BITS:
            raise TemplateLimitError(f"an integer of more than {MAX_TEMPLATE_INT_BITS} bits")
    elif op == "+":
        a, b = _seq_len(left), _seq_len(right)
        if a is not None and b is not None and a + b > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(f"a value of {a + b} items (the limit is {MAX_TEMPLATE_CHARS})")
    elif op == "**":
        if _is_int(left) and _is_int(right) and abs(left) > 1 and right > 0 \
                and right * math.log2(abs(left)) > MAX_TEMPLATE_INT_BITS:
            raise TemplateLimitError(f"an integer of more than {MAX_TEMPLATE_INT_BITS} bits")
    elif op == "%" and isinstance(left, str):
        _check_format(left, right)


_STR_METHODS_SIZED = ("center", "ljust", "rjust", "zfill", "expandtabs")
_LIPSUM_WORD_CHARS = 14  # the longest lorem ipsum word, a space and a comma or full stop


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with resource limits: a chat template is a program from a model file.

    Operators (``*``, ``+``, ``**``, ``%``) are intercepted (which also stops jinja from folding them at compile
    time) and refused when their result would pass the size limits; every call (macros, methods, filters'
    callables, ``loop()``) and every loop step ticks a per-render budget of steps and wall-clock time; ``range`` is
    the sandbox's own (at most 100k items, a real range as transformers' templates see it); filters' int
    arguments are capped and their results measured.
    """

    intercepted_binops = frozenset({"*", "+", "**", "%", "//", "/", "-"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals["lipsum"] = _bounded_lipsum

    @staticmethod
    def concat(chunks: Iterable[str]) -> str:
        """Captured output (a macro's, a caller's, a ``{% set %}`` or ``{% filter %}`` block's) joined, its
        length checked first."""
        parts = list(chunks)
        if sum(map(len, parts)) > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(f"a captured block longer than {MAX_TEMPLATE_CHARS} characters")
        return "".join(parts)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """str.format / format_map (jinja's sandboxed formatter) with the format's widths checked first."""
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        owner = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            values = list(args) + list(kwargs.values())
            _check_format(owner, values, percent=False)
            if isinstance(owner, str) and any("{" in (spec or "") for _, _, spec, _ in string.Formatter().parse(owner)):
                raise TemplateLimitError("a format spec with a field in it (its width would be unchecked)")
            for v in values:
                if isinstance(v, Mapping):
                    _check_int_args(v.values())
            return _check_size(fmt(*args, **kwargs))

        return checked

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        _tick()
        _check_binop(operator, left, right)
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any,  # noqa: N805 (jinja's signature)
             **kwargs: Any) -> Any:
        _tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, list, tuple, dict)):
            name = getattr(__obj, "__name__", "")
            if name in _STR_METHODS_SIZED:
                _check_int_args(list(args) + list(kwargs.values()))
                if name == "expandtabs" and isinstance(owner, str):
                    _check_expandtabs(owner, args[0] if args else kwargs.get("tabsize", 8))
            elif name == "translate" and isinstance(owner, str) and args:
                _check_translate(owner, args[0])
            elif name == "replace" and isinstance(owner, str) and len(args) >= 2:
                _check_replace(owner, args[0], args[1])
            elif name == "join" and isinstance(owner, str) and args:
                _check_join(owner, args[0])
        return _check_size(super().call(__context, __obj, *args, **kwargs))


def _check_replace(text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        hits = text.count(old) if old else len(text) + 1
        if len(text) + hits * len(new) > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(f"a replace making more than {MAX_TEMPLATE_CHARS} characters")


def _check_expandtabs(text: str, tabsize: Any) -> None:
    if _is_int(tabsize) and len(text) + text.count("\t") * max(tabsize, 0) > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"an expandtabs making more than {MAX_TEMPLATE_CHARS} characters")


def _check_translate(text: str, table: Any) -> None:
    """The translated length, counted per distinct character of ``text`` (a table maps a code to a string)."""
    if not isinstance(table, Mapping):
        return  # str.translate looks codes up in lists too: one character or none each
    longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
    if len(text) * longest <= MAX_TEMPLATE_CHARS:
        return
    total = 0
    for char, count in collections.Counter(text).items():
        mapped = table.get(ord(char), char)
        total += count * (len(mapped) if isinstance(mapped, str) else 1)
    if total > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"a translate making more than {MAX_TEMPLATE_CHARS} characters")


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (jinja's)
    """jinja's ``lipsum``, its paragraphs x words bounded by the size limit before any is made."""
    if not (_is_int(n) and _is_int(min) and _is_int(max)):
        raise TemplateLimitError("lipsum takes integer counts")
    if n * (abs(max) + 1) * _LIPSUM_WORD_CHARS > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"a lipsum of more than {MAX_TEMPLATE_CHARS} characters")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def _check_join(sep: Any, items: Any) -> None:
    if isinstance(items, (list, tuple)):
        total = _text_size(items, len(str(_check_text(sep))))
        if total > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(f"a join making more than {MAX_TEMPLATE_CHARS} characters")


# the built-in filters that print their input (str() or repr()) before working on it
_PRINTING_FILTERS = frozenset({"string", "pprint", "safe", "escape", "e", "forceescape", "capitalize", "lower",
                               "upper", "title", "trim", "striptags", "wordwrap", "wordcount", "truncate", "center",
                               "urlencode", "urlize", "indent", "replace", "filesizeformat"})


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a built-in filter: int arguments capped, replace/join/indent/format pre-checked, result measured.
    The wrapper keeps the filter's pass-context marker (functools.wraps copies it)."""

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        values = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.nodes.EvalContext,
                                                        jinja2.Environment))]
        _check_int_args(values[1:] + list(kwargs.values()))
        if name == "replace" and len(values) >= 3:
            _check_replace(str(values[0]), values[1], values[2])
        elif name == "join" and values:
            items = values[0] if isinstance(values[0], (list, tuple)) else None
            if items is not None:
                _check_join(values[1] if len(values) > 1 else kwargs.get("d", ""), items)
        elif name == "indent" and values and isinstance(values[0], str):
            width = values[1] if len(values) > 1 else kwargs.get("width", 4)
            w = len(width) if isinstance(width, str) else width if _is_int(width) else 0
            if (values[0].count("\n") + 1) * (w + 1) + len(values[0]) > MAX_TEMPLATE_CHARS:
                raise TemplateLimitError(f"an indent making more than {MAX_TEMPLATE_CHARS} characters")
        elif name == "format" and values:
            _check_format(values[0], values[1:] + list(kwargs.values()))
        elif name == "sum" and values and isinstance(args[0], jinja2.Environment):
            _check_sum(args[0], values[0], values[1] if len(values) > 1 else kwargs.get("attribute"),
                       values[2] if len(values) > 2 else kwargs.get("start", 0))
        elif name in _PRINTING_FILTERS and values:
            _check_text(values[0])
        return _check_size(f(*args, **kwargs))

    return bounded


def _check_sum(env: jinja2.Environment, items: Any, attribute: Any, start: Any) -> None:
    """``sum`` of sequences copies the running total at each item: the copies together stay under the limit."""
    if _seq_len(start) is None or not isinstance(items, (list, tuple)):
        return
    get = jinja2.filters.make_attrgetter(env, attribute) if attribute is not None else None
    running = copied = _seq_len(start) or 0
    for item in items:
        running += _seq_len(get(item) if get else item) or 0
        copied += running
        if copied > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(f"a sum copying more than {MAX_TEMPLATE_CHARS} items")


# -- the helpers templates get, compiling, rendering --------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    width = len(indent) if isinstance(indent, str) else indent  # json.dumps takes both, as transformers' tojson
    if indent is not None and (not _is_int(width) or not 0 <= width <= MAX_JSON_INDENT):
        raise TemplateLimitError(f"tojson indent must be an integer in [0, {MAX_JSON_INDENT}] or as many "
                                 f"characters, got {indent!r}")
    if separators is not None and not (isinstance(separators, (tuple, list)) and len(separators) == 2
                                       and all(isinstance(sep, str) for sep in separators)):
        raise TemplateLimitError("tojson separators must be two strings")
    _check_text(x, per_item=4 + 2 * (width or 0) + sum(map(len, separators or ())))
    return _check_size(json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys))


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > 256:
        raise TemplateLimitError("strftime_now takes a format of at most 256 characters")
    return datetime.now().strftime(fmt)


class GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which transformers' templates use to mark the assistant's
    tokens for training masks: its body rendered as it is (transformers' ``AssistantTracker`` when no mask is
    asked for)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


TEMPLATE_EXTENSIONS = (jinja2.ext.loopcontrols, GenerationBlock)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile ``source`` in the bounded sandbox, its loops and ``~`` rewritten through the guards."""
    if not isinstance(source, str):
        raise KestrelError(f"invalid chat template: expected text, got {type(source).__name__}")
    if len(source) > MAX_TEMPLATE_CHARS:
        raise KestrelError(f"invalid chat template: {len(source)} characters (the limit is {MAX_TEMPLATE_CHARS})")
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=list(TEMPLATE_EXTENSIONS),
                         finalize=_check_text)  # every {{ value }}, measured before it is printed
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        tree = _Rewrite().visit(env.parse(source))
        return env.from_string(tree)
    except jinja2.TemplateError as exc:
        raise KestrelError(f"invalid chat template: {one_line(exc)}") from None
    except (RecursionError, MemoryError) as exc:  # a template nested thousands deep
        raise KestrelError(f"invalid chat template: {type(exc).__name__}") from None


def loops_over_content(source: str) -> bool:
    """Whether the template loops over a message's content (``for part in message.content``, or over a variable
    or macro argument named ``content``): it reads content as a list of parts, as transformers passes a list,
    so such content is not joined into one string for it (vLLM's "openai" content format)."""
    try:
        tree = jinja2.Environment(extensions=list(TEMPLATE_EXTENSIONS)).parse(source)
    except (jinja2.TemplateError, RecursionError, MemoryError):
        return False  # compile_chat_template says what is wrong with it
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter | nodes.Test) and it.node is not None:  # content | selectattr(...)
            it = it.node
        if (isinstance(it, nodes.Getattr) and it.attr == "content"
                or isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content"
                or isinstance(it, nodes.Name) and it.name == "content"):
            return True
    return False


def template_content(content: Any, parts: bool) -> Any:
    """A message's content as its template reads it: a list of parts stays a list for a template that loops over
    content (``loops_over_content``), and is its text parts joined by newlines for one that reads a string."""
    if not isinstance(content, list) or parts:
        return content
    return "\n".join(str(p.get("text") or "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")


def render_bounded(template: jinja2.Template, budget: _Budget | None = None, **context: Any) -> str:
    """Render with the limits: the output is gathered chunk by chunk (``generate``) so that its size is checked
    as it grows, and each chunk ticks the deadline."""
    budget = budget or _Budget()
    token = _BUDGET.set(budget)
    try:
        out: list[str] = []
        size = 0
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > budget.chars:
                raise TemplateLimitError(f"the rendered prompt passed {budget.chars} characters")
            budget.tick()
            out.append(chunk)
        return "".join(out)
    finally:
        _BUDGET.reset(token)


CONTINUE_MARK = "<|kestrel:continue|>"  # text no template writes of its own


def continue_final_message(render: Callable[[list[dict[str, Any]]], str], messages: Sequence[Mapping[str, Any]]) \
        -> str:
    """The prompt ``render`` (a chat template, no generation prompt) makes of ``messages``, cut where the last
    message's text ends, so that the answer continues that message (a prefill) instead of opening a turn of its
    own, as transformers' ``continue_final_message``: the text is rendered with a mark after it, and what the
    template writes from the mark on (its end of turn) is dropped; the text's own trailing whitespace stays."""
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, list):  # parts: the mark after the last text
        texts = [i for i, p in enumerate(content) if isinstance(p, Mapping) and p.get("type") == "text"]
        content = [dict(p) if isinstance(p, Mapping) else p for p in content]
        if texts:
            content[texts[-1]]["text"] = f"{content[texts[-1]].get('text') or ''}{CONTINUE_MARK}"
        else:
            content.append({"type": "text", "text": CONTINUE_MARK})
        last["content"] = content
    else:
        last["content"] = f"{content or ''}{CONTINUE_MARK}"
    prompt = render([*map(dict, messages[:-1]), last])
    at = prompt.rfind(CONTINUE_MARK)
    if at < 0:
        raise KestrelError("the last message cannot be continued: the chat template does not write its text")
    return prompt[:at].replace(CONTINUE_MARK, "")  # a template that wrote the text twice: the earlier copy too


def render_chat(template: jinja2.Template, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                **context: Any) -> str:
    """The prompt text for ``messages``, rendered with the limits; whatever the template does wrong (a limit, the
    sandbox, its own exceptions, recursion) is one KestrelError line."""
    try:
        return render_bounded(template, messages=[dict(m) for m in messages],
                              add_generation_prompt=add_generation_prompt, **context)
    except TemplateLimitError as exc:
        raise KestrelError(f"chat template stopped: {one_line(exc)}") from None
    except jinja2.TemplateError as exc:
        kind = "refused by the sandbox" if isinstance(exc, SecurityError) else "failed"
        raise KestrelError(f"chat template {kind}: {one_line(exc)}") from None
    except KestrelError:
        raise
    except (RecursionError, MemoryError) as exc:
        raise KestrelError(f"chat template stopped: {type(exc).__name__} (too deep or too large)") from None
    except Exception as exc:  # TypeError, ZeroDivisionError, OverflowError... from the template's own code
        raise KestrelError(f"chat template failed: {type(exc).__name__}: {one_line(exc)}") from None
