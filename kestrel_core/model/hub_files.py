"""The files of one commit of a Hub repository, fetched into the Hugging Face cache several at a time (``hub.py``
lists the repository and picks the files; ``CommitFiles.fetch`` brings them).

- Pinned: every file is requested at the commit the listing named, so a push while a model downloads cannot
  mix the files of two commits; ``refs/REVISION`` names that commit, as huggingface_hub records a download by
  a branch or tag name (by a commit it records none), so the name finds the snapshot offline afterwards.
- Several at a time: up to ``WORKERS`` files, as snapshot_download fetches them (without Xet storage each file
  is one HTTP download, which alone leaves most of a fast link idle).
- Bounded: hf_hub_download asks again for the metadata of a file its cache lacks when the first request times
  out, with limits of its own (60 s, five more times: minutes); so a file that is to be downloaded is first
  asked for with one request of kestrel's own (``get_hf_file_metadata``, which does not try again) that waits
  ``HF_HUB_ETAG_TIMEOUT``.
- Ctrl-C (which only the main thread receives) or a file that fails ends the fetch at once: the files not
  started never are, the downloads under way are left to their threads (daemons, which a process that ends
  does not wait for), and the partial files those were writing are removed, then and again as the process
  exits (one still in its metadata request creates its file later).
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from pathlib import Path

from kestrel_core.errors import KestrelError

log = logging.getLogger(__name__)

# files fetched at a time: snapshot_download's max_workers
WORKERS = 8
# huggingface_hub's limits, in seconds: a request's answer (the listing, a file's metadata), and the wait between
# two reads of a download
ANSWER_LIMIT = "HF_HUB_ETAG_TIMEOUT"
READ_LIMIT = "HF_HUB_DOWNLOAD_TIMEOUT"


class _Stopped(Exception):
    """The fetch ended (Ctrl-C, another file failed) before this file's download began."""


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
        stop = threading.Event()
        writing: dict[str, str] = {}  # a file being downloaded -> its etag, which names the partial file
        jobs = [(name, Future[Path]()) for name in names]
        pending = iter(jobs)
        take = threading.Lock()

        def work() -> None:
            while not stop.is_set():
                with take:
                    job = next(pending, None)
                if job is None:
                    return
                name, future = job
                if not future.set_running_or_notify_cancel():  # cancelled: the fetch has ended
                    continue
                try:
                    future.set_result(self._file(name, sizes[name], force, stop, writing))
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
            stop.set()
            for future in futures:
                future.cancel()  # those not started; a running one cannot be, its thread is left to end
            running = [writing[name] for name, future in jobs if future.running() and name in writing]
            self._remove_partial(running)
            # a download still in its own metadata request creates its partial file after this: removed at exit
            # too, which ends that thread with the process
            atexit.register(self._remove_partial, running)
            raise
        return [future.result() for future in futures]

    def _file(self, name: str, size: int | None, force: bool, stop: threading.Event, writing: dict[str, str]) -> Path:
        """The repository's file ``name`` in the cache at the commit: downloaded where the cache lacks it there,
        where ``force``, or where the cached copy is not ``size`` bytes (the Hub's size, None where unknown), as
        a download cut short or a damaged disk leaves it (hf_hub_download trusts any copy it has). Before a
        download, its metadata (``_metadata``; its etag goes to ``writing``), and nothing more once ``stop`` is
        set. A request that timed out is a KestrelError naming the file and the limit it waited."""
        from huggingface_hub import constants, hf_hub_download

        def download(again: bool) -> Path:
            if again or not self._snapshot().joinpath(name).exists():  # otherwise no request is made
                etag = self._metadata(name)
                if etag is not None:
                    writing[name] = etag
                if stop.is_set():
                    raise _Stopped(name)
            return Path(
                hf_hub_download(
                    self.repo,
                    name,
                    revision=self.commit,
                    cache_dir=self.cache_dir,
                    endpoint=self.endpoint,
                    force_download=again,
                    etag_timeout=constants.HF_HUB_ETAG_TIMEOUT,
                )
            )

        try:
            path = download(force)
            return download(True) if not force and _wrong_size(path, size) else path
        except KestrelError:
            raise
        except Exception as exc:
            timeout = timeout_of(exc)
            if timeout is None:
                raise
            if timeout is exc:  # raised by the download itself, once its resumes gave up
                raise KestrelError(
                    f"model {self.model}: the Hub stopped sending {name}: nothing came for "
                    f"{constants.HF_HUB_DOWNLOAD_TIMEOUT:g} s, nor after resuming "
                    f"{limit_hint(READ_LIMIT)}"
                ) from exc
            # hf_hub_download's own metadata request, which it reports as a file it cannot locate
            raise self._no_metadata(name) from exc

    def _metadata(self, name: str) -> str | None:
        """The etag of the file ``name`` at the commit (the name of its blob in the cache), from one request that
        waits at most HF_HUB_ETAG_TIMEOUT and is not tried again; None where the Hub answers with an error,
        which hf_hub_download then meets and reports (trying again where it is one worth it, a 429 or a 5xx)."""
        from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url

        url = hf_hub_url(self.repo, name, revision=self.commit, endpoint=self.endpoint)
        try:
            return get_hf_file_metadata(url, timeout=constants.HF_HUB_ETAG_TIMEOUT).etag
        except Exception as exc:
            if timeout_of(exc) is None:
                return None
            raise self._no_metadata(name) from exc

    def _no_metadata(self, name: str) -> KestrelError:
        # no seconds said: where kestrel's request was answered and hf_hub_download's own, made right after it,
        # was not, huggingface_hub tried that one again with limits of its own
        return KestrelError(
            f"model {self.model}: the Hub sent no answer to the request for {name}'s metadata "
            f"{limit_hint(ANSWER_LIMIT)}"
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

    def _remove_partial(self, etags: list[str]) -> None:
        """The partial files of the downloads of blobs ``etags`` that a fetch left to their threads: each writes
        blobs/ETAG.<random>.incomplete (blobs/ETAG.incomplete before huggingface_hub 1.x), which it removes
        itself only if its read ends."""
        blobs = self._folder() / "blobs"
        for etag in etags:
            for partial in glob.glob(str(blobs / f"{glob.escape(etag)}*.incomplete")):
                try:
                    os.unlink(partial)
                except OSError:  # gone already (its download ended), or held open on Windows
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
