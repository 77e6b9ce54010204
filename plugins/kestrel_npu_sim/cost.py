"""The simulated NPU clock: a roofline per matmul run plus a fixed cost per run.

    t_run = launch_s + max(macs / mac_rate, bytes / bandwidth)
    bytes = N*K (int8 weight) + M*K (int8 activations) + 4*M*N (int32 result)

One *run* is one ``rknn_matmul_run``: one K-block (strip) of one K-segment of one N-chunk. The three
constants are fitted to rknn-llm's published RK3588 figures for Llama3-8B (calibration.py redoes the fit;
``python -m kestrel_npu_sim.calibration`` prints the arithmetic that docs/backends/npu_sim.md shows).
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import Geometry


@dataclass(frozen=True)
class GemmCost:
    runs: int = 0
    macs: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def __add__(self, other: GemmCost) -> GemmCost:
        return GemmCost(self.runs + other.runs, self.macs + other.macs, self.bytes + other.bytes,
                        self.seconds + other.seconds)

    def scaled(self, times: int) -> GemmCost:
        return GemmCost(self.runs * times, self.macs * times, self.bytes * times, self.seconds * times)


@dataclass(frozen=True)
class CostModel:
    launch_s: float = 16.62e-6  # fixed cost of one run
    bandwidth: float = 29.36e9  # bytes/s the NPU streams from DRAM
    mac_rate: float = 4.053e11  # int8 MAC/s of the three cores at LLM shapes (0.81 TOPS)

    @staticmethod
    def run_bytes(m: int, n: int, k: int) -> int:
        return n * k + m * k + 4 * m * n

    def run_seconds(self, m: int, n: int, k: int) -> float:
        return self.launch_s + max(m * n * k / self.mac_rate, self.run_bytes(m, n, k) / self.bandwidth)

    def gemm(self, m: int, geo: Geometry, block: int | None) -> GemmCost:
        """Cost of [M, K] x a weight of geometry ``geo``: one run per ``block`` columns of every segment and
        chunk (``block`` None: one run per segment, the NPU applying a per-channel scale itself)."""
        total = GemmCost()
        for n0, n1 in geo.chunks:
            for k0, k1 in geo.segments:
                width = block or (k1 - k0)
                runs, rest = divmod(k1 - k0, width)
                if rest:
                    raise ValueError(f"a K-segment of {k1 - k0} is not a whole number of {width}-wide blocks")
                n = n1 - n0
                one = GemmCost(1, m * n * width, self.run_bytes(m, n, width), self.run_seconds(m, n, width))
                total = total + one.scaled(runs)
        return total
