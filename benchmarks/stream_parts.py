"""Time to stream an answer through the part readers (model/parts.py), token by token, as the server feeds them.

    python benchmarks/stream_parts.py                           # the kestrel_core that imports
    PYTHONPATH=/tmp/parts-before python benchmarks/stream_parts.py --tokens 2000,8000

For each length it feeds four answers a token's text at a time and reports the seconds for the whole answer
(feeds and finish): a ``<think>`` answer that reasons that long (ReasoningStream), one that answers that long
after a short block, one whose reasoning mentions ``<tool_call>`` first (held until its ``</think>``), and a
harmony answer (gpt-oss's) whose analysis and final messages share the tokens (HarmonyStream). A reader whose
feeds cost the answer's length so far takes time quadratic in its length.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from kestrel_core.model.harmony import HarmonyStream
from kestrel_core.model.parts import PartStream
from kestrel_core.model.reasoning import ReasoningStream


def words(n: int) -> list[str]:
    return [f" word{i % 97}" for i in range(n)]


ANSWERS: dict[str, tuple[Callable[[], PartStream], Callable[[int], list[str]]]] = {
    "reasoning": (ReasoningStream, lambda n: ["<think>", "\n", *words(n), "\n</think>", "\n\nDone."]),
    "content after a block": (ReasoningStream, lambda n: ["<think>", "\nShort.\n", "</think>", "\n\n", *words(n)]),
    "reasoning after <tool_call>": (ReasoningStream, lambda n: ["<think>", "\nA <tool_call>", *words(n), "\n</think>",
                                                                "\n\nDone."]),
    "harmony": (HarmonyStream, lambda n: ["<|channel|>", "analysis", "<|message|>", *words(n // 2), "<|end|>",
                                          "<|start|>", "assistant", "<|channel|>", "final", "<|message|>",
                                          *words(n - n // 2), "<|return|>"]),
}


def seconds(make: Callable[[], PartStream], tokens: list[str]) -> float:
    stream = make()
    start = time.perf_counter()
    for token in tokens:
        stream.feed(token)
    stream.finish()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="2000,8000,20000,50000", help="answer lengths, comma-separated")
    args = ap.parse_args()
    lengths = [int(n) for n in args.tokens.split(",")]
    print(f"{'answer':<28}" + "".join(f"{n:>12,}" for n in lengths) + "  (seconds per answer)")
    for name, (make, tokens) in ANSWERS.items():
        print(f"{name:<28}" + "".join(f"{seconds(make, tokens(n)):>12.3f}" for n in lengths), flush=True)


if __name__ == "__main__":
    main()
