"""Launch decode-kernel builds twice each for `ncu` (timing-free): bench_decode's MID_VARIANTS.

    ncu --metrics <list> -k regex:qpn python benchmarks/profile_decode.py [M] [NxK] [label,label...]

Each launch prints its label and split first, so ncu's per-launch rows can be matched in order.
"""
import sys

import cupy as cp
import numpy as np

from qpn.benchmarks.bench_decode import MID_VARIANTS, G, _launch_variant, _qpn2_copies, _qpn8_copies, shipped_macros


class _Ctx:  # minimal stand-in for bench_kernels.Context: cp, and time_calls = 2 launches, no timing
    cp = cp

    def time_calls(self, launch, slots):
        launch(0)
        launch(1)
        cp.cuda.Device().synchronize()
        return {"us": 0.0}


PROFILED = ("shipped", "x rows")

if __name__ == "__main__":
    m = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    n, k = (int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "28672x8192").split("x"))
    bufs = {"qpn2": _qpn2_copies(cp, n, k, 2), "qpn8": _qpn8_copies(cp, n, k, 2)}
    x = cp.asarray(np.random.default_rng(0).standard_normal((m, k)).astype(np.float16))
    y = cp.empty((m, n), cp.float16)
    g = cp.full(1, G, cp.float32)
    profiled = sys.argv[3].split(",") if len(sys.argv) > 3 else PROFILED
    for fmt in ("qpn2", "qpn8"):
        for label, extra in MID_VARIANTS:
            if label not in profiled:
                continue
            macros = tuple(sorted({**shipped_macros(fmt, -(-m // 8)), **dict(extra)}.items()))
            split = _launch_variant(_Ctx(), fmt, macros, n, k, m, bufs[fmt], x, y, 2, g)[1]
            print(f"{fmt} M={m} {n}x{k} {label} ({split})", flush=True)
