"""What a plugin author meets, written from docs/plugins.md: names, API versions, options, reasons as
written, the exported SelfTestCase; and non-finite logits of the model itself are a clear error."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

import kestrel_core
from kestrel_core import cli
from kestrel_core.errors import KestrelError, NonFiniteLogits
from kestrel_core.hookspecs import API_VERSION
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.presets import synthetic_model
from kestrel_core.registry import Backend, Registry, parse_backend_options

AUTHORS = Path(__file__).resolve().parents[1] / "fixtures" / "backends" / "authors"
PRESET = ["--preset", "smollm2-135m", "-n", "1", "--no-chat"]


def _tiny_model(seed: int = 0) -> kestrel_core.model.weights.Model:
    config = ModelConfig(arch="llama", vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position=64, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
    return synthetic_model(config, "q8", seed=seed)


@pytest.mark.parametrize("probing", ["1", "0"])
@pytest.mark.parametrize(("entry", "name"), [
    ("kestrel_named.py", "named_npu"),  # the file's name is not the backend's
    ("pkg_backend/__init__.py", "pkg_named"),  # was named "__init__"
    ("pkg_backend", "pkg_named"),
])
def test_a_path_backend_is_named_by_its_backend_info(monkeypatch: pytest.MonkeyPatch, entry: str, name: str,
                                                     probing: str) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(AUTHORS / entry))
    monkeypatch.setenv("KESTREL_PROBE", probing)
    reg = Registry()
    paths = [b for b in reg.candidates() if b.source.startswith("path")]
    assert [b.name for b in paths] == [name]
    assert reg.select(name).bound and reg.select("auto").name == name  # an npu: auto takes it
    reg.close()


def test_the_allow_list_is_comma_separated_and_uses_backend_info_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", f"{AUTHORS / 'kestrel_named.py'}:{AUTHORS / 'pkg_backend'}"
                                               f":{AUTHORS / 'api_string.py'}")
    monkeypatch.setenv("KESTREL_PLUGINS", " named_npu , pkg_named,")
    reg = Registry()
    reg.bind_all()
    assert reg.backends["named_npu"].bound and reg.backends["pkg_named"].bound
    assert reg.backends["api_string"].reason == "not in KESTREL_PLUGINS"
    reg.close()


def test_an_entry_points_backend_info_must_carry_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(AUTHORS / "kestrel_named.py"))
    reg = Registry()
    module = reg.describe("named_npu").plugin
    reg.backends["renamed"] = Backend("renamed", "entry point kestrel_named", load=lambda: module)
    backend = reg.describe("renamed")
    assert backend.reason == "BackendInfo.name 'named_npu' differs from the name 'renamed' given by its entry point"


def test_api_version_as_a_string(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", f"{AUTHORS / 'api_string.py'}:{AUTHORS / 'api_garbage.py'}")
    reg = Registry()
    good = reg.bind("api_string")
    assert good.bound and good.info is not None and good.info.api_version == (1, 0)
    assert good.as_dict()["api_version"] == "1.0"
    bad = reg.bind("api_garbage")
    assert bad.reason == ("api_version must be (major, minor) such as kestrel_core.API_VERSION or a string like "
                          f"'{API_VERSION[0]}.{API_VERSION[1]}', got 'v1'")
    reg.close()


@pytest.mark.parametrize(("info", "reason"), [
    ('"huge", "1", API_VERSION, "g" * 200_000', "unknown kind 'ggg"),
    ('"huge", "1", "1." + "9" * 200_000, "gpu"', "api_version must be (major, minor)"),
    ('"huge", "1", (1, 10 ** 5000), "gpu"', "api_version must be (major, minor)"),
])
def test_a_bad_backend_info_value_is_shown_cut_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, info: str,
                                                     reason: str) -> None:
    """A value of the plugin's own in a reason is cut to the length every plugin text is (errors.safe_text), and
    an API version is parsed only as long as one can be: one short line, in ``kestrel backends`` and as the
    error of ``--backend``."""
    (tmp_path / "huge.py").write_text(f"""
from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_cpu import kestrel_close, kestrel_gemm_f32, kestrel_gemm_q8, kestrel_open  # noqa: F401


@hookimpl
def kestrel_backend_info():
    return BackendInfo({info})
""")
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "huge.py"))
    backend = Registry().bind("huge")
    assert backend.reason.startswith(reason) and len(backend.reason) < 500, backend.reason[:500]
    with pytest.raises(KestrelError) as error:
        Registry().select("huge")
    assert len(str(error.value)) < 600 and "\n" not in str(error.value)


def test_options_reach_kestrel_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(AUTHORS / "options.py"))
    reg = Registry({"device": "1", "mode": "fast=yes"})
    backend = reg.select("options")
    assert backend.plugin.SEEN[-1] == {"device": "1", "mode": "fast=yes"}
    assert backend.device_description == "options device=1,mode=fast=yes"
    reg.close()
    with kestrel_core.load(_tiny_model(), backend="options", backend_options={"queue": "2"}) as engine:
        assert engine.backend.plugin.SEEN[-1] == {"queue": "2"}
        assert len(list(engine.generate([1, 5, 7], max_tokens=2, stop_at_eos=False))) == 2
    with pytest.raises(KestrelError, match="backend option 'n' must be a string, got int"):
        Registry({"n": 1})  # type: ignore[dict-item]


def test_backend_option_on_the_command_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(AUTHORS / "options.py"))
    args = ["run", *PRESET, "--backend", "options", "--backend-option", "device=1", "--backend-option", "x.y-z="]
    assert cli.main([*args, "hi"]) == 0
    assert "backend: options (npu, options device=1,x.y-z=)" in capsys.readouterr().err
    assert Registry().select("options").plugin.SEEN[-1] == {}  # the CLI's options ended with its command
    for bad in ("novalue", "1key=v", "=v", "a b=c"):
        assert cli.main(["run", *PRESET, "--backend-option", bad, "hi"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--backend-option takes KEY=VALUE" in err and repr(bad) in err
    assert parse_backend_options(["a=1", "a=2", "b.c=="]) == {"a": "2", "b.c": "="}


def test_reasons_are_shown_as_written_not_as_markup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(AUTHORS / "markup.py"))
    buffer = io.StringIO()
    monkeypatch.setattr(cli, "out", Console(file=buffer, width=400, highlight=False))
    assert cli.main(["backends"]) == 0
    assert "needs [red]x[/red] in /dev/widget[0]" in buffer.getvalue()
    assert "probe" in buffer.getvalue()


def test_selftest_case_is_exported() -> None:
    from kestrel_core.selftest import SelfTestCase

    assert kestrel_core.SelfTestCase is SelfTestCase and "SelfTestCase" in kestrel_core.__all__


def test_non_finite_logits_on_the_cpu_path_are_a_clear_error() -> None:
    model = _tiny_model()
    model.final_norm[:] = np.nan
    with kestrel_core.load(model, backend="cpu") as engine:
        with pytest.raises(NonFiniteLogits, match="non-finite logits .* on the CPU path"):
            engine.logits([1, 2, 3])
        with pytest.raises(NonFiniteLogits):
            list(engine.generate([1, 2, 3], max_tokens=4))  # never an empty answer
