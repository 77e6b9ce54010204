"""The model cache shared by processes: the temp files of writers killed outright, cold loads of one model at once,
kestrel versions sharing one KESTREL_HOME."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kestrel_core.cli import main
from kestrel_core.model.cache import MODEL_CACHE_ENV
from kestrel_core.model.loader import load_model

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
        killed.wait(60)
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
        live.wait(60)
        load_model(TINY, quant="q8")  # a load that writes to the cache sweeps it
        assert _temps(cache) == []
    finally:
        killed.kill()
        live.kill()
