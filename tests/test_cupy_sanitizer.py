"""compute-sanitizer memcheck over every wrapper, on the smallest legal shapes and one large one.

The test re-runs this file as a script (`--drive`) under `compute-sanitizer --tool memcheck`.
The driver turns CuPy's memory pool off, so every array is its own cudaMalloc with its exact
size and an out-of-bounds access by one byte is reported instead of landing in pool slack.
Shapes include ragged QPN8 chunks (K/16 = 1, 3, 5 groups with 4 groups per thread).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

SMALL_QPN2 = [(32, 64), (32, 128)]
SMALL_QPN8 = [(32, 16), (32, 48), (32, 80)]
SMALL_QPN8_BLOCK = [(128, 128)]
LARGE = (4096, 4096)
NON_NAN_E4M3 = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)


def drive() -> None:
    import cupy

    from qpn import cupy_kernels as ck

    cupy.cuda.set_allocator(None)  # exact-size allocations: memcheck sees every overrun
    rng = np.random.default_rng(0)
    for n, k in [*SMALL_QPN2, LARGE]:
        wp = cupy.asarray(rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8))
        ws = cupy.asarray(rng.choice(NON_NAN_E4M3, size=(n, k // 16)).astype(np.uint8))
        codes, scales = ck.qpn2_prepack(wp, ws)
        g_tile = cupy.asarray(np.full(n // 32, 0.01, np.float32))
        ck.qpn2_dequantize(codes, scales, g_tile, n, k, check=True)
        ck.qpn2_dequantize(codes, scales, 0.01, n, k, check=False)
        ck.qpn2_dense_linear(cupy.asarray(rng.standard_normal((3, k)).astype(np.float16)), codes, scales, g_tile)
    for (n, k), block in [*((s, False) for s in [*SMALL_QPN8, LARGE]),
                          *((s, True) for s in [*SMALL_QPN8_BLOCK, LARGE])]:
        w = cupy.asarray(rng.choice(NON_NAN_E4M3, size=(n, k)).astype(np.uint8))
        s = np.full((n // 128, k // 128) if block else (n,), 0.01, np.float32)
        codes, group_scales = ck.qpn8_prepack(w, cupy.asarray(s))
        ck.qpn8_dequantize(codes, group_scales, n, k, check=True)
        ck.qpn8_dense_linear(cupy.asarray(rng.standard_normal((3, k)).astype(np.float16)), codes, group_scales)
    weight = cupy.asarray(np.resize(NON_NAN_E4M3, 32 * 16).reshape(32, 16))
    codes, group_scales = ck.qpn8_prepack(weight, np.float32(0.5))
    ck.qpn8_dequantize(codes, group_scales, 32, 16)
    cupy.cuda.runtime.deviceSynchronize()
    print("driver done")


@pytest.mark.gpu
@pytest.mark.slow
def test_memcheck_clean(compute_sanitizer):
    compute_sanitizer("memcheck", __file__)


if __name__ == "__main__" and "--drive" in sys.argv:
    drive()
