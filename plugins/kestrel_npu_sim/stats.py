"""The backend's own counters, reported flat through ``kestrel_stats`` (prefix ``npu_sim_``).

The core's Offload only knows "declined by backend"; the reasons live here, one counter per reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .cost import GemmCost

# decline reasons (the counter is npu_sim_declined_<reason>)
N_UNALIGNED = "n_unaligned"  # N not a multiple of 32 with padding turned off (KESTREL_NPU_SIM_PAD_N=0)
BAD_OPERANDS = "bad_operands"  # activations that do not match the weight (K, G, dtype): the CPU reports it
TOO_LARGE = "too_large"  # a packed weight, activation or result buffer over the device's largest allocation
NON_FINITE = "f32_non_finite"  # float activations with inf/nan: no int8 slicing represents them
DECLINE_REASONS = (N_UNALIGNED, BAD_OPERANDS, TOO_LARGE, NON_FINITE)


@dataclass
class NpuSimStats:
    calls: int = 0  # GEMM hook calls the simulated NPU ran
    runs: int = 0  # simulated rknn_matmul_run: one per K-block per K-segment per N-chunk
    launches: int = 0  # OpenCL kernel launches (one per K-segment x N-chunk)
    macs: int = 0
    bytes: int = 0
    time_s: float = 0.0  # simulated NPU time (cost model)
    calls_m1: int = 0  # single-row (decode-shaped) calls and their share of the simulated time
    time_m1_s: float = 0.0
    wall_s: float = 0.0  # host wall time inside the hooks (OpenCL on this machine + host float work)
    f32_slices: int = 0  # int8 activation slices the float-activation GEMMs needed
    repacks: int = 0  # weights repacked into the native layout
    repack_bytes: int = 0
    uncached_repacks: int = 0  # repacks of wkey 0 ("do not cache") weights, redone every call
    declined: Counter = field(default_factory=Counter)

    def charge(self, cost: GemmCost, rows: int) -> None:
        if rows == 1:
            self.calls_m1 += 1
            self.time_m1_s += cost.seconds
        self.runs += cost.runs
        self.macs += cost.macs
        self.bytes += cost.bytes
        self.time_s += cost.seconds

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "npu_sim_time_s": self.time_s, "npu_sim_calls": self.calls, "npu_sim_runs": self.runs,
            "npu_sim_time_m1_s": self.time_m1_s, "npu_sim_calls_m1": self.calls_m1,
            "npu_sim_launches": self.launches, "npu_sim_macs": self.macs, "npu_sim_bytes": self.bytes,
            "npu_sim_wall_s": self.wall_s, "npu_sim_f32_slices": self.f32_slices,
            "npu_sim_repacks": self.repacks, "npu_sim_repack_bytes": self.repack_bytes,
            "npu_sim_uncached_repacks": self.uncached_repacks,
            "npu_sim_declined": sum(self.declined.values()),
        }
        for reason in (*DECLINE_REASONS, *sorted(set(self.declined) - set(DECLINE_REASONS))):
            out[f"npu_sim_declined_{reason}"] = self.declined[reason]
        return out
