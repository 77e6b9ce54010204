"""``serve()`` from a Python program: its lines are printed whether or not the program configured logging, once."""

from __future__ import annotations

import re
import signal
from pathlib import Path

from .helpers import ServeProcess, http

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-qwen3"
URL = re.compile(r"^\S+ kestrel serve: (http://127\.0\.0\.1:\d+)/v1 \(model tiny-qwen3, backend cpu")

# a program that serves one model, given its logging setup (argv[1]: none, or a root handler of its own); with
# argv[2] "announce" uvicorn's loop is left out: the server announces itself and returns
SCRIPT = f"""
import logging, sys
import kestrel_core as kestrel
from kestrel_core.serve import server
from kestrel_core.serve.server import serve

if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.INFO, format="MINE %(name)s: %(message)s")
if sys.argv[2] == "announce":
    def run_forever(self):
        self.on_started(self)
        return 0
    server.KestrelServer.run_forever = run_forever
engine = kestrel.load({str(TINY)!r}, backend="cpu")
sys.exit(serve(engine, port=0))
"""


def test_a_program_that_configured_no_logging_sees_the_servers_lines() -> None:
    """Without logging set up, the startup line, the request lines and the last line went nowhere (INFO records of
    a logger with no handler): they are printed to stderr, as the command prints them."""
    served = ServeProcess(["-c", SCRIPT, "unconfigured", "serve"])
    try:
        url = served.wait_for(URL).group(1)
        assert http("GET", f"{url}/v1/models")[0] == 200
        served.wait_for(r"GET /v1/models 200 ")
        served.proc.send_signal(signal.SIGTERM)
        assert served.finish() == 0
    finally:
        served.kill()
    assert re.search(r"^\S+ kestrel serve: stopped$", "\n".join(served.seen), re.MULTILINE)


def test_a_program_that_configured_logging_keeps_its_own_and_sees_each_line_once() -> None:
    served = ServeProcess(["-c", SCRIPT, "configured", "announce"])
    try:
        assert served.finish() == 0
    finally:
        served.kill()
    lines = [line for line in served.seen if "kestrel serve: http" in line]
    assert len(lines) == 1 and lines[0].startswith("MINE kestrel.serve: kestrel serve: http://127.0.0.1:"), served.seen
