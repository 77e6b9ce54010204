"""Shared test setup: the default-model marker, and an environment without stray kestrel settings."""

from __future__ import annotations

import os

import pytest

KESTREL_ENV = ("KESTREL_FORCE_CPU", "KESTREL_PLUGINS", "KESTREL_BACKEND_PATH", "KESTREL_CUDA_STREAM",
               "KESTREL_CUDA_CACHE_MB", "KESTREL_CUDA_MIN_FLOPS")


@pytest.fixture(scope="session")
def _probe_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One plugin-probe cache for the session, not the user's: a fixture backend is probed once."""
    return str(tmp_path_factory.mktemp("kestrel-probe") / "probes.json")


@pytest.fixture(autouse=True)
def _clean_kestrel_env(monkeypatch: pytest.MonkeyPatch, _probe_cache: str) -> None:
    for name in KESTREL_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("KESTREL_PROBE", raising=False)
    monkeypatch.delenv("KESTREL_PROBE_TIMEOUT", raising=False)
    monkeypatch.setenv("KESTREL_PROBE_CACHE", _probe_cache)
    # loading a Hugging Face directory would cache its artifact in KESTREL_HOME (the user's cache, which the
    # default-model tests read): tests that test the cache turn it back on with a KESTREL_HOME of their own
    monkeypatch.setenv("KESTREL_HF_CACHE", "0")


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
