"""A Hugging Face Hub on 127.0.0.1 for the real ``huggingface_hub`` client: the calls it makes to list a
repository (``/api/models/R/tree/REV``, ``/api/models/R/revision/REV``) and to download a file
(``/R/resolve/REV/FILE``, HEAD then GET), with the Hub's error codes for a missing, gated or unknown-revision
repository, and its failures (a 5xx, a 429, a connection that stalls or trickles)."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest


@dataclass
class FakeHub:
    """Repositories ``{"owner/name": {path: bytes}}``; ``gated`` ones answer 401 GatedRepo to a request without
    one of ``tokens``; a repository of ``failing`` answers every request with its status (503: the Hub down), a
    file of it (``owner/name/path``) its downloads; one of ``refusing`` answers (status, X-Error-Code, message),
    the Hub's refusal with its reason; ``warning``, where set, goes with every answer (``X-HF-Warning``);
    ``served`` lists the files downloaded (GET), ``asked`` those whose metadata was asked for (HEAD, answered
    or not). A request whose path (without its query) matches a pattern of ``stalling`` (fnmatch's: a listing,
    ``/api/models/R``; a file at any revision, ``/R/resolve/*/FILE``) is answered with that many bytes of its
    body (0: not even its headers), then nothing until the server stops, as a stalled proxy does, and listed in
    ``stalled``; where ``spared`` gives the pattern a count, that many requests matching it are first answered
    in full. A download matching a pattern of ``holding`` gets that many bytes of its body, is listed in
    ``held``, and gets the rest once ``release`` is set; one matching a pattern of ``trickling`` gets its body
    in chunks of that many bytes, ``between_chunks()`` called before each but the first. A file of ``in_xet``
    (``owner/name/path``) says it is stored in Xet; one of ``on_storage`` answers its metadata request with a
    redirect to a storage host (the server under another name, ``localhost``), which lists the Authorization
    each download from it carried in ``storage_authorizations``. A repository's files are its main branch, whose
    commit is named by their content: a test that changes them pushes a commit, and the files of every commit
    an answer named stay there by its sha (``commits``, by ``owner/name@sha``)."""

    repos: dict[str, dict[str, bytes]]
    gated: set[str] = field(default_factory=set)
    tokens: set[str] = field(default_factory=set)
    failing: dict[str, int] = field(default_factory=dict)
    refusing: dict[str, tuple[int, str, str]] = field(default_factory=dict)
    warning: str = ""
    stalling: dict[str, int] = field(default_factory=dict)
    spared: dict[str, int] = field(default_factory=dict)
    holding: dict[str, int] = field(default_factory=dict)
    release: threading.Event = field(default_factory=threading.Event)
    held: list[str] = field(default_factory=list)
    asked: list[str] = field(default_factory=list)
    in_xet: set[str] = field(default_factory=set)
    on_storage: set[str] = field(default_factory=set)
    storage_authorizations: list[str | None] = field(default_factory=list)
    trickling: dict[str, int] = field(default_factory=dict)
    between_chunks: Callable[[], None] = lambda: None
    served: list[str] = field(default_factory=list)
    stalled: list[str] = field(default_factory=list)
    url: str = ""
    stopped: threading.Event = field(default_factory=threading.Event)
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    counting: threading.Lock = field(default_factory=threading.Lock)

    @staticmethod
    def slowed(path: str, table: dict[str, int]) -> int | None:
        """The bytes ``table`` gives the request for ``path``, None where no pattern of it matches."""
        return next((n for pattern, n in table.items() if fnmatchcase(urlsplit(path).path, pattern)), None)

    def stall(self, path: str) -> int | None:
        """The bytes ``stalling`` gives the request for ``path``, None where it is answered in full: no pattern
        matches, or ``spared`` lets it through (one fewer to let through after it)."""
        pattern = next((p for p in self.stalling if fnmatchcase(urlsplit(path).path, p)), None)
        if pattern is None:
            return None
        with self.counting:
            left = self.spared.get(pattern, 0)
            if left:
                self.spared[pattern] = left - 1
                return None
        return self.stalling[pattern]

    def sha(self, repo: str) -> str:
        """The sha of the commit main is at: 40 hex digits from its files' names and contents, so that a test
        that changes them pushes a commit."""
        files = self.repos[repo]
        named = hashlib.sha1(repo.encode())
        for name, body in sorted(files.items()):
            named.update(name.encode() + b"\0" + hashlib.sha256(body).digest())
        self.commits[f"{repo}@{named.hexdigest()}"] = dict(files)
        return named.hexdigest()

    def answer(self, method: str, path: str, authorization: str | None = None) -> tuple[int, dict[str, str], bytes]:
        parts = [unquote(p) for p in urlsplit(path).path.strip("/").split("/")]
        if parts[0] == "storage":  # /storage/R/FILE: a storage host's URL of a file at main
            repo, name = "/".join(parts[1:3]), "/".join(parts[3:])
            self.storage_authorizations.append(authorization)
            self.served.append(f"{repo}/{name}")
            body = self.repos[repo][name]
            return 200, {"Content-Length": str(len(body)), "Content-Type": "application/octet-stream"}, body
        api = parts[:2] == ["api", "models"]
        repo = "/".join(parts[2:4] if api else parts[:2])
        files = self.repos.get(repo)
        if repo in self.failing:
            return _error(self.failing[repo], "", f"the Hub failed with {self.failing[repo]}")
        if repo in self.refusing:
            return _error(*self.refusing[repo])
        if files is None:
            return _error(404, "RepoNotFound", f"Repository Not Found for url: {path}")
        if repo in self.gated and authorization not in {f"Bearer {t}" for t in self.tokens}:
            return _error(401, "GatedRepo", f"Access to model {repo} is restricted.")
        if api and len(parts) == 4:  # the repository's info at main
            parts += ["revision", "main"]
        rev = parts[5] if api else parts[3] if len(parts) > 3 else ""
        head = self.sha(repo)
        sha = head if rev == "main" else rev
        files = files if sha == head else self.commits.get(f"{repo}@{sha}")
        if files is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if api and parts[4] == "revision":  # with ?blobs=true, each file's size and git blob id too
            blobs = "blobs" in parse_qs(urlsplit(path).query)
            siblings = [{"rfilename": f} | ({"size": len(b), "blobId": hashlib.sha1(b).hexdigest()} if blobs else {})
                        for f, b in sorted(files.items())]
            return _json({"id": repo, "modelId": repo, "sha": sha, "private": False, "siblings": siblings})
        if api and parts[4] == "tree":
            return _json([{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                          for f, b in sorted(files.items())])
        if not api and len(parts) > 4 and parts[2] == "resolve":
            name = "/".join(parts[4:])
            body = files.get(name)
            if method == "HEAD":
                self.asked.append(f"{repo}/{name}")
            status = self.failing.get(f"{repo}/{name}")
            if status is not None:
                return _error(status, "", f"the Hub failed with {status}")
            if body is None:
                return _error(404, "EntryNotFound", f"{name} does not exist on {rev}")
            if method == "GET":
                self.served.append(f"{repo}/{name}")
            etag = hashlib.sha256(body).hexdigest()
            if f"{repo}/{name}" in self.on_storage:
                location = f"{self.url.replace('127.0.0.1', 'localhost')}/storage/{repo}/{name}"
                return 302, {"X-Repo-Commit": sha, "X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(body)),
                             "Location": location, "Content-Length": "0"}, b""
            headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Content-Length": str(len(body)),
                       "Content-Type": "application/octet-stream"}
            if f"{repo}/{name}" in self.in_xet:
                headers |= {"X-Xet-Hash": etag, "X-Xet-Refresh-Route": f"/api/models/{repo}/xet-read-token/{sha}"}
            return 200, headers, body
        return _error(404, "", f"no route {path}")


def _json(value: object) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps(value).encode()
    return 200, {"Content-Type": "application/json", "Content-Length": str(len(body))}, body


def _error(status: int, code: str, message: str) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"error": message}).encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body)), "X-Error-Message": message}
    if code:
        headers["X-Error-Code"] = code
    return status, headers, body


def repo_files(root: Path) -> dict[str, bytes]:
    """A local model directory (or one file) as a repository's files."""
    if root.is_file():
        return {root.name: root.read_bytes()}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@contextmanager
def serving(hub: FakeHub) -> Iterator[FakeHub]:
    """``hub`` answering on 127.0.0.1 (``hub.url``) until the block ends."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, method: str) -> None:
            stall = hub.stall(self.path)
            if stall == 0:
                hub.stalled.append(self.path)
                hub.stopped.wait()
                return
            status, headers, body = hub.answer(method, self.path, self.headers.get("Authorization"))
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            if hub.warning:
                self.send_header("X-HF-Warning", f"kestrel-test; {hub.warning}")
            self.end_headers()
            if method != "GET":
                return
            if stall is not None:
                self.wfile.write(body[:stall])
                self.wfile.flush()
                hub.stalled.append(self.path)
                hub.stopped.wait()
                return
            hold = hub.slowed(self.path, hub.holding)
            if hold is not None:
                self.wfile.write(body[:hold])
                self.wfile.flush()
                hub.held.append(self.path)
                hub.release.wait()
                body = body[hold:]
            chunk = hub.slowed(self.path, hub.trickling) or len(body) or 1
            try:
                for start in range(0, len(body), chunk):
                    self.wfile.write(body[start:start + chunk])
                    self.wfile.flush()
                    if start + chunk < len(body):
                        hub.between_chunks()
            except ConnectionError:  # the client went away (a download it ended)
                pass

        def do_GET(self) -> None:  # noqa: N802
            self._reply("GET")

        def do_HEAD(self) -> None:  # noqa: N802
            self._reply("HEAD")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        hub.stopped.set()
        hub.release.set()
        server.shutdown()
        server.server_close()


def socket_waits(monkeypatch: pytest.MonkeyPatch, url: str) -> list[float | None]:
    """The limits, in seconds, that the sockets connected to ``url``'s port are given (``settimeout``) from now
    on: how long each read of an answer waits at most, whichever HTTP library huggingface_hub runs on (None: for
    ever)."""
    port = urlsplit(url).port
    waits: list[float | None] = []
    settimeout = socket.socket.settimeout

    def recorded(sock: socket.socket, value: float | None) -> None:
        try:
            peer = sock.getpeername()
        except OSError:  # not connected yet: the wait is the connection's, not an answer's
            peer = None
        if isinstance(peer, tuple) and peer[1] == port:
            waits.append(value)
        settimeout(sock, value)

    monkeypatch.setattr(socket.socket, "settimeout", recorded)
    return waits
