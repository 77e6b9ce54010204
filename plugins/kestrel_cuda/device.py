"""The CUDA device handle: what ``kestrel_open`` returns and every hook works through.

Host-layer contract: a hook returns the whole result or ``None``. It declines unsupported
inputs, and any CUDA error, out-of-memory included, is caught here, counted by type, logged once and turned
into ``None``, so the CPU recomputes the whole output; results are copied back only after every launch
succeeded, so a partial failure never hands out a half-written array. The FLOPs threshold and
KESTREL_FORCE_CPU are enforced by the core (``kestrel_core.dispatch``) before a hook is called.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kestrel_core.contract import StripCache
from kestrel_core.wkey import lm_head_wkey
from kestrel_cuda.config import CudaConfig
from kestrel_cuda.cupy_alloc import CupyAllocator
from kestrel_cuda.gemm import DeviceGemm
from kestrel_cuda.host_pin import HostPins
from kestrel_cuda.layout import fusable, layer_groups
from kestrel_cuda.residency import DeviceWeight, PreloadItem, WeightCache, cache_budget
from kestrel_cuda.streaming import UploadTimer, WindowStreamer, pinned_h2d_gb_s
from kestrel_cuda.weights import column_offsets, geometry_for, make_upload

log = logging.getLogger("kestrel")


class CudaDevice:
    def __init__(self, cp: Any, kernels: Any, config: CudaConfig, compute_capability: int) -> None:
        self.cp = cp
        self.kernels = kernels
        self.config = config
        self.index = index = config.device
        self.compute_capability = compute_capability
        self.device = cp.cuda.Device(index)
        with self.device:
            props = cp.cuda.runtime.getDeviceProperties(index)
            name = props["name"]
            self.name = name.decode() if isinstance(name, bytes) else str(name)
            self.sm_count = int(props["multiProcessorCount"])
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.allocator = CupyAllocator(cp)
            self.cache = WeightCache(self.allocator, budget=cache_budget(self.allocator.free_bytes(), config.cache_mb),
                                     keep=config.window)
            self.gemm = DeviceGemm(cp, kernels, self.sm_count, clusters=config.cluster and compute_capability >= 90)
            self.gemm.workspace(self.stream)
            self.timer = UploadTimer(cp)  # every weight upload's GPU time
            self.streamer = WindowStreamer(cp, self.cache, self.stream) if config.window else None
        self.description = f"{self.name} (sm_{compute_capability}, {self.sm_count} SMs)"
        self.errors: Counter[str] = Counter()
        self.declined: Counter[str] = Counter()
        self.preload_info: dict[str, Any] = {}
        self.forward: Any = None  # kestrel_cuda.forward.DeviceForward, made on first use
        self.pins = HostPins(cp)  # the window's streamed strip-caches, page-locked
        self.closed = False

    # -- weights -------------------------------------------------------------------------------------

    def weight(self, key: int, strips: StripCache | Sequence[StripCache]) -> DeviceWeight:
        """The resident device weight of ``strips`` (one, or a fusable list for a fused wkey).

        Uploads on a miss; wkey 0 gives a temporary the caller hands back with ``self.cache.release``.
        """
        members = [strips] if isinstance(strips, StripCache) else list(strips)
        return self.cache.get_or_upload(key, geometry_for(members),
                                        make_upload(self.cp, self.kernels, members, self.stream, self.timer),
                                        source=members[0])

    # -- hooks ---------------------------------------------------------------------------------------

    def _failed(self, hook: str, exc: BaseException) -> None:
        kind = type(exc).__name__
        if not self.errors[kind]:
            log.warning("cuda: %s failed (%s: %s); the CPU computes it (reported once per error type)", hook,
                        kind, str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        self.errors[kind] += 1
        return None

    def _decline(self, why: str) -> None:
        self.declined[why] += 1
        return None

    @staticmethod
    def _q8_inputs_ok(a_codes: Any, a_scales: Any, w: StripCache) -> bool:
        return (isinstance(a_codes, np.ndarray) and isinstance(a_scales, np.ndarray) and a_codes.ndim == 2
                and a_codes.dtype == np.int8 and a_codes.shape[0] >= 1 and a_codes.shape[1] == w.k
                and a_scales.dtype == np.float32 and a_scales.shape == (a_codes.shape[0], w.ngroups))

    def gemm_q8(self, a_codes: np.ndarray, a_scales: np.ndarray, weight: StripCache,
                key: int) -> np.ndarray | None:
        if not self._q8_inputs_ok(a_codes, a_scales, weight):
            return self._decline("unsupported input")
        out = self._run_q8(a_codes, a_scales, [weight], [key], None)
        return None if out is None else out[0]

    def gemm_fused_q8(self, a_codes: np.ndarray, a_scales: np.ndarray, weights: Sequence[StripCache],
                      keys: Sequence[int], fused_key: int) -> list[np.ndarray] | None:
        weights = list(weights)
        if not weights or len(keys) != len(weights) or \
                not all(self._q8_inputs_ok(a_codes, a_scales, w) for w in weights):
            return self._decline("unsupported input")
        return self._run_q8(a_codes, a_scales, weights, list(keys), fused_key)

    def _run_q8(self, a_codes: np.ndarray, a_scales: np.ndarray, weights: list[StripCache], keys: list[int],
                fused_key: int | None) -> list[np.ndarray] | None:
        cp = self.cp
        m = a_codes.shape[0]
        try:
            with self.device, self.stream:
                a = cp.asarray(np.ascontiguousarray(a_codes))
                s = cp.asarray(np.ascontiguousarray(a_scales))
                if fused_key is not None and fusable(weights):
                    ng = sum(w.n for w in weights)
                    out = cp.empty((m, ng), dtype=cp.float32)
                    self._launch_q8(a, s, fused_key, weights, out, ng)
                    host = out.get(stream=self.stream)
                    self.stream.synchronize()
                    return [np.ascontiguousarray(host[:, off:off + w.n])
                            for off, w in zip(column_offsets(weights), weights)]
                outs = []
                for w, key in zip(weights, keys):
                    out = cp.empty((m, w.n), dtype=cp.float32)
                    self._launch_q8(a, s, key, [w], out, w.n)
                    outs.append(out)
                hosts = [o.get(stream=self.stream) for o in outs]
                self.stream.synchronize()
                return hosts
        except Exception as exc:
            return self._failed("gemm_q8", exc)

    def _launch_q8(self, a: Any, s: Any, key: int, members: list[StripCache], out: Any, n: int) -> None:
        weight = self.weight(key, members)
        weight.pins += 1
        try:
            self.gemm.q8(a, s, weight, out, n, self.stream)
        finally:
            weight.pins -= 1
            self.cache.release(weight)  # a wkey-0 temporary goes back to the pool (stream-ordered reuse)

    def gemm_f32(self, a: np.ndarray, weight: StripCache, key: int) -> np.ndarray | None:
        if not (isinstance(a, np.ndarray) and a.ndim == 2 and a.shape[0] >= 1 and a.shape[1] == weight.k):
            return self._decline("unsupported input")
        cp = self.cp
        try:
            with self.device, self.stream:
                x = cp.asarray(np.ascontiguousarray(a, dtype=np.float32))
                out = cp.empty((a.shape[0], weight.n), dtype=cp.float32)
                dw = self.weight(key, [weight])
                dw.pins += 1
                try:
                    self.gemm.f32(x, dw, out, weight.n, self.stream)
                finally:
                    dw.pins -= 1
                    self.cache.release(dw)
                host = out.get(stream=self.stream)
                self.stream.synchronize()
                return host
        except Exception as exc:
            return self._failed("gemm_f32", exc)

    def layer_boundary(self, layer: int) -> None:
        with self.device:
            self.cache.on_layer_boundary(layer)
            if self.streamer is not None:
                self.streamer.boundary(layer)

    # -- whole-step forward (kestrel_cuda.forward) -----------------------------------------------------

    def _weight_source(self, key: int, strips: Sequence[StripCache]) -> DeviceWeight | None:
        members = list(strips)
        if len(members) > 1 and not fusable(members):
            return None  # the forward then asks for each projection under its own wkey
        return self.weight(key, members)

    def forward_engine(self) -> Any:
        """The device's DeviceForward, made on first use on this device's stream, GEMMs and weight cache;
        None when the forward module is not available."""
        if self.forward is None:
            try:
                from kestrel_cuda.forward import DeviceForward
            except ImportError:
                return None
            # a window that keeps every layer (the model fits its budget) changes nothing: no boundary, so the
            # decode steps can be captured
            streams = self.preload_info.get("window_streamed_layers", 1) > 0
            boundary = self.layer_boundary if self.config.window > 0 and streams else None
            with self.device:
                self.forward = DeviceForward(self._weight_source, boundary, config=self.config, stream=self.stream,
                                             gemm=self.gemm, pin=self.cache.pin, unpin=self.cache.unpin)
        return self.forward

    def forward_supports(self, model: Any) -> bool | None:
        """False for a model the device forward never runs (``forward_state.unsupported_reason``: recurrent
        layers, a head size it has no kernels for); None where the forward module is not available."""
        try:
            from kestrel_cuda.forward_state import unsupported_reason
        except ImportError:
            return None
        return unsupported_reason(model) is None

    def run_forward(self, model: Any, seq_id: int, tokens: Any, start: int, all_logits: bool) -> Any:
        """Errors propagate: the dispatcher declines and the engine runs the step layer by layer."""
        fwd = self.forward_engine()
        if fwd is None:
            return self._decline("no device forward")
        with self.device:
            return fwd.forward(model, seq_id, tokens, start, all_logits)

    def run_forward_batch(self, model: Any, batch: Any) -> Any:
        """The batched step (``DeviceForward.start_batch``: its results, or the call that waits for them);
        errors propagate as ``run_forward``'s."""
        fwd = self.forward_engine()
        if fwd is None:
            return self._decline("no device forward")
        with self.device:
            out = fwd.start_batch(model, batch)
        if not callable(out):
            return out

        def results() -> Any:
            with self.device:
                return out()

        return results

    def run_greedy(self, model: Any, seq_id: int, token: int, start: int, count: int) -> Iterator[int] | None:
        """The pipelined greedy decode (``DeviceForward.greedy``); every step it runs is under this device."""
        fwd = self.forward_engine()
        if fwd is None:
            return self._decline("no device forward")
        with self.device:
            tokens = fwd.greedy(model, seq_id, token, start, count)
        return None if tokens is None else self._on_device(tokens)

    def _on_device(self, tokens: Iterator[int]) -> Iterator[int]:
        while True:
            with self.device:
                tok = next(tokens, None)
            if tok is None:
                return
            yield tok

    def release_sequence(self, seq_id: int) -> None:
        if self.forward is not None:
            with self.device:
                self.forward.release(seq_id)

    # -- preload -------------------------------------------------------------------------------------

    def preload_items(self, model: Any, stream: Any = None) -> list[PreloadItem]:
        """Every weight the layer loop uses, as the GEMM hooks will ask for it (fused where fusable), uploading
        on ``stream`` (None: the compute stream)."""
        items: list[PreloadItem] = []
        stream = stream or self.stream

        def add(key: int, members: list[StripCache]) -> None:
            items.append(PreloadItem(key, geometry_for(members),
                                     make_upload(self.cp, self.kernels, members, stream, self.timer),
                                     members[0]))

        for i, lw in enumerate(model.layers):
            for strips, keys, fused_key in layer_groups(i, lw):
                if fused_key and fusable(strips):
                    add(fused_key, strips)
                else:
                    for key, w in zip(keys, strips):
                        add(key, [w])
        add(lm_head_wkey(), [model.lm_head])
        return items

    def preload(self, model: Any) -> None:
        """Every weight, or with the residency window on the layers it keeps (``residency.kept_layers``)."""
        start = time.perf_counter()
        with self.device, self.stream:
            result = self.cache.preload(self.preload_items(model))
            self.stream.synchronize()
        self.preload_info = {"preload_s": round(time.perf_counter() - start, 4), "preload_weights": result.uploaded,
                             "preload_bytes": result.bytes, "preload_already_resident": result.already_resident}
        if self.config.window:
            self.preload_info.update(window_streamed_layers=result.streamed_layers,
                                     window_streamed_bytes=result.streamed_bytes)
            streamed = [i for i in range(len(model.layers)) if i not in self.cache.kept]
            self.pins.register(a for i in streamed for strips, _, _ in layer_groups(i, model.layers[i])
                               for s in strips for a in (s.codes, s.scales))
            if self.streamer is not None:
                self.streamer.plan(self.preload_items(model, self.streamer.upload_stream), set(streamed))
            if streamed:
                with self.device:
                    self.preload_info["bus_h2d_pinned_gb_s"] = round(pinned_h2d_gb_s(self.cp), 2)
        if result.stopped:
            self.preload_info["preload_stopped"] = result.stopped

    # -- stats and teardown --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"device": self.description, "kernel_compile_s": round(self.kernels.compile_s, 3)}
        out.update({f"kernel_{k}": v for k, v in self.kernels.info.items()})
        cache = self.cache.stats()
        out.update({f"cache_{k}": v for k, v in cache.items()})
        with self.device:
            upload_s = self.timer.seconds()
        out.update(weight_upload_bytes=self.timer.bytes, weight_upload_s=round(upload_s, 6))  # kestrel bench
        out.update({f"launches_{k}": v for k, v in self.gemm.launches.items()})
        out.update({f"errors_{k}": v for k, v in self.errors.items()})
        out.update({f"declined_{k.replace(' ', '_')}": v for k, v in self.declined.items()})
        out.update(self.preload_info)
        out.update(self.pins.stats())
        if self.forward is not None:
            out.update(self.forward.stats())  # its keys say forward_ already
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.forward is not None:
                self.forward.close()
            with self.device:
                self.stream.synchronize()
                if self.streamer is not None:
                    self.streamer.upload_stream.synchronize()
                    self.streamer.clear()
                self.cache.close()
                self.pins.release()
        finally:
            self.forward = None
