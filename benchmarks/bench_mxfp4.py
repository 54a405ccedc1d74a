"""MXFP4 decode benchmark (issue 23): the QPNMX decode kernels against the QPN2 (NVFP4) decode kernels on the
same shapes, and against the streaming-read ceiling measured in the same run (a GPU script).

    python benchmarks/bench_mxfp4.py [--out DIR] [--ms 1,8,32]

Shapes: 28672x8192 (the decode kernels' reference shape: results/decode_h200.md) and gpt-oss-20b's expert
projections as one dense layer each (gate_up 5760x2880, down 2880x2880). Per shape and M: microseconds
per call (CUDA-graph replay of rotating weight copies spanning >= 4x L2: bench_kernels.Context.time_calls),
the packed bytes over that time as % of the read ceiling, and MX / QPN2 time. Weights: random bytes
(timing depends on shapes, not values), MX scale bytes 110..127 with every tile's 2^T from its largest
(the fast decode path, as real checkpoints take it), QPN2 scale bytes 0x28..0x7D with g = 1e-3.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from qpn.benchmarks import bench_kernels as bk  # (Context: the graph timing and the read ceiling)

SHAPES = {"28672x8192": (28672, 8192), "gpt-oss gate_up 5760x2880": (5760, 2880),
          "gpt-oss down 2880x2880": (2880, 2880)}


def buffers(cp, wf: str, n: int, k: int, slots: int) -> list[tuple]:
    """`slots` copies of one layer's packed buffers (random bytes in the fast path's range)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(slots):
        codes = cp.asarray(rng.integers(0, 256, (n, k // 2), dtype=np.uint8))
        if wf == "mxfp4":
            scales = rng.integers(110, 128, (n, k // 32), dtype=np.uint8)
            scales[::32, 0] = 127  # every tile's largest: T = 127 - 140
            out.append((codes, cp.asarray(scales), cp.full(n // 32, 2.0**-13, np.float32)))
        else:
            scales = rng.integers(0x28, 0x7E, (n, k // 16), dtype=np.uint8)
            out.append((codes, cp.asarray(scales), cp.full(1, 1e-3, np.float32)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--ms", default="1,8,32")
    args = parser.parse_args(argv)
    from qpn.cupy_kernels import qpn2_linear
    from qpn.cupy_kernels.mxfp4 import qpnmx_linear
    from qpn.ref.formats import QPN2, QPNMX

    ctx = bk.Context(quick=False)
    cp = ctx.cp
    bk.section_ceiling(ctx)
    read = ctx.ceiling["read"]
    print(f"{ctx.gpu_name}: read ceiling {read:.0f} GB/s", flush=True)
    rows = []
    for name, (n, k) in SHAPES.items():
        for m in (int(v) for v in args.ms.split(",")):
            x = cp.asarray(np.random.default_rng(m).standard_normal((m, k)).astype(np.float16))
            row = {"shape": name, "n": n, "k": k, "m": m}
            for wf, fn, fmt in (("mxfp4", qpnmx_linear, QPNMX), ("nvfp4", qpn2_linear, QPN2)):
                nbytes = fmt.weight_bytes(n, k)
                slots = ctx.rotations(nbytes)
                bufs = buffers(cp, wf, n, k, slots)
                y = cp.empty((m, n), np.float16)
                t = ctx.time_calls(lambda i, fn=fn, bufs=bufs, y=y, x=x: fn(x, *bufs[i % len(bufs)], out=y), slots)
                row[f"{wf}_us"] = round(t["us"], 2)
                row[f"{wf}_pct_read"] = round(100 * bk.gbps(nbytes, t["us"]) / read, 1)
                row[f"{wf}_timing"] = t["method"]
                del bufs
            row["mx_over_nvfp4"] = round(row["mxfp4_us"] / row["nvfp4_us"], 3)
            rows.append(row)
            print(f"{name:26s} M={m:<3d} MXFP4 {row['mxfp4_us']:8.2f} us ({row['mxfp4_pct_read']:5.1f} % read) "
                  f"NVFP4 {row['nvfp4_us']:8.2f} us ({row['nvfp4_pct_read']:5.1f} %)  MX/NVFP4 "
                  f"{row['mx_over_nvfp4']:.3f}  [{row['mxfp4_timing']}]", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    bk.write_atomic(args.out / "mxfp4_h200.json", json.dumps({"gpu": ctx.gpu_name, "read_gbps": read, "rows": rows},
                                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
