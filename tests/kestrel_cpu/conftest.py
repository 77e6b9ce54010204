"""Helpers of the CPU backend's tests."""

from __future__ import annotations

import pytest

from kestrel_core.dispatch import Offload
from kestrel_core.registry import Registry
from kestrel_cpu import LAYERS_ENV


def cpu_offload(layers: bool = True) -> Offload:
    """The CPU backend's offload, from a registry of its own; ``layers=False``: the backend opened with
    ``KESTREL_CPU_LAYERS=0``, every layer op by op."""
    with pytest.MonkeyPatch.context() as mp:
        if not layers:
            mp.setenv(LAYERS_ENV, "0")
        cpu = Registry().cpu()
    return Offload(cpu, cpu)
