"""The scheduler's steps where one greedy sequence decodes alone: the backend's pipelined greedy decode
(``Offload.decode_greedy``) runs steps on its device ahead of the host, which takes their tokens one at a time.

``LoneDecode`` is a base of ``Scheduler`` (kestrel_core.model.scheduler): its methods use the scheduler's
``engine``, ``pool``, ``running``, ``waiting`` and ``steps``, and its ``step``, ``_accept``, ``_report`` and
``_would_guess``.
"""

from __future__ import annotations

from typing import Any

from kestrel_core.model.request import Request, RequestOutput
from kestrel_core.model.sampling import TokenLogprob


class LoneDecode:
    """A lone greedy sequence's steps run ahead on the device (see the module docstring)."""

    engine: Any
    pool: Any
    running: list[Request]
    waiting: Any
    steps: int

    def _device_step_possible(self) -> bool:
        """One greedy sequence decoding with nothing else to do: the backend may run steps ahead of us."""
        if len(self.running) != 1 or self.waiting or not self.engine.whole_step:
            return False
        request = self.running[0]
        if request._device_tokens is None and request._device_offered:
            return False
        return (
            request.pending == 1
            and len(request.seq.tokens) >= len(request.prompt_ids)
            and request.argmax_only
            and request.seq.device_len == len(request.seq.tokens)
            and not self._would_guess(request)
        )

    def _device_step(self, request: Request) -> list[RequestOutput]:
        seq = request.seq
        if request._device_tokens is None:
            request._device_offered = True
            c = self.engine.config
            steps = min(request.params.max_tokens - len(request.output_ids), c.max_position - len(seq.tokens))
            request._device_tokens = self.engine.offload.decode_greedy(
                self.engine.model, seq.seq_id, request.output_ids[-1], len(seq.tokens), steps, c.vocab_size
            )
        nxt = next(request._device_tokens, None) if request._device_tokens is not None else None
        if nxt is None:  # declined, or ended: step by step from here on
            self._drop_device(request)
            return self.step()
        if not self.pool.reserve(seq.cache, len(seq.tokens) + 1):
            self._drop_device(request)
            return self.step()
        sampled = [self._device_token(request, nxt)]
        if not request.finished and self._would_guess(request):  # its next steps carry guesses: it takes the
            # token of the step the device runs ahead, and the pipeline is offered again once the guesses stop
            ahead = self._last_device_token(request)
            if ahead is not None:
                sampled.append(self._device_token(request, ahead))
            self._drop_device(request, offer_again=True)
        return [self._report(request, sampled)]

    def _device_token(self, request: Request, token: int) -> tuple[int, TokenLogprob | None]:
        """A token the device chose after running the request's latest one."""
        self.steps += 1
        request.seq.tokens.append(request.output_ids[-1])
        request.seq.device_len = len(request.seq.tokens)
        request.sampler.count(token)
        return self._accept(request, (token, None))

    def _last_device_token(self, request: Request) -> int | None:
        """The token of the step the pipelined decode runs ahead, none launched after it (``send(False)``, API
        1.6); None where it runs none ahead, cannot stop so, or the pool has no block for it (computed again)."""
        send = getattr(request._device_tokens, "send", None)
        if send is None or not self.pool.reserve(request.seq.cache, len(request.seq.tokens) + 1):
            return None
        try:
            return send(False)
        except StopIteration:
            return None

    def _drop_device(self, request: Request, offer_again: bool = False) -> None:
        """Stop ``request``'s pipelined greedy decode, its sequence going on from what the device is known to hold
        (``Engine.device_ran_ahead``); ``offer_again``: left for other steps, not declined."""
        if offer_again:
            request._device_offered = False
        if request.stop_device_decode():
            self.engine.device_ran_ahead(request.seq)
