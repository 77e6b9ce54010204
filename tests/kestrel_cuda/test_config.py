"""The CUDA backend's settings (kestrel_cuda.config): read from the environment, overridden by backend options,
bad values and the renamed variable refused in one line, and the documented table the same as the code's."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from kestrel_core.errors import KestrelError
from kestrel_cuda.config import RENAMED, SETTINGS, CudaConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "backends" / "cuda.md"


def test_defaults_without_environment() -> None:
    assert CudaConfig.from_env({}) == CudaConfig()
    assert CudaConfig() == CudaConfig(device=0, cache_mb=None, window=0, max_context=32768, graph=True, pdl=True,
                                      cluster=True, trace=False)


def test_every_variable_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in [("KESTREL_CUDA_DEVICE", "2"), ("KESTREL_CUDA_CACHE_MB", " 40000 "),
                        ("KESTREL_CUDA_WINDOW", "4"), ("KESTREL_CUDA_MAX_CONTEXT", "4096"),
                        ("KESTREL_CUDA_GRAPH", "0"), ("KESTREL_CUDA_PDL", "off"), ("KESTREL_CUDA_CLUSTER", "no"),
                        ("KESTREL_CUDA_TRACE", "1")]:
        monkeypatch.setenv(name, value)
    assert CudaConfig.from_env() == CudaConfig(device=2, cache_mb=40000, window=4, max_context=4096, graph=False,
                                               pdl=False, cluster=False, trace=True)


def test_options_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_CUDA_WINDOW", "4")
    monkeypatch.setenv("KESTREL_CUDA_PDL", "0")
    cfg = CudaConfig.from_env({"window": "0", "pdl": "yes", "cache_mb": "100", "threads": "8"})  # threads: not ours
    assert (cfg.window, cfg.pdl, cfg.cache_mb, cfg.graph) == (0, True, 100, True)


@pytest.mark.parametrize("name, raw", [("KESTREL_CUDA_CACHE_MB", "0"), ("KESTREL_CUDA_CACHE_MB", "12MB"),
                                       ("KESTREL_CUDA_WINDOW", "-1"), ("KESTREL_CUDA_WINDOW", "2.5"),
                                       ("KESTREL_CUDA_MAX_CONTEXT", "0"), ("KESTREL_CUDA_DEVICE", "gpu1"),
                                       ("KESTREL_CUDA_GRAPH", "maybe")])
def test_bad_variable_is_one_line_naming_it(name: str, raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(KestrelError) as err:
        CudaConfig.from_env({})
    assert name in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key, raw", [("cache_mb", "-5"), ("window", "yes"), ("max_context", ""), ("pdl", "2")])
def test_bad_option_is_one_line_naming_it(key: str, raw: str) -> None:
    with pytest.raises(KestrelError) as err:
        CudaConfig.from_env({key: raw})
    assert f"backend option {key}" in str(err.value) and "\n" not in str(err.value)


def test_renamed_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_CUDA_STREAM", "1")
    with pytest.raises(KestrelError, match="KESTREL_CUDA_STREAM was renamed KESTREL_CUDA_WINDOW"):
        CudaConfig.from_env({})


def test_settings_table_matches_the_config_and_the_docs() -> None:
    assert [s.key for s in SETTINGS] == [f.name for f in fields(CudaConfig)]
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("\n## Settings\n"):]
    rows = re.findall(r"^\| `(KESTREL_CUDA_\w+)` \| `(\w+)` \|", section, re.M)
    assert rows == [(s.env, s.key) for s in SETTINGS]
    assert set(RENAMED) & {s.env for s in SETTINGS} == set()
