"""Generation constrained by a grammar, on llguidance (a grammar backend of both vLLM and llama.cpp).

A request's ``SamplingParams.grammar`` is llguidance's grammar text, made by ``json_schema_grammar`` (JSON that
a JSON Schema accepts), ``lark_grammar`` or ``regex_grammar``. Its ``Constraint`` (an ``LLMatcher`` over the
model's ``grammar_vocab``) sets every token the grammar does not allow next to -inf before the sampler chooses,
and consumes each token chosen; the end of text is allowed exactly where the grammar is complete. Grammars come
from clients, so llguidance's default limits bound the work of each token's mask; a grammar that fails in
generation (past a limit) ends its answer at once. llguidance is imported on first use. A grammar is compiled once
a request (``compiling``, on threads of its own); each of its choices takes a ``Constraint.copy`` of it.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
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
        """Another place in the same compiled grammar, where this one is now: the choices of one request each take
        one rather than compile the grammar again (llguidance's copy shares the compiled grammar)."""
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
