"""The pipelined greedy decode under the scheduler on the GPU: test_forward_pipeline_host.py's scenarios through
the real backend (its captured decode graph, which reads the step's token and position from the device). Skipped
where CuPy or a CUDA device is missing (CI)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

import kestrel_core  # noqa: E402
from kestrel_core.model.sampling import SamplingParams  # noqa: E402
from kestrel_core.model.scheduler import Scheduler  # noqa: E402

from .forward_check import cuda_device_count  # noqa: E402
from .test_forward_pipeline_host import work_between_two_steps  # noqa: E402
from .test_forward_speculate_host import tiny_model  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]


def test_a_prompt_whose_last_chunk_is_one_token_then_decodes_on_the_device() -> None:
    model = tiny_model()
    prompt = np.random.default_rng(1).integers(3, model.config.vocab_size, 17).tolist()
    with kestrel_core.load(model, backend="cuda") as engine:
        sched = Scheduler(engine, max_batch=1, token_budget=8)
        request = sched.add(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
        got = []
        while sched.has_work:
            got += [t for o in sched.step() for t in o.new_token_ids]
        fwd = engine.backend.device.forward_engine()
    assert len(got) == 6 and request.finish_reason == "length" and fwd.counters["graph_replays"] >= 4


def test_work_between_two_steps_leaves_the_decode_on_the_gpu() -> None:
    """Another sequence's forward between two steps of a lone request's pipelined decode: the answer is the one
    the request gives without it."""
    got, alone, running, pipelines = work_between_two_steps("cuda")
    assert running == [False] and pipelines >= 2 and got == alone
