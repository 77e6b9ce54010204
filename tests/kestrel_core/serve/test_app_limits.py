"""What the server over the default model (default_server.py) refuses before it runs a request: a burst over its
capacity (429), too many choices, a request without the API key, a body over the limit (413), a foreign web page
(403); and the CORS answers an allowed page gets.

Besides the module's server, a tiny one for the capacity, key and body tests: one running sequence, one waiting, an
API key.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.serve.server import KestrelServer

from ..waits import HANG_GUARD_S
from .default_server import NAME, _chat, default_async_engine, default_engine  # noqa: F401 (fixtures)
from .helpers import HI, http, openai_client, running_server, wait_idle

pytestmark = pytest.mark.default_model

KEY = "sekrit-key"
SMALL_BODY = 20_000


@pytest.fixture(scope="module")
def small_server() -> Iterator[KestrelServer]:
    """One running sequence, one waiting: the third concurrent request is refused. With an API key, and request
    bodies of at most ``SMALL_BODY`` bytes."""
    with kestrel_core.load(None, backend="cpu", kv_cache_mb=64) as e:
        with running_server(AsyncEngine(e, max_batch=1, max_waiting=1), NAME, api_key=KEY,
                            max_request_bytes=SMALL_BODY) as s:
            yield s


def test_a_burst_over_capacity_gets_429s(small_server: KestrelServer) -> None:
    client = openai_client(small_server, KEY)
    barrier = threading.Barrier(6)

    def one(_: int) -> str:
        barrier.wait()
        try:
            _chat(client, max_tokens=16, extra_body={"ignore_eos": True})
            return "ok"
        except openai.RateLimitError as exc:
            assert exc.status_code == 429 and "capacity" in exc.body["message"]
            return "429"

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    assert results.count("ok") >= 1 and results.count("429") >= 1, results
    assert results.count("ok") <= 2, results  # one running plus one waiting
    wait_idle(small_server.async_engines[0])


def test_choices_over_capacity_get_a_400_or_a_429_and_leave_nothing_running(small_server: KestrelServer) -> None:
    """One running and one waiting fit. Three choices never can: a 400 before anything is queued (a 429 would be
    retried for ever). Two while another request runs: refused whole with a 429, its admitted choice aborted."""
    client = openai_client(small_server, KEY)
    with pytest.raises(openai.BadRequestError) as never:
        _chat(client, n=3, max_tokens=4)
    assert never.value.body["param"] == "n" and "--max-batch + --max-waiting" in never.value.body["message"]
    busy = client.chat.completions.create(model=NAME, messages=HI, max_tokens=4000, stream=True,
                                          extra_body={"ignore_eos": True})
    next(iter(busy))
    with pytest.raises(openai.RateLimitError) as info:
        _chat(client, n=2, max_tokens=4)
    assert "capacity" in info.value.body["message"]
    busy.close()
    wait_idle(small_server.async_engines[0])
    assert len(_chat(client, n=2, max_tokens=4).choices) == 2  # two fit


def test_api_key_is_required_on_v1_only(small_server: KestrelServer) -> None:
    wrong = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.body["code"] == "invalid_api_key"
    status, _, body = http("POST", f"{small_server.url}/v1/chat/completions", {"messages": HI})  # no header
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    good = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key=KEY, max_retries=0)
    assert good.models.list().data[0].id == NAME
    assert http("GET", f"{small_server.url}/health")[0] == 200
    assert http("GET", f"{small_server.url}/metrics")[0] == 200


def test_a_body_over_the_limit_is_a_413_in_each_apis_shape(small_server: KestrelServer) -> None:
    """Refused whether the body says its length or comes in chunks without one; the server goes on."""
    client = openai_client(small_server, KEY)
    with pytest.raises(openai.APIStatusError) as info:
        _chat(client, [{"role": "user", "content": "x" * SMALL_BODY}])
    assert info.value.status_code == 413 and "--max-request-mb" in info.value.body["message"]
    anthropic_client = anthropic.Anthropic(base_url=small_server.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as refused:
        anthropic_client.messages.create(model=NAME, max_tokens=4,
                                         messages=[{"role": "user", "content": "x" * SMALL_BODY}])
    assert refused.value.status_code == 413 and refused.value.body["error"]["type"] == "request_too_large"
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    chunks = (b'{"model": "x", "prompt": "' + b"x" * 1000 for _ in range(SMALL_BODY // 1000 + 1))
    answer = httpx.post(f"{small_server.url}/api/generate", content=chunks, headers=auth, timeout=HANG_GUARD_S)
    assert answer.status_code == 413 and "--max-request-mb" in answer.json()["error"]
    assert "content-length" not in answer.request.headers  # sent in chunks
    assert _chat(client, max_tokens=2).usage.completion_tokens == 2


def test_a_web_pages_requests_are_refused_unless_its_origin_is_allowed(server: KestrelServer, engine: Any) -> None:
    """A page on another site can make the browser POST here (text/plain: no preflight) and, by DNS rebinding
    its own name to 127.0.0.1, read the answer: a foreign Host or Origin is a 403 before anything runs. API
    clients send no Origin; the loopback's own pages are answered."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    url = f"{server.url}/v1/completions"
    plain = {"Content-Type": "text/plain"}
    for headers in ({"Host": "rebind.evil.example"}, {"Host": "127.0.0.1.evil.example"},
                    {"Origin": "https://evil.example"}, {"Origin": "null"}, {"Origin": "http://127.0.0.1.evil.example"}):
        status, _, raw = http("POST", url, raw=body, headers={**plain, **headers})
        assert status == 403 and json.loads(raw)["error"]["code"] == "forbidden", headers
    for headers in ({}, {"Origin": "http://localhost:5173"}, {"Host": "localhost:8000"}, {"Host": "[::1]:8000"},
                    {"Origin": "http://127.0.0.2:3000"}):
        assert http("POST", url, raw=body, headers={**plain, **headers})[0] == 200, headers
    with running_server(AsyncEngine(engine), NAME, allowed_origins=["https://app.example"]) as other:
        ok = http("POST", f"{other.url}/v1/completions", raw=body, headers={**plain, "Origin": "https://app.example"})
        refused = http("POST", f"{other.url}/v1/completions", raw=body, headers={**plain, "Origin": "https://b.example"})
        assert (ok[0], refused[0]) == (200, 403)


def _cors_allows(response: httpx.Response, origin: str, method: str = "", headers: Sequence[str] = ()) -> bool:
    """The Fetch standard's CORS check, as a browser makes it: the answer names the page's origin and, for a
    preflight (``method`` given), is a 2xx allowing the method and every header it asked for."""
    if response.headers.get("access-control-allow-origin") != origin:
        return False
    if not method:
        return True
    allowed_methods = {m.strip().upper() for m in response.headers.get("access-control-allow-methods", "").split(",")}
    allowed_headers = {h.strip().lower() for h in response.headers.get("access-control-allow-headers", "").split(",")}
    return (response.is_success and method.upper() in allowed_methods
            and all(h.lower() in allowed_headers for h in headers))


def test_an_allowed_pages_preflights_are_answered_and_its_requests_carry_cors_headers(server: KestrelServer,
                                                                                        engine: Any) -> None:
    """A page's browser reads an answer only when it names the page's origin, and sends a JSON POST (or one with
    an API key) only after a preflight allowed it; the preflight carries no key, so it is answered before the
    key is asked for. A refused page's preflight stays a 403."""
    asked = ["authorization", "content-type", "x-api-key", "anthropic-version"]
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": ", ".join(asked)}
    body = {"prompt": "Hi", "max_tokens": 1}
    page = "https://app.example"
    with running_server(AsyncEngine(engine), NAME, api_key=KEY, allowed_origins=[page]) as keyed:
        with httpx.Client(base_url=keyed.url, timeout=HANG_GUARD_S) as browser:
            answer = browser.options("/v1/chat/completions", headers={"Origin": page, **preflight})
            assert _cors_allows(answer, page, "POST", asked), (answer.status_code, answer.headers)
            answer = browser.post("/v1/completions", json=body,
                                  headers={"Origin": page, "Authorization": f"Bearer {KEY}"})
            assert answer.status_code == 200 and _cors_allows(answer, page), answer.headers
            assert "origin" in answer.headers.get("vary", "").lower()
            unkeyed = browser.get("/v1/models", headers={"Origin": page})
            assert unkeyed.status_code == 401 and _cors_allows(unkeyed, page)  # the page can read why
            refused = browser.options("/v1/chat/completions", headers={"Origin": "https://b.example", **preflight})
            assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers
    loopback_page = "http://localhost:5173"
    with httpx.Client(base_url=server.url, timeout=HANG_GUARD_S) as browser:
        answer = browser.options("/v1/completions", headers={"Origin": loopback_page, **preflight})
        assert _cors_allows(answer, loopback_page, "POST", asked), (answer.status_code, answer.headers)
        answer = browser.post("/v1/completions", json=body, headers={"Origin": loopback_page})
        assert answer.status_code == 200 and _cors_allows(answer, loopback_page), answer.headers
