"""Every option the command line takes is in the user docs: ``kestrel serve``'s in docs/serving.md, the others'
in the README or docs/."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kestrel_core.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = {"kestrel serve": [ROOT / "docs" / "serving.md"]}
EVERY_DOC = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"kestrel": parser, **{f"kestrel {name}": sub for name, sub in subparsers.choices.items()}}


def _mentions(text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_option_is_documented(command: str) -> None:
    text = "\n".join(p.read_text(encoding="utf-8") for p in DOCS.get(command, EVERY_DOC))
    parser = _commands()[command]
    undocumented = [action.option_strings for action in parser._actions
                    if action.option_strings and not isinstance(action, argparse._HelpAction)
                    and not any(_mentions(text, option) for option in action.option_strings)]
    assert not undocumented, f"{command}: {undocumented} only in --help"
