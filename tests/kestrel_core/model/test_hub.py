"""Models by Hub name (kestrel_core/model/hub.py) against a Hub on 127.0.0.1 (fake_hub) through the real
``huggingface_hub`` client: what is fetched, what is picked, what is refused, and the cache used offline."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kestrel_core.errors import KestrelError
from kestrel_core.model.hub import Hub, HubSpec, _refusal, cached_models, choose_files, parse_hub_spec

from ..waits import HANG_GUARD_S, within
from .fake_hub import FakeHub, repo_files, serving, socket_waits

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"
GGUF = (FIXTURES / "tiny-llama.gguf").read_bytes()


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    repos = {
        "org/tiny": repo_files(FIXTURES / "tiny-qwen3") | {"pytorch_model.bin": b"pickle", "modeling.py": b"code"},
        "org/tiny-GGUF": {"tiny-Q4_K_M.gguf": GGUF, "tiny-Q8_0.gguf": GGUF + b"\0", "README.md": b"#"},
        "org/named-GGUF": {"tiny.Q5_K_M.gguf": GGUF, "tiny.gguf": GGUF + b"\0", "sub/tiny.gguf": GGUF + b"\0\0"},
        "org/vlm-GGUF": {"vlm-BF16.gguf": GGUF, "vlm-Q8_0.gguf": GGUF, "mmproj-BF16.gguf": b"GGUFclip",
                         "mmproj-F16.gguf": b"GGUFclip", "mmproj-vlm-F32.gguf": b"GGUFclip"},
        "org/pickled": {"config.json": b"{}", "pytorch_model.bin": b"pickle"},
        "org/gated": {"config.json": b"{}"},
        "org/sharded": {"config.json": b"{}", "model.safetensors.index.json": json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}).encode(),
            "model-00001-of-00002.safetensors": b"1", "model-00002-of-00002.safetensors": b"2",
            "consolidated.safetensors": b"12", "original/params.safetensors": b"p", "1_Pooling/config.json": b"{ }"},
        "org/globbed": {"config.json": b"{}", "model.safetensors.index.json": json.dumps({"weight_map": {
            "a": "model.safetensors", "b": "*"}}).encode(), "model.safetensors": b"1", "pytorch_model.bin": b"p"},
    }
    with serving(FakeHub(repos, gated={"org/gated"})) as h:
        yield h


@pytest.mark.parametrize(("text", "spec"), [
    ("Qwen/Qwen3-0.6B", HubSpec("Qwen/Qwen3-0.6B")),
    ("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", HubSpec("bartowski/Llama-3.2-1B-Instruct-GGUF",
                                                                  tag="Q4_K_M")),
    ("https://huggingface.co/org/m@v1.0", HubSpec("org/m", revision="v1.0")),
    ("org/m@refs/pr/1:Q8_0", HubSpec("org/m", revision="refs/pr/1", tag="Q8_0")),
])
def test_a_hub_name_is_read_with_its_revision_and_tag(text: str, spec: HubSpec) -> None:
    assert parse_hub_spec(text) == spec
    assert parse_hub_spec(str(spec)) == spec


@pytest.mark.parametrize("text", ["model", "./org/m", "/abs/m", "org/m/extra", "org/..", "../m", "org/m@..",
                                  "~/m", "org/-m", ""])
def test_what_is_not_a_hub_name_stays_a_missing_path(text: str) -> None:
    assert parse_hub_spec(text) is None


def test_the_file_picked_from_a_repository() -> None:
    plain = HubSpec("o/m")
    assert choose_files(plain, ["config.json", "model.safetensors", "m-Q8_0.gguf"]) == ("safetensors", "")
    assert choose_files(HubSpec("o/m", tag="Q8_0"), ["config.json", "model.safetensors", "m-Q8_0.gguf"]) == (
        "gguf", "m-Q8_0.gguf")
    many = ["m-Q2_K.gguf", "m-Q4_K_M.gguf", "m-f16.gguf", "m-Q8_0.gguf", "m-IQ4_XS.gguf"]
    assert choose_files(plain, many) == ("gguf", "m-Q8_0.gguf")  # kestrel's q8 codes are Q8_0's
    assert choose_files(plain, many[:3]) == ("gguf", "m-f16.gguf")
    assert choose_files(HubSpec("o/m", tag="q4_k_m"), many) == ("gguf", "m-Q4_K_M.gguf")
    assert choose_files(plain, ["m-IQ4_XS.gguf"]) == ("gguf", "m-IQ4_XS.gguf")
    split = ["Q8_0/m-Q8_0-00002-of-00002.gguf", "Q8_0/m-Q8_0-00001-of-00002.gguf"]
    assert choose_files(plain, split) == ("gguf", "Q8_0/m-Q8_0-00001-of-00002.gguf")  # a split file: its first part
    assert choose_files(plain, [*split, "m-Q4_K_M.gguf"]) == ("gguf", split[1])  # the more precise, though split
    assert choose_files(plain, [*split, "m-Q8_0.gguf"]) == ("gguf", "m-Q8_0.gguf")  # whole before split
    with pytest.raises(KestrelError, match=r"no GGUF file for the tag 'Q3_K_S' \(the repository has m-IQ4"):
        choose_files(HubSpec("o/m", tag="Q3_K_S"), many)
    with pytest.raises(KestrelError, match="pickle"):
        choose_files(plain, ["config.json", "pytorch_model.bin"])
    with pytest.raises(KestrelError, match="neither safetensors"):
        choose_files(plain, ["README.md"])


def _llama_cpp_tag_matches(tag: str, path: str) -> bool:
    """llama.cpp's find_best_model (common/download.cpp): the tag, any case, followed by "." or "-"."""
    return re.search(re.escape(tag) + "[.-]", path, re.IGNORECASE) is not None


@pytest.mark.parametrize(("tag", "files", "picked"), [
    ("Q6_K", ["m-Q6_K_L.gguf", "m-Q4_K_M.gguf"], None),  # bartowski's _L variant is another quant
    ("Q4_K", ["m-Q4_K_S.gguf", "m-Q4_K_M.gguf"], None),
    ("Q6_K", ["m-Q6_K_L.gguf", "Q6_K/m-Q6_K-00002-of-00002.gguf", "Q6_K/m-Q6_K-00001-of-00002.gguf"],
     "Q6_K/m-Q6_K-00001-of-00002.gguf"),  # the tag's own file, though split
    ("F16", ["m-Q4_0-F16.gguf", "F16/m-F16-00001-of-00002.gguf", "F16/m-F16-00002-of-00002.gguf"],
     "F16/m-F16-00001-of-00002.gguf"),  # the file of that quant before one that only names it
    ("q6_k_l", ["m-Q6_K_L.gguf", "m-Q6_K.gguf"], "m-Q6_K_L.gguf"),
    ("Q8_0", ["m.Q8_0.gguf", "m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"], "m.Q8_0.gguf"),
])
def test_a_tag_picks_its_own_quant_as_llama_cpp_does(tag: str, files: list[str], picked: str | None) -> None:
    if picked is None:
        assert not any(_llama_cpp_tag_matches(tag, f) for f in files)
        with pytest.raises(KestrelError, match=f"no GGUF file for the tag '{tag}'"):
            choose_files(HubSpec("o/m", tag=tag), files)
    else:
        assert _llama_cpp_tag_matches(tag, picked)
        assert choose_files(HubSpec("o/m", tag=tag), files) == ("gguf", picked)


# the GGUF files llama.cpp's gguf_filename_is_model (common/download.cpp) tells from a model by their names
COMPANIONS = ["mmproj-F16.gguf", "mmproj-m-Q8_0.gguf", "m-Q8_0-mmproj-f16.gguf", "imatrix-m-Q8_0.gguf",
              "m.imatrix.gguf", "mtp-m-Q8_0.gguf", "eagle3-m-Q8_0.gguf", "dflash-m-Q8_0.gguf", "dspark-m-Q8_0.gguf"]


@pytest.mark.parametrize("companion", COMPANIONS)
def test_a_models_companion_gguf_is_never_the_model(companion: str) -> None:
    """A vision projector, an importance matrix or a draft head beside the model: never picked, by no tag or by
    its quant, nor alone."""
    files = [companion, "m-Q4_K_M.gguf"]
    assert choose_files(HubSpec("o/m"), files) == ("gguf", "m-Q4_K_M.gguf")
    for tag in ("Q8_0", "F16"):
        with pytest.raises(KestrelError, match=rf"no GGUF file for the tag '{tag}' \(the repository has m-Q4_K_M"):
            choose_files(HubSpec("o/m", tag=tag), files)
    with pytest.raises(KestrelError, match="its GGUF files are a model's companions"):
        choose_files(HubSpec("o/m"), [companion])


def test_a_vision_repository_gives_and_lists_its_language_model(hub: FakeHub, tmp_path: Path) -> None:
    h = Hub(hub.url, str(tmp_path))
    assert h.fetch(HubSpec("org/vlm-GGUF")).name == "vlm-Q8_0.gguf"
    assert h.fetch(HubSpec("org/vlm-GGUF", tag="BF16")).name == "vlm-BF16.gguf"
    with pytest.raises(KestrelError, match="no GGUF file for the tag 'F16'"):
        h.fetch(HubSpec("org/vlm-GGUF", tag="F16"))
    from huggingface_hub import snapshot_download

    snapshot_download("org/vlm-GGUF", cache_dir=str(tmp_path), endpoint=hub.url)  # the projectors too
    assert [m.name for m in cached_models(str(tmp_path))] == ["org/vlm-GGUF:BF16", "org/vlm-GGUF:Q8_0"]


def test_a_safetensors_repository_is_fetched_without_pickles_or_code(hub: FakeHub, tmp_path: Path) -> None:
    snap = Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/tiny"))
    assert sorted(p.name for p in snap.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                      "tokenizer_config.json"]
    assert not any(f.endswith((".bin", ".py")) for f in hub.served)
    assert (snap / "model.safetensors").read_bytes() == (FIXTURES / "tiny-qwen3" / "model.safetensors").read_bytes()


def test_a_sharded_repository_is_fetched_as_its_index_names_it(hub: FakeHub, tmp_path: Path) -> None:
    """Only the shards the index names (hf.weight_files reads those), not a consolidated copy or a folder's."""
    snap = Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/sharded"))
    assert sorted(f.removeprefix("org/sharded/") for f in hub.served) == [
        "1_Pooling/config.json", "config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert (snap / "model-00002-of-00002.safetensors").read_bytes() == b"2"


def test_a_gguf_repository_gives_the_tagged_or_the_most_precise_file(hub: FakeHub, tmp_path: Path) -> None:
    h = Hub(hub.url, str(tmp_path))
    assert h.fetch(HubSpec("org/tiny-GGUF")).name == "tiny-Q8_0.gguf"
    tagged = h.fetch(HubSpec("org/tiny-GGUF", tag="Q4_K_M"))
    assert tagged.name == "tiny-Q4_K_M.gguf" and tagged.read_bytes() == GGUF
    assert sorted(hub.served) == ["org/tiny-GGUF/tiny-Q4_K_M.gguf", "org/tiny-GGUF/tiny-Q8_0.gguf"]


@pytest.mark.parametrize(("name", "why"), [
    ("org/missing", "no such local path, and no such repository on the Hugging Face Hub"),
    ("org/gated", "is gated: accept its terms on huggingface.co/org/gated, then set HF_TOKEN"),
    ("org/tiny@v9", "the repository has no revision 'v9'"),
    ("org/pickled", "pickle checkpoints"),
    ("org/tiny-GGUF:Q2_K", "no GGUF file for the tag 'Q2_K'"),
    ("org/globbed", "index.json names '\\*', not a safetensors file of the repository"),  # not a pattern
])
def test_what_the_hub_refuses_is_one_line(hub: FakeHub, tmp_path: Path, name: str, why: str) -> None:
    spec = parse_hub_spec(name)
    assert spec is not None
    with pytest.raises(KestrelError, match=why) as info:
        Hub(hub.url, str(tmp_path)).fetch(spec)
    assert "\n" not in str(info.value) and not any(f.endswith(".bin") for f in hub.served)


def test_an_unreachable_hub_falls_back_to_the_cache(hub: FakeHub, tmp_path: Path) -> None:
    Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/tiny"))
    Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/tiny-GGUF", tag="Q4_K_M"))
    down = Hub("http://127.0.0.1:9", str(tmp_path))  # nothing listens on the discard port
    assert (down.fetch(HubSpec("org/tiny")) / "config.json").is_file()
    assert down.fetch(HubSpec("org/tiny-GGUF")).name == "tiny-Q4_K_M.gguf"  # the one the cache holds
    with pytest.raises(KestrelError, match="org/gated: no such local path, not in the Hugging Face cache, and the Hub"):
        down.fetch(HubSpec("org/gated"))


@pytest.fixture
def silent_hub() -> Iterator[str]:
    """The URL of a Hub that takes the connection and never answers (a stalled proxy, a captive portal): the
    kernel completes the handshake of a listening socket nobody accepts from."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_hub_that_never_answers_falls_back_to_the_cache_after_the_etag_timeout(
        hub: FakeHub, silent_hub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The listing waits HF_HUB_ETAG_TIMEOUT as it is when the fetch runs (its default is 10 s), as
    huggingface_hub's own metadata requests do, then the cache answers as for an unreachable Hub."""
    from huggingface_hub import constants

    cached = Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/tiny-GGUF", tag="Q4_K_M"))
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
    waits = socket_waits(monkeypatch, silent_hub)
    assert within(HANG_GUARD_S, lambda: Hub(silent_hub, str(tmp_path)).fetch(HubSpec("org/tiny-GGUF"))) == cached
    assert waits and set(waits) == {1}, waits
    with pytest.raises(KestrelError, match="org/gated: no such local path, not in the Hugging Face cache, and the Hub"):
        within(HANG_GUARD_S, lambda: Hub(silent_hub, str(tmp_path)).fetch(HubSpec("org/gated")))


@pytest.mark.parametrize("status", [500, 503, 504, 429, 404])
def test_a_cached_model_loads_while_the_hub_fails_as_hf_hub_download_does(hub: FakeHub, tmp_path: Path,
                                                                          status: int) -> None:
    """The Hub down, rate-limiting, or saying the repository is not there (as it says of a private one to a
    missing or expired token): the cached copy, as huggingface_hub's hf_hub_download serves it; a model not in
    the cache gets the Hub's answer."""
    from huggingface_hub import hf_hub_download

    h = Hub(hub.url, str(tmp_path))
    cached = h.fetch(HubSpec("org/tiny-GGUF", tag="Q4_K_M"))
    if status == 404:
        del hub.repos["org/tiny-GGUF"], hub.repos["org/tiny"]
    else:
        hub.failing.update({"org/tiny-GGUF": status, "org/tiny": status})
    reference = hf_hub_download("org/tiny-GGUF", "tiny-Q4_K_M.gguf", cache_dir=str(tmp_path), endpoint=hub.url)
    assert h.fetch(HubSpec("org/tiny-GGUF", tag="Q4_K_M")) == cached == Path(reference)
    why = "no such repository on the Hugging Face Hub" if status == 404 else rf"Hub refused it \(.*{status}"
    with pytest.raises(KestrelError, match=f"model org/tiny: .*{why}"):
        h.fetch(HubSpec("org/tiny"))


def test_a_cached_gated_model_loads_without_the_token_that_fetched_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import hf_hub_download

    repo = {"m-Q4_K_M.gguf": GGUF}
    with serving(FakeHub({"org/gated-GGUF": repo, "org/other-GGUF": repo}, gated={"org/gated-GGUF", "org/other-GGUF"},
                         tokens={"hf_granted"})) as fake:
        h = Hub(fake.url, str(tmp_path))
        monkeypatch.setenv("HF_TOKEN", "hf_granted")
        cached = h.fetch(HubSpec("org/gated-GGUF"))
        monkeypatch.delenv("HF_TOKEN")
        reference = hf_hub_download("org/gated-GGUF", "m-Q4_K_M.gguf", cache_dir=str(tmp_path), endpoint=fake.url)
        assert h.fetch(HubSpec("org/gated-GGUF")) == cached == Path(reference)
        with pytest.raises(KestrelError, match="org/other-GGUF is gated: accept its terms"):
            h.fetch(HubSpec("org/other-GGUF"))


def test_a_cached_file_of_another_size_than_the_hubs_is_downloaded_again(hub: FakeHub, tmp_path: Path) -> None:
    """A download cut short or a damaged disk: where the cached file's size is not the one the Hub lists, the
    file is fetched again (what is the Hub's size is not)."""
    h = Hub(hub.url, str(tmp_path))
    gguf = h.fetch(HubSpec("org/tiny-GGUF", tag="Q4_K_M"))
    weights = h.fetch(HubSpec("org/tiny")) / "model.safetensors"
    whole = weights.read_bytes()
    for path in (gguf, weights):
        os.truncate(path.resolve(), path.stat().st_size * 6 // 10)
    hub.served.clear()
    assert h.fetch(HubSpec("org/tiny-GGUF", tag="Q4_K_M")).read_bytes() == GGUF
    assert (h.fetch(HubSpec("org/tiny")) / "model.safetensors").read_bytes() == whole
    assert sorted(hub.served) == ["org/tiny-GGUF/tiny-Q4_K_M.gguf", "org/tiny/model.safetensors"]


def test_a_damaged_cached_file_names_the_way_out_and_pull_force_takes_it(hub: FakeHub, tmp_path: Path) -> None:
    """Bytes changed in place (the size the Hub's): the load says the file is corrupt and how to download it
    again, and `kestrel pull --force` does."""
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "KESTREL_HOME": str(tmp_path / "k"),
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    pulled = _kestrel("pull", "org/tiny-GGUF:Q4_K_M", env=env)
    assert pulled.returncode == 0, pulled.stderr
    blob = Path(pulled.stdout.strip()).resolve()
    blob.write_bytes(b"XXXX" + GGUF[4:])
    ran = _kestrel("run", "-m", "org/tiny-GGUF:Q4_K_M", "--max-tokens", "2", "Hi", env={**env, "HF_HUB_OFFLINE": "1"})
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert "truncated or corrupt" in ran.stderr and "kestrel pull --force org/tiny-GGUF:Q4_K_M" in ran.stderr
    offline = _kestrel("pull", "--force", "org/tiny-GGUF:Q4_K_M", env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 2 and "HF_HUB_OFFLINE is set" in offline.stderr and blob.read_bytes() != GGUF
    forced = _kestrel("pull", "--force", "org/tiny-GGUF:Q4_K_M", env=env)
    assert forced.returncode == 0, forced.stderr
    assert blob.read_bytes() == GGUF


def test_a_tag_missing_from_the_cache_says_the_hub_was_not_asked(hub: FakeHub, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline or unreachable, the files a missing tag's error lists are the cache's, not the repository's."""
    from huggingface_hub import constants

    Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/tiny-GGUF", tag="Q4_K_M"))
    cache_has = r"no GGUF file for the tag 'Q8_0' \(the Hugging Face cache has tiny-Q4_K_M.gguf\), and the Hub's"
    with pytest.raises(KestrelError, match=cache_has + " list is unknown: the Hub cannot be reached"):
        Hub("http://127.0.0.1:9", str(tmp_path)).fetch(HubSpec("org/tiny-GGUF", tag="Q8_0"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(KestrelError, match=cache_has + " list is unknown: HF_HUB_OFFLINE is set"):
        Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/tiny-GGUF", tag="Q8_0"))


@pytest.mark.parametrize(("status", "code", "message"), [
    (401, "", "Invalid credentials in Authorization header"),  # an expired or revoked HF_TOKEN
    (403, "", "Access to this resource is disabled."),
    (403, "GatedRepo", "Access to model org/x is restricted and you are not in the authorized list. Visit "
                       "https://huggingface.co/org/x to ask for access."),  # a token, and the terms not accepted
    (400, "", "Invalid repository name"),
])
def test_a_hub_refusal_keeps_the_hubs_reason(hub: FakeHub, tmp_path: Path, status: int, code: str,
                                             message: str) -> None:
    """The reason the Hub gives, as huggingface_hub's error holds it (its server_message), in one line."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    hub.refusing["org/x"] = (status, code, message)
    with pytest.raises(HfHubHTTPError) as client_error:
        HfApi(endpoint=hub.url).repo_info("org/x")
    assert client_error.value.server_message == message
    with pytest.raises(KestrelError) as refused:
        Hub(hub.url, str(tmp_path)).fetch(HubSpec("org/x"))
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert "gated: accept its terms on huggingface.co/org/x" in str(refused.value) if code else \
        f"the Hugging Face Hub refused it ({status} " in str(refused.value)


def test_a_refusal_through_requests_keeps_its_reason() -> None:
    """huggingface_hub before 1.0 runs on requests, whose response gives its reason as ``reason`` (httpx's as
    ``reason_phrase``): the refusal says it, in one line."""
    import requests
    from huggingface_hub.errors import HfHubHTTPError

    response = requests.Response()
    response.status_code, response.reason = 403, "Forbidden"
    refused = _refusal(HubSpec("org/x"), HfHubHTTPError("403 Forbidden", response=response))  # type: ignore[arg-type]
    assert refused == "model org/x: the Hugging Face Hub refused it (403 Forbidden)"


def _kestrel(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kestrel_core.cli", *args], capture_output=True, text=True,
                          timeout=HANG_GUARD_S, env={**os.environ, **env})


def test_kestrel_run_and_pull_take_a_hub_name_and_run_offline_after(hub: FakeHub, tmp_path: Path) -> None:
    """The CLI end to end: `kestrel pull` fetches into HF_HOME, `kestrel run` generates from the Hub name the
    same tokens as from the local directory, and with HF_HUB_OFFLINE=1 from the cache alone."""
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "KESTREL_HOME": str(tmp_path / "k"),
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    pulled = _kestrel("pull", "org/tiny", env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert Path(pulled.stdout.strip()).joinpath("model.safetensors").is_file()
    ask = ("run", "--no-chat", "--max-tokens", "6", "--temperature", "0", "--json", "Hello")
    local = _kestrel(*ask, "-m", str(FIXTURES / "tiny-qwen3"), env=env)
    by_name = _kestrel(*ask, "-m", "org/tiny", env=env)
    offline = _kestrel(*ask, "-m", "org/tiny", env={**env, "HF_HUB_OFFLINE": "1"})
    assert local.returncode == by_name.returncode == offline.returncode == 0, by_name.stderr + offline.stderr
    texts = [json.loads(r.stdout)["text"] for r in (local, by_name, offline)]
    assert texts[0] and texts == [texts[0]] * 3
    missing = _kestrel("run", "-m", "org/missing", "Hi", env=env)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "org/missing: no such local path, and no such repository on the Hugging Face Hub" in missing.stderr


def test_a_warning_of_huggingface_hub_is_printed_once(hub: FakeHub, tmp_path: Path) -> None:
    """huggingface_hub prints its warnings with a handler of its own; the CLI's does not print them again."""
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "KESTREL_HOME": str(tmp_path / "k"),
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    hub.warning = "this Hub is a test double"
    pulled = _kestrel("pull", "org/tiny-GGUF:Q4_K_M", env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stderr.count("this Hub is a test double") == 1, pulled.stderr


def test_a_model_loaded_by_hub_name_keeps_that_name(hub: FakeHub, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_model("org/tiny")`` fetches it; the server names it so (as vLLM does)."""
    from kestrel_core.model import loader
    from kestrel_core.serve.server import default_model_name

    monkeypatch.setattr(loader, "fetch", Hub(hub.url, str(tmp_path)).fetch)
    loaded = loader.load_model("org/tiny", cache="off")
    assert loaded.source.startswith("org/tiny (") and str(tmp_path) in loaded.source
    assert default_model_name(loaded.source) == "org/tiny"
    assert loaded.model.config.arch == "qwen3"


def test_a_hub_model_with_an_adapter_is_named_with_it(hub: FakeHub, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's default name shows the adapter, as it does for a local path, not the base's name alone."""
    from kestrel_core.model import loader
    from kestrel_core.serve.server import default_model_name

    from .lora_adapters import peft_adapter

    monkeypatch.setattr(loader, "fetch", Hub(hub.url, str(tmp_path / "hf")).fetch)
    peft_adapter(tmp_path / "my-adapter", FIXTURES / "tiny-qwen3", ["self_attn.q_proj"])
    loaded = loader.load_model("org/tiny", cache="off", lora=str(tmp_path / "my-adapter"))
    assert loaded.source.startswith("org/tiny (") and loaded.source.endswith(") + LoRA my-adapter")
    assert default_model_name(loaded.source) == "org/tiny-+-LoRA-my-adapter"


def test_without_huggingface_hub_a_hub_name_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as when it is not installed
    with pytest.raises(KestrelError, match="huggingface_hub, which fetches models by Hub name, cannot be imported"):
        Hub().fetch(HubSpec("org/m"))


def test_a_split_gguf_is_fetched_whole_and_listed_once(tmp_path: Path) -> None:
    """Every part of the picked quant is fetched into one snapshot directory (and no other quant's), the first
    part is what loads, and the cache lists the split file once, by its tag, with all its parts' bytes."""
    from .test_gguf_split import WHOLE, split

    parts = split(WHOLE, tmp_path / "parts" / "tiny-Q8_0.gguf", 10)
    repo = {f"Q8_0/{p.name}": p.read_bytes() for p in parts} | {"tiny-Q4_K_M.gguf": GGUF}
    with serving(FakeHub({"org/split-GGUF": repo})) as fake:
        path = Hub(fake.url, str(tmp_path / "cache")).fetch(HubSpec("org/split-GGUF"))
        assert sorted(fake.served) == sorted(f"org/split-GGUF/{name}" for name in repo if name.startswith("Q8_0/"))
    assert path.name == parts[0].name and sorted(p.name for p in path.parent.iterdir()) == [p.name for p in parts]
    import kestrel_core

    with kestrel_core.load(str(path), backend="cpu") as engine:
        assert engine.model.config.num_experts == 8
    (listed,) = cached_models(str(tmp_path / "cache"))
    assert (listed.name, listed.path, listed.size) == ("org/split-GGUF:Q8_0", path, sum(p.stat().st_size
                                                                                        for p in parts))


def test_the_cache_lists_what_kestrel_can_load_by_the_name_it_takes(hub: FakeHub, tmp_path: Path) -> None:
    h = Hub(hub.url, str(tmp_path))
    h.fetch(HubSpec("org/tiny"))
    h.fetch(HubSpec("org/tiny-GGUF", tag="Q4_K_M"))
    h.fetch(HubSpec("org/tiny-GGUF"))
    from huggingface_hub import snapshot_download  # a repository kestrel cannot load: left out

    snapshot_download("org/pickled", cache_dir=str(tmp_path), endpoint=hub.url)
    models = cached_models(str(tmp_path))
    assert [(m.name, m.kind) for m in models] == [("org/tiny", "safetensors"), ("org/tiny-GGUF:Q4_K_M", "gguf"),
                                                  ("org/tiny-GGUF:Q8_0", "gguf")]
    assert models[1].size == len(GGUF) and models[1].path.name == "tiny-Q4_K_M.gguf"
    for m in models:  # each name loads what the listing shows
        spec = parse_hub_spec(m.name)
        assert spec is not None and Hub("http://127.0.0.1:9", str(tmp_path)).fetch(spec) == m.path
    assert cached_models(str(tmp_path / "none")) == []


def test_a_cache_that_cannot_be_read_is_an_error_naming_it_not_an_empty_one(hub: FakeHub, tmp_path: Path,
                                                                          unprivileged: list[str]) -> None:
    """`kestrel list` says the cache cannot be read (exit 2) where it is a file, or a directory this user may not
    read, rather than "no local models"; a cache not made yet holds none."""
    Hub(hub.url, str(tmp_path / "hf")).fetch(HubSpec("org/tiny"))
    (tmp_path / "notes").write_text("my notes")
    with pytest.raises(KestrelError, match=f"^cannot read the Hugging Face cache {tmp_path / 'notes'}: not a "
                                           "directory$"):
        cached_models(str(tmp_path / "notes"))
    (tmp_path / "hf").chmod(0)
    try:
        done = subprocess.run([*unprivileged, sys.executable, "-m", "kestrel_core.cli", "list"], capture_output=True,
                              text=True, timeout=HANG_GUARD_S, env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf"),
                                                                    "KESTREL_HOME": str(tmp_path / "k")})
    finally:
        (tmp_path / "hf").chmod(0o755)
    assert (done.returncode, done.stdout) == (2, ""), done.stdout + done.stderr
    assert done.stderr.strip() == f"error: cannot read the Hugging Face cache {tmp_path / 'hf'}: permission denied"
    assert [m.name for m in cached_models(str(tmp_path / "hf"))] == ["org/tiny"]


def test_a_model_folder_that_cannot_be_read_is_left_out_with_a_warning(hub: FakeHub, tmp_path: Path,
                                                                     unprivileged: list[str]) -> None:
    """One model's folder this user may not read (huggingface_hub's scan_cache_dir stops at it): `kestrel list`
    lists the others, exit 0, and one warning line names the folder."""
    h = Hub(hub.url, str(tmp_path / "hf"))
    h.fetch(HubSpec("org/tiny"))
    h.fetch(HubSpec("org/tiny-GGUF"))
    locked = tmp_path / "hf" / "models--org--tiny-GGUF"
    locked.chmod(0)
    try:
        done = subprocess.run([*unprivileged, sys.executable, "-m", "kestrel_core.cli", "list", "--json"],
                              capture_output=True, text=True, timeout=HANG_GUARD_S,
                              env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf"),
                                   "KESTREL_HOME": str(tmp_path / "k")})
    finally:
        locked.chmod(0o755)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [json.loads(line)["name"] for line in done.stdout.splitlines()] == ["org/tiny"]
    assert done.stderr.strip() == (f"WARNING  cannot read models--org--tiny-GGUF (permission denied) in the Hugging "
                                   f"Face cache {tmp_path / 'hf'}: its models are left out")
    assert [m.name for m in cached_models(str(tmp_path / "hf"))] == ["org/tiny", "org/tiny-GGUF:Q8_0"]


def test_a_sharded_snapshot_without_all_its_shards_is_neither_listed_nor_loaded(hub: FakeHub, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A download that failed after the index and the first shard (the Hub down for one file, asked again as
    huggingface_hub asks, then its answer): the cache's copy is not a model until the shards the index names are
    all there, as a split GGUF's parts must be."""
    from kestrel_core.model import hub_files

    monkeypatch.setattr(hub_files, "RETRY_WAITS_S", (0.01, 0.02))
    h = Hub(hub.url, str(tmp_path))
    hub.failing["org/sharded/model-00002-of-00002.safetensors"] = 503
    with pytest.raises(KestrelError, match=r"^model org/sharded: the Hugging Face Hub refused it \(503 Service "
                                           r"Unavailable: the Hub failed with 503\)$"):
        h.fetch(HubSpec("org/sharded"))
    assert hub.asked.count("org/sharded/model-00002-of-00002.safetensors") == 3
    snap = next((tmp_path / "models--org--sharded" / "snapshots").iterdir())
    assert (snap / "model.safetensors.index.json").is_file() and (snap / "model-00001-of-00002.safetensors").is_file()
    assert cached_models(str(tmp_path)) == []
    with pytest.raises(KestrelError, match="org/sharded: the Hugging Face cache holds it without "
                                           "model-00002-of-00002.safetensors; the Hub cannot be reached"):
        Hub("http://127.0.0.1:9", str(tmp_path)).fetch(HubSpec("org/sharded"))
    del hub.failing["org/sharded/model-00002-of-00002.safetensors"]
    assert h.fetch(HubSpec("org/sharded")) == snap
    assert [m.name for m in cached_models(str(tmp_path))] == ["org/sharded"]


def test_the_cache_names_a_gguf_without_a_quant_in_its_name_by_its_stem(hub: FakeHub, tmp_path: Path) -> None:
    """A quantization after a dot (TheBloke's names) is a tag; a file without one is named by its stem, which
    -m takes; one that neither picks (its stem belongs to a shorter file) is shown with its file."""
    from huggingface_hub import snapshot_download

    snapshot_download("org/named-GGUF", cache_dir=str(tmp_path), endpoint=hub.url)
    models = cached_models(str(tmp_path))
    assert [m.name for m in models] == ["org/named-GGUF (sub/tiny.gguf)", "org/named-GGUF:Q5_K_M",
                                        "org/named-GGUF:tiny"]
    for m in models[1:]:
        spec = parse_hub_spec(m.name)
        assert spec is not None and Hub("http://127.0.0.1:9", str(tmp_path)).fetch(spec) == m.path


def test_kestrel_list_shows_the_models_by_name(hub: FakeHub, tmp_path: Path) -> None:
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "KESTREL_HOME": str(tmp_path / "k"),
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    empty = _kestrel("list", env=env)
    assert empty.returncode == 0 and "no local models" in empty.stdout
    assert _kestrel("pull", "org/tiny-GGUF:Q4_K_M", env=env).returncode == 0
    listed = _kestrel("list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["name"], r["format"], r["size"]) for r in rows] == [("org/tiny-GGUF:Q4_K_M", "gguf", len(GGUF))]
    (tmp_path / "k" / "models").mkdir(parents=True)
    (tmp_path / "k" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(GGUF)  # the default, pulled
    table = _kestrel("list", env=env)
    assert table.returncode == 0, table.stderr
    assert "SmolLM2-135M-Instruct (the default: no -m)" in table.stdout and "org/tiny-GGUF:Q4_K_M" in table.stdout


def test_a_mistyped_local_path_read_as_a_hub_name_does_not_hang(silent_hub: str, tmp_path: Path) -> None:
    """``models/x.gguf`` (no such file) reads as a Hub name; a Hub that never answers ends it after
    HF_HUB_ETAG_TIMEOUT with one line."""
    env = {"HF_ENDPOINT": silent_hub, "HF_HOME": str(tmp_path / "hf"), "KESTREL_HOME": str(tmp_path / "k"),
           "HF_HUB_ETAG_TIMEOUT": "1"}
    try:
        ran = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "run", "-m", "models/x.gguf", "Hi"],
                             capture_output=True, text=True, timeout=HANG_GUARD_S, env={**os.environ, **env},
                             cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kestrel run -m models/x.gguf still waiting for the Hub after {HANG_GUARD_S:.0f} s")
    assert ran.returncode == 2, ran.stderr  # ended by the limit, which the line names
    assert "models/x.gguf: no such local path, not in the Hugging Face cache, and the Hub sent no answer to the " \
        "listing of models/x.gguf in 1 s (HF_HUB_ETAG_TIMEOUT: set it higher" in ran.stderr
    assert "Traceback" not in ran.stderr
