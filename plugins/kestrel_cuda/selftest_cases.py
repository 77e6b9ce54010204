"""The CUDA backend's own self-test cases, added to the conformance suite (``kestrel selftest --backend
cuda``): both kernels (the GEMV at M = 1, tensor cores above: split over K up to 64 rows), every GEMV
variant (8-/4-column vectors for N % 8 and odd N, split K), int8 and int4, G 32 and 256, M up to 512, fused
and unfused."""

from __future__ import annotations

from kestrel_core.selftest import SelfTestCase

Q8, F32, FUSED = "kestrel_gemm_q8", "kestrel_gemm_f32", "kestrel_gemm_fused_q8"


def cuda_cases() -> list[SelfTestCase]:
    cases: list[SelfTestCase] = []
    for bits in (8, 4):
        for g in (32, 256):
            k_small = 256 if g == 32 else 512
            for m in (1, 2, 3, 7, 9, 64, 130, 512):
                cases.append(SelfTestCase(Q8, m, (256,), k_small, g, bits, 11))  # N % 16 == 0
                cases.append(SelfTestCase(Q8, m, (37,), k_small, g, bits, 12))   # odd N: Npad 40
            cases.append(SelfTestCase(Q8, 1, (136,), 4096, g, bits, 13))         # N % 8: VEC 4, split K
            cases.append(SelfTestCase(Q8, 4, (136,), 4096, g, bits, 14))         # tensor cores, K splits
            cases.append(SelfTestCase(Q8, 1, (1024,), 4096, g, bits, 15))        # decode-like, split K
            cases.append(SelfTestCase(Q8, 256, (200,), 2048, g, bits, 16))       # mma, partial tiles
            cases.append(SelfTestCase(F32, 1, (37,), k_small, g, bits, 17))
            cases.append(SelfTestCase(F32, 33, (128,), k_small, g, bits, 18))
            for m in (1, 5, 96):
                cases.append(SelfTestCase(FUSED, m, (128, 64, 64), k_small, g, bits, 19))  # fused QKV
                cases.append(SelfTestCase(FUSED, m, (64, 30), k_small, g, bits, 20))       # unfusable
    return cases
