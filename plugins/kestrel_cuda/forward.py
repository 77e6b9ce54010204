"""Whole-step decode on the device: one token step (or a prefill) of a ``Model`` run entirely on the GPU.

API (what the ``kestrel_forward`` / ``kestrel_release_sequence`` hookimpls call):

    fwd = DeviceForward(weight_source=None, layer_boundary=None, max_context=None)
    fwd.forward(model, seq_id, tokens, start, all_logits) -> np.ndarray float32 [T or 1, vocab] | None
    fwd.release(seq_id) -> None
    fwd.stats() -> dict[str, int | float]
    fwd.close() -> None

- ``weight_source(wkey, strip_cache) -> device weight``: the weight cache's get-or-upload. ``None``: the
  forward uploads (and keeps) its own copy of every weight it uses, in the same K-major layout.
- ``layer_boundary(layer)``: called before each layer when the residency window is on
  (``KESTREL_CUDA_STREAM``). A window forces the non-graph path: weights are fetched through
  ``weight_source`` per layer per step, because a captured graph bakes in device pointers that an
  eviction would invalidate. Without a window the decode step (T == 1) is captured once per sequence in a
  CUDA graph and replayed; the position and token are read from device memory, so one graph serves all
  positions.
- ``forward``: ``tokens`` int32 [T] at absolute positions ``start..start+T-1`` of sequence ``seq_id``. The
  KV cache lives on the device, one per ``seq_id``; ``start == 0`` resets it; ``start`` below the cached
  length rewinds; ``start`` above it (the engine computed steps on the CPU meanwhile), a context beyond
  ``max_context``, or an unsupported model returns ``None`` (declined: the engine recomputes on the CPU).
  Returns all T rows of logits if ``all_logits`` else the last row only, as [1, vocab].
"""

from __future__ import annotations
