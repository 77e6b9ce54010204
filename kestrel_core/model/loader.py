"""One entry point for every model input: ``load_model(path, quant) -> LoadedModel``.

``None`` is the default model (SmolLM2-135M-Instruct, pulled on first use; its strip-cache is cached as an
artifact in ``$KESTREL_HOME/cache`` because reading a GGUF's vocabulary and re-quantizing it takes seconds);
a directory is a Hugging Face checkpoint; a ``.gguf`` file is read with gguf-py; a kestrel artifact
(``.kst``) carries its own quantization, which wins over ``quant``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kestrel_core import __version__
from kestrel_core.artifact import FORMAT_VERSION, load_artifact, save_artifact
from kestrel_core.errors import KestrelError
from kestrel_core.model.pull import DEFAULT_MODEL, kestrel_home, pull_default_model
from kestrel_core.model.quantize import parse_quant, quantize_model
from kestrel_core.model.tokenizer import NoTokenizer, Tokenizer
from kestrel_core.model.weights import Model

log = logging.getLogger("kestrel")

GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedModel:
    model: Model
    tokenizer: Tokenizer | NoTokenizer
    source: str  # what was loaded, for messages and stats
    quant: str  # the quant mode the weights are in


def cache_dir() -> Path:
    return kestrel_home() / "cache"


def write_artifact(loaded: LoadedModel, path: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Save a loaded model (with its tokenizer and chat template, when it has them) as a kestrel artifact."""
    tok = loaded.tokenizer
    tokenizer_json = None if isinstance(tok, NoTokenizer) else tok.to_json_str()
    return save_artifact(path, loaded.model, tokenizer_json=tokenizer_json, chat_template=tok.chat_template,
                         quant=loaded.quant, extra={"source": loaded.source}, force=force)


def _load_hf(path: Path, quant: str) -> LoadedModel:
    from kestrel_core.model.hf import HFCheckpoint

    ckpt = HFCheckpoint(path)
    c = ckpt.config
    if (path / "tokenizer.json").is_file():
        tokenizer: Tokenizer | NoTokenizer = Tokenizer.from_hf_dir(path, bos_token_id=c.bos_token_id,
                                                                   eos_token_ids=c.eos_token_ids)
    else:  # token ids still work; text fails when it is asked for
        tokenizer = NoTokenizer(f"tokenizer.json is missing in {path}", c.vocab_size, c.eos_token_ids)
    return LoadedModel(quantize_model(ckpt, quant), tokenizer, str(path), quant)


def _load_gguf(path: Path, quant: str) -> LoadedModel:
    from kestrel_core.model.gguf_reader import GGUFCheckpoint  # gguf-py is imported for GGUF files only

    ckpt = GGUFCheckpoint(path)
    tokenizer = Tokenizer.from_gguf_vocab(ckpt.tokenizer_fields(), where=str(path))
    model = quantize_model(ckpt, quant)
    del ckpt  # drop the memory map before the caller goes on
    return LoadedModel(model, tokenizer, str(path), quant)


def _load_artifact(path: Path, quant: str | None) -> LoadedModel:
    model, meta = load_artifact(path)
    if quant is not None and parse_quant(quant).name != meta.quant:
        log.warning("%s holds %s weights; using them (an artifact is not re-quantized, --quant %s ignored)",
                    path, meta.quant, quant)
    c = model.config
    if meta.tokenizer_json is None:
        tokenizer: Tokenizer | NoTokenizer = NoTokenizer(f"the artifact {path} carries none", c.vocab_size,
                                                         c.eos_token_ids)
    else:
        tokenizer = Tokenizer.from_json_str(meta.tokenizer_json, chat_template=meta.chat_template,
                                            bos_token_id=c.bos_token_id, eos_token_ids=c.eos_token_ids)
    return LoadedModel(model, tokenizer, str(path), meta.quant)


def _load_default(quant: str) -> LoadedModel:
    gguf_path = pull_default_model(progress=True)
    # keyed on the source bytes, the quant mode, the format and the kestrel version (its quantizer)
    cached = cache_dir() / (f"{DEFAULT_MODEL.filename}.{DEFAULT_MODEL.member_sha256[:12]}.{quant}"
                            f".v{FORMAT_VERSION}.kestrel-{__version__}.kst")
    source = f"SmolLM2-135M-Instruct ({gguf_path})"
    if cached.is_file():
        try:
            loaded = _load_artifact(cached, quant)
            loaded.source = source
            return loaded
        except KestrelError as exc:  # our own cache: rebuild it
            log.warning("rebuilding the cached strip-cache %s (%s)", cached, exc)
    loaded = _load_gguf(gguf_path, quant)
    loaded.source = source
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_artifact(loaded, cached, force=True)
        # entries of this model and mode from other kestrel / format versions are stale now
        for stale in cached.parent.glob(f"{DEFAULT_MODEL.filename}.*.{quant}.v*.kst"):
            if stale != cached:
                stale.unlink(missing_ok=True)
    except OSError as exc:  # a read-only cache only costs speed
        log.warning("could not cache the quantized model in %s: %s", cached, exc)
    return loaded


def _sniff(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError as exc:
        raise KestrelError(f"{path}: cannot read it ({exc.strerror or exc})") from None


def load_model(path: str | os.PathLike[str] | None = None, quant: str | None = "q8") -> LoadedModel:
    """Load a model and its tokenizer, quantized to ``quant`` (default q8; an artifact keeps its own)."""
    mode = parse_quant(quant or "q8").name  # an unknown mode fails before any heavy work
    if path is None:
        return _load_default(mode)
    p = Path(path).expanduser()
    if not p.exists():
        raise KestrelError(f"model {path} does not exist (give a Hugging Face model directory, a .gguf file "
                           "or a .kst artifact)")
    if p.is_dir():
        return _load_hf(p, mode)
    if not os.access(p, os.R_OK):
        raise KestrelError(f"{p}: cannot read it (permission denied)")
    magic = _sniff(p)
    if magic == GGUF_MAGIC:
        return _load_gguf(p, mode)
    if p.suffix.lower() == ".gguf":
        raise KestrelError(f"{p}: not a GGUF file (bad magic {magic!r}; truncated or corrupt?)")
    if p.suffix.lower() == ".kst" or p.suffix.lower() == ".safetensors":
        return _load_artifact(p, quant)
    raise KestrelError(f"{p}: unrecognised model file (expected a Hugging Face model directory, a .gguf file "
                       "or a .kst artifact)")
