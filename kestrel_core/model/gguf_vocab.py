"""A `tokenizers` backend from a GGUF's tokenizer.* metadata: llama.cpp's two BPE vocabularies.

- ``gpt2``: byte-level BPE with the merges the file lists, split the way ``tokenizer.ggml.pre`` says.
- ``llama``: SentencePiece BPE. The file lists pieces with scores and no merges; the merges are recovered
  from the vocabulary (every split of a piece into two pieces, best score first), with byte fallback
  (``<0xNN>`` pieces) and "▁" for spaces. A prefix space where ``tokenizer.ggml.add_space_prefix`` (default on)
  says, added by a normalizer as Llama 2's and Phi-3's own tokenizer.json add it (to every text between special
  tokens, as llama.cpp does; a leading space stays a piece of its own), Phi-3's tokens matched whole taking the
  whitespace after them; Gemma 3's (by ``general.architecture``: spaces only replaced; pieces of spaces stored as
  real spaces and respelled; merges ranked by the pieces' order in the file, which its scores do not follow).

Either way the ends of generation, the types of the tokens llama.cpp finds by their text, and the special ids a
SentencePiece file leaves out (``DEFAULT_IDS``) are llama.cpp's (``end_of_generation``, ``special_id``); so are the
text of a token of a type it does not print (an unused one), none (``_decoder``), and the files refused for a bos or
eos to add that they lack (``_check_added``).

tests/kestrel_core/model/test_tokenizer.py compares them with llama.cpp's test vectors (the models' own
tokenizers' ids) and with transformers' own reading of the same files.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from kestrel_core.errors import KestrelError
from kestrel_core.model.chat_template import one_line
from kestrel_core.model.validate import is_int, is_number

# llama.cpp's tokenizer.ggml.pre -> how that vocabulary's merges were learned to split text. The regexes are the
# ones of each model's own tokenizer.json, as llama.cpp's llama-vocab.cpp quotes them; "default" (a file that names
# none) is llama.cpp's own: runs of punctuation first, then GPT-2's regex, then numbers, then ASCII digits in threes.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SEED_CODER_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
                     r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3_SPLITS = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                     r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                     r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _Pre:
    """How one ``tokenizer.ggml.pre`` splits text before its byte-level BPE, and llama.cpp's settings for it."""

    splits: tuple[str, ...] = ()  # regexes applied in turn (none: GPT-2's own)
    digits: bool = False  # every digit on its own, then GPT-2's regex
    ignore_merges: bool = False  # a word that is a token is that token
    add_bos: bool = False  # llama.cpp's default where tokenizer.ggml.add_bos_token is absent
    nfc: bool = False


PRE = {
    "default": _Pre(_DEFAULT_SPLITS),
    **dict.fromkeys(("gpt2", "gpt-2", "phi-2", "exaone4"), _Pre()),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "command-r"), _Pre(digits=True)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _Pre((_QWEN2_SPLIT,), nfc=True)),
    "qwen35": _Pre((_QWEN35_SPLIT,)),  # no NFC: its combining marks are tokens of their own
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "lfm2", "falcon3", "pixtral"),
                    _Pre((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)),
    **dict.fromkeys(("smaug-bpe", "glm4", "chatglm-bpe"), _Pre((_LLAMA3_SPLIT,))),
    "tekken": _Pre((_TEKKEN_SPLIT,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _Pre((_O200K_SPLIT,))),
    "seed-coder": _Pre((_SEED_CODER_SPLIT,)),
    "deepseek-v3": _Pre(_DEEPSEEK3_SPLITS),
}
SUPPORTED_PRE = tuple(PRE)
MODELS = ("gpt2", "llama")
SPACE = "\u2581"  # SentencePiece's space

# llama.cpp token types; llama.cpp matches UNKNOWN's and CONTROL's text only where special tokens are parsed, and
# leaves both out of a text decoded without them; a token of any type its token_to_piece does not print (UNUSED: a
# padded vocabulary's "[PAD151700]", UNDEFINED, a type past BYTE, and BYTE in a byte-level vocabulary) decodes to
# nothing either way, its text still a piece of the vocabulary
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
SPECIAL_TYPES = (TOKEN_UNKNOWN, TOKEN_CONTROL)
PRINTED_TYPES = {"gpt2": (TOKEN_NORMAL, *SPECIAL_TYPES, TOKEN_USER_DEFINED),
                 "llama": (TOKEN_NORMAL, *SPECIAL_TYPES, TOKEN_USER_DEFINED, TOKEN_BYTE)}

# llama.cpp's ends of generation (llama_vocab::impl::load, src/llama-vocab.cpp): the ids the file names for eos, eot
# and eom, the fill-in-the-middle padding, repository and file-separator tokens, and every token of one of these
# texts, which is made a control token where the file types it otherwise (converters leave some of them normal)
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~["})
# llama.cpp's fill-in-the-middle tokens by tokenizer.ggml.fim_<slot>_token_id, else found by their text (then made
# control tokens); the last three end a generation
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
FIM_DEPRECATED_KEYS = {"pre": "prefix", "suf": "suffix", "mid": "middle"}  # llama.cpp reads these too
# gpt-oss's harmony header tokens, which llama.cpp makes user-defined whatever the file's type: matched whole where
# special tokens are not parsed, and kept in a text decoded without them
USER_DEFINED_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
# The ids of the special tokens a SentencePiece file names none of (or one outside the vocabulary), llama.cpp's:
# SentencePiece reserves them. llama.cpp's byte-level default, 11 for bos and eos, is not taken: 11 is a text token
# of those vocabularies (GPT-NeoX's ","), where it would end every answer at its first comma.
DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unknown": 0}}
# llama.cpp's byte-level default for both (which only decides whether it refuses a file: ``_check_added``), and the
# pre-tokenizers after which it has no default bos
LLAMA_CPP_BYTE_LEVEL_ID = 11
NO_DEFAULT_BOS_PRE = ("glm4", "chatglm-bpe")


@dataclass
class GGUFVocab:
    backend: _Backend
    chat_template: str | None
    tool_template: str | None  # tokenizer.chat_template.tool_use
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int]


def _str_list(fields: Mapping[str, Any], key: str, where: str) -> list[str]:
    """A GGUF metadata array of strings (empty when absent); anything else is one line naming the key."""
    value = fields.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise KestrelError(f"{where}: {key} must be an array of strings")
    return value


def special_id(fields: Mapping[str, Any], name: str, where: str = "GGUF") -> int | None:
    """The id of special token ``name`` (``bos``, ``eos``...) as llama.cpp takes it (``_special_id``)."""
    return _special_id(fields, name, len(_str_list(fields, "tokenizer.ggml.tokens", where)), where)


def _special_id(fields: Mapping[str, Any], name: str, count: int, where: str) -> int | None:
    """The id ``tokenizer.ggml.<name>_token_id`` names where it is one of the ``count`` tokens, else llama.cpp's
    default for the tokenizer model (``DEFAULT_IDS``) where that is one of them; None where neither is."""
    key = f"tokenizer.ggml.{name}_token_id"
    v = fields.get(key)
    if v is not None and not is_int(v):
        raise KestrelError(f"{where}: {key} must be an integer, got {v!r}")
    if v is not None and 0 <= int(v) < count:
        return int(v)
    model = fields.get("tokenizer.ggml.model")
    default = DEFAULT_IDS.get(model, {}).get(name) if isinstance(model, str) else None
    return default if default is not None and default < count else None


def _tokens_and_types(fields: Mapping[str, Any], where: str) -> tuple[list[str], list[int]]:
    tokens = _str_list(fields, "tokenizer.ggml.tokens", where)
    types = fields.get("tokenizer.ggml.token_type")
    if types is None:
        types = [TOKEN_NORMAL] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens) or not all(is_int(t) for t in types):
        raise KestrelError(f"{where}: tokenizer.ggml.token_type must be one integer per token "
                           f"({len(tokens)} tokens)")
    return tokens, [int(t) for t in types]


def end_of_generation(fields: Mapping[str, Any], where: str = "GGUF") -> tuple[int, ...]:
    """The ids that end a generation with a GGUF's vocabulary (``_end_of_generation``)."""
    return tuple(_end_of_generation(fields, *_tokens_and_types(fields, where), where)[0])


def _end_of_generation(fields: Mapping[str, Any], tokens: list[str], types: list[int],
                       where: str) -> tuple[list[int], list[int]]:
    """(llama.cpp's end-of-generation ids, the file's eos first; the token types as llama.cpp corrects them).

    Where llama.cpp finds a fill-in-the-middle token by text and the vocabulary holds several of its texts, it takes
    the first its hash map yields; kestrel takes the one of lowest id."""
    types = list(types)
    ids = {t: i for i, t in enumerate(tokens)}

    def key(name: str) -> int | None:
        return _special_id(fields, name, len(tokens), where)

    def control(i: int) -> None:
        if types[i] not in SPECIAL_TYPES:
            types[i] = TOKEN_CONTROL

    fim: dict[str, int | None] = {}
    for slot, texts in FIM_TEXTS.items():
        old = FIM_DEPRECATED_KEYS.get(slot)
        found = key(old) if old is not None else None
        found = found if found is not None else key(f"fim_{slot}")
        if found is None and (found := min((ids[t] for t in texts if t in ids), default=None)) is not None:
            control(found)
        fim[slot] = found
    by_text = sorted(ids[t] for t in EOG_TEXTS if t in ids)
    for i in by_text:
        control(i)
    eog = dict.fromkeys(i for i in (key("eos"), key("eot"), key("eom"), fim["pad"], fim["rep"], fim["sep"],
                                    *by_text) if i is not None)
    for text in USER_DEFINED_TEXTS:
        if text in ids:
            types[ids[text]] = TOKEN_USER_DEFINED
    present = {tokens[i]: i for i in eog}
    calls = "<|call|>" in present or "<|calls|>" in present
    if "<|end|>" in present and calls and ("<|return|>" in present or "<|flush|>" in present):
        # gpt-oss's harmony (and Solar Open's): "<|end|>" ends a message, not the answer; it stays in the text
        del eog[present["<|end|>"]]
        types[present["<|end|>"]] = TOKEN_USER_DEFINED
    if "<|tool_response>" in present and "</s>" in present:  # Gemma 4's "</s>" is plain text
        del eog[present["</s>"]]
        types[present["</s>"]] = TOKEN_NORMAL
    return list(eog), types


def build_gguf_vocab(fields: Mapping[str, Any], where: str = "GGUF", architecture: str = "") -> GGUFVocab:
    """The tokenizer a GGUF's metadata describes; every defect one line naming the key."""
    kind = fields.get("tokenizer.ggml.model")
    if kind not in MODELS:
        raise KestrelError(f"{where}: tokenizer model {kind!r} is not supported (kestrel builds the BPE "
                           f"vocabularies, tokenizer.ggml.model {' or '.join(repr(m) for m in MODELS)})")
    tokens, types = _tokens_and_types(fields, where)
    template, tool_template = fields.get("tokenizer.chat_template"), fields.get("tokenizer.chat_template.tool_use")
    if template is not None and not isinstance(template, str) or \
            tool_template is not None and not isinstance(tool_template, str):
        raise KestrelError(f"{where}: tokenizer.chat_template and tokenizer.chat_template.tool_use must be text")
    bos_id, eos_id, unk_id = (_special_id(fields, k, len(tokens), where) for k in ("bos", "eos", "unknown"))
    eos_ids, types = _end_of_generation(fields, tokens, types, where)
    if kind == "llama" and architecture == "gemma3":  # pieces of spaces stored as spaces; GemmaTokenizer spells
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]  # them "▁"
    silent = [t for t, ty in zip(tokens, types) if ty not in PRINTED_TYPES[kind]]
    if kind == "gpt2":
        backend, pre = _byte_level(fields, tokens, silent, where)
        add_bos = fields.get("tokenizer.ggml.add_bos_token", pre.add_bos)
    else:
        backend = _sentencepiece(fields, tokens, architecture, unk_id, silent, where)
        add_bos = fields.get("tokenizer.ggml.add_bos_token", True)  # llama.cpp's default for SentencePiece
    add_eos = fields.get("tokenizer.ggml.add_eos_token", False)
    _check_added(fields, {"bos": add_bos, "eos": add_eos}, len(tokens), where)
    # Phi-3's tokens matched whole (user-defined ones too: its "</s>") take the whitespace after them (rstrip),
    # <unk>, <s> and <|endoftext|> aside, as its tokenizer_config.json and llama.cpp (by general.name) have it
    phi3 = any(n in str(fields.get("general.name") or "").lower() for n in ("phi-3", "phi3"))

    def added(text: str, special: bool) -> AddedToken:
        return AddedToken(text, special=special, normalized=False,
                          rstrip=phi3 and text not in ("<unk>", "<s>", "<|endoftext|>"))

    backend.add_special_tokens([added(t, True) for t, ty in zip(tokens, types) if ty in SPECIAL_TYPES])
    backend.add_tokens([added(t, False) for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED])
    # llama.cpp's tokenizer: BOS before, and where add_eos_token is set (embedding models), EOS after each text
    bos = tokens[bos_id] if add_bos and bos_id is not None else None
    eos = tokens[eos_id] if add_eos and eos_id is not None else None
    if bos is not None or eos is not None:
        single = " ".join(t for t in (bos, "$A", eos) if t is not None)
        pair = " ".join(t for t in (bos, "$A", eos, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if t)
        specials = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                               special_tokens=list(dict.fromkeys(specials)))
    return GGUFVocab(backend, template, tool_template, tokens[bos_id] if bos_id is not None else None,
                     tokens[eos_id] if eos_id is not None else None, eos_ids)


def _check_added(fields: Mapping[str, Any], added: Mapping[str, Any], count: int, where: str) -> None:
    """Refuse the file where a bos or eos is to be added (``added``: its add_<name>_token, or llama.cpp's default)
    and llama.cpp has none: neither the file's id among the ``count`` tokens nor its default for the tokenizer model
    (check_add_special_token in llama_vocab::impl::load). A byte-level file without one that has 12 tokens or more
    loads: llama.cpp takes 11, kestrel none (``DEFAULT_IDS``)."""
    for name, add in added.items():
        if not add or _special_id(fields, name, count, where) is not None:
            continue
        byte_level = fields.get("tokenizer.ggml.model") == "gpt2"
        if byte_level and LLAMA_CPP_BYTE_LEVEL_ID < count and not (
                name == "bos" and fields.get("tokenizer.ggml.pre") in NO_DEFAULT_BOS_PRE):
            continue
        raise KestrelError(f"{where}: tokenizer.ggml.add_{name}_token is true, but tokenizer.ggml.{name}_token_id "
                           f"names none of its {count} tokens (llama.cpp refuses the file too)")


def _regex_literal(text: str) -> str:
    """``text`` matched as it is by a tokenizers (Oniguruma) regex: every character but an ASCII letter or digit by
    its code point."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def _decoder(steps: Sequence[Any], silent: Sequence[str]) -> Any:
    """The decoder of ``steps``, first emptying each token whose text is one of ``silent``, as llama.cpp's
    token_to_piece gives an unused token no text (``PRINTED_TYPES``; each token is a string of its own at that step; a
    match costs well under a microsecond a token with 50,000 such texts). One flat sequence: llguidance reads what
    the decoder is from the steps in it."""
    pattern = "|".join(_regex_literal(t) for t in silent if t)
    if pattern:
        steps = [decoders.Replace(Regex(rf"\A(?:{pattern})\z"), ""), *steps]
    return steps[0] if len(steps) == 1 else decoders.Sequence(list(steps))


def _vocab(tokens: Sequence[str], where: str) -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise KestrelError(f"{where}: tokenizer.ggml.tokens holds the same token twice")
    return vocab


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], where: str, **options: Any) -> _Backend:
    try:
        return _Backend(models.BPE(vocab=vocab, merges=merges, **options))
    except Exception as exc:  # the Rust side raises plain Exception
        raise KestrelError(f"{where}: the embedded vocabulary is not a valid BPE ({one_line(exc)})") from None


def _byte_level(fields: Mapping[str, Any], tokens: list[str], silent: Sequence[str],
                where: str) -> tuple[_Backend, _Pre]:
    merges_raw = _str_list(fields, "tokenizer.ggml.merges", where)
    if not tokens or not merges_raw:
        raise KestrelError(f"{where}: the embedded vocabulary lacks tokens or merges")
    name = fields.get("tokenizer.ggml.pre", "default")
    if not isinstance(name, str) or name not in PRE:
        raise KestrelError(f"{where}: pre-tokenizer {name!r} is not supported "
                           f"(kestrel knows {', '.join(SUPPORTED_PRE)})")
    pre = PRE[name]
    vocab = _vocab(tokens, where)
    merges = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        if not sep or not a or not b:
            raise KestrelError(f"{where}: malformed merge {m[:80]!r}")
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise KestrelError(f"{where}: merge {m[:80]!r} names tokens outside the vocabulary")
        merges.append((a, b))
    backend = _bpe(vocab, merges, where, ignore_merges=pre.ignore_merges)
    if pre.splits:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False) for split in pre.splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            *([pre_tokenizers.Digits(individual_digits=True)] if pre.digits else []),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    backend.decoder = _decoder([decoders.ByteLevel()], silent)
    return backend, pre


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every split of a piece into two pieces of the
    vocabulary, ranked by the piece's score (best first; a tie by the shorter left, then right, part, then
    the order found), the splits of one piece ordered by their parts' ids. transformers recovers merges the
    same way, so both tokenize alike."""
    ids = {tok: i for i, tok in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    lengths = sorted({len(t) for t in tokens})
    found = []
    for piece, score in score_of.items():
        # both parts are pieces shorter than this one: at most ``part`` long (a long piece costs no more)
        part = lengths[bisect.bisect_left(lengths, len(piece)) - 1] if len(piece) > lengths[0] else 0
        cuts = range(max(1, len(piece) - part), min(len(piece), part + 1))
        splits = sorted(((piece[:i], piece[i:]) for i in cuts if piece[:i] in ids and piece[i:] in ids),
                        key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        found += [(score, left, right) for left, right in splits]
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in found]


def _sentencepiece(fields: Mapping[str, Any], tokens: list[str], architecture: str, unk_id: int | None,
                   silent: Sequence[str], where: str) -> _Backend:
    if not tokens:
        raise KestrelError(f"{where}: the embedded vocabulary lacks tokens")
    vocab = _vocab(tokens, where)
    if architecture == "gemma3":  # its scores do not follow its merges; the pieces' order does
        scores: Sequence[float] = [-float(i) for i in range(len(tokens))]
    else:
        scores = fields.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens) or not all(is_number(x) for x in scores):
            raise KestrelError(f"{where}: tokenizer.ggml.scores must be one number per token ({len(tokens)} "
                               "tokens)")
    options: dict[str, Any] = {"fuse_unk": True, "byte_fallback": True}
    if architecture == "gemma3" and unk_id is not None:
        options["unk_token"] = tokens[unk_id]
    backend = _bpe(vocab, sentencepiece_merges(tokens, scores), where, **options)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    prefix_space = fields.get("tokenizer.ggml.add_space_prefix", True) is not False
    if architecture == "gemma3":
        backend.normalizer = normalizers.Replace(" ", SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        prefix_space = False
    elif prefix_space:  # Llama 2's and Phi-3's own tokenizer.json: "  hi" keeps both of its spaces, and every
        # text between special tokens gets the prefix, as llama.cpp adds it after each special token
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    else:
        backend.normalizer = normalizers.Replace(" ", SPACE)
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = _decoder(steps, silent)
    return backend
