"""One entry point for every model input: ``load_model(path, quant) -> LoadedModel``.

``None`` is the default model (SmolLM2-135M-Instruct, pulled on first use); a directory is a Hugging Face
checkpoint, or without a config.json the GGUF file it holds (``hub.directory_gguf``); a ``.gguf`` file is read
with gguf-py; a kestrel artifact (``.kst``) carries its own quantization, which wins over ``quant``. The
strip-caches of the default model, of Hugging Face directories and of GGUF files are cached as artifacts in
``$KESTREL_HOME/cache`` (model/cache.py says how entries are keyed), so only the first load of a checkpoint at
a quant mode reads, dequantizes and quantizes it; later loads map the artifact.
An entry of a GiB or more is written on a thread while the first load goes on with the model it built; the
interpreter waits for that thread at exit, and ``finish_cache_writes`` waits for it (or cancels it) sooner.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kestrel_core.artifact import ArtifactMeta
from kestrel_core.artifact_load import load_artifact
from kestrel_core.artifact_write import remove_stale_temps, save_artifact
from kestrel_core.errors import KestrelError, os_error, os_reason
from kestrel_core.model import cache as store
from kestrel_core.model.hub import directory_gguf, fetch, parse_hub_spec, redownload_hint
from kestrel_core.model.lora import Adapter, LoraPaths, LoraSource, read_adapters
from kestrel_core.model.pull import DEFAULT_MODEL, default_model_path, pull_default_model
from kestrel_core.model.quantize import parse_quant, quantize_model
from kestrel_core.model.tokenizer import NoTokenizer, Tokenizer
from kestrel_core.model.validate import check_regular_file
from kestrel_core.model.weights import Model
from kestrel_core.progress import Report, progress_bar
from kestrel_core.temps import LockFile, watch_signals

log = logging.getLogger("kestrel")

GGUF_MAGIC = b"GGUF"
CACHE_MODES = ("on", "read", "off")  # read: use a valid entry, never write one
BACKGROUND_WRITE_BYTES = 1 << 30  # cache entries this large are written on a thread (docs/performance.md)


@dataclass
class LoadedModel:
    model: Model
    tokenizer: Tokenizer | NoTokenizer
    source: str  # what was loaded, for messages and stats
    quant: str  # the quant mode the weights are in


def cache_dir() -> Path:
    return store.cache_dir()


def write_artifact(loaded: LoadedModel, path: str | os.PathLike[str], *, force: bool = False,
                   extra: dict[str, Any] | None = None, progress: Report | None = None) -> Path:
    """Save a loaded model (with its tokenizer and chat template, when it has them) as a kestrel artifact;
    ``progress``: a ``report(done, total)`` callback instead of the progress bar."""
    tok = loaded.tokenizer
    tokenizer_json = None if isinstance(tok, NoTokenizer) else tok.to_json_str()
    special = {} if isinstance(tok, NoTokenizer) else {"bos_token": tok.bos_token, "eos_token": tok.eos_token,
                                                       "tool_template": tok.tool_template}

    def save(report: Report) -> Path:
        return save_artifact(path, loaded.model, tokenizer_json=tokenizer_json, chat_template=tok.chat_template,
                             quant=loaded.quant, extra={"source": loaded.source, **(extra or {})}, force=force,
                             progress=report, **special)

    if progress is not None:
        return save(progress)
    with progress_bar(f"writing {Path(path).name}") as bar:
        return save(bar)


def _quantize(ckpt: Any, quant: str, what: str) -> Model:
    if getattr(ckpt, "fp4_experts", False) and parse_quant(quant).bits == 4:
        log.warning("%s: its experts are MXFP4 (FP4 codes, which int4's even steps cannot hold): %s re-rounds "
                    "them, q8 keeps them to its own rounding (docs/parity.md)", what, quant)
    with progress_bar(f"quantizing {what} ({quant})", unit="weights") as report:
        return quantize_model(ckpt, quant, progress=report)


def _load_hf(path: Path, quant: str, adapters: tuple[Adapter, ...] = ()) -> LoadedModel:
    from kestrel_core.model.hf import HFCheckpoint
    from kestrel_core.model.hf_config import llama_cpp_architecture

    ckpt: Any = HFCheckpoint(path)
    if adapters:
        ckpt = LoraSource(ckpt, adapters, llama_cpp_architecture(path))
    c = ckpt.config
    if (path / "tokenizer.json").is_file():
        tokenizer: Tokenizer | NoTokenizer = Tokenizer.from_hf_dir(path, bos_token_id=c.bos_token_id,
                                                                   eos_token_ids=c.eos_token_ids)
    else:  # token ids still work; text fails when it is asked for
        tokenizer = NoTokenizer(f"tokenizer.json is missing in {path}", c.vocab_size, c.eos_token_ids)
    return LoadedModel(_quantize(ckpt, quant, _named(path, adapters)), tokenizer, _named(path, adapters, str(path)),
                       quant)


def _named(path: Path, adapters: tuple[Adapter, ...], name: str | None = None) -> str:
    """A model's name (``path``'s, or ``name``), with its adapters'."""
    return (path.name if name is None else name) + "".join(f" + LoRA {a.path.name}" for a in adapters)


def _origins(path: Path, adapters: tuple[Adapter, ...]) -> list[str]:
    """What a cache entry is built from (recorded in it: ``kestrel cache`` finds the entries whose model is gone)."""
    return [str(p.resolve()) for p in (path, *(a.path for a in adapters))]


def _cached_entry(path: Path, key: str, stem: str, quant: str,
                  adapters: tuple[Adapter, ...]) -> tuple[Path, str, store.Slot]:
    """(entry, key, slot) of a checkpoint's cached artifact; a merge of adapters is a slot of its own, keyed on
    each one's files and scale, in order."""
    if adapters:
        key = hashlib.sha256(f"{key}+lora:{'+'.join(a.key for a in adapters)}".encode()).hexdigest()
        stem = f"{stem}+{store.adapter_stem([a.path for a in adapters])}"
    return store.cache_dir() / store.entry_name(stem, key[:16], quant), key, store.Slot(stem, quant)


def _load_hf_cached(path: Path, quant: str, mode: str, adapters: tuple[Adapter, ...] = ()) -> LoadedModel:
    try:
        key = store.hf_key(path, quant)
    except (OSError, KestrelError):  # not a readable checkpoint: the uncached load says what is wrong
        return _load_hf(path, quant, adapters)
    entry, key, slot = _cached_entry(path, key, store.hf_stem(path), quant, adapters)
    return _cached(entry, key, quant, slot, lambda: _load_hf(path, quant, adapters), _named(path, adapters, str(path)),
                   _origins(path, adapters), write=mode == "on")


def _load_gguf_cached(path: Path, quant: str, mode: str, adapters: tuple[Adapter, ...] = ()) -> LoadedModel:
    try:
        key = store.gguf_key(path, quant)
    except (OSError, KestrelError):  # not a readable GGUF file: the uncached load says what is wrong
        return _load_gguf(path, quant, adapters)
    entry, key, slot = _cached_entry(path, key, store.gguf_stem(path), quant, adapters)
    return _cached(entry, key, quant, slot, lambda: _load_gguf(path, quant, adapters),
                   _named(path, adapters, str(path)), _origins(path, adapters), write=mode == "on")


def _load_gguf(path: Path, quant: str, adapters: tuple[Adapter, ...] = ()) -> LoadedModel:
    from kestrel_core.model.gguf_reader import GGUFCheckpoint  # gguf-py is imported for GGUF files only

    gguf = GGUFCheckpoint(path)
    tokenizer = Tokenizer.from_gguf_vocab(gguf.tokenizer_fields(), where=str(path),
                                          architecture=str(gguf.field("general.architecture", "")))
    ckpt: Any = LoraSource(gguf, adapters, str(gguf.field("general.architecture"))) if adapters else gguf
    model = _quantize(ckpt, quant, _named(path, adapters))
    del ckpt, gguf  # drop the memory map before the caller goes on
    return LoadedModel(model, tokenizer, _named(path, adapters, str(path)), quant)


def _from_artifact(path: Path, quant: str | None, **options: Any) -> tuple[LoadedModel, ArtifactMeta]:
    with progress_bar(f"verifying {path.name}") as report:
        model, meta = load_artifact(path, progress=report, **options)
    if quant is not None and parse_quant(quant).name != meta.quant:
        log.warning("%s holds %s weights; using them (an artifact is not re-quantized, --quant %s ignored)",
                    path, meta.quant, quant)
    c = model.config
    if meta.tokenizer_json is None:
        tokenizer: Tokenizer | NoTokenizer = NoTokenizer(f"the artifact {path} carries none", c.vocab_size,
                                                         c.eos_token_ids)
    else:
        tokenizer = Tokenizer.from_json_str(meta.tokenizer_json, chat_template=meta.chat_template,
                                            tool_template=meta.tool_template,
                                            bos_token_id=c.bos_token_id, eos_token_ids=c.eos_token_ids,
                                            bos_token=meta.bos_token, eos_token=meta.eos_token)
    return LoadedModel(model, tokenizer, str(path), meta.quant), meta


def _load_artifact(path: Path, quant: str | None) -> LoadedModel:
    return _from_artifact(path, quant)[0]


def _read_cached(entry: Path, key: str, quant: str) -> LoadedModel | None:
    """The cache entry's model, or None (missing; or corrupt, stale, not a regular file: then removed, with a
    warning, so that it is rebuilt)."""
    kind = store.entry_kind(entry)
    if kind == "missing":
        return None
    if kind == "unreadable":
        log.warning("cannot read the cache directory %s; loading without it", entry.parent)
        return None
    if kind == "file":
        try:
            loaded, meta = _from_artifact(entry, quant, require_checksums=True)
            if meta.extra.get("cache_key") != key or meta.quant != quant:
                raise KestrelError("it was built from another checkpoint or quant mode")
            return loaded
        except KestrelError as exc:
            log.warning("rebuilding the cached strip-cache %s (%s)", entry, exc)
    else:
        log.warning("rebuilding the cached strip-cache %s (not a regular file)", entry)
    try:
        store.remove_entry(entry)
    except OSError as exc:
        log.warning("could not remove %s: %s", entry, os_reason(exc))
    return None


def _cached(entry: Path, key: str, quant: str, slot: store.Slot, build: Callable[[], LoadedModel], source: str,
            origins: list[str], write: bool = True) -> LoadedModel:
    """The model from cache ``entry`` if it holds ``key``; else ``build()`` it and (``write``) cache it.

    A fresh entry is written atomically (temp file, fsync, rename; see artifact_write.save_artifact). A small
    one is written before this returns and the model is then read back from it: its arrays become views of the
    page cache (shared, and not the process's own memory) instead of a second copy. A large one is written on
    a thread while the caller goes on with the model it has (``finish_cache_writes``). Entries of the same
    slot and mode under another key are removed. One process at a time builds a slot's entry: a load of the
    slot in another process waits for it (``_hold``), then reads the entry it wrote, or builds it itself where
    it wrote none.
    """
    for pending in [w for w in list(_writes.values()) if w.slot == slot]:  # this process writes the slot's entry
        pending.thread.join()
    if write:
        remove_stale_temps(entry.parent)  # writers that were killed outright, hit or miss
    hit = _read_cached(entry, key, quant)
    if hit is not None:
        return _from_source(hit, source, f"none came with {source}")
    lock = _hold(slot, entry, source) if write else None
    try:
        hit = None if lock is None else _read_cached(entry, key, quant)  # what the lock's last holder wrote
        if hit is not None:
            return _from_source(hit, source, f"none came with {source}")
        loaded = build()
        loaded.source = source
        if not write:
            return loaded
        extra = {"cache_key": key, "sources": origins}
        if loaded.model.nbytes >= BACKGROUND_WRITE_BYTES:
            _Write(loaded, entry, extra, slot, lock)
            lock = None  # the writer's thread lets it go
            return loaded
        if not _write_entry(loaded, entry, extra, slot, progress=None):
            return loaded
    finally:
        if lock is not None:
            lock.release()
    try:
        again, _ = _from_artifact(entry, quant, require_checksums=True)
    except KestrelError as exc:
        log.warning("could not read back the cached strip-cache %s: %s", entry, exc)
        return loaded
    return _from_source(again, source, getattr(loaded.tokenizer, "reason", ""))


def _hold(slot: store.Slot, entry: Path, source: str) -> LockFile | None:
    """The lock of ``slot``, waited for (saying so) while another process builds its entry; None where it cannot
    be had (a cache that cannot be written, a file system without flock): two loads may then both build it."""
    lock = slot.lock_file()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # _write_entry says why
    if lock.acquire(lambda: log.warning("waiting for another kestrel process to finish caching %s at %s", source,
                                        slot.quant)):
        return lock
    return None


def _from_source(loaded: LoadedModel, source: str, no_tokenizer: str) -> LoadedModel:
    """A model read from its cache entry, named by its source: so is a missing tokenizer's reason."""
    loaded.source = source
    if isinstance(loaded.tokenizer, NoTokenizer):
        loaded.tokenizer.reason = no_tokenizer
    return loaded


def _write_entry(loaded: LoadedModel, entry: Path, extra: dict[str, Any], slot: store.Slot,
                 progress: Report | None) -> bool:
    """Write cache ``entry`` (``extra``: its key and sources) and remove the slot's entries it supersedes (another
    key's, an older kestrel's: Slot.superseded); False (with a warning) where it cannot be written, which only
    costs speed. ``progress``: None shows a bar of its own."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        write_artifact(loaded, entry, force=True, extra=extra, progress=progress)
        for stale in slot.superseded(entry):
            stale.unlink(missing_ok=True)
    except _Cancelled:
        return False
    except (OSError, KestrelError) as exc:  # a read-only or full cache only costs speed
        log.warning("could not cache the quantized model in %s: %s", entry,
                    os_error(exc) if isinstance(exc, OSError) else exc)
        return False
    return True


class _Cancelled(KestrelError):
    pass


class _Write:
    """A cache entry written on a thread of its own (not a daemon: the interpreter waits for it at exit)."""

    def __init__(self, loaded: LoadedModel, entry: Path, extra: dict[str, Any], slot: store.Slot,
                 lock: LockFile | None) -> None:
        self.entry, self.slot, self.lock = entry, slot, lock
        self.done, self.total = 0, 1
        self.cancel = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(loaded, extra), name=f"kestrel cache {entry.name}")
        _writes[entry] = self
        watch_signals()  # from the starting thread: the writer's own cannot install the handler
        self.thread.start()

    def _report(self, done: int, total: int) -> None:
        if self.cancel.is_set():
            raise _Cancelled("cancelled")  # save_artifact removes its temp file
        self.done, self.total = done, total

    def _run(self, loaded: LoadedModel, extra: dict[str, Any]) -> None:
        try:
            _write_entry(loaded, self.entry, extra, self.slot, progress=self._report)
        except Exception as exc:  # nobody catches on this thread: one warning, not a traceback
            log.warning("could not cache the quantized model in %s: %s: %s", self.entry, type(exc).__name__, exc)
        finally:
            if self.lock is not None:
                self.lock.release()
            _writes.pop(self.entry, None)


_writes: dict[Path, _Write] = {}


def finish_cache_writes(*, cancel: bool = False) -> None:
    """Wait for the cache entries this process is writing on threads (a progress bar after a second), or with
    ``cancel`` stop them (no entry, no temp file is left)."""
    for w in list(_writes.values()):
        if cancel:
            w.cancel.set()
            w.thread.join()
            continue
        with progress_bar(f"writing the cache entry {w.entry.name}") as report:
            while w.thread.is_alive():
                report(w.done, w.total)
                w.thread.join(0.1)


def _load_default(quant: str, adapters: tuple[Adapter, ...] = ()) -> LoadedModel:
    """The default model from its cache entry, pulled (when its file is missing or changed) only to build one."""
    gguf_path = default_model_path()
    # keyed on the source bytes (the pinned hash, so an entry is found without the file), what is read of a GGUF
    # file (its key scheme: an entry holds the tokenizer and the ends of generation), the quant mode, the format and
    # the kestrel version (its quantizer)
    stem = DEFAULT_MODEL.filename
    source_key = f"{store.GGUF_KEY_SCHEME}:{DEFAULT_MODEL.member_sha256}"
    if not adapters:
        entry = store.cache_dir() / store.entry_name(stem, DEFAULT_MODEL.member_sha256[:12], quant)
        key, slot = source_key, store.Slot(stem, quant)
    else:
        entry, key, slot = _cached_entry(gguf_path, source_key, stem, quant, adapters)
    return _cached(entry, key, quant, slot, lambda: _load_gguf(pull_default_model(progress=True), quant, adapters),
                   _named(gguf_path, adapters, f"SmolLM2-135M-Instruct ({gguf_path})"), _origins(gguf_path, adapters))


def _sniff(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError as exc:
        raise os_error(exc, "cannot read", path) from None


def load_model(path: str | os.PathLike[str] | None = None, quant: str | None = "q8", *,
               cache: str = "on", lora: LoraPaths | None = None,
               lora_scale: float | Sequence[float] = 1.0) -> LoadedModel:
    """Load a model and its tokenizer, quantized to ``quant`` (default q8; an artifact keeps its own).

    ``cache`` (Hugging Face directories and GGUF files): "on" reads and writes the cached artifact, "read" uses
    a valid one but never writes one (``kestrel quantize`` writes its own), "off" neither;
    ``KESTREL_MODEL_CACHE=0`` means "off" whatever is asked. The default model is always cached (its artifact
    is small). ``lora``: a LoRA adapter (a PEFT directory or llama.cpp's GGUF adapter), or a list of them,
    merged into the weights before they are quantized, each one's delta added in order, its scale times
    ``lora_scale`` (one for all of them, or a list: one each; kestrel_core.model.lora); the merge is cached in a
    slot of its own."""
    mode = parse_quant("q8" if quant is None else quant).name  # an unknown mode fails before any heavy work
    if cache not in CACHE_MODES:
        raise KestrelError(f"cache must be one of {', '.join(CACHE_MODES)}, got {cache!r}")
    adapters = () if lora is None else read_adapters(lora, lora_scale)
    if path is None:
        return _load_default(mode, adapters)
    p = Path(path).expanduser()
    try:
        present = p.exists()
    except OSError as exc:  # a name too long, a directory it may not search: no Hub name either
        raise os_error(exc, "cannot read the model", p) from None
    if present:
        return _load_path(p, _checkpoint_mode(p, quant, mode, adapters), quant, cache, adapters)
    spec = parse_hub_spec(str(path))
    if spec is None:
        raise KestrelError(f"model {path} does not exist (give a Hugging Face model directory or Hub name such "
                           "as Qwen/Qwen3-0.6B, a .gguf file or a .kst artifact)")
    fetched = fetch(spec)
    try:
        loaded = _load_path(fetched, _checkpoint_mode(fetched, quant, mode, adapters), quant, cache, adapters)
    except KestrelError as exc:
        way_out = redownload_hint(spec, exc)
        if way_out is None:
            raise
        raise KestrelError(f"{exc}; {way_out}") from exc
    return replace(loaded, source=_named(fetched, adapters, f"{spec} ({fetched})"))


def _checkpoint_mode(p: Path, quant: str | None, mode: str, adapters: tuple[Adapter, ...]) -> str:
    """``mode``, or where no quant was asked for, a Hugging Face directory's own (int_quant.natural_quant: q4 for a
    symmetric 4-bit checkpoint, whose codes q4 holds as they are). Merged with adapters, the weights are not
    those codes: ``mode``, as for float weights."""
    if quant is not None or not (p / "config.json").is_file():
        return mode
    from kestrel_core.model.hf import HFCheckpoint
    from kestrel_core.model.hf_config import read_json
    from kestrel_core.model.int_quant import natural_quant

    try:
        config = read_json(p / "config.json")
        natural = natural_quant(config.get("quantization_config") if isinstance(config, dict) else None)
        if natural is None or not HFCheckpoint(p).projections_integer():  # its tensors' headers only
            return mode
    except KestrelError:  # the load says what is wrong with it
        return mode
    if adapters:
        log.info("%s: symmetric 4-bit weights with a LoRA adapter merged in, loaded at %s as float weights are (the "
                 "merged weights are off the 4-bit grid; --quant says otherwise)", p, mode)
        return mode
    log.info("%s: symmetric 4-bit weights, loaded at %s (their codes as they are; --quant says otherwise)", p, natural)
    return natural


def _load_path(p: Path, mode: str, quant: str | None, cache: str, adapters: tuple[Adapter, ...] = ()) -> LoadedModel:
    cached = cache != "off" and store.model_cache_enabled()
    if p.is_dir():
        gguf = None if (p / "config.json").is_file() else directory_gguf(p)
        if gguf is None:
            return _load_hf_cached(p, mode, cache, adapters) if cached else _load_hf(p, mode, adapters)
        p = gguf
    check_regular_file(p)  # a FIFO would block the open below forever
    if not os.access(p, os.R_OK):
        raise KestrelError(f"cannot read {p}: permission denied")
    magic = _sniff(p)
    if magic == GGUF_MAGIC:
        return _load_gguf_cached(p, mode, cache, adapters) if cached else _load_gguf(p, mode, adapters)
    if p.suffix.lower() == ".gguf":
        raise KestrelError(f"{p}: not a GGUF file (bad magic {magic!r}; truncated or corrupt?)")
    if p.suffix.lower() == ".kst" or p.suffix.lower() == ".safetensors":
        if adapters:
            raise KestrelError(f"{p}: a LoRA adapter merges into a checkpoint's float weights (a Hugging Face "
                               "directory or a GGUF file); an artifact's are quantized already")
        return _load_artifact(p, quant)
    raise KestrelError(f"{p}: unrecognised model file (expected a Hugging Face model directory, a .gguf file "
                       "or a .kst artifact)")
