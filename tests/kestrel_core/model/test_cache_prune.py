"""`kestrel cache --prune` / `--clear`: what they remove, what they keep, and how they fail."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kestrel_core.model.cache import MODEL_CACHE_ENV

TINY_LLAMA = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-llama"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(MODEL_CACHE_ENV, "1")
    return tmp_path / "home"


def test_prune_keeps_a_newer_kestrels_entry_it_cannot_read(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry this kestrel cannot read is orphaned, unless a newer kestrel wrote it (in a format only that one
    reads): kestrel versions sharing a KESTREL_HOME each keep their own. --clear removes it too."""
    from kestrel_core.model import cache as model_cache

    monkeypatch.setattr(model_cache, "__version__", "0.10.0")
    entries = home / "cache"
    entries.mkdir(parents=True)
    newer = entries / "hf-m.0123456789ab.k1.q8.v2.kestrel-0.11.0.kst"
    older = entries / "hf-m.0123456789ab.k1.q8.v1.kestrel-0.9.0.kst"
    for path in (newer, older):
        path.write_bytes(b"not an artifact this kestrel reads")
    removed, _ = model_cache.prune_cache()
    assert [e.path for e in removed] == [older] and newer.exists()
    removed, _ = model_cache.prune_cache(everything=True)
    assert [e.path for e in removed] == [newer] and os.listdir(entries) == []


def test_an_entry_that_cannot_be_removed_is_one_line(home: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A read-only KESTREL_HOME: `kestrel cache --clear` names the entry and why, not Python's errno text."""
    from kestrel_core.cli import main
    from kestrel_core.model import cache as model_cache

    (home / "cache").mkdir(parents=True)
    (home / "cache" / "hf-m.0123456789ab.k1.q8.v1.kestrel-0.1.0.kst").write_bytes(b"junk")

    def read_only(path: Path) -> None:
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(model_cache, "remove_entry", read_only)
    assert main(["cache", "--clear"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot remove the cache entry ") and err.endswith(": read-only file system"), err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("sources", [5, True, "abc", [None], {"x": 1}])
def test_an_entry_whose_recorded_sources_are_damaged_is_listed_and_pruned(home: Path, sources: object,
                                                                          capsys) -> None:
    """An entry whose metadata records its sources as no list of paths is an unreadable entry, as a corrupt one
    is: listed with none, orphaned, and removed by --prune, not a TypeError that leaves it there for good."""
    from kestrel_core.cli import main
    from kestrel_core.model.loader import load_model, write_artifact

    (home / "cache").mkdir(parents=True)
    entry = home / "cache" / "hf-m.0123456789ab.k1.q8.v1.kestrel-0.1.0.kst"
    write_artifact(load_model(TINY_LLAMA, quant="q8", cache="off"), entry, extra={"sources": sources},
                   progress=lambda done, total: None)
    assert main(["cache", "--json"]) == 0
    (listed,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (listed["sources"], listed["quant"], listed["orphaned"]) == ([], "?", True)
    assert main(["cache", "--prune"]) == 0 and not entry.exists()
