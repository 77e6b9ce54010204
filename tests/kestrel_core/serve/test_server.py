"""``kestrel serve`` as a process: it announces its URL, drains on SIGTERM (503s meanwhile) and exits 0."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

import kestrel_core
from kestrel_core.errors import KestrelError
from kestrel_core.serve.app import create_app
from kestrel_core.serve.server import bind_socket, default_model_name, serve

from ..waits import HANG_GUARD_S, wait_until
from .helpers import ServeProcess, http

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-qwen3"

ROOT = Path(__file__).resolve().parents[3]
URL = re.compile(r"kestrel serve: (http://127\.0\.0\.1:(\d+))/v1 \(model (\S+), backend cpu")


@pytest.mark.parametrize(("source", "name"), [
    ("SmolLM2-135M-Instruct (/root/.cache/kestrel/models/SmolLM2-135M-Instruct.Q4_1.gguf)", "SmolLM2-135M-Instruct"),
    ("/models/Qwen3-0.6B", "Qwen3-0.6B"),
    ("/models/Qwen3-0.6B/", "Qwen3-0.6B"),
    ("qwen3-0.6b.q8.kst", "qwen3-0.6b.q8"),
    ("/x/model.Q8_0.gguf", "model.Q8_0"),
    ("preset qwen3-8b (q8, seed 0)", "preset-qwen3-8b"),
    ("Qwen/Qwen3-0.6B (/hf/hub/models--Qwen--Qwen3-0.6B/snapshots/abc)", "Qwen/Qwen3-0.6B"),
    ("org/m-GGUF:Q4_K_M (/hf/hub/models--org--m-GGUF/snapshots/abc/m-Q4_K_M.gguf)", "org/m-GGUF:Q4_K_M"),
    ("models/m", "m"),
    ("", "kestrel"),
    ("/models/Qwen3-0.6B + LoRA my-adapter", "Qwen3-0.6B-+-LoRA-my-adapter"),
    ("/x/model.Q8_0.gguf + LoRA a + LoRA b.gguf", "model.Q8_0-+-LoRA-a-+-LoRA-b.gguf"),
    ("SmolLM2-135M-Instruct (/root/.cache/kestrel/models/SmolLM2-135M-Instruct.Q4_1.gguf) + LoRA my-adapter",
     "SmolLM2-135M-Instruct-+-LoRA-my-adapter"),
    ("Qwen/Qwen3-0.6B (/hf/hub/models--Qwen--Qwen3-0.6B/snapshots/abc) + LoRA a + LoRA b",
     "Qwen/Qwen3-0.6B-+-LoRA-a-+-LoRA-b"),
])
def test_default_model_name(source: str, name: str) -> None:
    assert default_model_name(source) == name


def test_a_busy_port_is_a_one_line_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(KestrelError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind_socket("127.0.0.1", port)


def test_bad_serve_arguments_are_one_line_errors_before_anything_runs() -> None:
    """From Python: a port past 65535 (getaddrinfo took 70000 for 4464), a host or engine of the wrong type (an
    AttributeError), and an API key that is blank (it served without one), not text, or not Unicode text."""
    for host, port, says in (("127.0.0.1", 70000, r"port must be an integer in \[0, 65535\], got 70000"),
                             ("127.0.0.1", -1, "port must be an integer in"), ("127.0.0.1", "80", "port must be an"),
                             (5, 0, "host must be a str, got int")):
        with pytest.raises(KestrelError, match=says):
            bind_socket(host, port)  # type: ignore[arg-type]
    for engines in (None, "engine", [None]):
        with pytest.raises(KestrelError, match="serve takes an Engine .* or a list of them, got (NoneType|str)"):
            serve(engines, port=0)
    for key, says in (("", "api_key is blank"), (" \t", "api_key is blank"), (5, "api_key must be a str"),
                      ("k\ud800", "api_key is not valid UTF-8")):
        with pytest.raises(KestrelError, match=says):
            create_app({}, api_key=key)  # type: ignore[arg-type]


@pytest.mark.parametrize(("sizes", "says"), [
    ({"max_batch": 4097}, r"max_batch must be an integer in \[1, 4096\], got 4097"),
    ({"max_waiting": 1 << 20}, r"max_waiting must be an integer in \[0, 65536\], got 1048576"),
    ({"token_budget": 10**9}, r"token_budget must be an integer in \[1, 65536\], got 1000000000"),
])
def test_serves_sizes_from_python_are_bounded_as_the_commands(sizes: dict[str, int], says: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve(max_batch=...)`` takes what ``kestrel serve --max-batch`` takes: one line, before it listens."""
    def listening(*_: object) -> None:  # sizes taken: it would serve until a signal
        raise AssertionError(f"serve took {sizes}")

    monkeypatch.setattr("kestrel_core.serve.server.warm_up", listening)
    with kestrel_core.load(str(TINY), backend="cpu") as engine, pytest.raises(KestrelError, match=says):
        serve(engine, port=0, **sizes)  # type: ignore[arg-type]


def _Serve(*extra: str) -> ServeProcess:
    """``python -m kestrel_core.cli serve --port 0 --backend cpu`` with its stderr read line by line."""
    return ServeProcess(["-m", "kestrel_core.cli", "serve", "--port", "0", "--backend", "cpu", *extra])


@pytest.mark.default_model
def test_sigterm_drains_the_running_stream_then_exits_0() -> None:
    serve = _Serve("--served-model-name", "smol", "--shutdown-grace", str(int(HANG_GUARD_S)))
    try:
        url = serve.wait_for(URL).group(1)
        assert http("GET", f"{url}/health")[0] == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)
        stream = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=150, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        chunks = iter(stream)
        text = [next(chunks).choices[0].delta.content or "", next(chunks).choices[0].delta.content or ""]
        serve.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: http("GET", f"{url}/health")[0] != 200, "unhealthy after SIGTERM")  # at its next tick
        assert http("GET", f"{url}/health")[0] == 503  # still listening while it drains
        with pytest.raises(openai.InternalServerError) as info:  # new work is refused
            client.completions.create(model="smol", prompt="x", max_tokens=2)
        assert info.value.status_code == 503
        finish = None
        for chunk in chunks:  # the running request still gets its whole answer
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "length" and "".join(text)
        assert serve.finish() == 0
    finally:
        serve.kill()
    log = "\n".join(serve.seen)
    assert "shutting down" in log and "kestrel serve: stopped" in log and "Traceback" not in log
    assert re.search(r"POST /v1/chat/completions 200 prompt=\d+ completion=150 ", log)


@pytest.mark.default_model
def test_sigint_when_idle_exits_0() -> None:
    serve = _Serve()
    try:
        serve.wait_for(URL)
        serve.proc.send_signal(signal.SIGINT)
        assert serve.finish() == 0
    finally:
        serve.kill()
    assert "Traceback" not in "\n".join(serve.seen)


def test_an_embedding_model_serves_embeddings_then_exits_0_on_sigterm() -> None:
    model = ROOT / "tests" / "fixtures" / "models" / "tiny-qwen3-embed.gguf"
    serve = _Serve("--model", str(model), "--pooling", "mean")
    try:
        url = serve.wait_for(r"kestrel serve: (\S+)/v1 \(model tiny-qwen3-embed, embeddings only \(mean pooling\), "
                             r"backend cpu").group(1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)
        response = client.embeddings.create(model="tiny-qwen3-embed", input=["Paris", "Rome"], dimensions=8)
        assert [len(d.embedding) for d in response.data] == [8, 8]
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.finish() == 0
    finally:
        serve.kill()
    log = "\n".join(serve.seen)
    assert re.search(r"POST /v1/embeddings 200 prompt=\d+ ", log) and "Traceback" not in log


def test_two_models_are_served_and_named() -> None:
    models = ROOT / "tests" / "fixtures" / "models"
    serve = _Serve("--model", str(models / "tiny-qwen3"), "--model", str(models / "tiny-qwen3-embed.gguf"),
                   "--served-model-name", "chat")
    try:
        url = serve.wait_for(r"kestrel serve: (\S+)/v1 \(model chat, backend cpu, model tiny-qwen3-embed, "
                             r"embeddings only \(last pooling\), backend cpu; max batch").group(1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)
        assert [m.id for m in client.models.list().data] == ["chat", "tiny-qwen3-embed"]
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.finish() == 0
    finally:
        serve.kill()
    assert "Traceback" not in "\n".join(serve.seen)


# serve() with uvicorn's loop left out: what the collector holds as the server would start, in a process of
# its own, since the freeze is the interpreter's
FROZEN_WHILE_SERVING = """
import gc, json, sys
from kestrel_core.cli import main
from kestrel_core.serve import server

seen = {}

def run_forever(self):
    walked = {id(o) for o in gc.get_objects()}  # every object the collector walks; the frozen ones are not listed
    seen["engines"] = [gc.is_tracked(ae.engine) and id(ae.engine) not in walked for ae in self.async_engines]
    seen["app"] = id(self.config.app) not in walked
    return 0

server.KestrelServer.run_forever = run_forever
seen["status"] = main(["serve", "--port", "0", "--backend", "cpu", *sys.argv[1:]])
seen["frozen_after"] = gc.get_freeze_count()
print(json.dumps(seen))
"""


def test_the_served_models_are_out_of_the_collectors_walks_while_serving() -> None:
    """Every model (two here) and the app, loaded before the server starts and alive as long as it, are in the
    collector's permanent generation while it serves (server.frozen_heap), and the heap is unfrozen once serve()
    returns."""
    models = ROOT / "tests" / "fixtures" / "models"
    done = subprocess.run([sys.executable, "-c", FROZEN_WHILE_SERVING, "--model", str(models / "tiny-qwen3"),
                           "--model", str(models / "tiny-llama")], cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {"engines": [True, True], "app": True, "status": 0, "frozen_after": 0}


def test_a_heap_the_caller_froze_stays_frozen() -> None:
    """A program that froze its own heap before serving finds it frozen still afterwards (in a process of its own)."""
    script = ("import gc\nfrom kestrel_core.serve.server import frozen_heap\ngc.freeze()\nwith frozen_heap():\n"
              "    pass\nprint(gc.get_freeze_count() > 0)")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True"], done.stderr


def test_stacked_adapters_are_served_under_a_name_that_names_them(tmp_path: Path) -> None:
    """``serve`` takes --lora as ``run`` does, repeated: the model it serves is the base with both adapters."""
    from ..model.lora_adapters import peft_adapter

    models = ROOT / "tests" / "fixtures" / "models"
    peft_adapter(tmp_path / "second", models / "tiny-llama", ["self_attn.q_proj"], seed=1)
    serve = _Serve("--model", str(models / "tiny-llama"), "--lora", str(models / "tiny-llama-lora"), "--lora",
                   str(tmp_path / "second"), "--lora-scale", "0.5", "--lora-scale", "2")
    name = "tiny-llama-+-LoRA-tiny-llama-lora-+-LoRA-second"
    try:
        url = serve.wait_for(rf"kestrel serve: (\S+)/v1 \(model {re.escape(name)}, backend cpu").group(1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)
        assert [m.id for m in client.models.list().data] == [name]
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.finish() == 0
    finally:
        serve.kill()
    assert "Traceback" not in "\n".join(serve.seen)


def _post_head(port: int, path: str, length: int, rcvbuf: int | None = None) -> socket.socket:
    """A connection that has sent a POST's head announcing ``length`` bytes of JSON body, and nothing else yet;
    ``rcvbuf``: its receive buffer (set before it connects, so the kernel does not grow it)."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {length}\r\n\r\n".encode())
    return sock


def test_a_third_sigint_forces_the_exit_with_one_line_and_130() -> None:
    """Ctrl-C three times while requests run: the third drops the connections at once, which one line says, with
    no traceback of the requests it cancels, and the exit status is an interrupted command's."""
    model = ROOT / "tests" / "fixtures" / "models" / "tiny-qwen3"
    serve = _Serve("--model", str(model), "--shutdown-grace", "60")
    held: list[socket.socket] = []
    try:
        port = int(serve.wait_for(URL).group(2))
        # a long stream its client does not read: the server's writes fill the socket and wait (until the abort)
        body = json.dumps({"model": "tiny-qwen3", "prompt": "Hi", "max_tokens": 250, "n": 8, "logprobs": 5,
                           "stream": True, "ignore_eos": True}).encode()
        held.append(_post_head(port, "/v1/completions", len(body), rcvbuf=1024))
        held[-1].sendall(body)
        assert held[-1].recv(12, socket.MSG_WAITALL) == b"HTTP/1.1 200"
        # and a request still sending its body: uvicorn waits for it once the engine has stopped, so the third
        # signal surely comes while a request is in flight
        held.append(_post_head(port, "/v1/completions", 100))
        held[-1].sendall(b"{")
        for said in ("shutting down", "aborting", "forced exit"):
            serve.proc.send_signal(signal.SIGINT)
            serve.wait_for(said)
        assert serve.finish() == 130
    finally:
        serve.kill()
        for sock in held:
            sock.close()
    log = "\n".join(serve.seen)
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


def test_a_request_still_open_when_uvicorn_gives_up_waiting_is_said_in_kestrels_words() -> None:
    """A request still sending its body when the server stops: uvicorn waits for it up to its own graceful timeout,
    then cancels it; the line that says so is kestrel's, as every other line of the shutdown, not uvicorn's
    error record."""
    model = ROOT / "tests" / "fixtures" / "models" / "tiny-qwen3"
    serve = _Serve("--model", str(model))
    held = None
    try:
        port = int(serve.wait_for(URL).group(2))
        held = _post_head(port, "/v1/completions", 100)
        held.sendall(b"{")
        serve.proc.send_signal(signal.SIGTERM)
        serve.wait_for(r"kestrel serve: cancelling 1 request\(s\) still open \d+ s after the models stopped")
        assert serve.finish() == 0
    finally:
        serve.kill()
        if held is not None:
            held.close()
    log = "\n".join(serve.seen)
    assert "graceful shutdown exceeded" not in log and "ERROR" not in log and "Traceback" not in log, log
    assert "kestrel serve: stopped" in log
