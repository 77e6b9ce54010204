"""Continuous (iteration-level) batching: requests join and leave the running batch at any step.

Each ``step()`` is one ``Engine.start_batch``: one row for every running sequence that is decoding, then chunks of
prompts (chunked prefill) while the step's token budget lasts. A request is admitted when the KV pool has blocks for
its tokens (with a block of headroom for each running sequence), and, with the prefix cache, not while a running
request with the same prompt still computes it (the ``n`` choices of one prompt): it then attaches that prompt's
blocks instead of computing them again. When a running sequence cannot grow, one is preempted: its blocks are freed
and it waits again, to be recomputed from its prompt and the tokens it has generated. Which one, and the order of
admission, are the scheduling policy's (kestrel_core.model.request_queue): under fcfs, the most recently admitted,
waiting again at the head of the queue; under priority, the worst by (priority, arrival), and a waiting request of
better priority preempts the worst running ones where it has no room. A row's result does not depend on the batch
(``kernels``), so a recomputed sequence carries on exactly where it stopped.

Where the backend runs a step on its device while the host goes on (``Engine.start_batch``), the next step starts as
soon as this one's tokens are in, and the host then detokenizes and reports them while the device works. Where the
backend also takes fed rows (``Engine.feeds``) and every request the running step returns a token for has it chosen
on the device (greedy, ``argmax_only``), the next step starts before that: its decode rows run the tokens the device
chose, so the device never waits for the host; only the requests that ``max_tokens`` or the context end at the
running step are left out of it, and it admits no request that would need another preempted (nor starts while a
waiting request of better priority needs room: the next step is scheduled as usual, and preempts for it). A request
that the running step ends (EOS, a stop string, an abort) has a row in the next one already: that row's token is
dropped, and the request's sequence is freed once that step is in.

With ``Engine.speculate`` set, where sequences rewind (``Engine.rewinds``), a greedy request's decode row is
followed by up to that many guessed tokens, within the token budget every decode row and prompt chunk left: from its
context, or from ``Engine.draft_model`` where one is set (the ``Guesser``, kestrel_core.model.speculate, asked for
the step's requests together, and given a greedy request's tokens in the step of its prompt's last chunk, to read
beside it); the step keeps each row's argmax while the guesses agree, and the sequence is rewound
past the first that does not. While a greedy request may get a guess, the batch's steps are not fed (a guess needs
the tokens before it), so they are not the backend's pipelined greedy decode.

A ``Scoring`` request (kestrel_core.model.scoring) scores its prompt's tokens instead of generating: its prompt runs
as a prompt's chunks do, each chunk's logits of every row coming back.

Not thread-safe: one thread drives a scheduler (``AsyncEngine``, ``Engine.generate``) and its engine (model/driver.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kestrel_core.errors import InvalidRequest, KestrelError, Overloaded
from kestrel_core.model import scoring
from kestrel_core.model.detokenize import TextStream
from kestrel_core.model.drafting import Drafting
from kestrel_core.model.driver import Hold, check_engine
from kestrel_core.model.grammar import Constraint, prepare_masks
from kestrel_core.model.lone_decode import LoneDecode
from kestrel_core.model.request import FINISHED, RUNNING, WAITING, Request, RequestOutput, check_added, checked_prompt
from kestrel_core.model.request_queue import FCFS, PRIORITY, RequestQueue, checked_priority, outranked, rank
from kestrel_core.model.sampling import Sampler, SamplingParams, TokenLogprob, logprobs_of
from kestrel_core.model.scoring import Scoring
from kestrel_core.model.speculate import Guesser, LookupGuesser
from kestrel_core.model.tokenizer import NoTokenizer
from kestrel_core.model.validate import MAX_CONCURRENCY, MAX_TOKEN_BUDGET, MAX_WAITING, check_int
from kestrel_core.model.weights import PREFILL_CHUNK

log = logging.getLogger("kestrel")

DEFAULT_MAX_BATCH = 64
DEFAULT_MAX_WAITING = 256

def default_token_budget(max_batch: int) -> int:
    """Tokens per step (decode rows plus prompt chunks) when none is given: a whole prompt chunk beside a full
    batch of decode rows, so a prompt of up to PREFILL_CHUNK tokens that arrives while others decode gets its
    first token from one step."""
    return PREFILL_CHUNK + max_batch


class Scheduler(LoneDecode, Drafting):
    """Requests in, one batched step at a time, ``RequestOutput``s out (``token_budget``: default_token_budget's;
    ``policy``: fcfs or priority, kestrel_core.model.request_queue)."""

    def __init__(self, engine: Any, *, max_batch: int = DEFAULT_MAX_BATCH, token_budget: int | None = None,
                 max_waiting: int = DEFAULT_MAX_WAITING, policy: str = FCFS) -> None:
        check_engine(engine, "Scheduler")
        max_batch = check_int("max_batch", max_batch, 1, MAX_CONCURRENCY)
        max_waiting = check_int("max_waiting", max_waiting, 0, MAX_WAITING)
        token_budget = (default_token_budget(max_batch) if token_budget is None
                        else check_int("token_budget", token_budget, 1, MAX_TOKEN_BUDGET))
        self.engine = engine
        self.pool = engine.pool
        self.max_batch = max_batch
        self.token_budget = max(token_budget, max_batch)  # every running sequence decodes at every step
        self.max_waiting = max_waiting
        self.waiting = RequestQueue(policy)
        self.policy = self.waiting.policy
        self.running: list[Request] = []  # in admission order; under priority, by rank from each step's start
        self.requests: dict[str, Request] = {}
        self.eos = engine.eos_token_ids
        self._ids = itertools.count(1)
        self.steps = 0
        self.preemptions = 0
        self.speculate = int(getattr(engine, "speculate", 0))  # draft tokens a greedy step may guess
        self.guesser: Guesser = getattr(engine, "draft_model", None) or LookupGuesser()
        self.drafted = 0  # draft tokens run
        self.accepted = 0  # draft tokens the model confirmed
        self._ended: list[Request] = []  # requests ended while scheduling, reported by the next step
        self._running_step: tuple[list[tuple[Request, list[int], int]], Any] | None = None  # on the device
        self._start_error: Exception | None = None  # starting the next step failed: the next step() raises it
        self._held: list[Any] = []  # sequences of ended requests that the running step still uses
        self.on_start: Callable[[], None] | None = None  # called before each step is scheduled
        self._ahead = Hold(engine.driver)  # the engine, while a lone greedy decode runs ahead (``_driving``)

    # -- requests ------------------------------------------------------------------------------------

    def check(self, prompt_ids: Sequence[int], params: SamplingParams | Scoring, priority: int = 0) -> list[int]:
        """The prompt's token ids as a list; InvalidRequest for a request that can never run, or a priority the
        policy does not take (before it queues); a KestrelError once the engine is closed."""
        self.engine.check_open()
        checked_priority(self.policy, priority)
        if isinstance(params, Scoring):
            return scoring.checked_scoring(self.engine, self.pool, prompt_ids, params)
        return checked_prompt(self.engine, self.pool, prompt_ids, params)

    def add(self, prompt_ids: Sequence[int], params: SamplingParams | Scoring, request_id: str | None = None,
            constraint: Constraint | None = None, priority: int = 0) -> Request:
        """Queue a request (a ``Scoring``: one that scores its prompt, kestrel_core.model.scoring); InvalidRequest
        if it can never run, Overloaded if the queue is full. ``constraint``: its grammar's, built already
        (``Engine.constraint``), else built here (a grammar that does not compile is then the InvalidRequest);
        ``priority``: under the priority policy, lower first (kestrel_core.model.request_queue)."""
        prompt_ids = self.check(prompt_ids, params, priority)
        check_added(request_id, constraint)
        if len(self.waiting) >= self.max_waiting and len(self.running) >= self.max_batch:
            raise Overloaded(f"the server is at capacity ({len(self.running)} running, {len(self.waiting)} "
                             "waiting); retry later")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests or any(r.request_id == request_id for r in self._ended):  # its end unsaid
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        if isinstance(params, Scoring):
            request = scoring.scoring_request(request_id, prompt_ids, params)
        else:
            tokenizer = self.engine.tokenizer
            text = None if isinstance(tokenizer, NoTokenizer) else TextStream.of(tokenizer, params)
            if constraint is None and params.grammar is not None:
                constraint = self.engine.constraint(params.grammar)
            request = Request(request_id, prompt_ids, params, Sampler(params, constraint, prompt_ids, self.eos), text)
        request.priority = priority
        self.requests[request_id] = request
        self.waiting.add(request)
        return request

    def close(self) -> None:
        """Abort every request and finish the step still running on the device (a failure of it is logged; on a
        closed engine, left)."""
        if self.engine.closed:
            self._end_all()
            return
        with self._driving():
            for request in list(self.waiting) + list(self.running):
                self._finish(request, "abort")
            try:
                self.drain()
            except Exception as exc:
                log.warning("kestrel: the last step failed: %s", exc)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its sequence; the next step reports its end ("abort", with its held text)."""
        request = self.requests.get(request_id)
        if request is not None and not request.finished:
            with self._driving():
                self._finish(request, "abort")
            self._ended.append(request)

    @contextlib.contextmanager
    def _driving(self) -> Iterator[None]:
        """The engine driven by this thread while the scheduler works (kestrel_core.model.driver), and held for it
        after, while a lone greedy decode runs steps ahead on the device (LoneDecode): another thread's step would
        change what that reads. A step the device still runs holds the engine itself (``Step``)."""
        with self.engine.driver():
            try:
                yield
            finally:
                self._ahead.set(self, any(r._device_tokens is not None for r in self.running))

    def _end_all(self) -> int:
        """On a closed engine: every request ends ("abort") and its sequence is freed, the step on the device left
        untaken (its backends are closed); how many requests there were."""
        started, self._running_step = self._running_step, None
        if started is not None:
            started[1].forget()
        requests = list(self.waiting) + list(self.running)
        for request in requests:
            self._finish(request, "abort")
        self._release_held()
        self._ended, self._start_error = [], None
        self._ahead.set(self, False)
        return len(requests)

    @property
    def _busy(self) -> bool:  # anything but waiting requests: running ones, ends to report, a step or its error
        return bool(self.running or self._ended or self._running_step or self._start_error)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self._busy

    @property
    def stalled(self) -> bool:
        """Only waiting requests, none of which could start: a step does nothing until blocks come back."""
        return bool(self.waiting) and not self._busy

    @property
    def step_running(self) -> bool:
        """Whether a step runs on the device (``drain`` ends it): a batched one, or a lone greedy decode's ahead."""
        return self._running_step is not None or any(r._device_tokens is not None for r in self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batched step; the outputs of every request that got a token or finished. A KestrelError once
        the engine is closed: the requests under way end ("abort") as a stream's do (``Engine.close``)."""
        if self.engine.closed:
            ended = self._end_all()
            raise KestrelError(f"the engine was closed while {ended} request(s) ran; they are aborted" if ended
                               else "the engine is closed")
        with self._driving():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        if self._running_step is None and self._device_step_possible():
            return self._ended_outputs() + self._device_step(self.running[0])
        started, self._running_step = self._running_step, None
        started = started if started is not None else self._start()
        outputs = self._ended_outputs()
        if started is None:
            return outputs
        on_device = started[1].running
        self._running_step = self._start(started) if on_device else None
        try:
            tokens = self._collect(started)
        except Exception:
            self._drop_fed()
            raise
        if self._running_step is None and on_device and not self._device_step_possible():
            try:  # the device works on the next step while this one's tokens are reported
                self._running_step = self._start()
            except Exception as exc:  # raised by the next step() call, after these outputs are out
                self._start_error = exc
        outputs.extend(self._report(request, sampled) for request, sampled in tokens)
        # a request the next step's scheduling ended has just had its last output
        self._ended = [r for r in self._ended if all(r is not request for request, _ in tokens)]
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Finish the step still running on the device, if one is, starting none: its outputs (the engine is
        then free for other work, which may change what the device holds: a pipelined greedy decode is left, its
        step ahead computed again). Raises what that step raised."""
        if self.engine.closed:
            self._end_all()
            return []
        with self._driving():
            return self._drain()

    def _drain(self) -> list[RequestOutput]:
        for request in self.running:
            if request._device_tokens is not None:
                self._drop_device(request, offer_again=True)
        outputs = self._ended_outputs()
        started, self._running_step = self._running_step, None
        if started is not None:
            outputs.extend(self._report(request, sampled) for request, sampled in self._collect(started))
        return outputs

    def _collect(self, started: tuple[list[tuple[Request, list[int], int]], Any]
                 ) -> list[tuple[Request, list[tuple[int, TokenLogprob | None]]]]:
        """A started step's result: each of its requests still running takes its new token (or tokens, where
        its draft was right); one whose sampling fails ends alone, its error in its last output."""
        work, step = started
        try:
            logits = step.result()
        except Exception:  # the step failed as a whole: its requests end; the scheduler goes on
            self._abort_all(work)
            raise
        finally:
            self._release_held()
        taking = [(request, out) for (request, _, rows), out in zip(work, logits) if rows and not request.finished]
        prepare_masks([r.sampler.constraint for r, _ in taking if r.sampler.constraint is not None])
        tokens = []
        for request, out in taking:
            if request.scoring is not None:  # its chunk's scores; the prompt's end ends it
                scoring.take_scores(request, out)
                if not request.pending:
                    self._finish(request, "length")
                tokens.append((request, []))
                continue
            try:
                tokens.append((request, self._take_draft(request, out) if request.draft
                               else [self._accept(request, self._sample(request, out[-1]))]))
            except Exception as exc:  # its own parameters or constraint: it ends (reported), the batch goes on
                log.debug("kestrel: request %s failed", request.request_id, exc_info=True)
                self._finish(request, "abort")
                request.error = exc
                self._ended.append(request)
        return tokens

    def _start(self, before: tuple[list[tuple[Request, list[int] | None, int]], Any] | None = None
               ) -> tuple[list[tuple[Request, list[int] | None, int]], Any] | None:
        """Schedule a step and start it on the engine: (work, its Step), or None when there is nothing to run.
        With ``before`` (the step still on the device), the step after it, its decode rows fed with the tokens
        the device chooses there: None also when it cannot be (see the module docstring) or the backend did not
        take it, and the step then starts as usual once ``before`` is in."""
        ahead = None
        if before is not None:
            if not self.engine.feeds or any((rows or r.scoring) and not r.argmax_only for r, _, rows in before[0]
                                            if not r.finished):
                return None  # a request sampled (or scored) on the host: its next token is not the device's
            if self.speculate and any(r.draft or self._would_guess(r) for r, _, _ in before[0] if not r.finished):
                return None  # its next step guesses from the running step's tokens, or may
            if outranked(self.waiting, self.running, self._has_room):
                return None  # a better waiting request preempts for room (``_make_room``), which a fed step does not
            ahead = {id(r): (1 if toks is None else len(toks), rows) for r, toks, rows in before[0]}
            self._running_step = before  # what ends while scheduling is held for the step on the device
        elif self._start_error is not None:
            exc, self._start_error = self._start_error, None
            raise exc
        try:
            if self.on_start is not None:
                self.on_start()
            work = self._schedule(ahead)
        finally:
            if before is not None:
                self._running_step = None
        if not work:
            return None
        self.steps += 1
        args = ([(r.seq, toks, rows) for r, toks, rows in work], [r.argmax_only for r, _, _ in work])
        try:
            step = self.engine.start_batch(*args) if before is None else self.engine.start_batch(*args, after=before[1])
        except Exception:
            if before is None:
                self._abort_all(work)
                raise
            step = None
        if step is None:
            self.steps -= 1
        return None if step is None else (work, step)

    def _drop_fed(self) -> None:
        """The step before a fed step failed: the fed step's outputs are void; wait for it, quietly."""
        fed, self._running_step = self._running_step, None
        if fed is not None:
            try:
                with contextlib.suppress(Exception):
                    fed[1].result()
            finally:
                self._release_held()

    def _schedule(self, ahead: dict[int, tuple[int, int]] | None = None
                  ) -> list[tuple[Request, list[int] | None, int]]:
        """This step's work: (request, its new tokens, logit rows). With ``ahead`` (each request of the step
        still running: the tokens it runs there, its logit rows), the step that follows that one: a request
        whose token comes from it is fed (None), and no request is preempted (nothing is scheduled instead)."""
        budget = self.token_budget
        work: list[tuple[Request, list[int] | None, int]] = []
        limit = self.engine.config.max_position
        guessing = self.speculate > 0 and ahead is None and self.engine.rewinds
        if ahead is None and self.policy == PRIORITY:
            self._make_room()
        for request in list(self.running):
            if request.status != RUNNING or budget == 0:
                continue
            if request._device_tokens is not None:  # it was decoding alone: its steps ahead are left behind
                self._drop_device(request, offer_again=True)
            before = ahead.get(id(request)) if ahead is not None else None
            if before is None:
                n = min(request.pending, budget)
                if n > 1:  # a prompt chunk
                    n = self._prompt_chunk(request, n)
                grown = self._grow(request, n) if ahead is None else self.pool.reserve(
                    request.seq.cache, len(request.seq.tokens) + n)
                if not grown:
                    if ahead is not None:
                        return []
                    continue  # preempted, or finished for lack of room
                work.append(self._chunk(request, n))
                budget -= n
                continue
            done = len(request.seq.tokens) + before[0]  # positions once the running step is in
            if before[1]:  # its next token is the running step's: fed, unless that token ends it
                if len(request.output_ids) + 1 >= request.params.max_tokens or len(request.tokens) + 1 > limit:
                    continue
                if not self.pool.reserve(request.seq.cache, done + 1):
                    return []
                work.append((request, None, 1))
                budget -= 1
                continue
            left = len(request.tokens) - done  # the rest of its prompt
            n = min(left, budget)
            if not self.pool.reserve(request.seq.cache, done + n):
                return []
            work.append((request, request.tokens[done:done + n], int(n == left)))
            budget -= n
        while self.waiting and budget and len(self.running) < self.max_batch:
            request = self.waiting[0]
            if not self._has_room(request):
                break  # no room yet: it waits for running sequences (or an embedding's text) to finish
            if self._twin_computing(request):
                break
            self.waiting.popleft()
            request.admit(self.engine)
            self.running.append(request)
            n = self._prompt_chunk(request, min(request.pending, budget))
            if ahead is not None:
                if not self.pool.reserve(request.seq.cache, len(request.seq.tokens) + n):
                    return []
            elif not self._grow(request, n):
                continue
            work.append(self._chunk(request, n))
            budget -= n
        if guessing:
            self._guess(work, budget)
        return work

    def _has_room(self, request: Request) -> bool:
        """Whether the KV pool has blocks for a waiting request's tokens and a block of headroom for each running
        sequence; one that the whole pool cannot hold is let in alone (it ends with "length")."""
        need = self.pool.blocks_for(len(request.tokens) + 1)
        return need + len(self.running) <= self.pool.free_blocks or not self.running and need > self.pool.num_blocks

    def _make_room(self) -> None:
        """Under the priority policy: the running requests ordered by rank, the worst last (the one ``_grow``
        preempts), and those of worse priority than the next waiting request preempted, the worst first, while it
        has no room."""
        self.running.sort(key=rank)
        while outranked(self.waiting, self.running, self._has_room):
            self._preempt(self.running[-1])

    def _prompt_chunk(self, request: Request, n: int) -> int:
        """``n`` tokens of ``request``'s prompt, or fewer: a scoring's chunk holds PREFILL_CHUNK at most (all its rows'
        logits come to the host), and ``_to_state_end``'s."""
        return self._to_state_end(request, n if request.scoring is None else min(n, PREFILL_CHUNK))

    def _to_state_end(self, request: Request, n: int) -> int:
        """``n``, or fewer so that a chunk of the prompt ends where the prefix cache may keep its recurrent state
        (``Engine.state_end``, and whole blocks before it): a state stands only for the position its step ended."""
        end = self.engine.state_end(len(request.prompt_ids))
        done = len(request.seq.tokens)
        if not done < end < done + n:
            aligned = (done + n) // self.pool.block_size * self.pool.block_size
            return aligned - done if done < aligned < end else n
        return end - done

    def _twin_computing(self, request: Request) -> bool:
        """Whether a running request with ``request``'s prompt (at least a block long) has not finished it: its
        blocks are shared once it has (prefix cache), so ``request`` waits rather than computes them too."""
        prompt = request.prompt_ids
        return bool(self.engine.prefix_cache and not request.preemptions and not request.scoring
                    and len(prompt) > self.pool.block_size
                    and any(r.seq is not None and len(r.seq.tokens) < len(r.prompt_ids) and r.prompt_ids == prompt
                            for r in self.running))

    def _chunk(self, request: Request, n: int) -> tuple[Request, list[int], int]:
        done, prompt = len(request.seq.tokens), len(request.prompt_ids)
        if request.draft:  # its next token and the guesses after it, each row's logits wanted
            return request, [request.output_ids[-1], *request.draft], 1 + len(request.draft)
        if done >= prompt:  # a decode row: not the whole sequence's list for one token
            tokens = request.output_ids[done - prompt:done - prompt + n]
        else:
            tokens = request.tokens[done:done + n]
            if request.scoring is not None:
                return request, tokens, scoring.score_rows(request, done, n)
        return request, tokens, int(n == request.pending)  # logits once the chunk reaches the last token

    def _grow(self, request: Request, n: int) -> bool:
        """KV blocks for n more tokens of ``request``, preempting the last running requests (the most recently
        admitted; under priority, the worst) if needed."""
        target = len(request.seq.tokens) + n
        while not self.pool.reserve(request.seq.cache, target):
            victim = self.running[-1]
            if victim is request:  # alone and still no room: the pool cannot hold it, or another user holds the room
                if len(self.running) == 1 and self.pool.blocks_for(target) > self.pool.num_blocks:
                    self._finish(request, "length")
                    self._ended.append(request)
                else:
                    self._preempt(request)
                return False
            self._preempt(victim)
        return True

    def _preempt(self, request: Request) -> None:
        request.stop_device_decode()
        self.guesser.forget(request)
        self.engine.release(request.seq)
        request.seq = None
        request.status = WAITING
        request.preemptions += 1
        self.preemptions += 1
        self.running.remove(request)
        self.waiting.put_back(request)

    def _sample(self, request: Request, logits: np.ndarray) -> tuple[int, TokenLogprob | None]:
        """The next token from a row of logits, or the token the device chose (``argmax_only``)."""
        if logits.ndim == 0:
            token = int(logits)
            request.sampler.count(token)
            return token, None
        token = request.sampler(logits)
        return token, logprobs_of(logits, token, request.params.top_logprobs) if request.params.logprobs else None

    def _accept(self, request: Request, sampled: tuple[int, TokenLogprob | None]) -> tuple[int, TokenLogprob | None]:
        """Append a new token and check the stop conditions that need no text (before the next step starts)."""
        token = sampled[0]
        p = request.params
        request.output_ids.append(token)
        if request.first_token_at is None:
            request.first_token_at = time.monotonic()
        if token in p.stop_token_ids:
            request.stop_reason = token
            self._finish(request, "stop")
        elif token in self.eos and not p.ignore_eos:
            self._finish(request, "stop")
        elif len(request.output_ids) >= p.max_tokens or len(request.tokens) >= self.engine.config.max_position:
            self._finish(request, "length")  # or the context is full: prompt and answer hold max_position tokens
        return sampled

    def _ended_outputs(self) -> list[RequestOutput]:
        """The last outputs of the requests ended while scheduling: the rest of their text."""
        ended, self._ended = self._ended, []
        return [RequestOutput(r.request_id, [], r.text.flush() if r.text is not None else "", None, True,
                              r.finish_reason, len(r.prompt_ids), len(r.output_ids), error=r.error) for r in ended]

    def _report(self, request: Request, sampled: list[tuple[int, TokenLogprob | None]]) -> RequestOutput:
        """The new tokens' text, the stop strings, and what changed. A stop string ends the answer at its token:
        tokens a draft added after it are dropped. A token that stopped the answer (an end of text, a stop token
        id) is counted but its text is not the answer's unless ``include_stop_str_in_output``, as in vLLM. A
        scoring's: the scores its chunks took."""
        if request.scoring is not None:
            return scoring.scored_output(request)
        stream = request.text
        tokens: list[int] = []
        offsets: list[int] = []
        text = ""
        by_token = (request.finish_reason == "stop" and not isinstance(request.stop_reason, str)  # set by _accept
                    and not request.params.include_stop_str_in_output)
        for i, (token, _) in enumerate(sampled):
            tokens.append(token)
            offsets.append(len(text))
            if stream is None or by_token and i == len(sampled) - 1:
                continue
            text += stream.push(token)
            if stream.stopped:
                request.stop_reason = stream.stopped_by
                if not request.finished:
                    self._finish(request, "stop")
                elif request.finish_reason == "length":
                    request.finish_reason = "stop"  # a stop string and max_tokens at the same token: the string's
                dropped = len(sampled) - len(tokens)
                if dropped:
                    del request.output_ids[len(request.output_ids) - dropped:]
                break
        if request.finished and stream is not None:
            text += stream.flush()
        logprobs = [lp for _, lp in sampled[:len(tokens)]] if sampled[0][1] is not None else None
        return RequestOutput(request.request_id, tokens, text, logprobs, request.finished, request.finish_reason,
                             len(request.prompt_ids), len(request.output_ids),
                             request.stop_reason if request.finished else None, text_offsets=offsets,
                             cached_tokens=request.cached_tokens)

    def _abort_all(self, work: list[tuple[Request, Any, int]]) -> None:
        """A step that failed as a whole, starting or running: its requests end."""
        for request, _, _ in work:
            self._finish(request, "abort")

    def _finish(self, request: Request, reason: str) -> None:
        request.stop_device_decode()
        self.guesser.forget(request)
        if request.seq is not None:
            if self._running_step is not None and any(r is request for r, _, _ in self._running_step[0]):
                self._held.append(request.seq)  # the running step still uses it
            else:
                self.engine.release(request.seq)
            request.seq = None
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        request.status = FINISHED
        request.finish_reason = reason
        self.requests.pop(request.request_id, None)

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for seq in held:
            self.engine.release(seq)
