"""Fixtures of the runtime tests (decoder, engine, sampling, presets, CLI): tiny configs, a CPU offload, a process
that file permissions stop."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable

import pytest

import kestrel_core
from kestrel_core.dispatch import Offload
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.presets import ByteTokenizer, synthetic_model
from kestrel_core.registry import Registry

from ..waits import HANG_GUARD_S

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}


def make_tiny_config(arch: str = "llama", **overrides: object) -> ModelConfig:
    """A 2-layer GQA model (4 query heads over 2 kv heads); qwen3 gets q/k norms and hd != D/H."""
    base: dict[str, object] = dict(
        arch=arch, vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=96,
        tie_word_embeddings=True, bos_token_id=ByteTokenizer.BOS, eos_token_ids=(ByteTokenizer.EOS,))
    if arch == "qwen2":
        base.update(qkv_bias=True, tie_word_embeddings=False)
    if arch == "qwen3":
        base.update(qk_norm=True, head_dim=32, rope_theta=1e6)
    if arch == "llama3":
        base.update(arch="llama", rope_scaling=LLAMA3_SCALING, rope_theta=500000.0)
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def tiny_config() -> Callable[..., ModelConfig]:
    """``tiny_config(arch, **overrides)``; arch llama, qwen2, qwen3 or llama3 (llama with rope scaling)."""
    return make_tiny_config


@pytest.fixture
def llama3_scaling() -> dict[str, object]:
    return dict(LLAMA3_SCALING)


@pytest.fixture
def cpu_offload() -> Offload:
    registry = Registry()
    cpu = registry.cpu()
    return Offload(cpu, cpu)


@pytest.fixture
def unprivileged() -> list[str]:
    """The prefix of a command line whose process file permissions stop: none for a user, and for root setpriv
    without the capabilities that read past them (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH); skipped where root
    cannot drop them."""
    if os.geteuid() != 0:
        return []
    prefix = [shutil.which("setpriv") or "setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    try:
        dropped = subprocess.run([*prefix, "true"], capture_output=True, timeout=HANG_GUARD_S).returncode == 0
    except OSError:
        dropped = False
    if not dropped:
        pytest.skip("root here cannot drop the capabilities that read past file permissions (setpriv)")
    return prefix


@pytest.fixture
def model(tiny_config):
    """The scheduler tests' model (a module that needs another defines its own ``model``)."""
    return synthetic_model(tiny_config("qwen3", max_position=160), "q8", seed=21)


@pytest.fixture
def engine(model):
    """A CPU engine of ``model``."""
    with kestrel_core.load(model, backend="cpu") as engine:
        yield engine
