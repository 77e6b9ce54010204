"""The server's probes over the default model (default_server.py): /health, /metrics and what its counters count
(a client that leaves while sending its body, a conversation's prefix found in the cache again)."""

from __future__ import annotations

import json
import socket

import openai
import pytest

from kestrel_core.serve.server import KestrelServer

from ..waits import HANG_GUARD_S, wait_until
from .default_server import NAME, _chat, default_async_engine, default_engine  # noqa: F401 (fixtures)
from .helpers import http

pytestmark = pytest.mark.default_model


def test_health(server: KestrelServer) -> None:
    status, _, body = http("GET", f"{server.url}/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})


def test_a_client_that_leaves_while_sending_its_body_counts_as_gone(server: KestrelServer) -> None:
    """Counted as 499 (the client left), not as the 400 its cut body gets."""
    def count(status: str) -> float:
        text = http("GET", f"{server.url}/metrics")[2].decode()
        return _samples(text).get(f'kestrel_requests_total{{endpoint="/v1/messages",status="{status}"}}', 0.0)

    gone, bad = count("499"), count("400")
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HANG_GUARD_S) as conn:
        conn.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5000\r\n\r\n" + b'{"model": "x", "messages": [' + b" " * 20)
    wait_until(lambda: count("499") > gone, "the request counted as gone")
    assert count("499") == gone + 1 and count("400") == bad


def test_metrics(server: KestrelServer, client: openai.OpenAI) -> None:
    _chat(client, max_tokens=4)
    list(_chat(client, max_tokens=4, stream=True))
    with pytest.raises(openai.BadRequestError):
        _chat(client, top_p=-0.1)
    status, headers, body = http("GET", f"{server.url}/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = body.decode()
    for name in ("kestrel_requests_total", "kestrel_prompt_tokens_total", "kestrel_generation_tokens_total",
                 "kestrel_num_requests_waiting", "kestrel_num_requests_running",
                 "kestrel_time_to_first_token_seconds_bucket", "kestrel_inter_token_latency_seconds_bucket",
                 "kestrel_request_duration_seconds_bucket", "kestrel_engine_steps_total",
                 "kestrel_offload_offered_total", "kestrel_offload_accepted_total", "kestrel_offload_declined_total"):
        assert name in text, name
    samples = _samples(text)
    assert samples['kestrel_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 2
    assert samples['kestrel_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 1
    assert samples[f'kestrel_num_requests_running{{model="{NAME}"}}'] == 0
    assert samples[f'kestrel_kv_cache_usage_perc{{model="{NAME}"}}'] == 0  # nothing runs: every block is free
    assert samples["kestrel_generation_tokens_total"] >= 8
    assert samples["kestrel_time_to_first_token_seconds_count"] >= 2


def test_a_conversation_sent_again_attaches_its_prefix(server: KestrelServer, client: openai.OpenAI) -> None:
    """A chat's second turn resends the first: the server's engine attaches the first turn's prompt blocks
    (the prefix cache's hits grow by at least one block) and the answer to the same turn is the same."""
    system = {"role": "system", "content": "You are a terse assistant. " * 12}  # a prompt of several blocks
    turn = [system, {"role": "user", "content": "Name a colour."}]

    def hits() -> float:
        text = http("GET", f"{server.url}/metrics")[2].decode()
        return _samples(text)[f'kestrel_prefix_cache_hit_tokens_total{{model="{NAME}"}}']

    first = _chat(client, turn, max_tokens=6)
    before = hits()
    again = _chat(client, turn, max_tokens=6)
    assert again.choices[0].message.content == first.choices[0].message.content
    follow_up = turn + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "Another."}]
    _chat(client, follow_up, max_tokens=6)
    assert hits() >= before + 2 * 32


def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}
