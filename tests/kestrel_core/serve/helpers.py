"""Shared helpers of the server tests: a real uvicorn server on an ephemeral port, in a background thread."""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ollama
import openai

from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.request import RequestOutput
from kestrel_core.model.sampling import SamplingParams, TokenLogprob
from kestrel_core.serve.protocol import ChatCompletionRequest
from kestrel_core.serve.server import KestrelServer, build_server

from ..waits import HANG_GUARD_S, wait_until

HI = [{"role": "user", "content": "Hi"}]


class Letters:
    """A tokenizer whose token i is the letter chr(ord('a') + i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + i) for i in ids)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])


def chat_request(**fields: Any) -> ChatCompletionRequest:
    """A chat request saying "Hi", with ``fields``."""
    return ChatCompletionRequest.model_validate({"messages": HI, **fields})


@contextmanager
def running_server(async_engine: Any, model_name: str, api_key: str | None = None,
                   shutdown_grace_s: float = 5.0, **options: Any) -> Iterator[KestrelServer]:
    """A KestrelServer on 127.0.0.1:<free port> in a daemon thread (``options``: build_server's); drained and
    joined on exit."""
    server = build_server({model_name: async_engine}, host="127.0.0.1", port=0, api_key=api_key,
                          shutdown_grace_s=shutdown_grace_s, **options)
    thread = threading.Thread(target=server.run_forever, name="kestrel-test-server", daemon=True)
    thread.start()
    try:
        assert server.wait_started(HANG_GUARD_S), f"the test server did not start within {HANG_GUARD_S:.0f} s"
        yield server
    finally:
        server.request_shutdown()
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive(), f"the test server did not stop within {HANG_GUARD_S:.0f} s"


def wait_idle(ae: AsyncEngine) -> None:
    """Until nothing runs or waits in ``ae``, and the step that reports an abort has been taken and counted: a
    call on the steps' thread runs between two steps."""

    def idle() -> bool:
        return not (ae.num_running or ae.active or ae.num_waiting or ae.scheduler.has_work)

    while True:
        wait_until(idle, f"idle (running={ae.num_running} active={ae.active} waiting={ae.num_waiting})")
        ae.run_sync(lambda: None)
        if idle():
            return


@contextmanager
def ending_aborted(ae: AsyncEngine, sequences: int = 1) -> Iterator[None]:
    """Around a client leaving its answer: once ``ae`` is idle again, its ``sequences`` ended aborted and nothing
    ended otherwise (an answer that ran to its end, however soon, ends "length")."""
    before = dict(ae.counters.finished)
    yield
    wait_idle(ae)
    ended = {k: n - before.get(k, 0) for k, n in ae.counters.finished.items() if n != before.get(k, 0)}
    assert ended == {"abort": sequences}, ended


def assert_stopped(ae: AsyncEngine, engine: Any) -> None:
    """Nothing runs in ``ae`` any more: a step taken after this is called makes no token (a call on the steps'
    thread runs between two steps, so two calls have one between them), and every KV block of ``engine`` is
    free again."""
    ae.run_sync(lambda: None)
    rows = ae.counters.step_rows
    ae.run_sync(lambda: None)
    ae.run_sync(lambda: None)
    assert ae.counters.step_rows == rows and not ae.num_running
    assert engine.pool.free_blocks == engine.pool.num_blocks


def leave_once_running(server: KestrelServer, ae: AsyncEngine, path: str, body: Any) -> None:
    """A client that posts ``body`` (JSON) to ``path`` and leaves, its answer unread, once its request runs in
    ``ae`` (the only one there)."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        wait_until(lambda: ae.num_running == 1, "the request running")


def openai_client(server: KestrelServer, api_key: str = "unused", timeout: float = HANG_GUARD_S) -> openai.OpenAI:
    """The official client for ``server``, no retries."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=timeout)


def http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
         raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one plain HTTP request (stdlib only: no client library in between)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=HANG_GUARD_S) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


class Uncompiled:
    """A grammar as a scripted engine takes it: not compiled, its answers being the script's, not the grammar's."""

    def __init__(self, grammar: str) -> None:
        self.grammar = grammar

    def copy(self) -> Uncompiled:
        return self


class Scripted(AsyncEngine):
    """An AsyncEngine whose answers are ``answers`` in order, 3 characters an output; the prompts it was given
    are kept as text, and the sampling of each request."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine, max_batch=4)
        self.answers: list[str] = []
        self.prompts: list[str] = []
        self.params: list[SamplingParams] = []

    def check(self, prompt_ids: Sequence[int], params: SamplingParams, priority: int = 0) -> list[int]:
        """Any prompt: the script answers whatever the context (the tests' tool prompts outgrow a tiny model's)."""
        return list(prompt_ids)

    async def compile(self, grammar: str) -> Any:
        return Uncompiled(grammar)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None, places: Any = None,
                       priority: int = 0, constraint: Any = None) -> AsyncIterator[RequestOutput]:
        self.prompts.append(self.engine.tokenizer.decode(list(prompt_ids)))
        self.params.append(params)
        text = self.answers.pop(0)
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)] or [""]  # an empty answer: one empty output
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield RequestOutput(request_id or "r", [1], piece, None, last, "stop" if last else None,
                                len(prompt_ids), k + 1)


@contextmanager
def scripted_ollama(engine: Any, name: str,
                    template: str) -> Iterator[tuple[Scripted, ollama.Client, KestrelServer]]:
    """A server of scripted answers over ``engine``, served as ``name`` with ``template`` as its chat template, the
    official ``ollama`` client of it and the server."""
    before = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = template
    try:
        front = Scripted(engine)
        with running_server(front, name) as s:
            yield front, ollama.Client(host=s.url), s
    finally:
        engine.tokenizer.chat_template = before


class Spoken(AsyncEngine):
    """An AsyncEngine that answers ``answers`` in order in the model's own tokens: each answer a list of texts
    tokenized apart (so which tokens are whose is known), ``per_step`` tokens an output, each with the offset of
    its text and, where asked for, a logprob of its own (-(its place + 1) / 1000); each answer's finish reason
    ``finish``. A token's text is decoded as the engine decodes it: a special token's is left out where the request
    skips special tokens. The prompts it was given are kept as text, special tokens' included."""

    def __init__(self, engine: Any, per_step: int = 1) -> None:
        super().__init__(engine, max_batch=4)
        self.answers: list[list[str]] = []
        self.prompts: list[str] = []
        self.per_step = per_step
        self.finish = "stop"

    def check(self, prompt_ids: Sequence[int], params: SamplingParams, priority: int = 0) -> list[int]:
        return list(prompt_ids)

    async def compile(self, grammar: str) -> Any:
        return Uncompiled(grammar)

    def tokens(self, pieces: Sequence[str]) -> list[list[int]]:
        """Each piece's token ids."""
        return [list(self.engine.tokenizer.encode(p, add_special_tokens=False)) for p in pieces]

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None, places: Any = None,
                       priority: int = 0, constraint: Any = None) -> AsyncIterator[RequestOutput]:
        self.prompts.append(self.engine.tokenizer.decode(list(prompt_ids)))
        ids = [t for piece in self.tokens(self.answers.pop(0)) for t in piece]
        texts = [self.engine.tokenizer.decode([t], skip_special_tokens=params.skip_special_tokens) for t in ids]
        for k in range(0, len(ids), self.per_step):
            step = range(k, min(k + self.per_step, len(ids)))
            last = step[-1] == len(ids) - 1
            offsets = [sum(len(texts[j]) for j in range(k, i)) for i in step]
            logprobs = [TokenLogprob(ids[i], -(i + 1) / 1000) for i in step] if params.logprobs else None
            yield RequestOutput(request_id or "r", [ids[i] for i in step], "".join(texts[i] for i in step), logprobs,
                                last, self.finish if last else None, len(prompt_ids), step[-1] + 1,
                                text_offsets=offsets)


def answering(served: tuple[Spoken, KestrelServer], *answers: list[str]) -> tuple[Spoken, openai.OpenAI]:
    """The spoken engine of a (front, server) fixture, to answer ``answers`` in order, and a client of its server."""
    front, server = served
    front.answers[:] = list(answers)
    return front, openai_client(server)


class ServeProcess:
    """``python <args>`` in the repository (a server: the command, or a script) with its output (stdout and stderr)
    read line by line."""

    def __init__(self, args: Sequence[str]) -> None:
        env = {k: v for k, v in os.environ.items() if k != "KESTREL_API_KEY"}
        self.proc = subprocess.Popen([sys.executable, *args], cwd=Path(__file__).resolve().parents[3], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, pattern: re.Pattern[str] | str, timeout: float = HANG_GUARD_S) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                assert self.proc.poll() is None, f"kestrel serve exited {self.proc.returncode}: {self.seen}"
                continue
            self.seen.append(line)
            if m := rx.search(line):
                return m
        raise AssertionError(f"no {rx.pattern!r} within {timeout} s: {self.seen}")

    def finish(self, timeout: float = HANG_GUARD_S) -> int:
        code = self.proc.wait(timeout)
        self.reader.join(timeout)  # every line read, up to the end of the output
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
