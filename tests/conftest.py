"""Shared test setup: the default-model marker, and an environment without stray kestrel settings."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

KESTREL_PREFIX = "KESTREL_"


def _clean_env(mp: pytest.MonkeyPatch, probe_cache: str) -> None:
    """No ``KESTREL_*`` setting of the user's reaches a test, but two of the tests' own: a private probe cache,
    and no Hugging Face artifact cache (loading an HF directory would write to the user's ``KESTREL_HOME``,
    which the default-model tests read; tests of the cache turn it back on with a ``KESTREL_HOME`` of their
    own)."""
    for name in [n for n in os.environ if n.startswith(KESTREL_PREFIX)]:
        mp.delenv(name)
    mp.setenv("KESTREL_PROBE_CACHE", probe_cache)
    mp.setenv("KESTREL_MODEL_CACHE", "0")


@pytest.fixture(scope="session")
def _probe_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One plugin-probe cache for the session, not the user's: a fixture backend is probed once."""
    return str(tmp_path_factory.mktemp("kestrel-probe") / "probes.json")


@pytest.fixture(autouse=True)
def _clean_kestrel_env(monkeypatch: pytest.MonkeyPatch, _probe_cache: str) -> None:
    _clean_env(monkeypatch, _probe_cache)


@pytest.fixture(scope="session")
def clean_session_env(_probe_cache: str) -> Iterator[None]:
    """The same clean environment for a session-scoped fixture, which is set up before any test's own."""
    with pytest.MonkeyPatch.context() as mp:
        _clean_env(mp, _probe_cache)
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Default-model tests run where the model was pulled; in CI a missing model is a failure, not a skip."""
    if not any(item.get_closest_marker("default_model") for item in items):
        return
    try:
        from kestrel_core.model.pull import default_model_path

        present = default_model_path().exists()
    except Exception:  # the pull module is not importable: treat the model as missing
        present = False
    if present or os.environ.get("CI"):
        return
    skip = pytest.mark.skip(reason="default model not pulled (run `kestrel pull`); CI runs these")
    for item in items:
        if item.get_closest_marker("default_model"):
            item.add_marker(skip)
