"""bf16 activations against fp16 on the GPU (issue 24, part 3): the qpn linear op on the same weights with
fp16 x and with bf16 x, per format, shape and M, GPU time of graph-replayed calls (bench_dispatch.time_us),
and their ratio (the target: <= 1.05 at M = 1-32). Both run the same path and kernels (dispatch.choose);
bf16 adds x_bf16.cu's launch (each row times 2^e into fp16: docs/DESIGN.md, "bf16 activations"), which at
M > 8 takes the place of the fp16 fragments' launch.

    python benchmarks/bench_bf16.py [--out DIR] [--shapes 4096x4096,14336x4096] [--ms 1,8,32]

Correctness is checked before timing: the bf16 output inside ref's bf16 bound (first 256 columns).
Weights: random packed bytes, as benchmarks/bench_cpu.py makes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from qpn.benchmarks import (
    bench_cpu,  # (make_layer, check: the same weights and the same bound check)
    bench_dispatch,  # (time_us: graph replay, CUDA events)
)
from qpn.benchmarks import bench_kernels as bk  # (write_atomic)

FORMATS = ("nvfp4", "fp8_channel")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write bf16_h200.{json,md} here")
    p.add_argument("--shapes", default="4096x4096,14336x4096")
    p.add_argument("--ms", default="1,8,32")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_bf16: no CUDA device (the CPU figures are benchmarks/bench_cpu.py's)", file=sys.stderr)
        return 3
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'format':12} {'N x K':>12} {'M':>4} {'fp16 us':>9} {'bf16 us':>9} {'bf16/fp16':>9}", flush=True)
    for n, k in shapes:
        for fmt in FORMATS:
            op, w16 = bench_cpu.make_layer(fmt, n, k, rng, "cuda")
            for m in ms:
                x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float16)).cuda()
                xb = x.bfloat16()
                bench_cpu.check(op, x, w16)
                bench_cpu.check(op, xb, w16)
                fp16 = bench_dispatch.time_us(lambda: op(x), "cuda")
                bf16 = bench_dispatch.time_us(lambda: op(xb), "cuda")
                rows.append(dict(format=fmt, n=n, k=k, m=m, fp16_us=fp16, bf16_us=bf16, ratio=bf16 / fp16))
                print(f"{fmt:12} {f'{n}x{k}':>12} {m:4d} {fp16:9.1f} {bf16:9.1f} {bf16 / fp16:9.2f}", flush=True)
    worst = max(r["ratio"] for r in rows)
    verdict = "met" if worst <= 1.05 else "missed"
    line = f"- target bf16 <= 1.05x fp16 at M = {ms[0]}-{ms[-1]}: worst {worst:.2f}x: {verdict}"
    print(line)
    if args.out:
        out = Path(args.out)
        table = ["| format | N x K | M | fp16 us | bf16 us | bf16 / fp16 |", "|---|---|---|---|---|---|"]
        table += [f"| {r['format']} | {r['n']}x{r['k']} | {r['m']} | {r['fp16_us']:.1f} | {r['bf16_us']:.1f} | "
                  f"{r['ratio']:.2f} |" for r in rows]
        md = "\n".join([f"# bf16 against fp16 activations, {torch.cuda.get_device_name()}", "",
                        "Run: `python benchmarks/bench_bf16.py`; GPU time per call, graph-replayed. Both dtypes "
                        "run the same kernels; bf16 first writes its fp16 rows (x_bf16.cu: one launch more at "
                        "M <= 8, in place of the fp16 fragments' launch above).", "", *table, "",
                        line, ""])
        bk.write_atomic(out / "bf16_h200.md", md)
        bk.write_atomic(out / "bf16_h200.json", json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
