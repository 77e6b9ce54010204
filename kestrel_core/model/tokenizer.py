"""Tokenizer on the `tokenizers` library, from tokenizer.json or from a GGUF's embedded vocabulary; NoTokenizer
for a model that ships none. Chat templates render in the sandbox of ``chat_template``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as _Backend

from kestrel_core.errors import KestrelError, os_error
from kestrel_core.model.chat_template import (
    compile_chat_template,
    loops_over_content,
    one_line,
    render_chat,
    template_content,
)
from kestrel_core.model.gguf_vocab import build_gguf_vocab
from kestrel_core.model.hf_config import read_json
from kestrel_core.model.reasoning import reasoning_markers, without_reasoning
from kestrel_core.model.validate import check_int, check_regular_file, is_int, is_token_ids, strict_text

PROCESSOR_TEMPLATE = "chat_template.json"  # a processor's own file (transformers' AutoProcessor reads it)
LONG_DECODE_IDS = 1024  # from here decode lets go of the interpreter lock (Tokenizer.decode); a call costs the same


def _processor_template(model_dir: Path) -> str | None:
    """The chat template of a checkpoint's processor, ``chat_template.json``'s ``chat_template``; None where absent."""
    path = model_dir / PROCESSOR_TEMPLATE
    if not path.is_file():
        return None
    template = read_json(check_regular_file(path, model_dir)).get("chat_template")
    if not isinstance(template, str):
        raise KestrelError(f"{path}: expected an object whose chat_template is a string")
    return template


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
                 eos_token: str | None = None, eos_token_ids: Sequence[int] = (),
                 tool_template: str | None = None) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.tool_template = tool_template  # a named "tool_use" template: what renders a request with tools
        self._compiled: dict[str, tuple[jinja2.Template, bool]] = {}  # the template, whether it loops over parts
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
                      bos_token: str | None = None, eos_token: str | None = None,
                      tool_template: str | None = None) -> Tokenizer:
        try:
            backend = _Backend.from_str(tokenizer_json)
        except Exception as exc:  # the Rust side raises plain Exception on bad JSON
            raise KestrelError(f"invalid tokenizer.json: {one_line(exc)}") from None
        if bos_token is None and bos_token_id is not None:
            bos_token = backend.id_to_token(bos_token_id)
        if eos_token is None and eos_token_ids:
            eos_token = backend.id_to_token(eos_token_ids[0])
        return cls(backend, chat_template=chat_template, bos_token=bos_token, eos_token=eos_token,
                   eos_token_ids=eos_token_ids, tool_template=tool_template)

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
        except OSError as exc:
            raise os_error(exc, "cannot read", tj) from None
        except UnicodeDecodeError as exc:
            raise KestrelError(f"{tj}: cannot read it ({exc})") from None
        cfg: dict[str, Any] = {}
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            check_regular_file(cfg_path, model_dir)
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except OSError as exc:
                raise os_error(exc, "cannot read", cfg_path) from None
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise KestrelError(f"{cfg_path}: cannot read it ({one_line(exc)})") from None
            if not isinstance(cfg, dict):
                raise KestrelError(f"{cfg_path}: expected a JSON object")
        template, tool_template = cfg.get("chat_template"), None
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
            tool_template = named.get("tool_use")
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():  # transformers takes it over tokenizer_config.json's
            try:
                template = check_regular_file(jinja_file, model_dir).read_text(encoding="utf-8")
            except OSError as exc:
                raise os_error(exc, "cannot read", jinja_file) from None
            except UnicodeDecodeError as exc:
                raise KestrelError(f"{jinja_file}: cannot read it ({one_line(exc)})") from None
        elif not isinstance(template, (str, list)):  # a vision checkpoint's processor holds it (Aya Vision), as vLLM
            template = _processor_template(model_dir)  # falls back to the processor's
        return cls.from_json_str(text, chat_template=template if isinstance(template, str) else None,
                                 tool_template=tool_template if isinstance(tool_template, str) else None,
                                 bos_token_id=bos_token_id, eos_token_ids=eos_token_ids,
                                 bos_token=_token_content(cfg.get("bos_token")),
                                 eos_token=_token_content(cfg.get("eos_token")))

    @classmethod
    def from_gguf_vocab(cls, fields: Mapping[str, Any], where: str = "GGUF", architecture: str = "") -> Tokenizer:
        """Build from GGUF tokenizer.* metadata values (already decoded to Python values); ``architecture`` (the
        file's ``general.architecture``) picks the SentencePiece variant (``gguf_vocab``)."""
        vocab = build_gguf_vocab(fields, where, architecture)
        return cls(vocab.backend, chat_template=vocab.chat_template, tool_template=vocab.tool_template,
                   bos_token=vocab.bos_token,
                   eos_token=vocab.eos_token, eos_token_ids=vocab.eos_token_ids)

    # -- use ---------------------------------------------------------------------------------------------

    def to_json_str(self) -> str:
        return self.backend.to_str()

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer adds (e.g. a BOS); ``max_length``:
        at most that many, the text's own tokens cut and the added ones kept, as the tokenizers library's
        truncation cuts (a last-token pooled embedding reads the end token the tokenizer appends). Through
        ``encode_batch``, which lets go of the interpreter lock while it works (``encode`` holds it: a megabyte
        prompt tokenized in a server's worker thread would stall every other request)."""
        try:
            if max_length is None:
                return list(self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
            check_int("max_length", max_length, 1)
            own = self.backend.encode_batch([text], add_special_tokens=False)[0]
            added = self.backend.num_special_tokens_to_add(False) if add_special_tokens else 0
            own.truncate(max(max_length - added, 0))
            return list(self.backend.post_process(own, add_special_tokens=add_special_tokens).ids)
        except BaseException as exc:
            _raise_panic(exc, "encode the text")
            _check_text(text, exc)
            raise

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` read as plain text: a special token's text in it is split as any text (the
        user's code in a fill-in-the-middle prompt), and nothing is added."""
        try:
            return list(self._literal.encode_batch([text], add_special_tokens=False)[0].ids)
        except BaseException as exc:
            _raise_panic(exc, "encode the text")
            _check_text(text, exc)
            raise

    @functools.cached_property
    def _literal(self) -> _Backend:
        """A copy of the backend that encodes special tokens' text as text (the backend's own setting is shared
        by every thread that encodes)."""
        backend = _Backend.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; a long sequence through ``decode_batch``, which lets go of the interpreter lock
        while it works (``decode`` holds it: a million ids decoded in a server's worker thread would stall every
        other request), a short one through ``decode``, whose lock the step loop's many calls keep."""
        try:  # a plain try, not a context manager: decode runs twice a generated token
            if len(ids) < LONG_DECODE_IDS:
                return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
            return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        except BaseException as exc:
            _raise_panic(exc, "decode the tokens")
            _check_ids(ids, exc)
            raise

    def token(self, token_id: int) -> str | None:
        """The token's text as the vocabulary spells it; None for an id past the vocabulary."""
        try:
            return self.backend.id_to_token(token_id)
        except (TypeError, OverflowError) as exc:
            if not is_int(token_id):
                raise KestrelError(f"a token id must be an integer, got {type(token_id).__name__}") from None
            _check_ids([token_id], exc)
            raise

    @functools.cached_property
    def left_context(self) -> tuple[int, ...]:
        """Ids of a plain letter, to decode a text's tokens after (TextStream, token_text): a SentencePiece
        decoder strips the first space of what it decodes, so "▁Paris" alone is "Paris", after them " Paris"."""
        return tuple(self.encode("a", add_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        """One token's own text, its leading space kept (special tokens by name)."""
        context = list(self.left_context)
        before = self.decode(context)
        text = self.decode([*context, token_id])
        return text[len(before):] if text.startswith(before) else self.decode([token_id])

    def _source(self, tools: bool = False) -> str:
        """The chat template's text (with ``tools``, the tool_use one where the model names one, as transformers
        picks it)."""
        source = self.tool_template if tools and self.tool_template else self.chat_template
        if not source:
            raise KestrelError("this model has no chat template (`kestrel run --no-chat` runs its prompt as it is)")
        return source

    def _template(self, source: str) -> tuple[jinja2.Template, bool]:
        """The chat template ``source`` compiled, once for each text, and whether it loops over a message's content
        parts."""
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = self._compiled[source] = (compile_chat_template(source), loops_over_content(source))
        return compiled

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for ``messages`` ([{"role": ..., "content": ...}, ...]; content a string or a list of
        {"type": "text", "text": ...} parts), rendered sandboxed; ``enable_thinking`` false also turns off the
        thinking of a template that has no switch of its own (reasoning.without_reasoning)."""
        _check_messages(messages)
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        source = self._source(bool(kwargs.get("tools")))
        template, parts = self._template(source)
        messages = [{**m, "content": template_content(m["content"], parts)} if isinstance(m.get("content"), list)
                    else m for m in messages]
        prompt = render_chat(template, messages, add_generation_prompt, **context)
        if kwargs.get("enable_thinking") is False:
            return without_reasoning(prompt, reasoning_markers(source))
        return prompt

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat prompt; the template writes any BOS itself, so none is added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


def _raise_panic(exc: BaseException, what: str) -> None:
    """The tokenizers library's Rust panic (a PanicException, a BaseException: a tokenizer.json's regex that gives
    up on a text, say) as a one-line error; any other exception is left to go on as it is."""
    if type(exc).__name__ == "PanicException":
        raise KestrelError(f"the model's tokenizer failed to {what}: {' '.join(str(exc).split())}") from None


def _check_messages(messages: object) -> None:
    """A one-line error for chat messages that are not a sequence of objects (the template would fail on a
    missing attribute)."""
    shape = 'messages must be a list of {"role": ..., "content": ...} objects'
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise KestrelError(f"{shape}, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise KestrelError(f"{shape}: message {i} is a {type(message).__name__}")


def _check_text(text: object, exc: BaseException) -> None:
    """A one-line error where the tokenizers library refused ``text`` (with a TypeError that names no argument)
    as it is no text, or not Unicode text (lone surrogates); nothing for another failure."""
    if not isinstance(exc, (TypeError, ValueError)):
        return
    if not isinstance(text, str):
        raise KestrelError(f"the text to encode must be a str, got {type(text).__name__}") from None
    strict_text(text, "the text to encode")


def _check_ids(ids: object, exc: BaseException) -> None:
    """A one-line error where the tokenizers library refused ``ids`` (a TypeError, an OverflowError for a negative
    one) as they are not token ids; nothing for another failure."""
    if not isinstance(exc, (TypeError, OverflowError)):
        return
    if not is_token_ids(ids):
        raise KestrelError(f"token ids must be a sequence of integers, got {type(ids).__name__}") from None
    negative = [int(i) for i in ids if i < 0]  # type: ignore[union-attr]
    if negative:
        raise KestrelError(f"token id {negative[0]} is negative") from None


class NoTokenizerError(KestrelError, AttributeError):
    """Text asked of a model without a tokenizer. Also an AttributeError, so that ``hasattr(tokenizer,
    "decode")`` is False for such a model: callers that decode only when they can (streamed text) skip it."""


class NoTokenizer:
    """The tokenizer of a model that ships none: token ids work (logits, generate), text fails in one line.

    Loading does not require a tokenizer, so weights can be checked, run on ids and quantized without one.
    The text methods (encode, decode, token, token_text, the chat template, to_json_str) are absent: looking one
    up raises NoTokenizerError, which says what is missing.
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
    def token_text(self) -> Any:
        raise self._missing()

    @property
    def apply_chat_template(self) -> Any:
        raise self._missing()

    @property
    def encode_chat(self) -> Any:
        raise self._missing()
