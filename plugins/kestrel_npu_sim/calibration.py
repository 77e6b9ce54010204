"""Where the cost model's constants come from: a fit to rknn-llm's RK3588 figures for Llama3-8B.

``python -m kestrel_npu_sim.calibration`` prints the arithmetic; tests check that the constants in
``CostModel`` reproduce the published figures.
"""

from __future__ import annotations

from collections.abc import Iterable

from .cost import CostModel, GemmCost
from .layout import geometry

NOMINAL_MAC_RATE = 6e12 / 2  # vendor: 6 TOPS int8 for three cores; 2 ops per MAC

# airockchip/rknn-llm README, "Model Performance Benchmark" (runtime v1.1.0): RK3588, llama3-8B, seqlen 64,
# max_context 320, 256 new tokens, CPU and NPU at their maximum clocks
RKNN_LLM_DECODE_TOK_S = 3.79  # w8a8 (per-channel weight scales)
RKNN_LLM_DECODE_G512_TOK_S = 3.05  # w8a8_g512 (one weight scale per 512-wide K group)
RKNN_LLM_TTFT_S = 1.128  # w8a8, 64-token prompt

# Llama3-8B: hidden 4096, intermediate 14336, 32 heads / 8 KV heads of 128, 32 layers, vocab 128256, untied
LLAMA3_8B_LAYERS = 32
LLAMA3_8B_LAYER = ((4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096),  # q k v o as (N, K)
                   (14336, 4096), (14336, 4096), (4096, 14336))             # gate up down
LLAMA3_8B_LM_HEAD = (128256, 4096)


def llama3_8b_step(model: CostModel, m: int, block: int | None) -> GemmCost:
    """Every GEMM of one Llama3-8B step over ``m`` tokens; only the last token goes through lm_head."""
    layer = sum((model.gemm(m, geometry(n, k), block) for n, k in LLAMA3_8B_LAYER), GemmCost())
    return layer.scaled(LLAMA3_8B_LAYERS) + model.gemm(1, geometry(*LLAMA3_8B_LM_HEAD), block)


def _solve_2x2(rows: Iterable[tuple[float, float, float]]) -> tuple[float, float]:
    (a, b, e), (c, d, f) = rows
    det = a * d - b * c
    return (e * d - b * f) / det, (a * f - e * c) / det


def calibrate() -> CostModel:
    """Fit the constants to rknn-llm's figures, attributing each whole token time to the NPU.

    Decode (M=1) is bandwidth-bound, so its time is ``runs * launch_s + bytes / bandwidth``: the w8a8 and
    w8a8_g512 figures give two such equations in (launch_s, 1/bandwidth). The 64-token TTFT then fixes
    ``mac_rate`` (its layer runs are compute-bound), found by bisection.
    """
    probe = CostModel(launch_s=0.0, bandwidth=1.0, mac_rate=1e30)  # counts runs and bytes only
    pc, g512 = llama3_8b_step(probe, 1, None), llama3_8b_step(probe, 1, 512)
    launch_s, inv_bw = _solve_2x2([(pc.runs, pc.bytes, 1 / RKNN_LLM_DECODE_TOK_S),
                                   (g512.runs, g512.bytes, 1 / RKNN_LLM_DECODE_G512_TOK_S)])
    lo, hi = 1e9, NOMINAL_MAC_RATE
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        ttft = llama3_8b_step(CostModel(launch_s, 1 / inv_bw, mid), 64, None).seconds
        lo, hi = (mid, hi) if ttft > RKNN_LLM_TTFT_S else (lo, mid)
    return CostModel(launch_s, 1 / inv_bw, (lo * hi) ** 0.5)


# SmolLM2-135M, kestrel's default model: hidden 576, intermediate 1536, 9 heads / 3 KV heads of 64, 30 layers;
# as the engine multiplies it: fused q|k|v (576+192+192), o, fused gate|up (2 x 1536), down, then lm_head
SMOLLM2_LAYERS = 30
SMOLLM2_LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
SMOLLM2_LM_HEAD = (49152, 576)


def smollm2_step(model: CostModel, m: int, block: int | None) -> GemmCost:
    layer = sum((model.gemm(m, geometry(n, k), block) for n, k in SMOLLM2_LAYER), GemmCost())
    return layer.scaled(SMOLLM2_LAYERS) + model.gemm(1, geometry(*SMOLLM2_LM_HEAD), block)


def report() -> str:
    """The calibration arithmetic, as docs/backends/npu_sim.md shows it (``python -m kestrel_npu_sim.cost``)."""
    probe = CostModel(launch_s=0.0, bandwidth=1.0, mac_rate=1e30)
    pc, g512 = llama3_8b_step(probe, 1, None), llama3_8b_step(probe, 1, 512)
    prefill = llama3_8b_step(probe, 64, None)
    fit, used = calibrate(), CostModel()
    lines = [
        "Llama3-8B decode step (M=1), counted by the model's own geometry:",
        f"  w8a8      : {pc.runs} runs, {pc.bytes / 1e9:.4f} GB  -> {pc.runs} t + {pc.bytes:.4e} / BW"
        f" = 1/{RKNN_LLM_DECODE_TOK_S} s = {1 / RKNN_LLM_DECODE_TOK_S * 1e3:.2f} ms",
        f"  w8a8_g512 : {g512.runs} runs, {g512.bytes / 1e9:.4f} GB  -> {g512.runs} t + {g512.bytes:.4e} / BW"
        f" = 1/{RKNN_LLM_DECODE_G512_TOK_S} s = {1 / RKNN_LLM_DECODE_G512_TOK_S * 1e3:.2f} ms",
        f"  solved    : t = {fit.launch_s * 1e6:.2f} us per run, BW = {fit.bandwidth / 1e9:.2f} GB/s",
        "Llama3-8B 64-token prefill (layers at M=64, lm_head at M=1):",
        f"  {prefill.runs} runs, {prefill.macs / 1e9:.1f} GMAC -> mac_rate = {fit.mac_rate:.4e} MAC/s"
        f" = {2 * fit.mac_rate / 1e12:.3f} TOPS = {fit.mac_rate / NOMINAL_MAC_RATE:.1%} of the 6 TOPS nominal",
        f"Constants used (rounded): t = {used.launch_s * 1e6:.2f} us, BW = {used.bandwidth / 1e9:.2f} GB/s,"
        f" mac_rate = {used.mac_rate:.4g} MAC/s",
        f"  they give: w8a8 {1 / llama3_8b_step(used, 1, None).seconds:.3f} tok/s,"
        f" w8a8_g512 {1 / llama3_8b_step(used, 1, 512).seconds:.3f} tok/s,"
        f" TTFT {llama3_8b_step(used, 64, None).seconds * 1e3:.1f} ms",
        "SmolLM2-135M (kestrel's default) decode step on the simulated NPU:",
    ]
    for label, block in (("G=32 strips (kestrel q8)", 32), ("per-channel (for contrast)", None)):
        c = smollm2_step(used, 1, block)
        lines.append(f"  {label:27}: {c.runs} runs, {c.bytes / 1e6:.1f} MB, {c.seconds * 1e3:.2f} ms"
                     f" = {1 / c.seconds:.1f} tok/s (launch share {c.runs * used.launch_s / c.seconds:.0%})")
    lines.append("Llama3-8B decode step under kestrel's strips (unfused shapes):")
    for block in (32, 256):
        c = llama3_8b_step(used, 1, block)
        lines.append(f"  G={block:<3}: {c.runs} runs, {c.seconds * 1e3:.1f} ms = {1 / c.seconds:.2f} tok/s"
                     f" (launch share {c.runs * used.launch_s / c.seconds:.0%})")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
