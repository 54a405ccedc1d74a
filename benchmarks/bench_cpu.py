"""CPU benchmark of the qpn linear ops (the numba backend) against torch's dense F.linear.

    python benchmarks/bench_cpu.py [--shapes 256x256,1024x1024,4096x4096,14336x4096] [--ms 1,64]
                                   [--formats nvfp4,fp8_channel,fp8_block] [--threads T]
                                   [--chunks 32,128,512,0]
                                   [--crossover-shape 4096x4096]
                                   [--json benchmarks/results/cpu.json]

Per format, shape (N x K) and M: microseconds of torch.ops.qpn.nvfp4_linear / fp8_linear (fp16 x,
fp16 y), of F.linear with the same W16 resident in fp32 (fp32 x) - the target: qpn within 1.5x -
and in bf16; and of the qpn op on bf16 x (bf16 y; issue 24: at most 5 % over its fp16 time, and
against bf16 F.linear). Each figure is the minimum over --repeats calls, the qpn and
F.linear calls interleaved so both see the same machine load; the ratio is qpn / fp32.
Correctness is checked before timing: every output inside qpn.ref.linear_bounds.

The crossover of the two CPU paths (fused; decode-then-matmul) is benchmarks/bench_dispatch.py
--device cpu's measurement: it writes the table the dispatch policy reads.
--chunks times the decode-then-matmul path at M = 64 with chunks of that many W16 rows (0 = all N
rows at once, a fresh N x K float32 buffer per call): the measurement behind CHUNK_ELEMENTS.

Weights: random codes (random bytes are valid in any byte order), e4m3 block scales 0x28..0x7D
(2^-2..416) with g = 1e-3 (NVFP4), QPN8 codes without the NaN bytes, S16 in [2^-6, 2^2].
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch
import torch.nn.functional as F

import qpn.torch_bridge  # noqa: F401  (registers torch.ops.qpn.*)
from qpn import ref
from qpn.benchmarks import bench_kernels as bk  # (write_atomic)
from qpn.torch_bridge import _cpu

FORMATS = ("nvfp4", "fp8_channel", "fp8_block")
G = 1e-3


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def make_layer(fmt: str, n: int, k: int, rng, device: str = "cpu"):
    """(op(x) -> y in x's dtype, W16 float16 [N, K]) for random QPN2 / QPN8 buffers on `device`."""
    if fmt == "nvfp4":
        codes = torch.from_numpy(rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)).to(device)
        scales = torch.from_numpy(rng.integers(0x28, 0x7E, size=(n, k // 16), dtype=np.uint8)).to(device)
        g = torch.tensor(G, dtype=torch.float32, device=device)
        w16 = torch.ops.qpn.nvfp4_dequantize(codes, scales, g)
        return (lambda x: torch.ops.qpn.nvfp4_linear(x, codes, scales, g)), w16
    codes = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    codes = torch.from_numpy(np.where((codes & 0x7F) == 0x7F, codes - 1, codes).astype(np.uint8)).to(device)
    shape = (1, n) if fmt == "fp8_channel" else (k // 128, n // 32)
    group_scales = torch.from_numpy(np.exp2(rng.uniform(-6.0, 2.0, size=shape)).astype(np.float16)).to(device)
    w16 = torch.ops.qpn.fp8_dequantize(codes, group_scales)
    return (lambda x: torch.ops.qpn.fp8_linear(x, codes, group_scales)), w16


def check(op, x: torch.Tensor, w16: torch.Tensor) -> None:
    """Every output inside ref's derived fp32-accumulation bound for x's dtype, fp16 or bf16 (first 256
    columns: ref's float64 bound is the slow part; bf16 values travel to ref as float32)."""
    cols = min(256, w16.shape[0])
    dtype = "bfloat16" if x.dtype == torch.bfloat16 else "float16"
    x_ref = x.float().cpu().numpy() if dtype == "bfloat16" else x.cpu().numpy()
    lo, hi = ref.linear_bounds(x_ref, w16[:cols].cpu().numpy(), dtype=dtype)
    y = op(x)[:, :cols].float().cpu().numpy()
    bad = ~((lo <= y) & (y <= hi))
    if bad.any():
        raise SystemExit(f"qpn output outside ref.linear_bounds at {np.argwhere(bad)[0]}: not timing a wrong result")


def time_interleaved(calls: dict, repeats: int) -> dict:
    """Minimum microseconds of each callable, called round-robin `repeats` times after one warm-up."""
    best = {name: float("inf") for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: seconds * 1e6 for name, seconds in best.items()}


def section_targets(args, rng) -> list:
    rows = []
    print(f"{'format':12} {'N x K':>12} {'M':>4} {'qpn us':>10} {'fp32 us':>10} {'bf16 us':>10} {'qpn/fp32':>9} "
          f"{'qpn bf16 us':>12} {'bf16/fp16':>9} {'qpn bf16/bf16':>13}")
    for n, k in args.shapes:
        for fmt in args.formats:
            op, w16 = make_layer(fmt, n, k, rng)
            w32, wbf = w16.float(), w16.bfloat16()
            for m in args.ms:
                x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float16))
                x32, xbf = x.float(), x.bfloat16()
                check(op, x, w16)
                check(op, xbf, w16)
                # each qpn call follows an F.linear (cold caches for both), never the other qpn call on the
                # same weights: that order gave the second a warm cache (bf16 measured up to 1.4x fp16 so)
                us = time_interleaved({"fp32": lambda: F.linear(x32, w32), "qpn": lambda: op(x),
                                       "bf16": lambda: F.linear(xbf, wbf), "qpn_bf16": lambda: op(xbf)},
                                      args.repeats)
                row = dict(format=fmt, n=n, k=k, m=m, qpn_us=us["qpn"], fp32_us=us["fp32"], bf16_us=us["bf16"],
                           ratio=us["qpn"] / us["fp32"], qpn_bf16_us=us["qpn_bf16"],
                           bf16_over_fp16=us["qpn_bf16"] / us["qpn"], qpn_bf16_over_bf16=us["qpn_bf16"] / us["bf16"])
                rows.append(row)
                print(f"{fmt:12} {f'{n}x{k}':>12} {m:4d} {row['qpn_us']:10.0f} {row['fp32_us']:10.0f} "
                      f"{row['bf16_us']:10.0f} {row['ratio']:9.2f} {row['qpn_bf16_us']:12.0f} "
                      f"{row['bf16_over_fp16']:9.3f} {row['qpn_bf16_over_bf16']:13.2f}", flush=True)
    return rows


def section_chunks(args, rng) -> list:
    n, k = args.crossover_shape
    rows = []
    saved = _cpu.CHUNK_ELEMENTS
    print(f"\nchunk rows of the decode-then-matmul path, {n}x{k}, M=64")
    try:
        for fmt in args.formats:
            op, _ = make_layer(fmt, n, k, rng)
            x = torch.from_numpy(rng.standard_normal((64, k)).astype(np.float16))
            for chunk in args.chunks:
                _cpu.CHUNK_ELEMENTS = (chunk or n) * k
                us = time_interleaved({"qpn": lambda: op(x)}, args.repeats)["qpn"]
                rows.append(dict(format=fmt, n=n, k=k, m=64, chunk_rows=chunk or n, qpn_us=us))
                print(f"{fmt:12} chunk {chunk or n:6d} rows {us:9.0f} us", flush=True)
    finally:
        _cpu.CHUNK_ELEMENTS = saved
    return rows


def parse_args(argv):
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="256x256,1024x1024,4096x4096,14336x4096",
                   type=lambda s: [tuple(int(d) for d in v.split("x")) for v in s.split(",")])
    p.add_argument("--ms", default="1,64", type=ints)
    p.add_argument("--formats", default=",".join(FORMATS), type=lambda s: s.split(","))
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--chunks", default="", type=ints)
    p.add_argument("--crossover-shape", default=(4096, 4096), type=lambda v: tuple(int(d) for d in v.split("x")),
                   help="N x K of --chunks (default 4096x4096)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    bad = [f for f in args.formats if f not in FORMATS]
    if bad:
        p.error(f"--formats must be among {','.join(FORMATS)}, got {bad}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision("highest")
    header = dict(cpu=cpu_name(), cores=__import__("os").cpu_count(), torch=torch.__version__,
                  numba=numba.__version__, torch_threads=torch.get_num_threads(),
                  numba_threads=min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS),
                  fused_max_m=_cpu.FUSED_MAX_M, chunk_elements=_cpu.CHUNK_ELEMENTS, argv=sys.argv[1:])
    print(" | ".join(f"{key} {value}" for key, value in header.items()), flush=True)
    rng = np.random.default_rng(0)
    result = dict(header=header, targets=section_targets(args, rng))
    if args.chunks:
        result["chunks"] = section_chunks(args, rng)
    if args.json:  # atomic: an interrupted run leaves the old file or the new one
        bk.write_atomic(Path(args.json), json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
