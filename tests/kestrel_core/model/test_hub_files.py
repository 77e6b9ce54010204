"""The files of a model by Hub name (kestrel_core/model/hub_files.py): all of the commit the listing named,
several at a time, and a fetch ended (Ctrl-C, a file that fails) leaves no partial file. Against the Hub on
127.0.0.1 (fake_hub) through the real ``huggingface_hub`` client; where a download is to be held under way, its
``hf_hub_download`` is a stand-in."""

from __future__ import annotations

import hashlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kestrel_core.errors import KestrelError
from kestrel_core.model.hub import Hub, HubSpec
from kestrel_core.model.hub_files import WORKERS

from .fake_hub import FakeHub, repo_files, serving, within

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


def test_the_files_are_fetched_several_at_a_time(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As snapshot_download fetches them: WORKERS downloads under way at once, and not more."""
    import huggingface_hub

    download = huggingface_hub.hf_hub_download
    under_way: list[str] = []
    most = [0]
    lock = threading.Lock()
    full = threading.Event()

    def counted(repo: str, name: str, **kwargs: object) -> str:
        with lock:
            under_way.append(name)
            most[0] = max(most[0], len(under_way))
            if len(under_way) == WORKERS:
                full.set()
        try:  # a guard: one download at a time would wait here for ever
            if not full.wait(10):
                raise AssertionError(f"{name}: {len(under_way)} download(s) under way, not {WORKERS}")
            return download(repo, name, **kwargs)
        finally:
            with lock:
                under_way.remove(name)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", counted)
    snap = within(60, lambda: Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/many")))
    assert isinstance(snap, Path) and {p.name: p.read_bytes() for p in snap.iterdir()} == MANY
    assert most[0] == WORKERS


@pytest.mark.parametrize("end", ["ctrl-c", "a file fails"])
def test_an_ended_fetch_starts_nothing_more_and_leaves_no_partial_file(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """WORKERS downloads held under way, each with its partial file written as huggingface_hub writes it; then
    Ctrl-C (which only the main thread receives) or one of them failing: the fetch ends at once with it, no
    other file is started, and no partial file is left, though the threads of those under way still wait."""
    import huggingface_hub

    started: list[str] = []
    lock = threading.Lock()
    all_under_way = threading.Event()
    release = threading.Event()
    failing = "config.json" if end == "a file fails" else None  # the first, which fails once the others are there

    def held(repo: str, name: str, **kwargs: object) -> str:
        if name != failing:
            blobs = tmp_path / "models--org--many" / "blobs"
            blobs.mkdir(parents=True, exist_ok=True)
            (blobs / f"{hashlib.sha256(MANY[name]).hexdigest()}.0123abcd.incomplete").write_bytes(b"part")
        with lock:
            started.append(name)
            if len(started) == WORKERS:
                all_under_way.set()
        if name == failing:
            all_under_way.wait(10)  # a guard: where the downloads come one at a time, the first fails alone
            raise OSError("the Hub closed the connection")
        release.wait()
        raise OSError("stalled")

    def interrupt() -> None:  # a guard too: where the downloads come one at a time, the first is interrupted
        all_under_way.wait(10)
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", held)
    fetch = Hub(hub.url, str(tmp_path)).fetch
    try:
        if end == "ctrl-c":
            threading.Thread(target=interrupt, daemon=True).start()
            with pytest.raises(KeyboardInterrupt):
                fetch(HubSpec("org/many"))
        else:
            with pytest.raises(KestrelError, match=r"^model org/many: downloading it failed \(the Hub closed the "):
                within(30, lambda: fetch(HubSpec("org/many")))
        assert len(set(started)) == len(started) == WORKERS
        assert not list(tmp_path.rglob("*.incomplete"))
    finally:
        release.set()


def test_a_partial_file_written_after_the_fetch_ended_is_removed_at_exit(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A download still in hf_hub_download's own metadata request when another file fails creates its partial file
    after the fetch removed those it knew of; the process's exit (its atexit functions, run here by hand) removes
    it, as that thread dies with the process."""
    import atexit

    import huggingface_hub

    at_exit: list[tuple[object, tuple[object, ...]]] = []
    monkeypatch.setattr(atexit, "register", lambda fn, *args: at_exit.append((fn, args)))
    files = {"config.json": b"{}", "model.safetensors": b"weights"}
    entered, gave_up, written, end = (threading.Event() for _ in range(4))

    def download(repo: str, name: str, **kwargs: object) -> str:
        if name == "config.json":
            entered.wait(10)
            raise OSError("the Hub closed the connection")
        entered.set()
        gave_up.wait(10)  # its metadata request answered only now
        blobs = tmp_path / "models--org--two" / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        (blobs / f"{hashlib.sha256(files[name]).hexdigest()}.0123abcd.incomplete").write_bytes(b"part")
        written.set()
        end.wait(30)
        raise OSError("ended with the process")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    try:
        with serving(FakeHub({"org/two": dict(files)})) as hub:
            with pytest.raises(KestrelError):
                within(30, lambda: Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/two")))
            gave_up.set()
            assert written.wait(10) and list(tmp_path.rglob("*.incomplete"))
            for fn, args in at_exit:
                fn(*args)  # type: ignore[operator]
            assert not list(tmp_path.rglob("*.incomplete"))
    finally:
        end.set()
