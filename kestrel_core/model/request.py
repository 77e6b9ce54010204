"""A request as the scheduler holds it (``Request``), what each step reports of it (``RequestOutput``), and the
checks a request passes before it is queued (``checked_prompt``)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kestrel_core.errors import ContextExceeded, InvalidRequest, KestrelError, invalid_request
from kestrel_core.model.detokenize import TextStream
from kestrel_core.model.sampling import Sampler, SamplingParams, TokenLogprob
from kestrel_core.model.speculate import PromptLookup
from kestrel_core.model.tokenizer import NoTokenizer

if TYPE_CHECKING:
    from kestrel_core.model.scoring import Scoring

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class RequestOutput:
    """What one step added to a request: new tokens and text, and whether (and why) it finished."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" (EOS, a stop token or string), "length", "abort", or None
    prompt_tokens: int
    completion_tokens: int
    stop_reason: str | int | None = None  # what stopped it: the stop string, or stop token id (None: end of text)
    error: Exception | None = None  # it failed alone (its sampling raised): finished, "abort", the others go on
    # where each new token's text starts in new_text (a token whose text is held back: where it will start, as a
    # later token's text carries it); None: unknown (every token then counts as starting where new_text does)
    text_offsets: list[int] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # a scoring's: its prompt tokens scored by this step
    cached_tokens: int = 0  # of its prompt, those the prefix cache held when it was first admitted


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    text: TextStream | None
    arrival: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower first, under the scheduler's priority policy (kestrel_core.model.request_queue)
    arrival_index: int = 0  # its place in the order requests came to its scheduler
    output_ids: list[int] = field(default_factory=list)
    status: str = WAITING
    finish_reason: str | None = None
    seq: Any = None  # the engine's SeqState while admitted
    preemptions: int = 0
    first_token_at: float | None = None
    _device_tokens: Iterator[int] | None = None  # the backend's pipelined greedy decode, while it runs
    _device_offered: bool = False
    lookup: PromptLookup | None = None  # its tokens' n-grams, for drafts (speculative decoding)
    draft_seq: Any = None  # its place in a draft model's engine, for drafts (kestrel_core.model.draft_model)
    draft: list[int] = field(default_factory=list)  # the tokens its running step guessed after its next one
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: Exception | None = None  # what ended it alone (its sampling raised)
    scoring: Scoring | None = None  # it scores its prompt and generates nothing (kestrel_core.model.scoring)
    scored: int = 0  # a scoring's prompt positions whose next token it has scored
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # a scoring's, until its next output
    cached_tokens: int = 0  # of its prompt, those the prefix cache held when it was first admitted

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def admit(self, engine: Any) -> None:
        """Running, in a new sequence of ``engine``'s that starts with the longest prefix of its tokens the prefix cache
        holds (none for a scoring: it scores every position)."""
        self.seq = engine.new_sequence(len(self.prompt_ids), () if self.scoring else self.tokens, self.preemptions > 0)
        if not self.preemptions:  # a resumed request mostly finds the blocks it computed itself
            self.cached_tokens = len(self.seq.tokens)
        self.status = RUNNING

    @property
    def argmax_only(self) -> bool:
        """Only the greedy token of its logits is needed (a backend may choose it on the device)."""
        return self.scoring is None and self.params.argmax_only

    @property
    def tokens(self) -> list[int]:
        """Every token of the sequence: the prompt, then the output."""
        return self.prompt_ids + self.output_ids

    @property
    def pending(self) -> int:
        """Tokens not yet in the KV cache (the last output token, or the rest of the prompt)."""
        done = len(self.seq.tokens) if self.seq is not None else 0
        return len(self.prompt_ids) + len(self.output_ids) - done

    def stop_device_decode(self) -> bool:
        """Close the backend's pipelined greedy decode of this request; whether one was running."""
        tokens, self._device_tokens = self._device_tokens, None
        close = getattr(tokens, "close", None)
        if close is not None:
            close()
        return tokens is not None


def check_added(request_id: object, constraint: object) -> None:
    """InvalidRequest for a request's id that is not text (its outputs and the server's answers name it), or a
    constraint that is not a grammar's (``Engine.constraint``): its first step would fail inside the sampler."""
    from kestrel_core.model.grammar import Constraint

    if request_id is not None and not isinstance(request_id, str):
        raise InvalidRequest(f"request_id must be a str, got {type(request_id).__name__}", param="request_id")
    if constraint is not None and not isinstance(constraint, Constraint):
        raise InvalidRequest(f"constraint must be a Constraint (engine.constraint(grammar)), got "
                             f"{type(constraint).__name__}", param="constraint")


def checked_prompt(engine: Any, pool: Any, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
    """``prompt_ids`` as a list; InvalidRequest for a request ``engine`` (its KV ``pool``) can never run, before
    it is queued."""
    engine.check_generates()
    if not isinstance(params, SamplingParams):
        raise InvalidRequest(f"params must be a SamplingParams (engine.sampling_params(...) makes one), got "
                             f"{type(params).__name__}", param="params")
    params.check()
    if params.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1 to generate, got {params.max_tokens}",
                             param="max_tokens")
    if params.stop and isinstance(engine.tokenizer, NoTokenizer):
        raise InvalidRequest("stop strings need a tokenizer, and this model has none", param="stop")
    try:
        prompt_ids = engine.check_ids(prompt_ids, "prompt")
    except KestrelError as exc:
        raise invalid_request(exc, "prompt") from None
    if len(prompt_ids) >= engine.config.max_position:
        raise ContextExceeded(f"the prompt has {len(prompt_ids)} tokens, which leaves no room for an answer in "
                              f"the model's context of {engine.config.max_position}", len(prompt_ids),
                              engine.config.max_position, param="prompt")
    vocab = engine.config.vocab_size
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
        outside = [t for t in ids if t >= vocab]
        if outside:
            raise InvalidRequest(f"{name} token id {outside[0]} is outside the vocabulary [0, {vocab})",
                                 param=name)
    if params.min_tokens:  # every logit at -inf: sampling has no distribution to draw from
        held = set(params.stop_token_ids) | (set() if params.ignore_eos else set(engine.eos_token_ids))
        if sum(t < vocab for t in held) >= vocab:
            raise InvalidRequest("min_tokens holds back the stop_token_ids and the end of text, and they are the "
                                 "whole vocabulary: no token is left to generate", param="min_tokens")
    if pool.blocks_for(len(prompt_ids)) > pool.num_blocks:
        raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens; the KV cache holds "
                             f"{pool.capacity}", param="prompt")
    return prompt_ids
