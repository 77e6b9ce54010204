"""Prompt scoring as the scheduler runs it: a request whose prompt's tokens after the first are each scored by the
logits before it (completions' ``echo`` with ``logprobs``), generating nothing.

A scoring is admitted, preempted and recomputed as a generation is, and its prompt runs in chunks of the step's
token budget beside the running sequences' decode rows, as a prompt's prefill does; each chunk asks for the
logits of all of its rows (at most PREFILL_CHUNK: they come to the host, [chunk, vocab]), which its output
reports as ``RequestOutput.prompt_logprobs``. It never attaches a cached prefix (that would skip positions it
scores), but leaves its prompt's blocks in the prefix cache for a generation of the same prompt. A recomputed
scoring asks only for the rows of the positions it has not reported yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kestrel_core.errors import InvalidRequest, KestrelError, invalid_request
from kestrel_core.model.request import Request, RequestOutput
from kestrel_core.model.sampling import MAX_TOP_LOGPROBS, Sampler, SamplingParams, logprobs_of
from kestrel_core.model.validate import is_int


@dataclass(frozen=True)
class Scoring:
    """What a scoring request asks for (``Scheduler.add``'s params instead of a SamplingParams): each prompt
    token's logprob with the ``top`` likeliest alternatives."""

    top: int = 0


def check_top(top: int) -> None:
    """InvalidRequest unless ``top`` (the alternatives a scored token reports) is in [0, MAX_TOP_LOGPROBS]."""
    if not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}", param="top")


def checked_scoring(engine: Any, pool: Any, prompt_ids: Sequence[int], scoring: Scoring) -> list[int]:
    """``prompt_ids`` as a list; InvalidRequest for a scoring ``engine`` (its KV ``pool``) can never run."""
    engine.check_generates()
    check_top(scoring.top)
    try:
        prompt_ids = engine.check_ids(prompt_ids, "prompt")
    except KestrelError as exc:
        raise invalid_request(exc, "prompt") from None
    if pool.blocks_for(len(prompt_ids)) > pool.num_blocks:
        raise InvalidRequest(
            f"the prompt has {len(prompt_ids)} tokens; the KV cache holds {pool.capacity}", param="prompt"
        )
    return prompt_ids


def scoring_request(request_id: str, prompt_ids: list[int], scoring: Scoring) -> Request:
    """A scoring as the scheduler holds it: its sampler is never asked for a token."""
    params = SamplingParams(max_tokens=1, seed=0)
    return Request(request_id, prompt_ids, params, Sampler(params), None, scoring=scoring)


def score_rows(request: Request, done: int, n: int) -> int:
    """Logit rows of a scoring's chunk of ``n`` tokens from position ``done``: those of the positions it has not
    scored (all of them, but where it is recomputed). The chunk that ends the prompt always has some."""
    return max(0, min(n, done + n - request.scored))


def take_scores(request: Request, rows: np.ndarray) -> None:
    """The logprobs of a scoring's chunk that has just run (its last ``len(rows)`` positions' logits), for its next
    output: each row scores the prompt token after it (the prompt's last token has none after it)."""
    prompt = request.prompt_ids
    end = len(request.seq.tokens)
    first, stop = end - len(rows), min(end, len(prompt) - 1)
    top = request.scoring.top
    request.prompt_logprobs += [logprobs_of(rows[p - first], prompt[p + 1], top) for p in range(first, stop)]
    request.scored = max(request.scored, stop)


def scored_output(request: Request) -> RequestOutput:
    """A scoring's output: the logprobs its chunks scored since the last one."""
    scored, request.prompt_logprobs = request.prompt_logprobs, []
    return RequestOutput(
        request.request_id,
        [],
        "",
        None,
        request.finished,
        request.finish_reason,
        len(request.prompt_ids),
        0,
        prompt_logprobs=scored,
    )
