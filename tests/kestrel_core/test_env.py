"""Settings from the environment: every reader's good values, and every bad one as one line naming the variable."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kestrel_core.env import env_choice, env_flag, env_float, env_int, env_str
from kestrel_core.errors import KestrelError

VAR = "KESTREL_TEST_SETTING"


def _one_line_error(call, needle: str) -> str:  # noqa: ANN001 - any reader
    with pytest.raises(KestrelError) as info:
        call()
    message = str(info.value)
    assert needle in message and "\n" not in message, message
    return message


# -- the readers ----------------------------------------------------------------------------------------------


def test_env_str_strips_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_str(VAR, "dflt") == "dflt"
    monkeypatch.setenv(VAR, "  ")
    assert env_str(VAR, "dflt") == "dflt"  # empty after stripping counts as unset
    monkeypatch.setenv(VAR, " /a b/ ")
    assert env_str(VAR, "dflt") == "/a b/"


def test_env_choice_strips_ignores_case_and_refuses_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_choice(VAR, ("fast", "Exact"), default="fast") == "fast"
    monkeypatch.setenv(VAR, " EXACT ")
    assert env_choice(VAR, ("fast", "Exact"), default="fast") == "Exact"
    monkeypatch.setenv(VAR, "slow")
    _one_line_error(lambda: env_choice(VAR, ("fast", "Exact"), default="fast"),
                    f"{VAR} must be fast or Exact, got 'slow'")


@pytest.mark.parametrize(("text", "value"), [("1", True), ("on", True), ("YES", True), (" True ", True),
                                             ("0", False), ("off", False), ("No", False), ("false", False)])
def test_env_flag_spellings(monkeypatch: pytest.MonkeyPatch, text: str, value: bool) -> None:
    monkeypatch.setenv(VAR, text)
    assert env_flag(VAR, default=not value) is value


def test_env_flag_default_and_garbage(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_flag(VAR) is False and env_flag(VAR, default=True) is True
    monkeypatch.setenv(VAR, "")
    assert env_flag(VAR, default=True) is True
    for text in ("2", "maybe", "y"):
        monkeypatch.setenv(VAR, text)
        _one_line_error(lambda: env_flag(VAR), f"{VAR} must be 1 or 0 (on/off), got {text!r}")


def test_env_int(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_int(VAR, 7) == 7
    monkeypatch.setenv(VAR, " 12 ")
    assert env_int(VAR, 7, minimum=12) == 12
    monkeypatch.setenv(VAR, "3")
    _one_line_error(lambda: env_int(VAR, 7, minimum=4, what="a number of MiB"),
                    f"{VAR} must be a number of MiB >= 4, got '3'")
    for text in ("1.5", "1e3", "lots"):
        monkeypatch.setenv(VAR, text)
        _one_line_error(lambda: env_int(VAR, 7), f"{VAR} must be a whole number >= 0, got {text!r}")


def test_env_float(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_float(VAR, 2.5) == 2.5
    monkeypatch.setenv(VAR, "1e7")
    assert env_float(VAR, 2.5) == 1e7
    monkeypatch.setenv(VAR, "0.25")
    assert env_float(VAR, 2.5, minimum=0.25) == 0.25
    for text in ("inf", "-inf", "nan", "1e400", "-5", "abc"):
        monkeypatch.setenv(VAR, text)
        _one_line_error(lambda: env_float(VAR, 2.5), f"{VAR} must be a number >= 0, got {text!r}")


# -- the settings that read through them ------------------------------------------------------------------


def test_force_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel_core.registry import force_cpu

    assert not force_cpu()
    monkeypatch.setenv("KESTREL_FORCE_CPU", "on")
    assert force_cpu()
    monkeypatch.setenv("KESTREL_FORCE_CPU", "0")
    assert not force_cpu()
    monkeypatch.setenv("KESTREL_FORCE_CPU", "always")
    _one_line_error(force_cpu, "KESTREL_FORCE_CPU must be 1 or 0")


def _min_flops(name: str = "npu_sim", default: int = 0) -> int:
    from kestrel_core.registry import Backend

    info = SimpleNamespace(min_flops=default) if default else None
    return Backend.min_flops.fget(SimpleNamespace(name=name, info=info))  # type: ignore[attr-defined]


def test_min_flops(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _min_flops(default=4096) == 4096
    monkeypatch.setenv("KESTREL_NPU_SIM_MIN_FLOPS", "")
    assert _min_flops(default=4096) == 4096
    monkeypatch.setenv("KESTREL_NPU_SIM_MIN_FLOPS", "2e6")
    assert _min_flops(default=4096) == 2_000_000
    monkeypatch.setenv("KESTREL_NPU_SIM_MIN_FLOPS", " 42 ")
    assert _min_flops() == 42
    for text in ("inf", "nan", "-5", "1e400", "abc"):
        monkeypatch.setenv("KESTREL_NPU_SIM_MIN_FLOPS", text)
        _one_line_error(_min_flops, f"KESTREL_NPU_SIM_MIN_FLOPS must be a finite number >= 0, got {text!r}")
    monkeypatch.setenv("KESTREL_TOY_DASH_MIN_FLOPS", "7")  # a name's "-" is "_", as a shell can set it
    assert _min_flops(name="toy-dash") == 7


def test_plugins_allow_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel_core.registry import _allow_list

    assert _allow_list() is None  # unset: every backend
    monkeypatch.setenv("KESTREL_PLUGINS", "")
    assert _allow_list() == {"cpu"}  # set but empty: only the reference
    monkeypatch.setenv("KESTREL_PLUGINS", " cuda , npu_sim,")
    assert _allow_list() == {"cpu", "cuda", "npu_sim"}


def test_hf_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel_core.model.cache import MODEL_CACHE_ENV, model_cache_enabled

    monkeypatch.delenv(MODEL_CACHE_ENV)
    assert model_cache_enabled()
    monkeypatch.setenv(MODEL_CACHE_ENV, "off")
    assert not model_cache_enabled()
    monkeypatch.setenv(MODEL_CACHE_ENV, "1")
    assert model_cache_enabled()
    monkeypatch.setenv(MODEL_CACHE_ENV, "sometimes")
    _one_line_error(model_cache_enabled, "KESTREL_MODEL_CACHE must be 1 or 0")


def test_kestrel_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kestrel_core.model.pull import kestrel_home

    default = kestrel_home()
    assert default.name == "kestrel"
    monkeypatch.setenv("KESTREL_HOME", f" {tmp_path} ")
    assert kestrel_home() == tmp_path
    monkeypatch.setenv("KESTREL_HOME", "")
    assert kestrel_home() == default


def test_cpu_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    import kestrel_cpu

    monkeypatch.setenv("KESTREL_CPU_REFERENCE", "yes")
    device = kestrel_cpu.CpuDevice()
    assert device.kernels is None and "KESTREL_CPU_REFERENCE set" in device.description
    monkeypatch.setenv("KESTREL_CPU_REFERENCE", "0")
    assert "KESTREL_CPU_REFERENCE" not in kestrel_cpu.CpuDevice().description
    monkeypatch.setenv("KESTREL_CPU_REFERENCE", "numpy")
    _one_line_error(kestrel_cpu.CpuDevice, "KESTREL_CPU_REFERENCE must be 1 or 0")


def test_cpu_reference_garbage_is_the_cpu_backends_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel_core.registry import Registry

    monkeypatch.setenv("KESTREL_CPU_REFERENCE", "numpy")
    message = _one_line_error(lambda: Registry().cpu(), "the CPU reference backend did not bind")
    assert "KESTREL_CPU_REFERENCE must be 1 or 0 (on/off), got 'numpy'" in message


def test_npu_sim_pad_n_is_read_before_the_device_opens(monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel_npu_sim.device import ENV_PAD_N, open_device

    monkeypatch.setenv(ENV_PAD_N, "sometimes")  # refused even where pyopencl or OpenCL is missing
    _one_line_error(lambda: open_device({}), "KESTREL_NPU_SIM_PAD_N must be 1 or 0")
