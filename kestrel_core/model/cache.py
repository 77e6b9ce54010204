"""Where quantized models are cached as artifacts (``$KESTREL_HOME/cache``), and how entries are named.

Three kinds of entries: the default model's (keyed on its GGUF's pinned sha256), Hugging Face directories'
(keyed on the checkpoint's files, below) and GGUF files' (keyed on the file's size, mtime_ns and its whole
header: metadata and tensor infos). Each entry is a ``.kst`` with checksums whose metadata records the
key it was built for; the loader (``loader._cached``) reads it, rebuilds it when it is missing, corrupt or not
a regular file, and writes it atomically.

The key of a Hugging Face directory is cheap to compute on every load, so a cache hit stays fast: the full
contents of the small files kestrel reads besides the weights (config.json, generation_config.json, the
shard index, tokenizer.json, tokenizer_config.json, chat_template.jinja, modules.json and the configs of the
Pooling modules it names; an absent one counts as absent; a processor's chat_template.json where there is one),
and for each safetensors shard its name, size, mtime_ns and its header (the tensor names, dtypes, shapes and
offsets), plus the quant mode. Hashing the weights themselves would cost a full read of the checkpoint
(16 GB for an 8B BF16 model) on every load. What the key misses: a weight file rewritten in place with the
same size, the same header and its mtime put back (for a GGUF file too).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kestrel_core import __version__
from kestrel_core.artifact import FORMAT_VERSION, MAX_HEADER_BYTES, read_meta
from kestrel_core.env import env_flag, env_str
from kestrel_core.errors import KestrelError, os_error
from kestrel_core.locks import remove_unheld
from kestrel_core.model.hf import weight_files
from kestrel_core.model.pull import home_error, kestrel_home
from kestrel_core.model.tokenizer import PROCESSOR_TEMPLATE
from kestrel_core.model.validate import check_regular_file
from kestrel_core.temps import LockFile, Temp

MODEL_CACHE_ENV = "KESTREL_MODEL_CACHE"  # 0 (off, no, false): never cache Hugging Face directories or GGUF files
RENAMED_ENV = {"KESTREL_HF_CACHE": MODEL_CACHE_ENV}
HF_KEY_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja", "modules.json")
LOCK_SUFFIX = ".lock"
KEY_SCHEME = "kestrel-hf-cache-6"  # bump when what goes into a directory's key, or what is read of it, changes
GGUF_KEY_SCHEME = "kestrel-gguf-cache-9"


def cache_dir() -> Path:
    return kestrel_home() / "cache"


def model_cache_enabled() -> bool:
    """Whether Hugging Face directories and GGUF files are cached (the default model always is)."""
    for old, new in RENAMED_ENV.items():
        if env_str(old):
            raise KestrelError(f"{old} was renamed {new}; set that instead")
    return env_flag(MODEL_CACHE_ENV, default=True)


def entry_name(stem: str, key: str, quant: str) -> str:
    """``<stem>.<key>.<quant>.v<format>.kestrel-<version>.kst``: the artifact format and the kestrel version
    (its quantizer) are part of every entry's name."""
    return f"{stem}.{key}.{quant}.v{FORMAT_VERSION}.kestrel-{__version__}.kst"


@dataclass(frozen=True)
class Slot:
    """The entries of one model (``stem``: with its adapters) at one quant mode, under any key, format or
    version; one process at a time builds its entry, holding the slot's lock file (``.<stem>.<quant>.lock``)."""

    stem: str
    quant: str

    def pattern(self) -> str:
        """A glob for the slot's entries."""
        return f"{glob.escape(self.stem)}.*.{glob.escape(self.quant)}.v*.kst"

    def lock_file(self) -> LockFile:
        return LockFile(cache_dir() / f".{self.stem}.{self.quant}{LOCK_SUFFIX}")

    def superseded(self, entry: Path) -> list[Path]:
        """The slot's entries that ``entry``, this kestrel's, replaces: this version's under another key, and older
        versions'. Never a newer kestrel's, nor one whose version cannot be ordered against this one's: kestrel
        versions sharing a KESTREL_HOME each keep their own."""
        found = []
        for path in entry.parent.glob(self.pattern()):
            theirs = _written_by(path)
            if path != entry and (theirs == __version__ or _order(theirs) == "older"):
                found.append(path)
        return found


def _written_by(entry: Path) -> str:
    """The kestrel version an entry's name says wrote it."""
    return entry.name.rpartition(".kestrel-")[2].removesuffix(".kst")


def _order(version: str) -> str | None:
    """"older", "newer" or "same" against this kestrel's version; None where either cannot be ordered."""
    ours, theirs = _release(__version__), _release(version)
    if ours is None or theirs is None:
        return None
    return "older" if theirs < ours else "newer" if theirs > ours else "same"


def _release(version: str) -> tuple[int, ...] | None:
    """The numbers a version starts with, trailing zeros dropped ("0.10.0rc1" -> (0, 10)), to order versions by;
    None where it starts with none."""
    numbers = re.match(r"\d+(?:\.\d+)*", version)
    if numbers is None:
        return None
    release = [int(n) for n in numbers.group().split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    return tuple(release)


def hf_stem(model_dir: Path) -> str:
    """One slot per checkpoint directory: its name (made file-name safe) and a hash of its absolute path. A
    new key for the same directory replaces the slot's old entries."""
    return _stem("hf", model_dir)


def gguf_stem(path: Path) -> str:
    """One slot per GGUF file, as ``hf_stem`` for directories."""
    return _stem("gguf", path)


def adapter_stem(paths: Sequence[Path]) -> str:
    """The LoRA adapters' part of a merged model's slot, as ``hf_stem``: their names and a hash of their absolute
    paths, in order."""
    return _stem("lora", *paths)


def _stem(kind: str, *paths: Path) -> str:
    resolved = [p.resolve() for p in paths]
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", "+".join(p.name for p in resolved))[:64] or "model"
    digest = hashlib.sha256(b"\0".join(os.fsencode(p) for p in resolved)).hexdigest()[:12]  # any bytes Linux allows
    return f"{kind}-{name}.{digest}"


def gguf_key(path: Path, quant: str) -> str:
    """The content key of a GGUF file at ``quant`` (of every part of a split one): each part's size, mtime_ns and
    header bytes (up to the tensor data, found by the reader's bounds walk); KestrelError or OSError where it is
    not a readable GGUF file."""
    from kestrel_core.model.gguf_bounds import check_gguf_bounds, split_parts  # the GGUF path only

    h = hashlib.sha256(f"{GGUF_KEY_SCHEME}\0{quant}\0".encode())
    for part in split_parts(path):
        data_start = check_gguf_bounds(part)
        with open(part, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(data_start)
        h.update(f"{st.st_size}\0{st.st_mtime_ns}\0".encode())
        h.update(head)
    return h.hexdigest()


def hf_key(model_dir: Path, quant: str) -> str:
    """The content key of a Hugging Face directory at ``quant`` (see the module docstring); OSError or
    KestrelError where the directory cannot be read as a checkpoint."""
    h = hashlib.sha256(f"{KEY_SCHEME}\0{quant}\0".encode())
    # the processor's chat template only where present, so that the keys of the directories without one stay
    extra = [PROCESSOR_TEMPLATE] if (model_dir / PROCESSOR_TEMPLATE).exists() else []
    for name in (*HF_KEY_FILES, *extra, *_pooling_configs(model_dir)):
        try:  # not a FIFO, a device or a link out of the directory (loading it says why)
            digest = hashlib.sha256(check_regular_file(model_dir / name, model_dir).read_bytes()).hexdigest()
        except KestrelError:
            digest = "absent"
        h.update(f"{name}\0{digest}\0".encode())
    for shard in weight_files(model_dir):
        p = model_dir / shard
        with open(p, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            head += f.read(min(n, MAX_HEADER_BYTES))
        h.update(f"{shard}\0{st.st_size}\0{st.st_mtime_ns}\0{hashlib.sha256(head).hexdigest()}\0".encode())
    return h.hexdigest()


def _pooling_configs(model_dir: Path) -> list[str]:
    """The configs of the Pooling modules ``modules.json`` names, wherever it puts them (unread where it cannot
    be read: loading the directory says why)."""
    try:
        modules = json.loads(check_regular_file(model_dir / "modules.json", model_dir).read_text(encoding="utf-8"))
    except (KestrelError, OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []
    if not isinstance(modules, list):
        return []
    return [f"{m['path']}/config.json" for m in modules if isinstance(m, dict) and isinstance(m.get("path"), str)
            and isinstance(m.get("type"), str) and m["type"].endswith("Pooling") and m["path"]]


def entry_kind(path: Path) -> str:
    """"missing", "file" (a regular file, not a symlink), "other" (a directory, a link, a FIFO...) or
    "unreadable" (its directory cannot be searched)."""
    try:
        st = path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except OSError:
        return "unreadable"
    return "file" if stat.S_ISREG(st.st_mode) else "other"


def remove_entry(path: Path) -> None:
    """Remove whatever sits at ``path`` (an entry's name in kestrel's own cache directory): a directory with
    its contents, anything else (a symlink: not its target) unlinked. OSError when that fails."""
    st = path.lstat()
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        path.unlink()


@dataclass(frozen=True)
class CacheEntry:
    """One quantized model in the cache: the model (and adapter) it was built from, as recorded in it (empty: an
    entry written before kestrel recorded them), its quant mode ("?": unreadable), bytes and last use."""

    path: Path
    sources: tuple[str, ...]
    quant: str
    size: int
    used: float

    @property
    def orphaned(self) -> bool:
        """No load can read it again: what it was built from is gone, or it is not a readable entry (a newer
        kestrel's may be one that only that kestrel reads: never orphaned for being unreadable here)."""
        if self.quant == "?":
            return _order(_written_by(self.path)) != "newer"
        return any(not Path(s).exists() for s in self.sources)


def cache_entries() -> list[CacheEntry]:
    """The entries of ``$KESTREL_HOME/cache``, the most recently used first; none where it does not exist. A
    cache directory that cannot be listed, or whose entries cannot be looked at, is a KestrelError naming it:
    never an empty cache (``Path.glob`` makes it one), which ``--clear`` would report as cleared."""
    directory = cache_dir()
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise home_error(exc, "cannot read the model cache", directory) from None
    entries = []
    for path in (directory / name for name in names if name.endswith(".kst")):
        try:
            st = path.lstat()
        except FileNotFoundError:  # removed since it was listed
            continue
        except OSError as exc:
            raise home_error(exc, "cannot read the model cache", directory) from None
        try:
            meta = read_meta(path)
            sources, quant = meta.extra.get("sources") or [], meta.quant
            if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
                raise KestrelError(f"{path}: its sources are not a list of paths")  # not what kestrel writes
        except (KestrelError, OSError):  # corrupt, truncated, not a file: a load rebuilds it
            sources, quant = [], "?"
        entries.append(CacheEntry(path, tuple(sources), quant, st.st_size,
                                  max(st.st_atime, st.st_mtime)))
    return sorted(entries, key=lambda e: -e.used)


def cache_temps() -> list[Temp]:
    """The temp files in ``$KESTREL_HOME/cache``: entries being written, and what writers that died left."""
    from kestrel_core.artifact_write import artifact_temps

    return artifact_temps(cache_dir())


def prune_cache(everything: bool = False) -> tuple[list[CacheEntry], list[Temp]]:
    """Remove the orphaned entries (``everything``: all of them) and the temp files of writers that died (never a
    live writer's); the ones removed. A model loaded again is quantized again. The slots' lock files that
    processes killed while building an entry left go too (no process holds them)."""
    from kestrel_core.artifact_write import remove_stale_temps

    removed = [e for e in cache_entries() if everything or e.orphaned]
    for e in removed:
        try:
            remove_entry(e.path)
        except OSError as exc:  # a read-only KESTREL_HOME
            raise os_error(exc, "cannot remove the cache entry", e.path) from exc
    for lock in cache_dir().glob(f".*{LOCK_SUFFIX}"):
        remove_unheld(lock)
    return removed, remove_stale_temps(cache_dir())
