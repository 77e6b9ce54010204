"""A Hub that takes the connection and then stalls (a stalled proxy, a connection dropped without a word): every
request of a fetch by Hub name (kestrel_core/model/hub.py) waits a bounded time and ends in one line naming what
stalled and the variable that raises the limit; a download that keeps coming, however slowly, is never cut off;
Ctrl-C ends a stalled fetch at once; a limit that is not a number of seconds is one line. Against the Hub on
127.0.0.1 (fake_hub) through the real ``huggingface_hub`` client, its limits set small."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kestrel_core.errors import KestrelError
from kestrel_core.model.hub import Hub, HubSpec

from ..waits import HANG_GUARD_S, wait_until, within
from .fake_hub import FakeHub, repo_files, serving, socket_waits

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
GGUF = (FIXTURES / "tiny-llama.gguf").read_bytes()
WEIGHTS = "/org/tiny/resolve/*/model.safetensors"  # at main, or at the commit main is
QUANT = "/org/tiny-GGUF/resolve/*/tiny-Q4_K_M.gguf"


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with serving(FakeHub({"org/tiny": repo_files(FIXTURES / "tiny-qwen3"),
                          "org/tiny-GGUF": {"tiny-Q4_K_M.gguf": GGUF}})) as h:
        yield h


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub's limits, in seconds, small: the answer to a request, the wait between two reads."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 0.5)
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 0.2)


def test_the_only_listing_is_the_one_with_a_timeout(hub: FakeHub, tmp_path: Path, limits: None) -> None:
    """A Hub that answers kestrel's listing and stalls every other request of the API (snapshot_download's own
    listing of the repository has no timeout): the model is fetched, no request left waiting."""
    hub.stalling["/api/models/org/tiny/*"] = 0
    snap = within(HANG_GUARD_S, lambda: Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/tiny")))
    assert isinstance(snap, Path) and (snap / "model.safetensors").read_bytes() == \
        (FIXTURES / "tiny-qwen3" / "model.safetensors").read_bytes()
    assert hub.stalled == []


def test_a_stalled_listing_names_its_limit(hub: FakeHub, tmp_path: Path, limits: None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The listing's request waits HF_HUB_ETAG_TIMEOUT for its answer, then the fetch ends in one line."""
    hub.stalling["/api/models/org/tiny"] = 0
    waits = socket_waits(monkeypatch, hub.url)
    with pytest.raises(KestrelError, match=r"^model org/tiny: no such local path, not in the Hugging Face cache, and "
                                           r"the Hub sent no answer to the listing of org/tiny in 0\.5 s "
                                           r"\(HF_HUB_ETAG_TIMEOUT: set it higher to wait longer\)$"):
        within(HANG_GUARD_S, lambda: Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/tiny")))
    assert hub.stalled and waits and set(waits) == {0.5}, waits


def test_a_download_that_stops_names_the_file_and_its_limit(hub: FakeHub, tmp_path: Path, limits: None) -> None:
    """Part of model.safetensors, then nothing: huggingface_hub resumes it (a pause of 1 s, then a wait of
    HF_HUB_DOWNLOAD_TIMEOUT, five times), then the fetch ends, nothing under the file's name in the cache."""
    hub.stalling[WEIGHTS] = 1000
    with pytest.raises(KestrelError, match=r"^model org/tiny: the Hub stopped sending model\.safetensors: nothing "
                                           r"came for 0\.2 s, nor after resuming \(HF_HUB_DOWNLOAD_TIMEOUT: set it "
                                           r"higher to wait longer\)$"):
        within(HANG_GUARD_S, lambda: Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/tiny")))
    assert len(hub.stalled) > 1 and all(p.endswith("/model.safetensors") for p in hub.stalled)  # resumed
    assert not [p for p in tmp_path.rglob("*") if p.name == "model.safetensors" or p.suffix == ".incomplete"]


def test_a_download_that_stalls_after_its_metadata_names_the_file_and_its_limit(hub: FakeHub, tmp_path: Path,
                                                                              limits: None) -> None:
    """The Hub answers the file's metadata request and is silent for every later request of it: the download
    ends after its own limit (resumed as huggingface_hub resumes one), not after minutes of metadata requests
    tried again, and nothing of the file is in the cache."""
    hub.stalling[QUANT], hub.spared[QUANT] = 0, 1
    with pytest.raises(KestrelError, match=r"^model org/tiny-GGUF: the Hub stopped sending tiny-Q4_K_M\.gguf: nothing "
                                           r"came for 0\.2 s, nor after resuming \(HF_HUB_DOWNLOAD_TIMEOUT: set it "
                                           r"higher to wait longer\)$"):
        within(HANG_GUARD_S, lambda: Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/tiny-GGUF")))
    assert hub.asked == ["org/tiny-GGUF/tiny-Q4_K_M.gguf"] and hub.stalled
    assert not [p for p in tmp_path.rglob("*") if p.name == "tiny-Q4_K_M.gguf" or p.suffix == ".incomplete"]


@pytest.mark.parametrize("force", [False, True], ids=["pull", "pull --force"])
def test_a_stalled_metadata_request_names_the_file_and_its_limit(hub: FakeHub, tmp_path: Path, limits: None,
                                                                 force: bool) -> None:
    """The listing answered, the metadata request (HEAD) of a file the cache lacks stalls: one line after the
    limit set, though hf_hub_download's own request for such a file would be tried again with limits of its own
    (minutes), and nothing of the file is in the cache."""
    hub.stalling[QUANT] = 0
    with pytest.raises(KestrelError, match=r"^model org/tiny-GGUF: the Hub sent no answer to the request for "
                                           r"tiny-Q4_K_M\.gguf's metadata in 0\.5 s \(HF_HUB_ETAG_TIMEOUT: set it "
                                           r"higher to wait longer\)$"):
        within(HANG_GUARD_S, lambda: Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/tiny-GGUF"), force=force))
    assert hub.stalled and not [p for p in tmp_path.rglob("*") if p.name == "tiny-Q4_K_M.gguf" or p.suffix ==
                                ".incomplete"]


def test_a_slow_download_that_keeps_coming_is_not_cut_off(hub: FakeHub, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight parts, and before each but the first the clock moves on by twice HF_HUB_DOWNLOAD_TIMEOUT: the
    download lasts longer than its limit by the clock, no read waits that long, and it is neither ended nor
    resumed (one GET). (A clock moved by the test, not a slow Hub: a busy machine can hold a read past any
    limit.)"""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)
    moved = [0.0]
    for name in ("monotonic", "time", "perf_counter"):
        real = getattr(time, name)
        monkeypatch.setattr(time, name, functools.partial(lambda real: real() + moved[0], real))

    def later() -> None:
        moved[0] += 2 * constants.HF_HUB_DOWNLOAD_TIMEOUT

    hub.trickling[QUANT], hub.between_chunks = len(GGUF) // 8 + 1, later
    path = within(HANG_GUARD_S, lambda: Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/tiny-GGUF")))
    assert moved[0] == 14 * constants.HF_HUB_DOWNLOAD_TIMEOUT  # the eight parts came
    assert isinstance(path, Path) and path.read_bytes() == GGUF
    assert hub.served == ["org/tiny-GGUF/tiny-Q4_K_M.gguf"]


@pytest.mark.parametrize(("stall", "at"), [("/api/models/org/tiny", 0), (WEIGHTS, 1000)],
                         ids=["listing", "download"])
def test_ctrl_c_ends_a_stalled_fetch_at_once(hub: FakeHub, tmp_path: Path, stall: str, at: int) -> None:
    """`kestrel pull` with the Hub's limits longer than the test waits: SIGINT ends it, not a limit, exit 130,
    "interrupted", and the file it was downloading is nowhere in the cache, not even in part."""
    hub.stalling[stall] = at
    limit = str(int(HANG_GUARD_S) * 2)
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "KESTREL_HOME": str(tmp_path / "k"),
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_ETAG_TIMEOUT": limit, "HF_HUB_DOWNLOAD_TIMEOUT": limit}
    pull = subprocess.Popen([sys.executable, "-m", "kestrel_core.cli", "pull", "org/tiny"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        wait_until(lambda: bool(hub.stalled) or pull.poll() is not None, "the stall")
        assert hub.stalled and pull.poll() is None, pull.communicate()
        pull.send_signal(signal.SIGINT)
        try:
            _, stderr = pull.communicate(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"kestrel pull still running {HANG_GUARD_S:.0f} s after Ctrl-C")
    finally:
        if pull.poll() is None:
            pull.kill()
            pull.communicate()
    assert pull.returncode == 130 and stderr.strip().splitlines()[-1] == "interrupted", stderr
    assert "Traceback" not in stderr
    assert not [p for p in tmp_path.rglob("*") if p.name == "model.safetensors" or p.suffix == ".incomplete"]


@pytest.mark.parametrize(("command", "limit", "value"), [(("pull", "org/tiny"), "HF_HUB_DOWNLOAD_TIMEOUT", "30s"),
                                                         (("list",), "HF_HUB_ETAG_TIMEOUT", "0.5")])
def test_a_limit_that_is_not_a_whole_number_of_seconds_is_one_line(tmp_path: Path, command: tuple[str, ...],
                                                                   limit: str, value: str) -> None:
    """What huggingface_hub's import refuses (it reads the limits with int()): named, not a ValueError."""
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "KESTREL_HOME": str(tmp_path / "k"),
           limit: value}
    ran = subprocess.run([sys.executable, "-m", "kestrel_core.cli", *command], capture_output=True, text=True,
                         timeout=HANG_GUARD_S, env={**os.environ, **env})
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr == f"error: {limit} must be a whole number of seconds >= 0, got {value!r}\n"
