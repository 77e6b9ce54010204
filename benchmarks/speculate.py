"""Speculative decoding by prompt lookup (``--speculate``, kestrel_core/model/speculate.py): greedy decode tok/s of
the default model (or ``--model``) without it and with 4 and 8 draft tokens, runs alternating, on a task whose
answer repeats its prompt (edit this code) and one whose answer does not (a story), at 1 and 4 concurrent streams;
with the acceptance rate, and a check that every setting gives the same tokens. With ``--draft-model``, also 4 and 8
draft tokens from that model's guesses (``--draft-model``, kestrel_core/model/draft_model.py) in the same runs, each
with the draft's probability cutoff (``--draft-p-min``, default 0.75) and without one (p_min 0).

    python benchmarks/speculate.py [--tokens 128] [--runs 3] [--backend cpu] [--model M] [--draft-model D]
        [--draft-p-min P]

With ``--preset`` (random weights, no text), what a guess costs and gains on the backend: a random prompt's
greedy answer without guesses, then with drafts of k tokens that are all right (the answer's next ones: the
most guessing can give) and all wrong (every guess taken back, drafting paused after misses: the most it can
cost), and either in every other stretch of 16 tokens (leaving and taking up the pipelined decode), runs
alternating.

    python benchmarks/speculate.py --preset qwen3-8b --backend cuda --quant q8 [--tokens 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np

import kestrel_core
from kestrel_core.model.draft_model import DraftModel, attach_draft_model
from kestrel_core.model.engine_load import load_preset
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.scheduler import Scheduler
from kestrel_core.model.speculate import DRAFT_P_MIN, PromptLookup

CODE = '''def load(path):
    with open(path) as f:
        return json.load(f)


def save(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def merge(a, b):
    out = dict(a)
    for key, value in b.items():
        if key in out and isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
'''
TASKS = {"edit code": f"Rename the function merge to deep_merge in this code and show the whole code:\n\n{CODE}",
         "story": "Write a long story about a cat who learns to sail."}


class Oracle(PromptLookup):
    """Drafts from a known answer: its next tokens (``right``), or tokens that are never the next one, which pause
    drafting as prompt lookup's misses do; with ``stretch``, only in every other stretch of that many tokens (a
    context that offers guesses now and then). Right drafts ignore the pause: a miss comes from a near-tie of the
    random weights going the other way than in the answer, after which the rest of the answer differs too."""

    def __init__(self, prompt_len: int, answer: list[int], right: bool, vocab: int, stretch: int = 0,
                 pausing: bool | None = None) -> None:
        super().__init__()
        self.prompt_len, self.answer, self.right, self.vocab, self.stretch = prompt_len, answer, right, vocab, stretch
        self.pausing = not right if pausing is None else pausing

    def draft(self, k: int) -> list[int]:
        at = len(self.tokens) - self.prompt_len  # the answer's tokens so far; the next one is guessed
        if self.paused and self.pausing or self.stretch and at // self.stretch % 2:
            return []
        nxt = self.answer[at:at + k]
        return nxt if self.right else [(t + 1) % self.vocab for t in nxt]


def run(engine: kestrel_core.Engine, ids: list[int], streams: int, tokens: int, speculate: int,
        lookup: Callable[[], PromptLookup] | None = None,
        draft: DraftModel | None = None) -> tuple[float, list[list[int]], int, int]:
    """(decode tok/s over all streams, each stream's tokens, drafted, accepted). ``lookup``: each request's
    drafts' source (an Oracle) instead of prompt lookup; ``draft``: a draft model's guesses instead."""
    engine.speculate, engine.draft_model = speculate, draft
    scheduler = Scheduler(engine, max_batch=streams)
    requests = [scheduler.add(ids, SamplingParams(max_tokens=tokens, ignore_eos=True)) for _ in range(streams)]
    if lookup is not None:
        for r in requests:
            r.lookup = lookup()
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    first = None
    while any(not r.finished for r in requests):
        for o in scheduler.step():
            out[o.request_id] += o.new_token_ids
        if first is None:  # the prompts' step is prefill: decode is timed from here
            first = time.perf_counter()
            counted = sum(len(v) for v in out.values())
    seconds = time.perf_counter() - first
    generated = sum(len(v) for v in out.values()) - counted
    return generated / seconds, [out[r.request_id] for r in requests], scheduler.drafted, scheduler.accepted


def preset_costs(engine: kestrel_core.Engine, tokens: int, runs: int, prompt_tokens: int) -> None:
    ids = np.random.default_rng(0).integers(3, engine.config.vocab_size, prompt_tokens).tolist()
    run(engine, ids, 1, 8, 0)  # warm-up
    # the answer drafts' checks give (every token chosen by a check: a backend's batched rows may round otherwise
    # than its one-row step), which right drafts follow
    vocab = engine.config.vocab_size
    _, (plain, *_), _, _ = run(engine, ids, 1, tokens, 0)
    _, (answer, *_), _, _ = run(engine, ids, 1, tokens, 2, partial(Oracle, len(ids), plain, False, vocab, 0, False))
    print(f"the answer of drafts' checks {'is' if answer == plain else 'is NOT'} the one without guesses")
    settings = [("no guesses", 0, None)] + [
        (f"{k} {'right' if right else 'wrong'}{', every other 16 tokens' if stretch else ''}", k,
         partial(Oracle, len(ids), answer, right, vocab, stretch))
        for k, right, stretch in ((2, True, 0), (4, True, 0), (8, True, 0), (2, False, 0), (4, False, 0),
                                  (4, True, 16), (4, False, 16))]
    for streams in (1, 4):
        for _, k, lookup in settings:
            run(engine, ids, streams, 8, k, lookup)  # warm-up (captures, the GEMM's scratch)
        rates: dict[str, list[float]] = {name: [] for name, _, _ in settings}
        kept: dict[str, tuple[int, int]] = {}
        for _ in range(runs):
            for name, k, lookup in settings:
                rate, _, drafted, accepted = run(engine, ids, streams, tokens, k, lookup)
                rates[name].append(rate)
                kept[name] = (accepted, drafted)
        print(f"{streams} stream(s), {tokens} tokens each, a random {prompt_tokens}-token prompt:")
        for name, values in rates.items():
            each = ", ".join(f"{v:.1f}" for v in values)
            print(f"  {name:>30}: {statistics.median(values):8.1f} tok/s (runs {each}), "
                  f"{kept[name][0]}/{kept[name][1]} drafts kept")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--preset", help="random weights of these shapes: what guesses cost and gain")
    ap.add_argument("--quant", default="q8")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="the model (default: the default model)")
    ap.add_argument("--draft-model", default=None, help="a draft model of the same vocabulary: its guesses too")
    ap.add_argument("--draft-p-min", type=float, default=DRAFT_P_MIN,
                    help="the draft model's probability cutoff, beside none (p_min 0)")
    args = ap.parse_args()
    if args.preset:
        with load_preset(args.preset, backend=args.backend, quant=args.quant) as engine:
            print(engine.backend_line)
            preset_costs(engine, args.tokens, args.runs, args.prompt_tokens)
        return 0
    with kestrel_core.load(args.model, backend=args.backend) as engine:
        settings: list[tuple[str, int, DraftModel | None]] = [("off", 0, None), ("prompt lookup 4", 4, None),
                                                              ("prompt lookup 8", 8, None)]
        if args.draft_model:
            draft = attach_draft_model(engine, args.draft_model, p_min=args.draft_p_min)
            uncut = DraftModel(draft.engine, engine.config.vocab_size, p_min=0)  # the same model's engine
            settings += [(f"draft {k}, p_min {args.draft_p_min:g}", k, draft) for k in (4, 8)]
            settings += [(f"draft {k}, p_min 0", k, uncut) for k in (4, 8)]
        for task, text in TASKS.items():
            ids = engine.tokenizer.encode_chat([{"role": "user", "content": text}])
            room = engine.config.max_position - args.tokens - 1
            if len(ids) > room:  # a tiny model's context
                print(f"{task}: its prompt's last {room} of {len(ids)} tokens, for a context of "
                      f"{engine.config.max_position}")
                ids = ids[-room:]
            for streams in (1, 4):
                for _, speculate, draft in settings:
                    if speculate == 4:
                        run(engine, ids, streams, 8, speculate, draft=draft)  # warm-up
                rates: dict[str, list[float]] = {name: [] for name, _, _ in settings}
                kept: dict[str, tuple[int, int]] = {}
                answers = set()
                for _ in range(args.runs):
                    for name, speculate, draft in settings:
                        rate, tokens, drafted, accepted = run(engine, ids, streams, args.tokens, speculate, draft=draft)
                        rates[name].append(rate)
                        kept[name] = (drafted, accepted)
                        answers.add(tuple(map(tuple, tokens)))
                same = "same tokens" if len(answers) == 1 else "TOKENS DIFFER"
                print(f"{task}, {streams} stream(s), {args.tokens} tokens each ({same}):")
                for name, values in rates.items():
                    drafted, accepted = kept[name]
                    share = f", {accepted}/{drafted} drafts kept" if drafted else ""
                    print(f"  {name:>20}: {statistics.median(values):7.1f} tok/s "
                          f"(runs {', '.join(f'{v:.1f}' for v in values)}){share}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
