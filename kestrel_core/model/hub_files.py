"""The files of one commit of a Hub repository, fetched into the Hugging Face cache several at a time (``hub.py``
lists the repository and picks the files; ``CommitFiles.fetch`` brings them).

- Pinned: every file is requested at the commit the listing named, so a push while a model downloads cannot
  mix the files of two commits; ``refs/REVISION`` names that commit, as huggingface_hub records a download by
  a branch or tag name (by a commit it records none), so the name finds the snapshot offline afterwards.
- Several at a time: up to ``WORKERS`` files, as snapshot_download fetches them (without Xet storage each file
  is one HTTP download, which alone leaves most of a fast link idle).
- One metadata request a file: a file the cache lacks at the commit is asked for once (``get_hf_file_metadata``,
  which waits ``HF_HUB_ETAG_TIMEOUT`` and, timed out, is not tried again), and its blob is downloaded from that
  answer into the cache as hf_hub_download lays it out: blobs/ETAG, written as blobs/ETAG.<random>.incomplete
  first, and snapshots/COMMIT/NAME linking to it. hf_hub_download would ask again for itself, and where its
  request times out, ask again with limits of its own (60 s, five more times: minutes).
- One download a blob: names of the same content (one etag) share it, with ``force`` too.
- Stopped: Ctrl-C (which only the main thread receives) or a file that fails ends the fetch at once. The files
  not started never are; a download under way stops at its next chunk (one waiting for a read, once the read
  ends: a thread cannot be woken from another), a metadata request waiting to be tried again at once; the
  partial files are removed then and there, and nothing is moved into the cache after the fetch ended.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import urlsplit

from kestrel_core.errors import KestrelError

if TYPE_CHECKING:
    from huggingface_hub import HfFileMetadata

log = logging.getLogger(__name__)

# files fetched at a time: snapshot_download's max_workers
WORKERS = 8
# huggingface_hub's limits, in seconds: a request's answer (the listing, a file's metadata), and the wait between
# two reads of a download
ANSWER_LIMIT = "HF_HUB_ETAG_TIMEOUT"
READ_LIMIT = "HF_HUB_DOWNLOAD_TIMEOUT"
# a metadata request the Hub answers that it is busy or failing is tried again after these many seconds, as
# huggingface_hub's http_backoff tries one
RETRY_WAITS_S = (1.0, 2.0, 4.0, 8.0, 8.0)
RETRIED_STATUSES = (408, 429, 500, 502, 503, 504)
# an etag that names a blob file (the Hub's are hex digests), nothing that leaves the blobs folder
_ETAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class _Stopped(Exception):
    """The fetch ended (Ctrl-C, another file failed) while this file was being fetched."""


class _Run:
    """What the threads of one fetch share: ``stop``, set as it ends; the partial files being written; the
    download of each blob begun, by etag."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._partials: set[Path] = set()
        self._blobs: dict[str, Future[None]] = {}

    def end(self) -> list[Path]:
        """Ends the fetch: the partial files being written are removed (none is created after), and returned."""
        with self._lock:
            self.stop.set()
            partials = list(self._partials)
        _remove(partials)
        return partials

    def once(self, etag: str, download: Callable[[], None]) -> None:
        """``download()`` of the blob ``etag``, unless another thread of the fetch began it: then that one's
        outcome."""
        with self._lock:
            begun = self._blobs.get(etag)
            mine = begun is None
            if begun is None:
                begun = self._blobs[etag] = Future()
        if not mine:
            begun.result()
            return
        try:
            download()
        except BaseException as exc:
            begun.set_exception(exc)
            raise
        begun.set_result(None)

    @contextmanager
    def partial(self, blob: Path, name: str) -> Iterator[BinaryIO]:
        """A partial file of ``blob``, the file ``name``'s, open to be written: moved to ``blob`` as the block
        ends, removed where it fails; ``_Stopped`` where the fetch has ended, before or meanwhile."""
        path = blob.with_name(f"{blob.name}.{uuid.uuid4().hex[:8]}.incomplete")
        with self._lock:  # so that end() removes every partial file, and none is created after it
            if self.stop.is_set():
                raise _Stopped(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            file = path.open("wb")
            self._partials.add(path)
        try:
            with file:
                yield file
            with self._lock:
                if self.stop.is_set():
                    raise _Stopped(name)
                os.replace(path, blob)
        finally:
            with self._lock:
                self._partials.discard(path)
            path.unlink(missing_ok=True)


class _StoppingFile:
    """``file``, whose next write once ``stop`` is set ends the download writing it (``_Stopped``)."""

    def __init__(self, file: BinaryIO, stop: threading.Event, name: str) -> None:
        self._file = file
        self._stop = stop
        self._name = name

    def write(self, data: bytes) -> int:
        if self._stop.is_set():
            raise _Stopped(self._name)
        return self._file.write(data)

    def __getattr__(self, attr: str) -> Any:  # tell, seek, truncate, name: the file's own
        return getattr(self._file, attr)


@dataclass(frozen=True)
class CommitFiles:
    """The files of the commit ``commit`` of the repository ``repo``, which the name ``revision`` resolved to,
    from huggingface_hub at ``endpoint`` into the cache at ``cache_dir`` (None: huggingface_hub's defaults);
    ``model`` is the model as errors name it."""

    model: str
    repo: str
    revision: str
    commit: str
    endpoint: str | None = None
    cache_dir: str | None = None

    def fetch(self, names: Sequence[str], sizes: Mapping[str, int | None], force: bool) -> list[Path]:
        """The paths in the cache of the files ``names``, in that order, each downloaded where the cache lacks it
        at the commit, where ``force``, or where it is not the size ``sizes`` gives it (``_file``); the first
        error of a file (or a KeyboardInterrupt) as it is, once the fetch has ended."""
        self._record_ref()
        run = _Run()
        jobs = [(name, Future[Path]()) for name in names]
        pending = iter(jobs)
        take = threading.Lock()

        def work() -> None:
            while not run.stop.is_set():
                with take:
                    job = next(pending, None)
                if job is None:
                    return
                name, future = job
                if not future.set_running_or_notify_cancel():  # cancelled: the fetch has ended
                    continue
                try:
                    future.set_result(self._file(name, sizes[name], force, run))
                except BaseException as exc:  # the caller's thread raises it
                    future.set_exception(exc)

        futures = [future for _, future in jobs]
        try:
            for n in range(min(WORKERS, len(jobs))):
                threading.Thread(target=work, name=f"hub-fetch-{n}", daemon=True).start()
            wait(futures, return_when=FIRST_EXCEPTION)  # a Ctrl-C interrupts the wait
            failure = next((f.exception() for f in futures if f.done() and f.exception() is not None), None)
            if failure is not None:
                raise failure
        except BaseException:
            removed = run.end()
            for future in futures:
                future.cancel()  # those not started; a running one stops by itself (_Run)
            if removed:  # hf_xet writes a partial file by its path, so may create one again: removed at exit too
                atexit.register(_remove, removed)
            raise
        return [future.result() for future in futures]

    def _file(self, name: str, size: int | None, force: bool, run: _Run) -> Path:
        """The repository's file ``name`` in the cache at the commit: its blob downloaded where the cache lacks
        it, where ``force``, or where the cached copy is not ``size`` bytes (the Hub's size, None where
        unknown), as a download cut short or a damaged disk leaves it (hf_hub_download trusts any copy it has).
        A download that stopped coming is a KestrelError naming the file and the limit it waited."""
        from huggingface_hub import constants

        if not _is_inside(name):
            raise KestrelError(f"model {self.model}: the repository lists {name!r}, which is not a path inside it")
        pointer = self._snapshot() / name
        if not force and pointer.exists() and not _wrong_size(pointer, size):
            return pointer  # without a request
        try:
            meta = self._metadata(name, run.stop)
            blob = self._folder() / "blobs" / str(meta.etag)
            expected = meta.size if meta.size is not None else size
            if force or pointer.exists() or not blob.exists() or _wrong_size(blob, expected):
                run.once(str(meta.etag), lambda: self._download(name, meta, blob, run))
            _link(pointer, blob)
            return pointer
        except Exception as exc:
            if isinstance(exc, KestrelError) or timeout_of(exc) is None:
                raise
            raise KestrelError(
                f"model {self.model}: the Hub stopped sending {name}: nothing came for "
                f"{constants.HF_HUB_DOWNLOAD_TIMEOUT:g} s, nor after resuming {limit_hint(READ_LIMIT)}"
            ) from exc

    def _metadata(self, name: str, stop: threading.Event) -> HfFileMetadata:
        """The metadata of the file ``name`` at the commit (its etag names its blob in the cache), from one request
        that waits at most HF_HUB_ETAG_TIMEOUT: asked again only where the Hub answers that it is busy or failing
        (``RETRIED_STATUSES``), ``RETRY_WAITS_S`` apart, and not once the fetch has ended. The Hub's other
        answers are its errors (hub.py words them); a request that waited past its limit is a KestrelError naming
        the file and the limit."""
        from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
        from huggingface_hub.errors import HfHubHTTPError

        url = hf_hub_url(self.repo, name, revision=self.commit, endpoint=self.endpoint)
        waits = iter(RETRY_WAITS_S)
        while True:
            try:
                meta = get_hf_file_metadata(url, timeout=constants.HF_HUB_ETAG_TIMEOUT)
            except HfHubHTTPError as exc:
                busy = getattr(exc.response, "status_code", None) in RETRIED_STATUSES
                pause = next(waits, None) if busy else None
                if pause is None:
                    raise
                if stop.wait(pause):
                    raise _Stopped(name) from exc
                continue
            except Exception as exc:
                if timeout_of(exc) is None:
                    raise
                raise KestrelError(
                    f"model {self.model}: the Hub sent no answer to the request for {name}'s metadata in "
                    f"{constants.HF_HUB_ETAG_TIMEOUT:g} s {limit_hint(ANSWER_LIMIT)}"
                ) from exc
            if not _ETAG.fullmatch(meta.etag or ""):
                raise KestrelError(
                    f"model {self.model}: the answer for {name} has no ETag that can name its blob in the cache "
                    f"({meta.etag!r}): is HF_ENDPOINT a Hugging Face Hub?"
                )
            return meta

    def _download(self, name: str, meta: HfFileMetadata, blob: Path, run: _Run) -> None:
        """The blob ``blob`` of the file ``name``, whose metadata is ``meta``: from Xet storage by hf_xet where the
        file is stored there and hf_xet is installed, as hf_hub_download fetches it; else over HTTP from where
        ``meta`` locates it (``http_get``, which resumes a download that stops, five times in a row)."""
        from huggingface_hub import hf_hub_url
        from huggingface_hub.file_download import http_get, is_xet_available, xet_get
        from huggingface_hub.utils import build_hf_headers

        headers = build_hf_headers()
        with run.partial(blob, name) as file:
            if meta.xet_file_data is not None and is_xet_available():
                file.close()  # hf_xet writes it by its path
                xet_get(
                    incomplete_path=Path(file.name),
                    xet_file_data=meta.xet_file_data,
                    headers=headers,
                    expected_size=meta.size,
                    displayed_filename=name,
                )
                return
            if urlsplit(meta.location).netloc != urlsplit(hf_hub_url(self.repo, name, endpoint=self.endpoint)).netloc:
                headers.pop("authorization", None)  # a storage host's signed URL: the token stays with the Hub
            http_get(
                meta.location,
                _StoppingFile(file, run.stop, name),
                headers=headers,
                expected_size=meta.size,
                displayed_filename=name,
            )

    def _folder(self) -> Path:
        """The repository's folder in the cache, as hf_hub_download finds it."""
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name

        cache = Path(self.cache_dir or constants.HF_HUB_CACHE).expanduser().resolve()
        return cache / repo_folder_name(repo_id=self.repo, repo_type="model")

    def _snapshot(self) -> Path:
        return self._folder() / "snapshots" / self.commit

    def _record_ref(self) -> None:
        """refs/REVISION naming the commit (the cache's documented layout), written whole or not at all; a cache
        kestrel may not write (read-only, every file already there) keeps the one it has."""
        if self.revision == self.commit:
            return
        ref = self._folder() / "refs" / self.revision
        try:
            if ref.is_file() and ref.read_text() == self.commit:
                return
            ref.parent.mkdir(parents=True, exist_ok=True)
            staged = ref.with_name(f"{ref.name}.{uuid.uuid4().hex[:8]}.tmp")
            staged.write_text(self.commit)
            os.replace(staged, ref)
        except OSError as exc:
            log.debug("%s: not recording %s as %s: %s", self.repo, self.commit, ref, exc)


def _link(pointer: Path, blob: Path) -> None:
    """``pointer`` (snapshots/COMMIT/NAME) naming ``blob`` as hf_hub_download makes it: a link relative to its
    folder, or a copy where the file system has no links (Windows without developer mode); put in place whole."""
    target = os.path.relpath(blob, pointer.parent)
    if pointer.is_symlink() and os.readlink(pointer) == target:
        return
    pointer.parent.mkdir(parents=True, exist_ok=True)
    staged = pointer.with_name(f"{pointer.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        try:
            os.symlink(target, staged)
        except OSError:
            shutil.copyfile(blob, staged)
        os.replace(staged, pointer)
    finally:
        staged.unlink(missing_ok=True)


def _is_inside(name: str) -> bool:
    """Whether the repository path ``name`` joined to a folder stays inside it, on POSIX and on Windows: no
    absolute path, drive or ``..``."""
    parts = name.replace("\\", "/").split("/")
    return all(part not in ("", ".", "..") and ":" not in part for part in parts)


def _remove(paths: list[Path]) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:  # held open on Windows
            pass


def _wrong_size(path: Path, size: int | None) -> bool:
    """Whether the cached file ``path`` is not ``size`` bytes (None: unknown, so not wrong), said as a warning."""
    have = path.stat().st_size
    if size is None or have == size:
        return False
    log.warning("%s: %d bytes in the Hugging Face cache, %d on the Hub; downloading it again", path, have, size)
    return True


def timeout_of(exc: BaseException) -> BaseException | None:
    """The timeout ``exc`` is, or came from (its cause or context), whichever HTTP library huggingface_hub
    runs on: requests' ``Timeout``, httpx's ``TimeoutException``, the socket's ``TimeoutError``; None where
    there is none."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if any(c.__name__ in ("TimeoutError", "Timeout", "TimeoutException") for c in type(current).__mro__):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def limit_hint(limit: str) -> str:
    return f"({limit}: set it higher to wait longer)"
