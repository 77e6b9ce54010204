"""Tokenizer on the `tokenizers` library, from tokenizer.json or from a GGUF's embedded vocabulary; NoTokenizer
for a model that ships none.

Chat templates come from model files, which are untrusted: they are rendered in a bounded subclass of jinja2's
ImmutableSandboxedEnvironment (``BoundedSandbox``: limits on loop iterations and calls, on the size of every
string or list an operator, filter or method builds, on the output, and a wall-clock deadline) with the helpers
Hugging Face offers templates (raise_exception, strftime_now, tojson); any template error or exceeded limit is a
one-line KestrelError.
"""

from __future__ import annotations

import contextvars
import functools
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from kestrel_core.errors import KestrelError
from kestrel_core.model.validate import check_regular_file

# llama.cpp's tokenizer.ggml.pre -> how that vocabulary's merges were learned to split text.
# The regexes are the ones of each model's own tokenizer.json (and llama.cpp's llama-vocab.cpp).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_GPT2 = ("default", "gpt2", "gpt-2")
PRE_DIGITS = ("smollm", "starcoder", "refact", "codeshell")  # every digit on its own, then GPT-2's regex
PRE_QWEN2 = ("qwen2", "deepseek-r1-qwen")
PRE_LLAMA3 = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")
SUPPORTED_PRE = PRE_GPT2 + PRE_DIGITS + PRE_QWEN2 + PRE_LLAMA3

# llama.cpp token types
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


# -- bounded rendering ---------------------------------------------------------------------------------------

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


def _check_int_args(args: Iterable[Any]) -> None:
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_TEMPLATE_INT_ARG:
            raise TemplateLimitError(f"an argument of {a} (the limit is {MAX_TEMPLATE_INT_ARG})")


_WIDE_FORMAT = re.compile(r"\d{7,}")  # a width or precision of a million or more, in % or {} formats


def _check_format(fmt: Any, args: Any) -> None:
    """``%`` and ``str.format``: no huge literal widths, no huge widths passed as arguments."""
    if isinstance(fmt, str) and _WIDE_FORMAT.search(fmt):
        raise TemplateLimitError("a format width of a million or more")
    values = args.values() if isinstance(args, Mapping) else args if isinstance(args, (tuple, list)) else (args,)
    _check_int_args(values)


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
    texts = [p if isinstance(p, str) else str(p) for p in parts]
    if sum(map(len, texts)) > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"a string longer than {MAX_TEMPLATE_CHARS} characters")
    return "".join(texts)


def _bounded_range(*args: Any) -> Any:
    """jinja's safe_range (at most 100k items) whose steps count against the render's budget."""
    from jinja2.sandbox import safe_range

    return _GuardedIterable(safe_range(*args))


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


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with resource limits: a chat template is a program from a model file.

    Operators (``*``, ``+``, ``**``, ``%``) are intercepted (which also stops jinja from folding them at compile
    time) and refused when their result would pass the size limits; every call (macros, methods, filters'
    callables, ``loop()``) and every loop step ticks a per-render budget of steps and wall-clock time; ``range``
    counts its steps; filters' int arguments are capped and their results measured.
    """

    intercepted_binops = frozenset({"*", "+", "**", "%", "//", "/", "-"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals["range"] = _bounded_range
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """str.format / format_map (jinja's sandboxed formatter) with the format's widths checked first."""
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        owner = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            values = list(args) + list(kwargs.values())
            _check_format(owner, values)
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


def _check_join(sep: Any, items: Any) -> None:
    if isinstance(items, (list, tuple)):
        total = sum(len(x) if isinstance(x, str) else 32 for x in items) + len(items) * len(str(sep))
        if total > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(f"a join making more than {MAX_TEMPLATE_CHARS} characters")


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
        return _check_size(f(*args, **kwargs))

    return bounded


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    if indent is not None and (not _is_int(indent) or not 0 <= indent <= MAX_JSON_INDENT):
        raise TemplateLimitError(f"tojson indent must be an integer in [0, {MAX_JSON_INDENT}], got {indent!r}")
    return _check_size(json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys))


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > 256:
        raise TemplateLimitError("strftime_now takes a format of at most 256 characters")
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile ``source`` in the bounded sandbox, its loops and ``~`` rewritten through the guards."""
    if not isinstance(source, str):
        raise KestrelError(f"invalid chat template: expected text, got {type(source).__name__}")
    if len(source) > MAX_TEMPLATE_CHARS:
        raise KestrelError(f"invalid chat template: {len(source)} characters (the limit is {MAX_TEMPLATE_CHARS})")
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        tree = _Rewrite().visit(env.parse(source))
        return env.from_string(tree)
    except jinja2.TemplateError as exc:
        raise KestrelError(f"invalid chat template: {_one_line(exc)}") from None
    except (RecursionError, MemoryError) as exc:  # a template nested thousands deep
        raise KestrelError(f"invalid chat template: {type(exc).__name__}") from None


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


def _str_list(fields: Mapping[str, Any], key: str, where: str) -> list[str]:
    """A GGUF metadata array of strings (empty when absent); anything else is one line naming the key."""
    value = fields.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise KestrelError(f"{where}: {key} must be an array of strings")
    return value


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """encode / decode / chat template / eos ids, on a `tokenizers.Tokenizer`."""

    def __init__(self, backend: _Backend, *, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        ids = list(eos_token_ids)
        if eos_token is not None and (eid := backend.token_to_id(eos_token)) is not None and eid not in ids:
            ids.append(eid)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)

    # -- construction ------------------------------------------------------------------------------------

    @classmethod
    def from_json_str(cls, tokenizer_json: str, *, chat_template: str | None = None,
                      bos_token_id: int | None = None, eos_token_ids: Sequence[int] = (),
                      bos_token: str | None = None, eos_token: str | None = None) -> Tokenizer:
        try:
            backend = _Backend.from_str(tokenizer_json)
        except Exception as exc:  # the Rust side raises plain Exception on bad JSON
            raise KestrelError(f"invalid tokenizer.json: {_one_line(exc)}") from None
        if bos_token is None and bos_token_id is not None:
            bos_token = backend.id_to_token(bos_token_id)
        if eos_token is None and eos_token_ids:
            eos_token = backend.id_to_token(eos_token_ids[0])
        return cls(backend, chat_template=chat_template, bos_token=bos_token, eos_token=eos_token,
                   eos_token_ids=eos_token_ids)

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path, *, bos_token_id: int | None = None,
                    eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        model_dir = Path(model_dir)
        tj = model_dir / "tokenizer.json"
        if not tj.is_file():
            raise KestrelError(f"{model_dir}: no tokenizer.json (kestrel needs the fast-tokenizer file)")
        check_regular_file(tj, model_dir)  # no FIFO, no symlink out of the model directory
        try:
            text = tj.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KestrelError(f"{tj}: cannot read it ({exc})") from None
        cfg: dict[str, Any] = {}
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            check_regular_file(cfg_path, model_dir)
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise KestrelError(f"{cfg_path}: cannot read it ({_one_line(exc)})") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            try:
                template = check_regular_file(jinja_file, model_dir).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise KestrelError(f"{jinja_file}: cannot read it ({_one_line(exc)})") from None
        return cls.from_json_str(text, chat_template=template if isinstance(template, str) else None,
                                 bos_token_id=bos_token_id, eos_token_ids=eos_token_ids,
                                 bos_token=_token_content(cfg.get("bos_token")),
                                 eos_token=_token_content(cfg.get("eos_token")))

    @classmethod
    def from_gguf_vocab(cls, fields: Mapping[str, Any], where: str = "GGUF") -> Tokenizer:
        """Build from GGUF tokenizer.* metadata values (already decoded to Python values)."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise KestrelError(f"{where}: tokenizer model {kind!r} is not supported (kestrel builds byte-level "
                               "BPE tokenizers, tokenizer.ggml.model 'gpt2')")
        tokens = _str_list(fields, "tokenizer.ggml.tokens", where)
        merges_raw = _str_list(fields, "tokenizer.ggml.merges", where)
        if not tokens or not merges_raw:
            raise KestrelError(f"{where}: the embedded vocabulary lacks tokens or merges")
        types = fields.get("tokenizer.ggml.token_type")
        if types is None:
            types = [TOKEN_NORMAL] * len(tokens)
        if not isinstance(types, list) or len(types) != len(tokens) or not all(_is_int(t) for t in types):
            raise KestrelError(f"{where}: tokenizer.ggml.token_type must be one integer per token "
                               f"({len(tokens)} tokens)")
        pre = fields.get("tokenizer.ggml.pre", "default")
        if pre not in SUPPORTED_PRE:
            raise KestrelError(f"{where}: pre-tokenizer {pre!r} is not supported "
                               f"(kestrel knows {', '.join(SUPPORTED_PRE)})")
        template = fields.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise KestrelError(f"{where}: tokenizer.chat_template must be text")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise KestrelError(f"{where}: tokenizer.ggml.tokens holds the same token twice")
        merges = []
        for m in merges_raw:
            a, sep, b = m.partition(" ")
            if not sep or not a or not b:
                raise KestrelError(f"{where}: malformed merge {m[:80]!r}")
            if a not in vocab or b not in vocab or a + b not in vocab:
                raise KestrelError(f"{where}: merge {m[:80]!r} names tokens outside the vocabulary")
            merges.append((a, b))
        try:
            backend = _Backend(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in PRE_LLAMA3))
        except Exception as exc:  # the Rust side raises plain Exception
            raise KestrelError(f"{where}: the embedded vocabulary is not a valid BPE ({_one_line(exc)})") from None
        if pre in PRE_GPT2:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif pre in PRE_DIGITS:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        else:
            split = _QWEN2_SPLIT if pre in PRE_QWEN2 else _LLAMA3_SPLIT
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            if pre in PRE_QWEN2:
                backend.normalizer = normalizers.NFC()
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED])

        def token_id(key: str) -> int | None:
            v = fields.get(key)
            if v is not None and not _is_int(v):
                raise KestrelError(f"{where}: {key} must be an integer, got {v!r}")
            return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

        bos_id, eos_id, eot_id = (token_id(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "eot"))
        if fields.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
            bos = tokens[bos_id]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
        eos_ids = [i for i in (eos_id, eot_id) if i is not None]
        eos_ids = list(dict.fromkeys(eos_ids))
        return cls(backend, chat_template=template,
                   bos_token=tokens[bos_id] if bos_id is not None else None,
                   eos_token=tokens[eos_id] if eos_id is not None else None, eos_token_ids=eos_ids)

    # -- use ---------------------------------------------------------------------------------------------

    def to_json_str(self) -> str:
        return self.backend.to_str()

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer adds (e.g. a BOS)."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise KestrelError("this model has no chat template (use --no-chat)")
        return compile_chat_template(self.chat_template)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for ``messages`` ([{"role": ..., "content": ...}, ...]), rendered sandboxed."""
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        try:
            return render_bounded(self._template, messages=[dict(m) for m in messages],
                                  add_generation_prompt=add_generation_prompt, **context)
        except TemplateLimitError as exc:
            raise KestrelError(f"chat template stopped: {_one_line(exc)}") from None
        except jinja2.TemplateError as exc:
            kind = "refused by the sandbox" if isinstance(exc, SecurityError) else "failed"
            raise KestrelError(f"chat template {kind}: {_one_line(exc)}") from None
        except KestrelError:
            raise
        except (RecursionError, MemoryError) as exc:
            raise KestrelError(f"chat template stopped: {type(exc).__name__} (too deep or too large)") from None
        except Exception as exc:  # TypeError, ZeroDivisionError, OverflowError... from the template's own code
            raise KestrelError(f"chat template failed: {type(exc).__name__}: {_one_line(exc)}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat prompt; the template writes any BOS itself, so none is added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


class NoTokenizerError(KestrelError, AttributeError):
    """Text asked of a model without a tokenizer. Also an AttributeError, so that ``hasattr(tokenizer,
    "decode")`` is False for such a model: callers that decode only when they can (streamed text) skip it."""


class NoTokenizer:
    """The tokenizer of a model that ships none: token ids work (logits, generate), text fails in one line.

    Loading does not require a tokenizer, so weights can be checked, run on ids and quantized without one.
    The text methods (encode, decode, token, the chat template, to_json_str) are absent: looking one up raises
    NoTokenizerError, which says what is missing.
    """

    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    def __init__(self, reason: str, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.reason = reason
        self.vocab_size = vocab_size
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)

    def _missing(self) -> NoTokenizerError:
        return NoTokenizerError(f"this model has no tokenizer ({self.reason})")

    @property
    def to_json_str(self) -> Any:
        raise self._missing()

    @property
    def encode(self) -> Any:
        raise self._missing()

    @property
    def decode(self) -> Any:
        raise self._missing()

    @property
    def token(self) -> Any:
        raise self._missing()

    @property
    def apply_chat_template(self) -> Any:
        raise self._missing()

    @property
    def encode_chat(self) -> Any:
        raise self._missing()
