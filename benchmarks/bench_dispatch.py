"""The measurement behind the dispatch policy: every path of the linear ops timed at a grid of M on a
set of layer shapes, written as the device family's table (torch_bridge/dispatch_tables/<family>.json)
that torch_bridge/dispatch.py reads.

    python benchmarks/bench_dispatch.py --device cuda [--out DIR] [--write]
    python benchmarks/bench_dispatch.py --device cpu [--out DIR] [--write]

Per layout (QPN2, QPN8 channel scales), shape (N x K), M and path: microseconds of the path forced
(torch_bridge/_cuda.linear_on: decode, gemm, dense; _cpu_ops.linear_on: cpu_fused, cpu_blas), the
median of REPEATS timings of CALLS back-to-back calls (on the GPU one CUDA graph of the calls,
replayed and timed with events: kernel time, not Python's; perf_counter on the CPU). On the GPU
the eager host time per call of each path (256x256, M = 1) is printed too. Printed per row: each
path's time, the fastest, and its speed-up over the other paths measured in the same run. --write
replaces the family's table in the package (the file the policy reads); the JSON always goes to
--out. Weights: random codes (any byte is valid; QPN8 without the NaN bytes),
e4m3 block scales 0x28..0x7D with g = 1e-3 (NVFP4), S16 in [2^-6, 2^2] (FP8): the values move no time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import qpn.torch_bridge  # noqa: F401  (registers torch.ops.qpn.*)
from qpn.ref.formats import QPN2, QPN8, WeightFormat
from qpn.torch_bridge import _cpu_ops, _cuda, dispatch

CUDA_SHAPES = ((4096, 4096), (6144, 4096), (4096, 14336), (14336, 4096), (28672, 4096), (5120, 17408),
               (28672, 8192))
CUDA_MS = (1, 8, 16, 32, 40, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
CPU_SHAPES = ((1024, 1024), (4096, 4096))
CPU_MS = (1, 2, 4, 8, 12, 16, 24, 32)
REPEATS, CALLS = 5, 10


def buffers(wf: WeightFormat, n: int, k: int, device: str, rng: np.random.Generator) -> tuple[torch.Tensor, ...]:
    if wf is QPN2:
        host = (rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
                rng.integers(0x28, 0x7E, (n, k // 16), dtype=np.uint8), np.full(n // 32, 1e-3, dtype=np.float32))
    else:
        codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN bytes
        host = (codes, (2.0 ** rng.uniform(-6, 2, (1, n))).astype(np.float16))
    return tuple(torch.from_numpy(b).to(device) for b in host)


def time_us(call, device: str) -> float:
    """Median over REPEATS of the mean time of CALLS calls. CUDA: GPU time, the calls captured in one
    CUDA graph and the replays timed with events (the paths are graph-safe), so Python's enqueue time
    (the same order for every path, and gone under vLLM's graphs) cannot hide the kernels' time."""
    for _ in range(2):
        call()
    if device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                call()
        graph.replay()
    samples = []
    for _ in range(REPEATS):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / CALLS)
        else:
            t0 = time.perf_counter()
            for _ in range(CALLS):
                call()
            samples.append((time.perf_counter() - t0) * 1e6 / CALLS)
    return statistics.median(samples)


def host_us(call, calls: int = 200) -> float:
    """Python's enqueue time per eager call (no graph): the loop's wall time with one sync at the end,
    on a layer small enough that the GPU keeps up."""
    call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def host_section() -> None:
    rng = np.random.default_rng(1)
    for wf in (QPN2, QPN8):
        bufs = buffers(wf, 256, 256, "cuda", rng)
        x = torch.zeros((1, 256), dtype=torch.float16, device="cuda")
        us = {p: host_us(lambda p=p: _cuda.linear_on(p, wf, x, bufs, 256, 256, 256, False)) for p in
              ("decode", "gemm", "dense")}
        op = torch.ops.qpn.nvfp4_linear if wf is QPN2 else torch.ops.qpn.fp8_linear
        us["op"] = host_us(lambda: op(x, *bufs))
        print(f"host us per eager call, {wf.key} 256x256 M=1: " + ", ".join(f"{p} {t:.1f}" for p, t in us.items()))


def measure(device: str) -> list[dict]:
    shapes, ms = (CUDA_SHAPES, CUDA_MS) if device == "cuda" else (CPU_SHAPES, CPU_MS)
    rows, rng = [], np.random.default_rng(0)
    for wf in (QPN2, QPN8):
        for n, k in shapes:
            bufs = buffers(wf, n, k, device, rng)
            for m in ms:
                x = torch.from_numpy((rng.standard_normal((m, k)) / 64).astype(np.float16)).to(device)
                us = {}
                for c in dispatch.CANDIDATES:
                    if not c.can_implement(device, m):
                        continue
                    if device == "cuda":
                        us[c.name] = time_us(lambda p=c.name: _cuda.linear_on(p, wf, x, bufs, n, k, n, False), device)
                    else:
                        us[c.name] = time_us(lambda p=c.name: _cpu_ops.linear_on(p, wf, x, bufs, n), device)
                rows.append({"layout": wf.key, "n": n, "k": k, "gated": False, "m": m,
                             "us": {p: round(t, 2) for p, t in us.items()}})
                best = min(us, key=us.get)
                others = ", ".join(f"{p} {t:.1f}" for p, t in us.items())
                speedups = ", ".join(f"{us[p] / us[best]:.2f}x vs {p}" for p in us if p != best)
                print(f"{wf.key:5s} {n:5d}x{k:<5d} M={m:<5d} {others}  -> {best} ({speedups})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--write", action="store_true", help="replace the family's table in the package")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    family = dispatch.device_family(device if device.type == "cpu" else torch.device("cuda", 0))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"dispatch table for {family} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}")
    if device.type == "cuda":
        host_section()
    table = {"family": family, "device": name, "written_by": "benchmarks/bench_dispatch.py",
             "torch": torch.__version__, "threads": torch.get_num_threads(),
             "date": time.strftime("%Y-%m-%d"), "rows": measure(device.type)}
    text = json.dumps(table, indent=1) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"dispatch_{family}.json").write_text(text)
    if args.write:
        target = dispatch.TABLES / f"{family}.json"
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(text)
        tmp.replace(target)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
