"""The access log: one line per request, whatever the request's path decodes to."""

from __future__ import annotations

import logging

import pytest

from kestrel_core.model.async_engine import AsyncEngine

from .helpers import http, running_server

NAME = "tiny"
KEY = "sekrit"


def test_a_path_with_control_characters_logs_one_line(async_engine: AsyncEngine,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    forged = "23:59:59 POST /v1/chat/completions 200 prompt=9 completion=9 0.100s"
    with running_server(async_engine, NAME, api_key=KEY) as server, caplog.at_level(logging.INFO, "kestrel.serve"):
        status, _, _ = http("GET", f"{server.url}/v1/models/x%0a{forged.replace(' ', '%20')}%0d%1b[2K%e2%80%a8")
    assert status == 401  # no key: refused, and logged all the same
    lines = [r.getMessage() for r in caplog.records if r.name == "kestrel.serve" and "/v1/models/x" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].splitlines() == [lines[0]] and "\x1b" not in lines[0] and "\r" not in lines[0]
    assert f"/v1/models/x\\n{forged}\\r\\x1b[2K\\u2028 401 " in lines[0]
