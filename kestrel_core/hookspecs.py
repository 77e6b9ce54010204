"""The backend interface: pluggy hookspecs of project ``kestrel``, and every name a backend needs to write them.

A backend is a module (or object) with ``@hookimpl`` functions, found through the entry-point group
``kestrel.backends`` or ``KESTREL_BACKEND_PATH``. Each bound backend has its own plugin manager, so every
hook here is called on one backend at a time. Offload hooks follow the 0/1 contract: return the result
(done on the device, the whole output) or ``None`` (declined: the core runs the CPU path).

A backend imports ``hookimpl``, ``API_VERSION``, ``BackendInfo``, ``KINDS``, ``BackendUnavailable`` and
``BatchEntry`` from here (or from ``kestrel_core``), never from the registry, which imports the backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pluggy

from kestrel_core.batch import BatchEntry as BatchEntry
from kestrel_core.errors import BackendUnavailable as BackendUnavailable

PROJECT = "kestrel"
API_VERSION = (1, 6)  # (major, minor): a backend must have the same major and a minor <= ours
KINDS = ("cpu", "gpu", "npu", "simulator")  # BackendInfo.kind; `--backend auto` picks a gpu, then an npu

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

REQUIRED_HOOKS = ("kestrel_backend_info", "kestrel_open", "kestrel_close", "kestrel_gemm_q8",
                  "kestrel_gemm_f32")


@dataclass(frozen=True)
class BackendInfo:
    """What ``kestrel_backend_info`` returns."""

    name: str
    version: str
    api_version: tuple[int, int]  # (major, minor); a "1.1" string is accepted too
    kind: str  # one of KINDS
    min_flops: int = 0  # offloads below this many FLOPs are declined (env KESTREL_<NAME>_MIN_FLOPS wins)
    description: str = ""


# -- required ----------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def kestrel_backend_info() -> Any:
    """Describe the backend: a ``BackendInfo`` (name, version, api_version, kind). firstresult."""


@hookspec(firstresult=True)
def kestrel_open(options: dict[str, Any]) -> Any:
    """Open the device and return its handle; raise ``BackendUnavailable(reason)`` if it cannot. firstresult."""


@hookspec
def kestrel_close(device: Any) -> None:
    """Release everything the device handle holds."""


@hookspec(firstresult=True)
def kestrel_gemm_q8(device: Any, a_codes: Any, a_scales: Any, weight: Any, wkey: int) -> Any:
    """Int8 activations [M, K] (scales [M, K/G]) times a StripCache: float32 [M, N], or None. firstresult."""


@hookspec(firstresult=True)
def kestrel_gemm_f32(device: Any, a: Any, weight: Any, wkey: int) -> Any:
    """Float32 activations [M, K] times a StripCache: float32 [M, N], or None. firstresult."""


# -- optional (default: not implemented, the core does it layer by layer on the CPU) ----------------


@hookspec(firstresult=True)
def kestrel_gemm_fused_q8(device: Any, a_codes: Any, a_scales: Any, weights: Any, wkeys: Any,
                          fused_wkey: int) -> Any:
    """Several weights sharing K (Q/K/V, gate/up): a list of float32 [M, N_i], or None. firstresult."""


@hookspec
def kestrel_layer_boundary(device: Any, layer: int) -> None:
    """The engine is about to run ``layer`` (residency window). Default: nothing."""


@hookspec
def kestrel_preload(device: Any, model: Any) -> None:
    """Make a whole ``Model``'s weights resident at load. Default: weights upload on first use."""


@hookspec(firstresult=True)
def kestrel_forward_supports(device: Any, model: Any) -> Any:
    """Whether the whole-step hooks can run ``model`` at all, asked once at load: False and the engine runs its
    steps on the host (offering the GEMMs) rather than offering each step to be declined. Since API 1.5.
    Default: they are offered. firstresult."""


@hookspec(firstresult=True)
def kestrel_forward(device: Any, model: Any, seq_id: int, tokens: Any, start: int, all_logits: bool) -> Any:
    """Run tokens [T] at positions start.. on the device (its own KV cache per seq_id; since API 1.6 a start
    below what it holds computes the positions from start on again).

    Returns float32 logits [T, vocab] if all_logits else [1, vocab], or None to decline: the engine then
    runs the layer-by-layer path from its own KV cache. firstresult.
    """


@hookspec(firstresult=True)
def kestrel_forward_batch(device: Any, model: Any, batch: Any) -> Any:
    """Run one step of several sequences (a list of ``BatchEntry``: decode rows and prompt chunks) on the
    device, each against its own KV cache. Since API 1.1.

    Returns a list with one float32 array [entry.logit_rows, vocab] per entry, in order (an entry marked
    ``argmax_only`` may get int64 token ids [entry.logit_rows] instead, since API 1.2), or None to decline
    the whole step: the engine then offers ``kestrel_forward`` per sequence, and runs what is still declined
    layer by layer with one GEMM per projection for the whole batch. Since API 1.3 it may instead return a
    call without arguments that waits for the step and returns that list (or None): the step runs on the
    device while the engine reports the last one, and the engine makes that call before any other into the
    backend, but one: since API 1.4 (to a backend that declares it) the engine may offer the next step first,
    whose ``fed`` entries take the tokens the device chose in the step still running. Since API 1.5 the
    engine's prefix cache lives in the backend's pool (``BatchEntry.shared`` and ``publish``). Since API 1.6 an
    entry's ``start`` may be below what the backend holds of its sequence: the positions from ``start`` on are
    computed again from the entry's tokens (draft tokens the model did not confirm, ``--speculate``).
    firstresult.
    """


@hookspec(firstresult=True)
def kestrel_decode_greedy(device: Any, model: Any, seq_id: int, token: int, start: int, count: int) -> Any:
    """Greedy decode on the device's KV cache of seq_id (positions < start, as kestrel_forward left it).

    Runs ``token`` at ``start``, then each step's argmax (numpy's: the first largest logit) at the next
    position, at most ``count`` steps, and returns an iterator of those argmax tokens; it may run steps ahead
    of its consumer. None declines: the engine samples each step's logits itself. Since API 1.6 the engine
    may ``send(False)`` to a generator it returned: it then gives the token of the step it runs ahead (or
    stops) and launches no step after that one. firstresult.
    """


@hookspec
def kestrel_release_sequence(device: Any, seq_id: int) -> None:
    """Forget the device state of a sequence. Default: nothing."""


@hookspec
def kestrel_selftest_cases(device: Any) -> Any:
    """Extra ``SelfTestCase`` objects of the backend's own, added to the conformance suite."""


@hookspec
def kestrel_stats(device: Any) -> Any:
    """A flat dict of the backend's own counters (cache hits, uploads, simulated time...). Default: {}."""
