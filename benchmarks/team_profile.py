"""One call each of a team build and the shipped build it replaces, for ncu (issue 25 parts 1-2).

    ncu --kernel-name regex:qpn --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section LaunchStats python3 benchmarks/team_profile.py

Calls, 28672 x 8192 (QPN8, random weights): the shipped M = 25-32 decode build and the decode team build
(T = 2, 2 groups per batch) at M = 32; the shipped GEMM build and the GEMM team build (T = 8) at M = 128.
Each call runs twice (the first compiles and warms up; ncu's --launch-skip picks the second).
`--pairs`: instead, the GEMM builds at M = 128 only -- the 64-token build, the team of 8 and the paired team of
8 the ops run (gemm.QPN8_TEAM) -- for their L2 traffic (the x every team reads per tile):

    ncu --kernel-name regex:qpn8_linear --metrics lts__t_sectors_srcunit_tex_op_read.sum,\
        l1tex__t_sector_hit_rate.pct,dram__bytes_read.sum,gpu__time_duration.sum --csv \
        python3 benchmarks/team_profile.py --pairs
"""
from __future__ import annotations

import sys

import cupy as cp
import numpy as np

from qpn.benchmarks.bench_decode import team_variant
from qpn.cupy_kernels import gemm
from qpn.cupy_kernels import linear as L
from qpn.cupy_kernels.loader import kernel
from qpn.ref.formats import QPN8

N, K = 28672, 8192


def main() -> None:
    rng = cp.random.RandomState(0)
    codes = rng.randint(0, 126, size=(N * K,), dtype=cp.uint8)  # e4m3 bytes below 0x7E: finite, no NaN
    scales = (rng.standard_normal((1, N)) * 0.01).astype(cp.float16)
    calls = []
    cases = ((32, (L.QPN8_LINEAR[4, False, False], team_variant("qpn8", 2, 2, False))),
             (128, (gemm.QPN8_GEMM[False, False], team_variant("qpn8", 8, 2, True))))
    if "--pairs" in sys.argv:
        cases = ((128, (gemm.QPN8_GEMM[False, False], gemm.QPN8_TEAM[False, False, 8, False],
                        gemm.QPN8_TEAM[False, False, 8, True])),)
    for m, builds in cases:
        x = (rng.standard_normal((m, K)) * 0.5).astype(cp.float16)
        for v in builds:
            y = cp.empty((m, N), cp.float16)
            if m > L.MAX_M:
                ws = cp.empty(gemm.gemm_workspace_size("fp8", m, N, K) + 4096, cp.float32)
                calls.append(lambda v=v, x=x, y=y, ws=ws: gemm.launch_gemm(QPN8, v, (codes, scales, np.int32(0)),
                                                                           x, y, N, False, ws))
            else:
                ws = cp.empty(L.decode_workspace_size("fp8", m, N, K) + 4096, cp.float32)
                calls.append(lambda v=v, x=x, y=y, ws=ws: L.launch_decode(
                    QPN8, kernel(v), (codes, scales, np.int32(0)), x, y, N, False, ws, True, v.defines))
    for c in calls:
        c()
        c()
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
