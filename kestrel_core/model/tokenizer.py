"""Tokenizer on the `tokenizers` library, from tokenizer.json or from a GGUF's embedded vocabulary; NoTokenizer
for a model that ships none. Chat templates render in the sandbox of ``chat_template``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from kestrel_core.errors import KestrelError
from kestrel_core.model.chat_template import compile_chat_template, one_line, render_chat
from kestrel_core.model.validate import check_regular_file, is_int

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
            raise KestrelError(f"invalid tokenizer.json: {one_line(exc)}") from None
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
                raise KestrelError(f"{cfg_path}: cannot read it ({one_line(exc)})") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            try:
                template = check_regular_file(jinja_file, model_dir).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise KestrelError(f"{jinja_file}: cannot read it ({one_line(exc)})") from None
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
        if not isinstance(types, list) or len(types) != len(tokens) or not all(is_int(t) for t in types):
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
            raise KestrelError(f"{where}: the embedded vocabulary is not a valid BPE ({one_line(exc)})") from None
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
            if v is not None and not is_int(v):
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
        return render_chat(self._template, messages, add_generation_prompt, **context)

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
