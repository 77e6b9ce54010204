"""The model cache shared by processes: the temp files of writers killed outright, cold loads of one model at once,
kestrel versions sharing one KESTREL_HOME."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kestrel_core.cli import main
from kestrel_core.model.cache import MODEL_CACHE_ENV
from kestrel_core.model.loader import load_model

from ..waits import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "tests" / "fixtures" / "models" / "tiny-llama"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(MODEL_CACHE_ENV, "1")
    return tmp_path / "home"


def _python(code: str, *argv: str, **kwargs) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *argv], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, **kwargs)


STUCK_WRITER = """
    import sys, time
    from kestrel_core import artifact_write
    from kestrel_core.model.presets import preset_model

    def stuck(f, *args, **kwargs):
        f.write(bytes(3_000_000))
        f.flush()
        print("writing", flush=True)
        time.sleep(600)

    artifact_write._write_safetensors = stuck
    artifact_write.save_artifact(sys.argv[1], preset_model("smollm2-135m", num_layers=1, vocab_size=512), quant="q8")
"""


def _stuck_writer(entry: Path) -> subprocess.Popen[str]:
    """A process stuck writing ``entry``, 3 MB into its temp file."""
    proc = _python(STUCK_WRITER, str(entry))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    return proc


def _temps(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name.startswith("."))


def test_a_killed_writers_temp_file_is_listed_and_goes_at_once_a_live_ones_stays(home: Path, capsys) -> None:
    """kill -9 (the OOM killer) mid-write leaves the temp file: `kestrel cache` counts it, `--clear` and the next
    load remove it at once, not an hour later; the temp of a writer still writing is never touched."""
    cache = home / "cache"
    cache.mkdir(parents=True)
    killed, live = _stuck_writer(cache / "a.kst"), _stuck_writer(cache / "b.kst")
    try:
        killed.kill()
        killed.wait(HANG_GUARD_S)
        assert len(_temps(cache)) == 2
        capsys.readouterr()
        assert main(["cache"]) == 0
        assert "3 MB in 1 temp files of writers that died" in capsys.readouterr().out
        assert main(["cache", "--clear"]) == 0
        assert "removed 0 cache entries (0 MB) and 1 temp files of writers that died (3 MB)" in \
            capsys.readouterr().err
        assert [t.split(".")[1] for t in _temps(cache)] == ["b"]  # the live writer's
        assert main(["cache", "--prune"]) == 0 and len(_temps(cache)) == 1
        live.kill()
        live.wait(HANG_GUARD_S)
        load_model(TINY, quant="q8")  # a load that writes to the cache sweeps it
        assert _temps(cache) == []
    finally:
        killed.kill()
        live.kill()


COLD_LOAD = """
    import logging, os, sys, time
    from pathlib import Path
    from kestrel_core.model import loader

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    quantize = loader.quantize_model

    def gated(source, quant, progress=None):
        print("quantizing", flush=True)
        with open(os.environ["BUILDS"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        deadline = time.monotonic() + float(os.environ["GUARD_S"])  # a guard: the test opens the gate
        while not Path(os.environ["GATE"]).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return quantize(source, quant, progress)

    loader.quantize_model = gated
    loader.load_model(sys.argv[1], quant="q8")
    print("loaded", flush=True)
"""


def _cold_load(tmp_path: Path) -> subprocess.Popen[str]:
    """A process loading TINY whose quantization, once begun (it says "quantizing"), waits for the gate file."""
    env = {**os.environ, "BUILDS": str(tmp_path / "builds"), "GATE": str(tmp_path / "gate"),
           "GUARD_S": str(HANG_GUARD_S)}
    return _python(COLD_LOAD, str(TINY), env=env, stderr=subprocess.STDOUT)


def _first_word(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().split(" ")[0].strip()


def _builds(tmp_path: Path) -> list[str]:
    return (tmp_path / "builds").read_text().split()


def test_a_second_cold_load_waits_for_the_first_and_loads_its_entry(home: Path, tmp_path: Path) -> None:
    """Two processes loading one model the first time: the second says it waits, quantizes nothing and maps the
    entry the first wrote (one build, one temp file of the model at a time, not two)."""
    first = _cold_load(tmp_path)
    second = None
    try:
        assert _first_word(first) == "quantizing"
        second = _cold_load(tmp_path)
        assert _first_word(second) == "waiting"  # not "quantizing": it holds off while the first builds
        (tmp_path / "gate").touch()
        assert first.wait(HANG_GUARD_S) == 0 and second.wait(HANG_GUARD_S) == 0
        assert second.stdout is not None and second.stdout.read().split() == ["loaded"]
    finally:
        (tmp_path / "gate").touch()
        for proc in (first, second):
            if proc is not None:
                proc.kill()
    assert _builds(tmp_path) == [str(first.pid)]
    assert len(list((home / "cache").glob("*.kst"))) == 1 and _temps(home / "cache") == []  # no lock file left


def test_a_waiting_load_builds_the_entry_itself_when_the_first_dies(home: Path, tmp_path: Path) -> None:
    """kill -9 of the process building the entry: the kernel releases its lock, and the one waiting builds."""
    first = _cold_load(tmp_path)
    second = None
    try:
        assert _first_word(first) == "quantizing"
        second = _cold_load(tmp_path)
        assert _first_word(second) == "waiting"
        first.kill()
        first.wait(HANG_GUARD_S)
        assert _first_word(second) == "quantizing"
        (tmp_path / "gate").touch()
        assert second.wait(HANG_GUARD_S) == 0
    finally:
        (tmp_path / "gate").touch()
        for proc in (first, second):
            if proc is not None:
                proc.kill()
    assert _builds(tmp_path) == [str(first.pid), str(second.pid)]
    assert len(list((home / "cache").glob("*.kst"))) == 1 and _temps(home / "cache") == []


def test_prune_removes_the_lock_files_no_process_holds(home: Path) -> None:
    """A process killed while it held a slot's lock leaves the lock file; --prune removes it, never a held one."""
    from kestrel_core.model.cache import Slot

    cache = home / "cache"
    cache.mkdir(parents=True)
    left = cache / ".gguf-gone.0123456789ab.q8.lock"
    left.touch()
    held = Slot("hf-model.0123456789ab", "q4").lock_file()
    assert held.acquire(lambda: None) and held.path.exists()
    try:
        assert main(["cache", "--prune"]) == 0
        assert _temps(cache) == [held.path.name]
    finally:
        held.release()
    assert _temps(cache) == []


def test_kestrel_versions_sharing_a_home_keep_each_others_entries(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two kestrel installs on one KESTREL_HOME, loading one GGUF file in turn: a newer version's entry replaces
    an older one's, never the other way round, so each goes on hitting its own (0.10 is newer than 0.9)."""
    from kestrel_core.model import cache, loader
    from kestrel_core.model.quantize import quantize_model

    builds: list[str] = []

    def counting(source, quant, progress=None):  # type: ignore[no-untyped-def]
        builds.append(cache.__version__)
        return quantize_model(source, quant, progress)

    monkeypatch.setattr(loader, "quantize_model", counting)

    def load_as(version: str) -> list[str]:
        monkeypatch.setattr(cache, "__version__", version)
        load_model(TINY.with_suffix(".gguf"), quant="q8")
        return sorted(p.name.rpartition(".kestrel-")[2] for p in (home / "cache").glob("*.kst"))

    assert load_as("0.9.0") == ["0.9.0.kst"]
    assert load_as("0.10.0") == ["0.10.0.kst"]  # the older version's entry goes
    assert load_as("0.9.0") == ["0.10.0.kst", "0.9.0.kst"]  # the newer one's stays
    assert load_as("0.10.0") == ["0.10.0.kst", "0.9.0.kst"]
    assert builds == ["0.9.0", "0.10.0", "0.9.0"]  # the last load a hit


def test_an_entry_supersedes_its_slots_entries_of_older_versions_and_other_keys_only(home: Path, monkeypatch) -> None:
    from kestrel_core.model import cache

    monkeypatch.setattr(cache, "__version__", "0.10.0")
    slot = cache.Slot("gguf-m.0123456789ab", "q8")
    (home / "cache").mkdir(parents=True)
    names = {version: home / "cache" / f"{slot.stem}.{key}.q8.v1.kestrel-{version}.kst" for key, version in
             [("k1", "0.9.0"), ("k2", "0.10.0"), ("k4", "0.11.0"), ("k5", "0.10.0rc1"), ("k6", "main"), ("k7", "0.10")]}
    other_key = home / "cache" / f"{slot.stem}.k3.q8.v1.kestrel-0.10.0.kst"
    other_mode = home / "cache" / f"{slot.stem}.k8.q4.v1.kestrel-0.9.0.kst"
    for path in (*names.values(), other_key, other_mode):
        path.touch()
    assert sorted(slot.superseded(names["0.10.0"])) == sorted([names["0.9.0"], other_key])
