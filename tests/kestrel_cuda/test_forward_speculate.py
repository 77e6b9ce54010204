"""Speculative decoding on the CUDA backend, on the GPU: test_forward_speculate_host.py's scenarios through the
real backend (its tiled GEMM for the drafts' rows, the captured steps, the pipelined greedy decode). Skipped
where CuPy or a CUDA device is missing (CI)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

import kestrel_core  # noqa: E402
from kestrel_core.model.sampling import SamplingParams  # noqa: E402

from .forward_check import FACTOR, cpu_logits, cuda_device_count, greedy_agrees, jitter_effect  # noqa: E402
from .test_forward_speculate_host import AnswerDrafts, looping_prompts, run, tiny_model  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]


@pytest.mark.parametrize("together", [False, True])
def test_the_cuda_backend_keeps_confirmed_guesses_and_rewinds_the_rest(together: bool) -> None:
    """Greedy requests with guesses, one at a time (the lone path, leaving the pipelined decode) or four at once
    (the pool), then with guesses that are all wrong: guesses are kept, the device takes back the wrong ones'
    positions and declines nothing, and every token is the CPU's choice at its step (or ties with it within the
    nudge's range)."""
    model = tiny_model()
    prompts = looping_prompts(model, 4, seed=1)
    params = SamplingParams(max_tokens=30, ignore_eos=True)

    def serve(engine, lookup=None):  # type: ignore[no-untyped-def]
        """Each prompt's tokens, and the guesses kept."""
        if together:
            got, sched = run(engine, prompts, 4, params, lookup)
            return got, sched.accepted
        runs = [run(engine, [p], 4, params, lookup) for p in prompts]
        return [tokens for (tokens,), _ in runs], sum(sched.accepted for _, sched in runs)

    with kestrel_core.load(model, backend="cuda") as engine:
        assert engine.rewinds
        got, accepted = serve(engine)
        answers = {tuple(p): tokens for p, tokens in zip(prompts, got)}
        wrong, kept = serve(engine, lambda p: AnswerDrafts(len(p), answers[tuple(p)], model.config.vocab_size))
        fwd = engine.backend.device.forward_engine()
        declined = engine.stats["offload"]["kestrel_forward_batch"]["declined"]
    assert accepted > 0 and kept == 0 and fwd.counters["rewound_positions"] > 0 and declined == 0
    for p, tokens in zip(prompts + prompts, got + wrong):
        assert len(tokens) == 30
        seq = np.array(p + tokens)
        ref = cpu_logits(model, seq, len(seq))
        tol = FACTOR * jitter_effect(model, seq, len(seq), ref)[1]
        assert greedy_agrees(tokens, model, np.array(p), tol) == [], (p, tokens)
