"""Ollama's API through a real server, field by field against Ollama's Go server (api/types.go, server/routes.go):
what its clients read (the heartbeat's text, the tool calls' ids, ``context``, the errors they match) and what they
send (ids of earlier calls, ``raw`` with ``system``, ``format`` with ``raw``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kestrel_core.serve.server import KestrelServer

from .helpers import http

NAME = "tiny"


def test_the_heartbeat_is_ollamas(server: KestrelServer) -> None:
    """Ollama's CLI checks a server with HEAD / before anything else; clients that detect an Ollama server compare
    GET /'s text with "Ollama is running"; HEAD /api/version and /api/tags are Ollama's health checks too."""
    for method in ("HEAD", "GET"):
        status, _, body = http(method, f"{server.url}/")
        assert status == 200 and body == (b"" if method == "HEAD" else b"Ollama is running")
    for path in ("/api/version", "/api/tags"):
        status, _, body = http("HEAD", f"{server.url}{path}")
        assert (status, body) == (200, b"")
        status, _, body = http("GET", f"{server.url}{path}")
        assert status == 200 and json.loads(body)
