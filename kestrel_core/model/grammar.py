"""Generation constrained by a grammar, on llguidance (a grammar backend of both vLLM and llama.cpp).

A request's ``SamplingParams.grammar`` is llguidance's grammar text, made by ``json_schema_grammar`` (JSON that
a JSON Schema accepts), ``lark_grammar`` or ``regex_grammar``. Its ``Constraint`` (an ``LLMatcher`` over the
model's ``grammar_vocab``) sets every token the grammar does not allow next to -inf before the sampler chooses,
and consumes each token chosen; the end of text is allowed exactly where the grammar is complete. Grammars come
from clients, so llguidance's default limits bound the work of each token's mask; a grammar that fails in
generation (past a limit) ends its answer at once. llguidance is imported on first use. A grammar is compiled on
threads of its own (``compiling``) and kept by its text (``CompiledGrammars``, an engine's last 64): each request's
choices, this request's and later ones', take a ``Constraint.copy`` of it.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kestrel_core.errors import InvalidRequest, KestrelError, invalid_request
from kestrel_core.model.validate import strict_text

T = TypeVar("T")
# grammars are made and compiled in turn on threads of their own: a client's schema may take seconds, and on the
# loop's default executor abandoned ones would hold up every other request's prompt rendering (llguidance lets go
# of the GIL meanwhile, so a compile does not hold up the loop itself)
GRAMMAR_THREADS = 2
_COMPILES = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="kestrel-grammar")


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of kestrel
        raise KestrelError("constrained generation needs llguidance: pip install llguidance") from None
    return llguidance


# JSON as models write it (json.dumps' separators), with no whitespace to wander into; keywords llguidance does
# not implement are ignored rather than refused
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


def json_schema_grammar(schema: dict[str, Any] | str, param: str = "grammar") -> str:
    """The grammar of the JSON texts ``schema`` (a JSON Schema, as an object or its text) accepts, written as
    ``JSON_OPTIONS`` say. A schema kestrel cannot read is an InvalidRequest naming ``param``."""
    try:
        grammar = _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"invalid JSON Schema: {exc}", param=param) from None
    check_grammar(grammar, param)
    return grammar


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark rule's body for the JSON a schema accepts, written as ``JSON_OPTIONS`` say (for ``lark_grammar``)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def lark_grammar(lark: str, param: str = "grammar") -> str:
    """The grammar of a Lark grammar's text (llguidance's dialect: ``%json {schema}`` embeds a JSON Schema)."""
    grammar = _llguidance().LLMatcher.grammar_from_lark(_text(lark, "a Lark grammar", param))
    check_grammar(grammar, param)
    return grammar


def regex_grammar(regex: str, param: str = "grammar") -> str:
    """The grammar of the texts a regular expression matches whole."""
    grammar = _llguidance().LLMatcher.grammar_from_regex(_text(regex, "a regular expression", param))
    check_grammar(grammar, param)
    return grammar


def check_grammar(grammar: str, param: str = "grammar") -> None:
    """InvalidRequest (naming ``param``) for a grammar llguidance refuses; cheap: no vocabulary is needed."""
    error = _llguidance().LLMatcher.validate_grammar(_text(grammar, "a grammar", param, "llguidance's grammar text"))
    if error and not error.startswith("WARNING"):
        raise InvalidRequest(f"invalid grammar: {' '.join(error.split())}", param=param)


def _text(text: object, what: str, param: str, kind: str = "a str") -> str:
    """``text`` where it is Unicode text: llguidance refuses anything else with a TypeError or a UnicodeEncodeError
    (a lone surrogate) that names no argument."""
    if not isinstance(text, str):
        raise InvalidRequest(f"{what} is {kind}, got {type(text).__name__}", param=param)
    try:
        return strict_text(text, what)
    except KestrelError as exc:
        raise invalid_request(exc, param) from None


async def compiling(work: Callable[[], T]) -> T:
    """``work()``, the making or compiling of a grammar, on the grammars' threads. Cancelled while it waits its
    turn (its request gone), it never runs."""
    return await asyncio.get_running_loop().run_in_executor(_COMPILES, contextvars.copy_context().run, work)


# compiled grammars an engine keeps: llguidance says nothing of a compiled grammar's size, so they are counted;
# clients send the same few schemas with every request
GRAMMAR_CACHE_ENTRIES = 64


@dataclass
class _Compiling:
    future: Future[Constraint]  # on the grammars' threads
    waiting: int = 0  # requests awaiting it


class CompiledGrammars:
    """Grammars compiled by ``compile`` (``Engine.constraint``), kept by their text, the ``entries`` last used.
    Requests for a grammar being compiled share that compile; one whose every request has left before its turn is
    never compiled; one that fails is not kept (the next request compiles it again). The compiled original is never
    advanced: each request takes a copy."""

    def __init__(self, compile: Callable[[str], Constraint], entries: int = GRAMMAR_CACHE_ENTRIES) -> None:
        self._compile = compile
        self._entries = entries
        self._lock = threading.RLock()  # reentrant: a cancelled future runs its callback where it is cancelled
        self._kept: OrderedDict[str, _Compiling] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    async def constraint(self, grammar: str) -> Constraint:
        """A place of its own at the start of ``grammar``, compiled on the grammars' threads unless kept (or being
        compiled) already; InvalidRequest for one that does not compile."""
        with self._lock:
            entry = self._kept.get(grammar)
            if entry is None:
                entry = self._kept[grammar] = _Compiling(
                    _COMPILES.submit(contextvars.copy_context().run, self._compile, grammar))
                entry.future.add_done_callback(lambda f: self._settled(grammar, entry))
                while len(self._kept) > self._entries:
                    self._kept.popitem(last=False)  # a compile under way goes on for those awaiting it
            else:
                self._kept.move_to_end(grammar)
            entry.waiting += 1
        compiled = asyncio.wrap_future(entry.future)
        compiled.add_done_callback(_retrieved)
        try:  # shielded: one request leaving does not cancel the compile that others await
            original = await asyncio.shield(compiled)
        finally:
            with self._lock:
                entry.waiting -= 1
                if not entry.waiting:
                    entry.future.cancel()  # nobody awaits it: if it has not started, it never does
        return original.copy()

    def _settled(self, grammar: str, entry: _Compiling) -> None:
        """A compile done: one that failed or never ran is not kept."""
        if entry.future.cancelled() or entry.future.exception() is not None:
            with self._lock:
                if self._kept.get(grammar) is entry:
                    del self._kept[grammar]


def _retrieved(future: asyncio.Future[Any]) -> None:
    """A compile's failure counts as seen where the request that awaited it has left (asyncio logs it otherwise)."""
    if not future.cancelled():
        future.exception()


def grammar_vocab(tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's view of a model's vocabulary (its ``LLTokenizer``, about a second to build: the engine keeps
    one). ``vocab_size``: the model's logits, which may be more than the tokenizer's tokens; ``eos_token_ids``
    (at least one): the tokens that end a text."""
    try:
        return _llguidance().LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
    except (ValueError, TypeError, RuntimeError) as exc:  # a tokenizer llguidance cannot take apart
        raise KestrelError(f"llguidance cannot read this model's tokenizer: {' '.join(str(exc).split())}") from None


class Constraint:
    """One request's place in its grammar. ``allow`` masks a row of logits; ``accept`` consumes a token."""

    def __init__(self, vocab: Any, grammar: str) -> None:
        self.matcher = _llguidance().LLMatcher(vocab, grammar, log_level=0)
        if self.matcher.is_error():
            raise InvalidRequest(f"invalid grammar: {' '.join(self.matcher.get_error().split())}", param="grammar")
        self.grammar = grammar
        self.vocab_size = vocab.vocab_size
        self.eos = vocab.eos_token  # the first end-of-text token grammar_vocab was given
        self._bits = np.zeros((self.vocab_size + 31) // 32, np.int32)
        self._ready = False  # _bits hold the next token's mask already (prepare_masks)

    def copy(self) -> Constraint:
        """Another place in the same compiled grammar, where this one is now: each request for a grammar the engine
        has compiled takes one rather than compile it again (llguidance's copy shares the compiled grammar)."""
        other = copy.copy(self)
        other.matcher = self.matcher.deep_copy()
        other._bits = self._bits.copy()
        return other

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next; InvalidRequest once it has failed (past llguidance's
        limits: an answer cut there would not be what the grammar describes, and would say it stopped)."""
        if self.matcher.is_error():
            raise InvalidRequest(f"the grammar failed while generating: {self.failed.splitlines()[0]}")
        if not self._ready:
            self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._ready = False
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)

    def allow(self, z: np.ndarray) -> np.ndarray:
        """Logits z [vocab] with every token the grammar does not allow next at -inf (a copy)."""
        allowed = self.allowed()
        if not allowed.any():  # nothing at all: let the end of text through rather than choose blind
            allowed[self.eos] = True
        return np.where(allowed, z, np.float32(-np.inf)).astype(np.float32, copy=False)

    def accept(self, token: int) -> None:
        """Consume the chosen ``token`` (a token the grammar refuses puts it in its failed state)."""
        self._ready = False
        if not self.matcher.is_error():
            self.matcher.consume_token(int(token))

    @property
    def failed(self) -> str:
        """Why the grammar failed, or ""."""
        return self.matcher.get_error() if self.matcher.is_error() else ""


_EXECUTOR: list[Any] = []  # llguidance's thread pool, made on first use


def prepare_masks(constraints: Sequence[Constraint]) -> None:
    """Compute the next masks of a step's constrained rows at once, on llguidance's thread pool (80 % of the
    CPUs, at most 32), rather than one after another as each row is sampled; each ``allowed`` then reads its
    own. The constraints are of one model (one vocabulary)."""
    live = [c for c in constraints if not c.matcher.is_error()]
    if len(live) < 2:
        return
    if not _EXECUTOR:
        _EXECUTOR.append(_llguidance().LLExecutor())
    bits = np.zeros((len(live), len(live[0]._bits)), np.int32)  # [rows, vocab / 32]
    _EXECUTOR[0].unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(live)], bits.ctypes.data,
                                         bits.shape[1] * 4, len(live))
    for c, row in zip(live, bits, strict=True):
        c._bits[:] = row
        c._ready = True
