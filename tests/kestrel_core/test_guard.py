"""kestrel_core.guard: what plugin code prints goes to stderr, and stdout comes back whatever threads do."""

from __future__ import annotations

import io
import sys
import threading

import pytest

from kestrel_core.guard import plugin_output

from .waits import HANG_GUARD_S


def test_a_plugins_print_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    with plugin_output():
        print("from the plugin")
    print("the command's own")
    captured = capsys.readouterr()
    assert captured.out == "the command's own\n" and captured.err == "from the plugin\n"


def test_stdout_comes_back_when_blocks_of_two_threads_end_out_of_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines' threads in plugin code at once (several served models): the first block to end does not put
    back a stdout, nor the last one the stderr the first had set."""
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with plugin_output():
            a_in.set()
            b_in.wait(HANG_GUARD_S)
        a_out.set()

    def second() -> None:
        a_in.wait(HANG_GUARD_S)
        with plugin_output():
            b_in.set()
            a_out.wait(HANG_GUARD_S)
            print("inside", file=sys.stdout)  # the first block has ended, this one has not: still stderr

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD_S)
    assert sys.stdout is out
    assert err.getvalue() == "inside\n" and out.getvalue() == ""
