"""Progress bars: on a terminal only, and only for steps that last more than a second."""

from __future__ import annotations

import io

from rich.console import Console

from kestrel_core.progress import LazyBar, progress_bar


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=100), out


def test_a_bar_shows_on_a_terminal_once_its_step_is_slow() -> None:
    console, out = _console(True)
    bar = LazyBar("writing m.kst", console=console, delay=0.0)
    for done in range(0, 101, 10):
        bar(done, 100)
    bar.close()
    assert "writing m.kst" in out.getvalue()


def test_no_bar_for_a_quick_step_or_without_a_terminal() -> None:
    console, out = _console(True)
    with progress_bar("quick", console=console) as report:  # the default delay: one second
        for done in range(0, 101, 10):
            report(done, 100)
    assert out.getvalue() == ""
    console, out = _console(False)
    bar = LazyBar("piped", console=console, delay=0.0)
    bar(1, 100)
    bar.close()
    assert out.getvalue() == ""


def test_a_step_done_before_the_delay_never_starts_a_bar() -> None:
    console, out = _console(True)
    bar = LazyBar("done", unit="weights", console=console, delay=0.0)
    bar(100, 100)
    bar.close()
    assert out.getvalue() == ""
