"""Prompt scoring (the scheduler's ``Scoring`` requests) on the GPU: test_forward_scoring_host.py's scenario through
the real backend. Skipped where CuPy or a CUDA device is missing (CI)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

from .forward_check import cuda_device_count  # noqa: E402
from .test_forward_scoring_host import scoring_beside_streams  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_scoring_beside_decoding_streams_on_the_gpu(temperature: float) -> None:
    """The scores are those of the prompt scored alone, to the batched steps' rounding."""
    scored, want, tokens = scoring_beside_streams("cuda", temperature)
    assert [s.token_id for s in scored] == [s.token_id for s in want]
    np.testing.assert_allclose([s.logprob for s in scored], [s.logprob for s in want], atol=2e-2)
    assert all(len(t) == 60 for t in tokens)
