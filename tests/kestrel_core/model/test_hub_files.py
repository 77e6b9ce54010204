"""The files of a model by Hub name (kestrel_core/model/hub_files.py): all of the commit the listing named,
several at a time, one metadata request and one download a blob, and a fetch ended (Ctrl-C, a file that fails)
stops its downloads and leaves no part of them. Against the Hub on 127.0.0.1 (fake_hub) through the real
``huggingface_hub`` client; where a metadata request is to be answered at a given moment, its
``get_hf_file_metadata`` is a stand-in."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from kestrel_core.errors import KestrelError
from kestrel_core.model.hub import Hub, HubSpec
from kestrel_core.model.hub_files import WORKERS

from ..waits import HANG_GUARD_S, within
from .fake_hub import FakeHub, repo_files, serving

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
# more files than are fetched at a time, each of its own content (a blob of its own)
MANY = {"config.json": b"{}", "model.safetensors": b"weights"} | {
    f"extra-{n:02}.json": f'{{"n": {n}}}'.encode() for n in range(WORKERS + 2)
}


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with serving(FakeHub({"org/tiny": repo_files(FIXTURES / "tiny-qwen3"), "org/many": dict(MANY)})) as h:
        yield h


def test_the_files_are_the_listed_commits_though_main_moves_meanwhile(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push between kestrel's listing and its downloads: every file is the listed commit's, in that commit's
    snapshot, which main names in the cache (so the Hub unreachable, it is the one loaded); the next fetch gets
    the new commit, downloading only the file the push changed."""
    from huggingface_hub import HfApi

    listed, before = hub.sha("org/tiny"), dict(hub.repos["org/tiny"])
    pushed = before | {"config.json": before["config.json"].replace(b"{", b'{"pushed": true, ', 1)}
    list_repository = HfApi.repo_info

    def listing_then_push(self: HfApi, *args: object, **kwargs: object) -> object:
        info = list_repository(self, *args, **kwargs)
        hub.repos["org/tiny"] = pushed
        return info

    monkeypatch.setattr(HfApi, "repo_info", listing_then_push)
    h = Hub(hub.url, str(tmp_path))
    snap = h.fetch(HubSpec("org/tiny"))
    assert snap.name == listed
    assert {p.name: p.read_bytes() for p in snap.iterdir()} == {
        n: before[n] for n in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    }
    assert (tmp_path / "models--org--tiny" / "refs" / "main").read_text() == listed
    assert Hub("http://127.0.0.1:9", str(tmp_path)).fetch(HubSpec("org/tiny")) == snap

    monkeypatch.setattr(HfApi, "repo_info", list_repository)
    hub.served.clear()
    moved = h.fetch(HubSpec("org/tiny"))
    assert moved.name == hub.sha("org/tiny") != listed
    assert (moved / "config.json").read_bytes() == pushed["config.json"]
    assert hub.served == ["org/tiny/config.json"]  # the other files: the blobs the cache holds


def test_the_files_are_fetched_several_at_a_time(hub: FakeHub, tmp_path: Path) -> None:
    """As snapshot_download fetches them: WORKERS downloads under way at once (each held by the Hub until they
    all are), and not more."""
    hub.holding["/org/many/resolve/*"] = 1
    under_way: list[int] = []

    def release_when_full() -> None:
        deadline = time.monotonic() + HANG_GUARD_S  # a guard: one download at a time would be held for ever
        while len(hub.held) < WORKERS and time.monotonic() < deadline:
            time.sleep(0.01)
        under_way.append(len(hub.held))
        hub.release.set()

    threading.Thread(target=release_when_full, daemon=True).start()
    snap = within(HANG_GUARD_S, lambda: Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/many")))
    assert isinstance(snap, Path) and {p.name: p.read_bytes() for p in snap.iterdir()} == MANY
    assert under_way == [WORKERS]


def test_each_file_is_asked_for_once_and_downloaded_once(hub: FakeHub, tmp_path: Path) -> None:
    """One metadata request (HEAD) a file the cache lacks, whose answer the download goes by, and one download
    (GET); none for a file the cache holds at the commit."""
    h = Hub(hub.url, str(tmp_path))
    snap = h.fetch(HubSpec("org/many"))
    assert sorted(hub.asked) == sorted(hub.served) == sorted(f"org/many/{name}" for name in MANY)
    for name, body in MANY.items():  # as hf_hub_download lays the cache out
        assert os.readlink(snap / name) == f"../../blobs/{hashlib.sha256(body).hexdigest()}"
    hub.asked.clear()
    hub.served.clear()
    h.fetch(HubSpec("org/many"))
    assert hub.asked == hub.served == []


def test_names_of_one_blob_are_downloaded_once_with_force_too(tmp_path: Path) -> None:
    """Files of the same content (one etag, one blob in the cache): one download, each name linking to it;
    `--force` downloads that blob again once, not once a name."""
    files = {"config.json": b"{}", "model.safetensors": b"weights", "generation_config.json": b"{}",
             "tokenizer_config.json": b"{}"}
    with serving(FakeHub({"org/twins": dict(files)})) as fake:
        h = Hub(fake.url, str(tmp_path))
        for force in (False, True):
            fake.served.clear()
            snap = h.fetch(HubSpec("org/twins"), force=force)
            assert {p.name: p.read_bytes() for p in snap.iterdir()} == files
            assert len(fake.served) == 2 and "org/twins/model.safetensors" in fake.served, fake.served
        assert len(list((tmp_path / "models--org--twins" / "blobs").iterdir())) == 2


def test_a_file_on_a_storage_host_is_downloaded_from_there_without_the_token(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A file whose metadata request the Hub answers with a storage host's URL (as it answers for an LFS or Xet
    file): downloaded from there, and HF_TOKEN, which the Hub's own requests carry (a gated repository's
    answer it), stays with the Hub."""
    files = {"config.json": b"{}", "model.safetensors": b"weights"}
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    with serving(FakeHub({"org/lfs": dict(files)}, gated={"org/lfs"}, tokens={"hf_granted"},
                         on_storage={"org/lfs/model.safetensors"})) as fake:
        snap = Hub(fake.url, str(tmp_path)).fetch(HubSpec("org/lfs"))
        assert {p.name: p.read_bytes() for p in snap.iterdir()} == files
        assert sorted(fake.asked) == sorted(fake.served) == ["org/lfs/config.json", "org/lfs/model.safetensors"]
        assert fake.storage_authorizations == [None]


def test_a_file_stored_in_xet_is_downloaded_by_hf_xet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file whose metadata says it is stored in Xet goes to hf_xet (``xet_get``, a stand-in) where it is
    installed, as hf_hub_download sends it: written to the partial file, which is moved into the cache."""
    from huggingface_hub import file_download

    files = {"config.json": b"{}", "model.safetensors": b"weights"}
    calls: list[tuple[str, str, int | None, str]] = []

    def xet_get(*, incomplete_path: Path, xet_file_data: Any, expected_size: int | None, displayed_filename: str,
                **kwargs: object) -> None:
        calls.append((displayed_filename, xet_file_data.file_hash, expected_size, incomplete_path.name))
        incomplete_path.write_bytes(files[displayed_filename])

    monkeypatch.setattr(file_download, "xet_get", xet_get)
    monkeypatch.setattr(file_download, "is_xet_available", lambda: True)
    with serving(FakeHub({"org/xet": dict(files)}, in_xet={"org/xet/model.safetensors"})) as fake:
        snap = Hub(fake.url, str(tmp_path)).fetch(HubSpec("org/xet"))
        assert {p.name: p.read_bytes() for p in snap.iterdir()} == files
        assert fake.served == ["org/xet/config.json"]
    etag = hashlib.sha256(files["model.safetensors"]).hexdigest()
    ((name, xet_hash, size, partial),) = calls
    assert (name, xet_hash, size) == ("model.safetensors", etag, len(files["model.safetensors"]))
    assert partial.startswith(f"{etag}.") and partial.endswith(".incomplete")
    assert not list(tmp_path.rglob("*.incomplete"))


def test_where_the_file_system_has_no_links_the_snapshot_holds_copies(hub: FakeHub, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """As hf_hub_download does on Windows without developer mode."""

    def no_links(*args: object, **kwargs: object) -> None:
        raise OSError("symbolic links are not supported")

    monkeypatch.setattr(os, "symlink", no_links)
    snap = Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/many"))
    assert {p.name: p.read_bytes() for p in snap.iterdir()} == MANY
    assert not any(p.is_symlink() for p in snap.iterdir())


@pytest.mark.parametrize("name", ["../../../../evil.json", "sub/../../../../evil.json", "/evil.json",
                                  "C:/evil.json", "sub\\..\\..\\evil.json"])
def test_a_listed_name_outside_the_repository_is_refused(tmp_path: Path, name: str) -> None:
    """A repository (or a Hub at HF_ENDPOINT) listing a file whose name leaves the snapshot's folder: one line,
    and nothing is written under that name."""
    files = {"config.json": b"{}", "model.safetensors": b"weights", name: b"{}"}
    with serving(FakeHub({"org/evil": files})) as fake:
        with pytest.raises(KestrelError, match=rf"^model org/evil: the repository lists {re.escape(repr(name))}, "
                                               r"which is not a path inside it$"):
            Hub(fake.url, str(tmp_path / "cache")).fetch(HubSpec("org/evil"))
    assert not [p for p in tmp_path.rglob("*evil.json")]


def test_an_etag_that_cannot_name_a_blob_is_refused(hub: FakeHub, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The etag names the file's blob in the cache: one that would leave the blobs folder is one line, and
    nothing is downloaded."""
    import huggingface_hub

    ask = huggingface_hub.get_hf_file_metadata

    def tampered(url: str, *args: object, **kwargs: object) -> object:
        return dataclasses.replace(ask(url, *args, **kwargs), etag="../../../evil")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", tampered)
    with pytest.raises(KestrelError, match=r"^model org/many: the answer for \S+ has no ETag that can name its "
                                           r"blob in the cache \('\.\./\.\./\.\./evil'\): is HF_ENDPOINT a "
                                           r"Hugging Face Hub\?$"):
        Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/many"))
    assert hub.served == [] and not list(tmp_path.rglob("evil*"))


def test_a_listing_whose_commit_would_leave_the_snapshots_folder_is_refused(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing's commit names the snapshot folder the files are linked in: one that would leave it (from a
    Hub that answers for that commit too) is one line, and the user's file it would have replaced is as it was."""
    from huggingface_hub import HfApi

    evil = "../../../mine"
    hub.commits[f"org/many@{evil}"] = hub.repos["org/many"]
    mine = tmp_path / "mine" / "config.json"
    mine.parent.mkdir()
    mine.write_text("the user's own")
    list_repository = HfApi.repo_info

    def tampered(self: HfApi, *args: object, **kwargs: object) -> object:
        info = list_repository(self, *args, **kwargs)
        info.sha = evil
        return info

    monkeypatch.setattr(HfApi, "repo_info", tampered)
    with pytest.raises(KestrelError, match=rf"^model org/many: the Hub's listing names its commit "
                                           rf"{re.escape(repr(evil))}, not a commit hash"):
        Hub(hub.url, str(tmp_path / "cache")).fetch(HubSpec("org/many"))
    assert not mine.is_symlink() and mine.read_text() == "the user's own" and hub.served == []


def _fetch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("hub-fetch-")}


@pytest.mark.parametrize("end", ["ctrl-c", "a file fails"])
def test_an_ended_fetch_stops_its_downloads_and_leaves_no_part_of_them(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """The downloads under way held by the Hub after the first byte of each file; then Ctrl-C (which only the main
    thread receives) or another file failing: the fetch ends at once with it, no other file is started, and no
    partial file is left. The Hub then sending the rest, each download stops at it, writing nothing more (as
    huggingface_hub's http_get writes it), and nothing of those files is moved into the cache."""
    import huggingface_hub
    from huggingface_hub import file_download

    hub.holding["/org/many/resolve/*"] = 1
    failing = "config.json" if end == "a file fails" else None  # the first, which fails once the others are held
    under_way = WORKERS - (failing is not None)
    ask = huggingface_hub.get_hf_file_metadata

    def held_first(url: str, *args: object, **kwargs: object) -> object:
        if failing is not None and url.endswith(f"/{failing}"):
            wait_for(lambda: len(hub.held) == under_way)
            hub.failing[f"org/many/{failing}"] = 403
        return ask(url, *args, **kwargs)

    def wait_for(condition: Callable[[], bool]) -> None:  # a guard: where the downloads come one at a time
        deadline = time.monotonic() + HANG_GUARD_S
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)

    def interrupt() -> None:
        wait_for(lambda: len(hub.held) == under_way)
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    download = file_download.http_get
    ended = threading.Event()
    written_after_the_end: list[int] = []

    class Recorded:
        def __init__(self, file: BinaryIO) -> None:
            self.file = file

        def write(self, data: bytes) -> int:
            written = self.file.write(data)
            if ended.is_set():
                written_after_the_end.append(written)
            return written

        def __getattr__(self, name: str) -> object:
            return getattr(self.file, name)

    def recorded(url: str, temp_file: BinaryIO, **kwargs: object) -> None:
        download(url, Recorded(temp_file), **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", held_first)
    monkeypatch.setattr(file_download, "http_get", recorded)
    before = _fetch_threads()
    fetch = Hub(hub.url, str(tmp_path)).fetch
    try:
        if end == "ctrl-c":
            threading.Thread(target=interrupt, daemon=True).start()
            with pytest.raises(KeyboardInterrupt):
                fetch(HubSpec("org/many"))
        else:
            with pytest.raises(KestrelError, match=r"^model org/many: "):
                within(HANG_GUARD_S, lambda: fetch(HubSpec("org/many")))
        ended.set()
        held = sorted(hub.held)
        assert len(set(held)) == len(held) == under_way
        assert not list(tmp_path.rglob("*.incomplete"))
    finally:
        hub.release.set()
    for thread in _fetch_threads() - before:
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive()
    assert written_after_the_end == []
    assert sorted(hub.held) == held and not list(tmp_path.rglob("*.incomplete"))
    blobs = tmp_path / "models--org--many" / "blobs"
    assert not (blobs.is_dir() and list(blobs.iterdir()))
    assert not list(tmp_path.glob("models--org--many/snapshots/*/*"))


def test_a_file_whose_metadata_comes_after_the_fetch_ended_is_not_downloaded(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A file still in its metadata request when another fails: its answer, come later, starts no download and
    leaves no file."""
    import huggingface_hub

    files = {"config.json": b"{}", "model.safetensors": b"weights"}
    ask = huggingface_hub.get_hf_file_metadata
    entered, ended = threading.Event(), threading.Event()

    def answered_late(url: str, *args: object, **kwargs: object) -> object:
        if url.endswith("/config.json"):
            entered.wait(HANG_GUARD_S)
            raise OSError("the Hub closed the connection")
        entered.set()
        ended.wait(2 * HANG_GUARD_S)  # answered only once the fetch has ended (past the fetch's guard)
        return ask(url, *args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", answered_late)
    before = _fetch_threads()
    with serving(FakeHub({"org/two": dict(files)})) as fake:
        with pytest.raises(KestrelError, match="the Hub closed the connection"):
            within(HANG_GUARD_S, lambda: Hub(fake.url, str(tmp_path)).fetch(HubSpec("org/two")))
        ended.set()
        for thread in _fetch_threads() - before:
            thread.join(HANG_GUARD_S)
            assert not thread.is_alive()
        assert fake.served == []
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and "blobs" in p.parts]
