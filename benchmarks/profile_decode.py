"""Launch decode-kernel builds a few times each (for `ncu` stall / occupancy sections); timing-free.

    ncu --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section Occupancy \
        --section ComputeWorkloadAnalysis -k regex:qpn python benchmarks/profile_decode.py
"""
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, __import__("os").path.dirname(__file__))
from bench_decode import G, _launch_variant, _qpn2_copies, _qpn8_copies, shipped_macros  # noqa: E402


class _Ctx:  # minimal stand-in for bench_kernels.Context.time_calls: 2 launches, no timing
    def time_calls(self, launch, slots):
        launch(0)
        launch(1)
        cp.cuda.Device().synchronize()
        return {"us": 0.0}


# (format, load batches (unroll, blocks/SM) or None for the shipped one, extra macros)
VARIANTS = [("qpn2", None, ()), ("qpn2", (4, 1), ()), ("qpn2", None, (("QPN_ABLATE", "1"),)),
            ("qpn8", None, ()), ("qpn8", (4, 2), ())]

if __name__ == "__main__":
    from qpn.cupy_kernels import linear as L

    n, k = 28672, 8192
    bufs = {"qpn2": _qpn2_copies(cp, n, k, 2), "qpn8": _qpn8_copies(cp, n, k, 2)}
    x = cp.asarray(np.random.default_rng(0).standard_normal((1, k)).astype(np.float16))
    y = cp.empty((1, n), cp.float16)
    g = cp.full(1, G, cp.float32)
    for fmt, pipe, extra in VARIANTS:
        macros = shipped_macros(fmt, 1)
        if pipe is not None:
            macros.update(L.pipeline_macros(*pipe))
        macros.update(extra)
        print(fmt, pipe, extra, _launch_variant(_Ctx(), fmt, tuple(sorted(macros.items())), n, k, 1, bufs[fmt], x, y, 2, g)[1], flush=True)
