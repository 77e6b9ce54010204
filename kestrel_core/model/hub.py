"""Models by name from the Hugging Face Hub: ``kestrel run -m Qwen/Qwen3-0.6B``.

A model that is not a local path but reads ``owner/name`` (``hf.co/`` or ``https://huggingface.co/`` before it
allowed, ``@revision`` and ``:TAG`` after it) is fetched with ``huggingface_hub`` into its cache (``HF_HOME``,
shared with transformers and vLLM; ``HF_TOKEN`` for gated or private repositories), and the local path is
loaded like any other:

- a repository of safetensors weights: only what kestrel reads (``*.safetensors``, the JSON configs and
  tokenizer files, a sentence-transformers pooling config), never a pickle checkpoint or code;
- a repository of GGUF files: the one whose name holds ``TAG`` then ``.`` or ``-`` (``Q4_K_M``, as llama.cpp's
  ``-hf``), else the most precise of the usual quantizations, Q8_0 first (kestrel's q8 codes are Q8_0's own);
  never a model's companion (``mmproj-F16.gguf``, a vision projector).

Offline (``HF_HUB_OFFLINE=1``, the Hub unreachable, or silent for ``HF_HUB_ETAG_TIMEOUT`` seconds) a model
already in the cache is used as it is; so it is where the Hub answers with an error other than an unknown
revision, as ``hf_hub_download`` does. A cached file whose size is not the one the Hub lists is downloaded again
(``force``: every file is).

The files come from the commit the listing named, several at a time (``hub_files``). Every request waits a
bounded time: the listing and each file's metadata ``HF_HUB_ETAG_TIMEOUT`` seconds, a download
``HF_HUB_DOWNLOAD_TIMEOUT`` seconds between two reads (so a slow download that keeps coming is never cut off); a
request that waits past its limit is one line naming what stalled and the variable that raises it.
"""

from __future__ import annotations

import glob
import json
import logging
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kestrel_core.env import env_int
from kestrel_core.errors import KestrelError, os_error, os_reason, safe_text
from kestrel_core.model.hub_files import ANSWER_LIMIT, READ_LIMIT, CommitFiles, limit_hint, timeout_of

log = logging.getLogger(__name__)

HUB_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/")
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_TAG = re.compile(r"[A-Za-z0-9._-]+")
_SPEC = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[A-Za-z0-9._/-]+?))?(?::(?P<tag>{_TAG.pattern}))?$")
# besides its weights, what a safetensors repository needs: configs (a sentence-transformers pooling one in its
# folder too: fnmatch's * crosses /), tokenizer, chat template
CONFIG_PATTERNS = ("*.json", "tokenizer.model", "*.jinja")
INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# a GGUF repository without a tag: the most precise first (kestrel requantizes to q8 or q4 as it loads)
GGUF_PREFERENCE = ("Q8_0", "F16", "BF16", "F32", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_0")
# what marks a GGUF file as a model's companion, not a model, in its name, as llama.cpp's gguf_filename_is_model
# (common/download.cpp) tells them apart: a vision projector, an importance matrix, a speculative draft head
COMPANION_MARKS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
# a commit's name as the Hub gives it, which names its snapshot folder in the cache (so nothing that leaves it)
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHARD = re.compile(r"-\d{5}-of-\d{5}$")
_SHARD_FIRST = re.compile(r"-00001-of-\d{5}$")


def is_model_gguf(path: str) -> bool:
    """A GGUF file that is a model: not one whose name (case as it is, as llama.cpp reads it) has a
    COMPANION_MARKS."""
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(mark in name for mark in COMPANION_MARKS)


def _is_part(gguf: str) -> bool:
    """A part of a GGUF file split into parts (``m-Q8_0-00001-of-00003.gguf``)."""
    return _SHARD.search(gguf[:-5]) is not None


def _parts(gguf: str) -> list[str]:
    """The repository paths of every part of the GGUF file ``gguf`` (itself where it is whole)."""
    from kestrel_core.model.gguf_bounds import split_parts  # gguf-py, for GGUF files only

    return [Path(gguf).with_name(p.name).as_posix() for p in split_parts(Path(gguf))]


@dataclass(frozen=True)
class HubSpec:
    """A model named on the Hub: ``owner/name[@revision][:tag]``."""

    repo: str
    revision: str | None = None
    tag: str | None = None

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "") + (f":{self.tag}" if self.tag else "")


def parse_hub_spec(text: str) -> HubSpec | None:
    """``text`` as a Hub model name, or None where it is not one."""
    for prefix in HUB_PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    m = _SPEC.match(text.rstrip("/"))
    if m is None or ".." in text:
        return None
    return HubSpec(m["repo"], m["revision"], m["tag"])


@dataclass(frozen=True)
class Hub:
    """``huggingface_hub`` (imported on first use) at ``endpoint`` (None: ``HF_ENDPOINT`` or huggingface.co)
    with its cache at ``cache_dir`` (None: ``HF_HUB_CACHE``)."""

    endpoint: str | None = None
    cache_dir: str | None = None

    def fetch(self, spec: HubSpec, force: bool = False) -> Path:
        """The local path of the model ``spec`` names (a snapshot directory or a GGUF file), downloaded into the
        cache unless it is there with the size the Hub lists (``force``: downloaded again whatever the cache
        holds); a KestrelError of one line where it cannot be had."""
        _check_limits()
        try:
            from huggingface_hub import HfApi, constants
            from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError
        except ImportError as exc:  # a dependency, so only a broken install lacks it
            raise KestrelError(f"model {spec}: no such local path, and huggingface_hub, which fetches models by "
                               f"Hub name, cannot be imported ({exc}); pip install huggingface_hub") from None

        if constants.HF_HUB_OFFLINE:
            return self._cached(spec, "HF_HUB_OFFLINE is set", quiet=True, force=force)
        try:  # repo_info: one request (list_repo_files retries an unreachable Hub for half a minute), which
            # waits as long as hf_hub_download's own metadata request does: a Hub that takes the connection and
            # never answers (a stalled proxy) ends in the cache too
            info = HfApi(endpoint=self.endpoint).repo_info(spec.repo, revision=spec.revision, files_metadata=True,
                                                           timeout=constants.HF_HUB_ETAG_TIMEOUT)
            sizes = {s.rfilename: s.size for s in info.siblings or ()}
        except RevisionNotFoundError as exc:  # the repository is there, the revision is not (hf_hub_download's too)
            raise KestrelError(_refusal(spec, exc)) from exc
        except HfHubHTTPError as exc:
            # down (5xx), rate-limiting (429), gated or private without a token, or no such repository (the Hub's
            # answer to a private one without a valid token): the cached copy, as hf_hub_download serves it
            return self._cached(spec, refusal=_refusal(spec, exc), force=force)
        except Exception as exc:  # the Hub cannot be reached (no network, DNS) or is silent
            if timeout_of(exc) is not None:
                why = (f"the Hub sent no answer to the listing of {spec.repo} in {constants.HF_HUB_ETAG_TIMEOUT:g} s "
                       f"{limit_hint(ANSWER_LIMIT)}")
            else:
                why = f"the Hub cannot be reached: {_first_line(exc)}"
            return self._cached(spec, why, force=force)
        if info.sha is not None and not (isinstance(info.sha, str) and _COMMIT.fullmatch(info.sha)):
            raise KestrelError(f"model {spec}: the Hub's listing names its commit {safe_text(info.sha, quoted=True)}, "
                               "not a commit hash that can name a snapshot in the cache: is HF_ENDPOINT a Hugging "
                               "Face Hub?")
        kind, chosen = choose_files(spec, list(sizes))
        # the listing's commit, which every file is fetched at (a name such as main may move meanwhile)
        files = CommitFiles(str(spec), spec.repo, spec.revision or constants.DEFAULT_REVISION,
                            info.sha or spec.revision or constants.DEFAULT_REVISION, self.endpoint, self.cache_dir)
        try:
            return self._download(spec, kind, chosen, sizes, files, force)
        except KestrelError:
            raise
        except HfHubHTTPError as exc:
            raise KestrelError(_refusal(spec, exc)) from exc
        except Exception as exc:
            raise KestrelError(f"model {spec}: downloading it failed ({_first_line(exc)})") from exc

    def _download(self, spec: HubSpec, kind: str, chosen: str, sizes: dict[str, int | None], files: CommitFiles,
                  force: bool) -> Path:
        """The GGUF file ``chosen``, or the snapshot of the weights kestrel reads (hf.weight_files: the shards
        the index names, else the top-level ``*.safetensors``; not a consolidated copy beside the shards) and
        ``CONFIG_PATTERNS``, of the repository whose files have ``sizes``, fetched by ``files``. From the
        listing ``fetch`` made: snapshot_download would list the repository again, without a timeout."""
        from huggingface_hub.utils import filter_repo_objects

        listed = list(sizes)
        if kind == "gguf":  # every part of a split file, into one snapshot directory
            missing = [p for p in _parts(chosen) if p not in listed]
            if missing:
                raise KestrelError(f"model {spec}: {chosen} is split into parts, and the repository lacks {missing[0]}")
            return files.fetch(_parts(chosen), sizes, force)[0]
        if INDEX in listed:
            (index_path,) = files.fetch([INDEX], sizes, force)
            weights = _index_weights(json.loads(index_path.read_text(encoding="utf-8")))
            if weights is None:
                raise KestrelError(f"model {spec}: {INDEX} has no weight_map")
            stray = next((w for w in weights if w not in listed or not w.endswith(".safetensors") or "/" in w), None)
            if stray is not None:
                raise KestrelError(f"model {spec}: {INDEX} names {stray!r}, not a safetensors file of the repository")
        else:
            weights = [f for f in listed if f.endswith(".safetensors") and "/" not in f]
        # the names as themselves, not as patterns
        patterns = [*(glob.escape(w) for w in weights), *CONFIG_PATTERNS]
        names = list(filter_repo_objects(listed, allow_patterns=patterns))
        first = files.fetch(names, sizes, force)[0]
        return first.parents[names[0].count("/")]  # the snapshot directory that holds it

    def _cached(self, spec: HubSpec, why: str = "", refusal: str = "", quiet: bool = False,
                force: bool = False) -> Path:
        """The model from the cache alone, the Hub not having listed it (``why``; or ``refusal``, the Hub's answer,
        which is the error where the cache lacks it): the files of its snapshot there (the cache's documented
        layout, models--OWNER--NAME/refs/REV and snapshots/COMMIT) decide its kind. Unless ``quiet``, a warning
        says the cached copy is used and why; where ``force`` (the cached copy is what is to be replaced), the
        error."""
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name

        if force:
            raise KestrelError(refusal or f"model {spec}: downloading it again needs the Hub, and {why}")

        folder = Path(self.cache_dir or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=spec.repo, repo_type="model")
        rev = spec.revision or "main"
        try:
            commit = rev if _COMMIT.fullmatch(rev) else (folder / "refs" / rev).read_text().strip()
        except OSError:
            commit = ""
        snap = folder / "snapshots" / commit
        files = [p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file()] if commit else []
        if not files:
            raise KestrelError(refusal or f"model {spec}: no such local path, not in the Hugging Face cache, and {why}")
        try:
            kind, chosen = choose_files(spec, files, where="the Hugging Face cache")
        except KestrelError as exc:
            raise KestrelError(f"{exc}, and the Hub's list is unknown: {refusal or why}") from None
        lacking = _lacking(snap, kind, chosen, files)
        if lacking is not None:  # a download that failed part way
            raise KestrelError(f"model {spec}: the Hugging Face cache holds it without {lacking}; {refusal or why}")
        if not quiet:
            log.warning("%s; loading the copy in the Hugging Face cache", refusal or f"model {spec}: {why}")
        return snap / chosen if kind == "gguf" else snap


@dataclass(frozen=True)
class CachedModel:
    """A model in the Hugging Face cache that kestrel can load by ``name``."""

    name: str  # owner/name, @ref where it is not main, :TAG for a GGUF file
    kind: str  # "safetensors" or "gguf"
    path: Path  # the snapshot directory or the GGUF file
    size: int  # bytes on disk
    modified: float  # seconds since the epoch


def cached_models(cache_dir: str | None = None) -> list[CachedModel]:
    """Every model of the Hugging Face cache (``cache_dir``, None: ``HF_HUB_CACHE``) kestrel can load, by name:
    a safetensors snapshot, and each GGUF file of one; what it cannot load (datasets, pickle checkpoints) is
    left out, and so is a model whose folder cannot be read, which a warning names."""
    _check_limits()
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    where = cache_dir or constants.HF_HUB_CACHE
    try:
        repos = scan_cache_dir(cache_dir).repos
    except CacheNotFound:  # nothing downloaded yet
        return []
    except OSError:  # scan_cache_dir gives up on the first folder it may not read (a warning only for a corrupt one)
        repos = frozenset(_scan_folders(where))
    except ValueError:  # huggingface_hub's answer to a file in the directory's place
        raise KestrelError(f"cannot read the Hugging Face cache {where}: not a directory") from None
    found = []
    for repo in repos:
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            files = {f.file_path.relative_to(rev.snapshot_path).as_posix(): f for f in rev.files}
            for ref in sorted(rev.refs) or [rev.commit_hash]:
                base = repo.repo_id + ("" if ref == "main" else f"@{ref}")
                found += _loadable(HubSpec(repo.repo_id), base, rev.snapshot_path, files)
    return sorted(found, key=lambda m: m.name.lower())


def _scan_folders(where: str) -> list[Any]:
    """The CachedRepoInfo of each model folder of the cache ``where`` that can be read, scanned one at a time as
    ``scan_cache_dir`` scans them; one warning names those that cannot be. An error where ``where`` itself cannot
    be read."""
    from huggingface_hub.utils import CorruptedCacheException
    from huggingface_hub.utils._cache_manager import _scan_cached_repo  # scan_cache_dir's scan of one folder

    root = Path(where).expanduser().resolve()  # as scan_cache_dir gives its paths
    try:
        folders = sorted(p for p in root.iterdir() if p.name.startswith("models--"))
    except OSError as exc:
        raise os_error(exc, "cannot read the Hugging Face cache", where) from None
    repos, unreadable = [], []
    for folder in folders:
        try:
            repos.append(_scan_cached_repo(folder))
        except CorruptedCacheException:  # not a download kestrel can load, as scan_cache_dir leaves it out
            continue
        except OSError as exc:
            unreadable.append(f"{folder.name} ({os_reason(exc)})")
    if unreadable:
        log.warning("cannot read %s in the Hugging Face cache %s: %s left out", ", ".join(unreadable), where,
                    "its models are" if len(unreadable) == 1 else "their models are")
    return repos


def _loadable(spec: HubSpec, base: str, snap: Path, files: dict[str, Any]) -> list[CachedModel]:
    try:
        kind, _ = choose_files(spec, list(files))
    except KestrelError:
        return []
    if kind == "safetensors":
        if _lacking(snap, kind, "", files) is not None:
            return []
        return [CachedModel(base, kind, snap, sum(f.size_on_disk for f in files.values()),
                            max(f.blob_last_modified for f in files.values()))]
    out = []
    for name in files:
        if not is_model_gguf(name) or (_is_part(name) and _SHARD_FIRST.search(name[:-5]) is None):
            continue
        parts = [files[p] for p in _parts(name) if p in files]
        if len(parts) < len(_parts(name)):
            continue  # a split file not all of whose parts are here
        tag = _tag_picking(spec, name, list(files))
        out.append(CachedModel(f"{base}:{tag}" if tag else f"{base} ({name})", "gguf", snap / name,
                               sum(f.size_on_disk for f in parts), max(f.blob_last_modified for f in parts)))
    return out


def _index_weights(index: object) -> list[str] | None:
    """The files a safetensors index (``INDEX``'s JSON) names in its weight_map; None where it has none."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    return sorted({str(v) for v in weight_map.values()}) if isinstance(weight_map, dict) else None


def _lacking(snap: Path, kind: str, chosen: str, files: Collection[str]) -> str | None:
    """The first file the model needs that the cached snapshot ``snap`` (holding ``files``) lacks: a part of
    the split GGUF ``chosen``, a shard the safetensors index names; None where it has them all."""
    if kind == "gguf":
        needed = _parts(chosen)
    elif INDEX in files:
        try:
            needed = _index_weights(json.loads((snap / INDEX).read_text(encoding="utf-8"))) or []
        except (OSError, ValueError):  # the load says what is wrong with the index
            return None
    else:
        return None
    return next((f for f in needed if f not in files), None)


def _tag_picking(spec: HubSpec, name: str, files: list[str]) -> str | None:
    """A ``:TAG`` that picks the GGUF file ``name`` among ``files``: its quantization, else its file name's stem;
    None where neither picks it (another file answers to both)."""
    stem = _SHARD.sub("", name[:-5])
    ggufs = [f for f in files if is_model_gguf(f)]
    for tag in (gguf_tag(stem + ".gguf"), stem.rsplit("/", 1)[-1]):
        if tag and _TAG.fullmatch(tag) and _pick_gguf(HubSpec(spec.repo, tag=tag), ggufs) == name:
            return tag
    return None


def gguf_tag(filename: str) -> str | None:
    """The quantization a GGUF file's name holds, as a ``:TAG`` picks it ("m-Q4_K_M.gguf" -> "Q4_K_M")."""
    m = re.search(r"(?:^|[._-])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?=[._-]|$)", Path(filename).stem, re.IGNORECASE)
    return m[1] if m else None


def fetch(spec: HubSpec, force: bool = False) -> Path:
    """``Hub().fetch(spec, force)``: the Hub and cache the environment names."""
    return Hub().fetch(spec, force)


def directory_gguf(directory: Path) -> Path | None:
    """The GGUF file a directory without a config.json holds as its model (at its top or a folder down, as a
    Hub repository holds the parts of a split one), picked as a repository's is (``choose_files``), except that
    files no quantization tells apart are an error naming them; None where it holds no GGUF file."""
    found = [p for p in (*directory.glob("*"), *directory.glob("*/*")) if p.name.lower().endswith(".gguf")]
    if not found:
        return None
    files = sorted(p.relative_to(directory).as_posix() for p in found)
    return directory / choose_files(HubSpec(str(directory)), files, where="the directory", by_name=False)[1]


def redownload_hint(spec: HubSpec, exc: KestrelError) -> str | None:
    """The way out of ``exc``, an error loading the model ``spec`` from the cache, where it says a file is
    truncated or corrupt (a download cut short, a damaged disk): None for any other error."""
    if re.search(r"truncated|corrupt", str(exc)) is None:
        return None
    return f"`kestrel pull --force {spec}` downloads it again"


def choose_files(spec: HubSpec, files: Sequence[str], where: str = "the repository",
                 by_name: bool = True) -> tuple[str, str]:
    """("safetensors", "") or ("gguf", the file) for a repository holding ``files``; a KestrelError saying
    what is missing otherwise (of ``files``, what ``where`` holds: the repository, or the cache's copy of it).
    ``by_name``: as ``_pick_gguf``'s."""
    ggufs = [f for f in files if is_model_gguf(f)]
    if spec.tag is None and "config.json" in files and any(f.endswith(".safetensors") for f in files):
        return "safetensors", ""
    if ggufs:
        return "gguf", _pick_gguf(spec, ggufs, where, by_name)
    if any(f.lower().endswith(".gguf") for f in files):
        raise KestrelError(f"model {spec}: its GGUF files are a model's companions (a vision projector, an "
                           "importance matrix, a draft head), not a model")
    if spec.tag is not None:
        raise KestrelError(f"model {spec}: {where} has no GGUF file to pick by the tag {spec.tag!r}")
    if any(f.lower().endswith(PICKLE_SUFFIXES) for f in files):
        raise KestrelError(f"model {spec}: its weights are pickle checkpoints (.bin, .pt), which kestrel never "
                           "loads (loading one can run code); use a repository of safetensors or GGUF weights")
    raise KestrelError(f"model {spec}: {where} has neither safetensors weights with a config.json nor a GGUF "
                       "file")


def _pick_gguf(spec: HubSpec, ggufs: list[str], where: str = "the repository", by_name: bool = True) -> str:
    """The GGUF file of ``spec``'s tag, or the most precise usual one: the file of that very quantization before
    one that also names it (``m-Q4_0-F16.gguf`` for F16), a whole file before the first part of a split one;
    then (``by_name``) the shorter name, the first by name. Without ``by_name``, files these rules do not tell
    apart are a KestrelError naming them."""
    def has(f: str, quant: str) -> bool:  # as llama.cpp's find_best_model: "." or "-" after it (Q6_K is not Q6_K_L)
        stem = _SHARD.sub("", f[:-5]).lower()
        return re.search(rf"(^|[._/-]){re.escape(quant.lower())}([.-]|$)", stem) is not None

    def rank(f: str, quant: str) -> tuple[bool, bool, int, str]:
        return ((gguf_tag(f) or "").lower() != quant.lower(), _is_part(f), len(f), f)

    def alike(files: list[str]) -> KestrelError:
        return KestrelError(f"model {spec}: {where} holds several GGUF files no quantization tells apart "
                            f"({', '.join(files)}); give the path of the one to load")

    loadable = [f for f in ggufs if not _is_part(f) or _SHARD_FIRST.search(f[:-5])]  # whole, or a first part
    wanted = [spec.tag] if spec.tag is not None else list(GGUF_PREFERENCE)
    for quant in wanted:
        hits = sorted((f for f in loadable if has(f, quant)), key=lambda f: rank(f, quant))
        if not by_name and len(hits) > 1 and rank(hits[0], quant)[:2] == rank(hits[1], quant)[:2]:
            raise alike([f for f in hits if rank(f, quant)[:2] == rank(hits[0], quant)[:2]])
        if hits:
            return hits[0]
    if spec.tag is not None:
        listed = ", ".join(sorted(ggufs)[:6]) + (", ..." if len(ggufs) > 6 else "")
        raise KestrelError(f"model {spec}: no GGUF file for the tag {spec.tag!r} ({where} has {listed})")
    if not loadable:
        raise KestrelError(f"model {spec}: its GGUF files are later parts of split ones ({ggufs[0]}, ...) without "
                           "their first parts")
    if not by_name and len(loadable) > 1:
        raise alike(sorted(loadable))
    return sorted(loadable, key=lambda f: (_is_part(f), f))[0]


def _refusal(spec: HubSpec, exc: Exception) -> str:
    """One line for the Hub's answer ``exc`` (an HfHubHTTPError), with the reason the Hub gave (huggingface_hub
    keeps it apart from its own words as ``server_message``)."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    said = safe_text(getattr(exc, "server_message", None) or "")
    if isinstance(exc, GatedRepoError):
        return (f"model {spec} is gated: accept its terms on huggingface.co/{spec.repo}, then set HF_TOKEN "
                "(or run `hf auth login`)" + (f"; the Hub says: {said}" if said else ""))
    if isinstance(exc, RepositoryNotFoundError):
        return (f"model {spec}: no such local path, and no such repository on the Hugging Face Hub (a private one "
                "needs HF_TOKEN)")
    if isinstance(exc, RevisionNotFoundError):
        return f"model {spec}: the repository has no revision {spec.revision!r}"
    response = getattr(exc, "response", None)
    if response is None:
        return f"model {spec}: the Hugging Face Hub refused it ({_first_line(exc)})"
    reason = getattr(response, "reason_phrase", None) or getattr(response, "reason", None) or ""  # httpx's, requests'
    status = f"{response.status_code} {reason}".strip()
    token = "; check HF_TOKEN" if response.status_code == 401 else ""
    return f"model {spec}: the Hugging Face Hub refused it ({status}{f': {said}' if said else ''}{token})"


def _check_limits() -> None:
    """``ANSWER_LIMIT`` and ``READ_LIMIT`` as huggingface_hub reads them: a value its ``int()`` refuses fails its
    import with a ValueError, so it is one line naming the variable before that."""
    for limit in (ANSWER_LIMIT, READ_LIMIT):
        env_int(limit, 10, what="a whole number of seconds")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
