"""Kernel benchmark for qpn's CuPy kernels (a script for the GPU machine, not a test).

    python benchmarks/bench_kernels.py [--sections ceiling,layouts,dense,sweep] [--quick]
                                       [--out benchmarks/results] [--name h200]

Writes <out>/<name>.json (every number, plus the environment) and <out>/<name>.md (tables), and
prints the tables. Method (docs/STYLE.md, item 14; docs/TURING.md, "The test GPU as a proxy"):

- One shared ceiling, measured first in the same run: streaming read with 16-byte `__ldcs`
  loads over >= 1 GiB (also write-only and copy, for context); every bandwidth figure is a
  ratio to the read ceiling (the issue's target), with the copy ceiling beside it.
- Every timed call rotates through enough input/output copies that the working set is at least
  L2_DEFEAT_FACTOR x the L2 size (the H200's L2 would otherwise hold small weights), and one
  timing covers many calls between two CUDA events: the calls are captured into a CUDA graph
  and the graph is replayed (falls back to a plain launch loop if capture fails; the row says
  which), so Python launch overhead does not dominate small shapes. Median of REPEATS.
- Correctness before timing: every timed kernel's output is compared byte for byte with
  qpn.ref on its first and last two tiles (the QPN layouts are tile-major, so a tile's bytes
  are a contiguous slice that qpn.ref can process alone).

Sections are functions `section_<name>(ctx) -> Section` registered in SECTIONS; a new section
adds one function and one SECTIONS entry and uses `ctx.time_calls`, `ctx.rotations`, `ctx.ceiling`
and `ctx.check_equal`; the writer handles every section alike. bench_decode.py (`qpn bench decode`)
builds its sections for the decode and GEMM builds on this framework; this file imports none of them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qpn.apps.arguments import Parser

HERE = Path(__file__).resolve().parent
# --out's default for every script: the committed results/ in a clone of the repository; an installed qpn ships
# no results/ (nor writes into its own install), so there it is a folder of the current directory
DEFAULT_OUT = HERE / "results" if (HERE / "results").is_dir() else Path("qpn-bench-results")
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (5120, 17408), (34816, 5120), (28672, 8192)]  # (N, K)
QUICK_SHAPES = [(4096, 4096), (28672, 8192)]
DENSE_MS = (64, 512, 2048)
L2_DEFEAT_FACTOR = 4  # working set of the rotated copies >= 4 x L2
REPEATS = 7  # timings per measurement; the median is reported
TARGET_US_PER_TIMING = 3000.0  # one timing spans about 3 ms of GPU work
MAX_CALLS_PER_TIMING = 400
CEILING_BYTES = 2 << 30  # 2 GiB per ceiling buffer (>= 1 GiB asked)
SWEEP_CONFIGS = [(2, 2), (4, 2), (8, 2), (4, 4), (8, 4)]  # (QPN_GROUPS_PER_THREAD, QPN_STAGE_GROUPS)
NON_NAN_E4M3 = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)


# ----------------------------------------------------------------------------- framework


@dataclass
class Column:
    key: str
    header: str
    fmt: str = "{}"


@dataclass
class Section:
    name: str
    title: str
    columns: list[Column]
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Context:
    """Shared state of one benchmark run: the GPU, timing helpers and the ceiling."""

    def __init__(self, quick: bool):
        import cupy

        self.cp = cupy
        self.quick = quick
        self.shapes = QUICK_SHAPES if quick else SHAPES
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        self.gpu_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.sm_count = int(props["multiProcessorCount"])
        self.l2_bytes = int(props["l2CacheSize"])
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.ceiling: dict[str, float] = {}  # GB/s: read, write, copy
        self.sections: list[Section] = []
        self.capture_failures: list[list[str]] = []  # why a timing fell back to a launch loop
        self.async_pool = None

    # -- sizes

    def rotations(self, bytes_per_call: int, minimum: int = 2, maximum: int = 64) -> int:
        """Copies to rotate through so that they span >= L2_DEFEAT_FACTOR x L2."""
        return max(minimum, min(maximum, math.ceil(L2_DEFEAT_FACTOR * self.l2_bytes / max(bytes_per_call, 1))))

    # -- timing

    def time_calls(self, launch: Callable[[int], None], slots: int) -> dict:
        """Median microseconds per call of launch(i) (i cycles over `slots` rotation copies).

        All launches go to ctx.stream. Capture `calls` launches into a CUDA graph and time its
        replays between two events; if capture fails, time a plain launch loop instead.
        """
        cp = self.cp
        stream = self.stream
        with stream:
            for i in range(slots):  # warm-up: JIT, cuBLAS heuristics and workspace, first touches
                launch(i)
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            for i in range(slots):
                launch(i)
            end.record(stream)
            end.synchronize()
            estimate = cp.cuda.get_elapsed_time(start, end) * 1000.0 / slots
            calls = min(MAX_CALLS_PER_TIMING, max(slots, math.ceil(TARGET_US_PER_TIMING / max(estimate, 0.5))))
            calls = slots * math.ceil(calls / slots)

            graph, method = self._capture(launch, calls)

            times, host = [], []
            for _ in range(REPEATS):
                start.record(stream)
                t0 = time.perf_counter()
                if graph is not None:
                    graph.launch(stream)
                else:
                    for i in range(calls):
                        launch(i)
                host.append((time.perf_counter() - t0) * 1e6 / calls)
                end.record(stream)
                end.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, end) * 1000.0 / calls)
        us = statistics.median(times)
        if graph is None and statistics.median(host) > 0.8 * us:
            method += ", host-bound"  # Python enqueue time is what this row measures
        return {"us": us, "us_min": min(times), "us_max": max(times), "calls": calls, "slots": slots,
                "method": method, "host_us": statistics.median(host)}

    def _capture(self, launch, calls):
        """(graph, "graph") if `calls` launches capture into a CUDA graph, else (None, "loop (why)").

        Tries CuPy's default memory pool first, then CUDA's stream-ordered allocator (whose
        cudaMallocAsync is legal inside a capture), because a library call that allocates
        scratch memory (cuBLAS through cupy.matmul) cannot capture from the default pool.
        """
        cp, stream = self.cp, self.stream
        reasons = []
        for allocator in ("default", "async"):
            if allocator == "async":
                cp.cuda.set_allocator(self._async_pool().malloc)
            try:
                stream.begin_capture()
                try:
                    for i in range(calls):
                        launch(i)
                finally:
                    graph = stream.end_capture()
                graph.launch(stream)
                stream.synchronize()
                return graph, "graph" if allocator == "default" else "graph (async pool)"
            except Exception as exc:  # noqa: BLE001 - any capture problem: try the next way, say why
                reasons.append(f"{allocator}: {type(exc).__name__}: {str(exc)[:120]}")
                stream.synchronize()
            finally:
                if allocator == "async":
                    cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
        self.capture_failures.append(reasons)
        return None, "loop"

    def _async_pool(self):
        if self.async_pool is None:
            self.async_pool = self.cp.cuda.MemoryAsyncPool()
        return self.async_pool

    # -- correctness

    @staticmethod
    def check_equal(what: str, gpu, ref) -> None:
        got = gpu.get() if hasattr(gpu, "get") else gpu
        if got.shape != ref.shape or not np.array_equal(got.view(np.uint8), np.ascontiguousarray(ref).view(np.uint8)):
            raise AssertionError(f"{what}: GPU bytes differ from qpn.ref; refusing to time a wrong kernel")


def gbps(nbytes: float, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


# ----------------------------------------------------------------------------- ceiling


def section_ceiling(ctx: Context) -> Section:
    """Streaming read / write / copy over CEILING_BYTES with 16-byte accesses; best of several grids."""
    from qpn.cupy_kernels.loader import get_function

    cp = ctx.cp
    source = str(HERE / "ceiling.cu")
    n_vec = CEILING_BYTES // 16
    src = cp.random.randint(0, 2**31, size=CEILING_BYTES // 4, dtype=cp.int32).view(cp.uint8)
    dst = cp.empty(CEILING_BYTES, dtype=cp.uint8)
    sink = cp.zeros(1, dtype=cp.uint32)
    sec = Section("ceiling", "Memory ceilings (16-byte accesses, 2 GiB buffers)",
                  [Column("kernel", "kernel"), Column("blocks_per_sm", "blocks/SM"), Column("us", "us", "{:.1f}"),
                   Column("gbps", "GB/s", "{:.0f}"), Column("method", "timing")])
    kernels = {
        "read": (get_function(source, "stream_read"),
                 lambda k, grid: k(grid, (256,), (src, np.int64(n_vec), sink)), 1),
        "write": (get_function(source, "stream_write"),
                  lambda k, grid: k(grid, (256,), (dst, np.int64(n_vec), np.uint32(7))), 1),
        "copy": (get_function(source, "stream_copy"),
                 lambda k, grid: k(grid, (256,), (src, dst, np.int64(n_vec))), 2),
    }
    for name, (kern, call, traffic) in kernels.items():
        best = None
        for blocks_per_sm in (4, 8, 16, 32):
            grid = (ctx.sm_count * blocks_per_sm,)
            t = ctx.time_calls(lambda i, kern=kern, call=call, grid=grid: call(kern, grid), 1)
            row = {"kernel": name, "blocks_per_sm": blocks_per_sm, "us": t["us"],
                   "gbps": gbps(traffic * CEILING_BYTES, t["us"]), "method": t["method"]}
            sec.rows.append(row)
            if best is None or row["gbps"] > best["gbps"]:
                best = row
        ctx.ceiling[name] = best["gbps"]
    ceilings = ", ".join(f"{k} {v:.0f} GB/s" for k, v in ctx.ceiling.items())
    sec.notes.append("ceilings used below (best grid): " + ceilings)
    del src, dst
    return sec


# ----------------------------------------------------------------------------- prepack / dequantize


def _nvfp4_inputs(cp, n, k, seed):
    rs = cp.random.RandomState(seed)
    weight_packed = rs.randint(0, 256, size=(n, k // 2), dtype=cp.uint8)
    weight_scale = rs.randint(0, 256, size=(n, k // 16), dtype=cp.uint8)
    weight_scale = cp.where((weight_scale & 0x7F) == 0x7F, weight_scale - 1, weight_scale).astype(cp.uint8)
    return weight_packed, weight_scale


def _fp8_inputs(cp, n, k, seed):
    rs = cp.random.RandomState(seed)
    weight = rs.randint(0, 256, size=(n, k), dtype=cp.uint8)
    weight = cp.where((weight & 0x7F) == 0x7F, weight - 1, weight).astype(cp.uint8)
    scale = cp.exp2(rs.uniform(-12.0, 0.0, size=n)).astype(cp.float32)
    return weight, scale


def _edge_tiles(n: int) -> list[tuple[int, int]]:
    """Row ranges of the first and the last two 32-row tiles."""
    rows = min(64, n)
    return [(0, rows), (n - rows, n)] if n > rows else [(0, n)]


def _check_qpn2(ctx, wp, ws, codes, scales, g_host, w16, k):
    from qpn.ref import qpn2_dequantize, qpn2_prepack

    for lo, hi in _edge_tiles(wp.shape[0]):
        ref_codes, ref_scales = qpn2_prepack(wp[lo:hi].get(), ws[lo:hi].get())
        ctx.check_equal("qpn2_prepack codes", codes[lo:hi], ref_codes)
        ctx.check_equal("qpn2_prepack scales", scales[lo:hi], ref_scales)
        g = g_host[lo // 32:hi // 32]
        ctx.check_equal("qpn2_dequantize", w16[lo:hi], qpn2_dequantize(ref_codes, ref_scales, g, hi - lo, k))


def _check_qpn8(ctx, w, s, codes, group_scales, w16, k):
    from qpn.ref import qpn8_dequantize, qpn8_prepack

    for lo, hi in _edge_tiles(w.shape[0]):
        ref_codes, ref_scales = qpn8_prepack(w[lo:hi].get(), s[lo:hi].get())
        ctx.check_equal("qpn8_prepack codes", codes[lo:hi], ref_codes)
        ctx.check_equal("qpn8_prepack group scales", group_scales[:, lo:hi], ref_scales)
        ctx.check_equal("qpn8_dequantize", w16[lo:hi], qpn8_dequantize(ref_codes, ref_scales, hi - lo, k))


def section_layouts(ctx: Context) -> Section:
    """Prepack and dequantize time per shape and format; GB/s = (bytes read + written) / time."""
    from qpn.cupy_kernels import prepack as pp
    from qpn.cupy_kernels.dequantize import qpn2_dequantize, qpn8_dequantize

    cp = ctx.cp
    sec = Section("layouts", "Prepack and dequantize (GB/s = bytes read + written per second)", [
        Column("fmt", "format"), Column("n", "N"), Column("k", "K"), Column("quant_mb", "quantized MB", "{:.1f}"),
        Column("op", "op"), Column("us", "us", "{:.1f}"), Column("gbps", "GB/s", "{:.0f}"),
        Column("pct_read", "% read ceiling", "{:.1f}"), Column("pct_copy", "% copy ceiling", "{:.1f}"),
        Column("slots", "copies"), Column("method", "timing"),
    ])

    def add_row(fmt, n, k, q_bytes, op, fn, traffic, slots):
        t = ctx.time_calls(fn, slots)
        rate = gbps(traffic, t["us"])
        sec.rows.append({"fmt": fmt, "n": n, "k": k, "quant_mb": q_bytes / 1e6, "op": op, "us": t["us"],
                         "gbps": rate, "pct_read": 100 * rate / ctx.ceiling["read"],
                         "pct_copy": 100 * rate / ctx.ceiling["copy"], "slots": slots, "method": t["method"],
                         "bytes": traffic, "us_min": t["us_min"], "us_max": t["us_max"]})

    for n, k in ctx.shapes:
        # ---- QPN2 (NVFP4): codes N*K/2, scales N*K/16, W16 2*N*K
        q_bytes = n * k // 2 + n * k // 16
        w_bytes = 2 * n * k
        slots = ctx.rotations(q_bytes + w_bytes)
        inputs = [_nvfp4_inputs(cp, n, k, seed) for seed in range(slots)]
        g_host = np.exp2(np.random.default_rng(n + k).uniform(-14, 0, size=n // 32)).astype(np.float32)
        g = cp.asarray(g_host)
        packed = [pp.qpn2_prepack(wp, ws) for wp, ws in inputs]
        outs = [cp.empty((n, k), cp.float16) for _ in range(slots)]
        flags = cp.zeros(1, cp.int32)
        qpn2_dequantize(*packed[0], g, n, k, out=outs[0])
        _check_qpn2(ctx, *inputs[0], *packed[0], g_host, outs[0], k)

        def prepack2(i):
            wp, ws = inputs[i % slots]
            pp.launch_qpn2_prepack(wp, ws, packed[i % slots][0], packed[i % slots][1], flags)

        def dequant2(i):
            codes, scales = packed[i % slots]
            qpn2_dequantize(codes, scales, g, n, k, out=outs[i % slots], check=False)

        for op, fn, traffic in (("prepack", prepack2, 2 * q_bytes), ("dequantize", dequant2, q_bytes + w_bytes)):
            add_row("qpn2", n, k, q_bytes, op, fn, traffic, slots)
        del inputs, packed, outs

        # ---- QPN8 (FP8, per-channel): codes N*K, S16 2*N, W16 2*N*K
        q_bytes = n * k
        slots = ctx.rotations(q_bytes + w_bytes)
        inputs = [_fp8_inputs(cp, n, k, seed) for seed in range(slots)]
        packed = [pp.qpn8_prepack(w, s) for w, s in inputs]
        outs = [cp.empty((n, k), cp.float16) for _ in range(slots)]
        qpn8_dequantize(*packed[0], n, k, out=outs[0])
        _check_qpn8(ctx, *inputs[0], *packed[0], outs[0], k)

        def prepack8(i):
            w, s = inputs[i % slots]
            pp.launch_qpn8_prepack(w, s, "channel", packed[i % slots][0], packed[i % slots][1], flags)

        def dequant8(i):
            codes, group_scales = packed[i % slots]
            qpn8_dequantize(codes, group_scales, n, k, out=outs[i % slots], check=False)

        for op, fn, traffic in (("prepack", prepack8, 2 * q_bytes + 6 * n),
                                ("dequantize", dequant8, q_bytes + 2 * n + w_bytes)):
            add_row("qpn8", n, k, q_bytes, op, fn, traffic, slots)
        del inputs, packed, outs
        cp.get_default_memory_pool().free_all_blocks()
    big = [r for r in sec.rows if r["op"] == "dequantize" and r["quant_mb"] >= 64]
    if big:
        worst = min(big, key=lambda r: r["pct_read"])
        sec.notes.append(
            f"target: dequantize >= 75 % of the read ceiling on shapes of >= 64 MB quantized weight; "
            f"worst such row: {worst['fmt']} {worst['n']}x{worst['k']} at {worst['pct_read']:.1f} %"
        )
    return sec


# ----------------------------------------------------------------------------- dense


DENSE_ROUNDS = 2  # every configuration is timed in each round, rounds interleave; min of the medians


def section_dense(ctx: Context) -> Section:
    """Dense path (dequantize + cuBLAS) vs cuBLAS fp16 on the SAME weights, resident in fp16.

    The baseline of each format multiplies that format's own W16: a GEMM's speed depends on its
    data (power-capped tensor cores; seen here: the same GEMM on FP8-derived weights ran 2-19 %
    slower than on NVFP4-derived ones), so a shared baseline would mis-state the ratio.
    """
    from qpn.cupy_kernels import prepack as pp
    from qpn.cupy_kernels.dense import qpn2_dense_linear, qpn8_dense_linear
    from qpn.cupy_kernels.dequantize import qpn2_dequantize, qpn8_dequantize

    cp = ctx.cp
    sec = Section("dense", "Dense prefill path vs cuBLAS fp16 on the same weights (resident fp16 W16)", [
        Column("n", "N"), Column("k", "K"), Column("m", "M"),
        Column("cublas2_us", "cuBLAS (qpn2 W16) us", "{:.1f}"), Column("cublas_tflops", "TFLOP/s", "{:.0f}"),
        Column("qpn2_us", "qpn2 dense us", "{:.1f}"), Column("qpn2_ratio", "qpn2 / cuBLAS", "{:.3f}"),
        Column("floor2", "qpn2 serial floor", "{:.3f}"),
        Column("cublas8_us", "cuBLAS (qpn8 W16) us", "{:.1f}"),
        Column("qpn8_us", "qpn8 dense us", "{:.1f}"), Column("qpn8_ratio", "qpn8 / cuBLAS", "{:.3f}"),
        Column("floor8", "qpn8 serial floor", "{:.3f}"),
        Column("dequant2_us", "qpn2 dequant us", "{:.1f}"), Column("dequant8_us", "qpn8 dequant us", "{:.1f}"),
        Column("method", "timing"),
    ])
    for n, k in ctx.shapes:
        # Rotate weights (the part that could sit in L2); x, y and the W16 workspace are reused
        # as a module would reuse them.
        slots = ctx.rotations(2 * n * k, minimum=2, maximum=8)
        nvfp4 = [pp.qpn2_prepack(*_nvfp4_inputs(cp, n, k, seed)) for seed in range(slots)]
        fp8 = [pp.qpn8_prepack(*_fp8_inputs(cp, n, k, seed)) for seed in range(slots)]
        g = cp.full(n // 32, 1e-3, dtype=cp.float32)
        w16_2 = [qpn2_dequantize(c, s, g, n, k) for c, s in nvfp4]  # the same weights, resident in fp16
        w16_8 = [qpn8_dequantize(c, s, n, k) for c, s in fp8]
        workspace = cp.empty((n, k), cp.float16)
        for m in DENSE_MS:
            x = (cp.random.RandomState(m).standard_normal((m, k)) * 0.5).astype(cp.float16)
            y = cp.empty((m, n), cp.float16)
            y_ref = cp.empty((m, n), cp.float16)
            qpn2_dense_linear(x, *nvfp4[0], g, out=y, workspace=workspace)
            cp.matmul(x, w16_2[0].T, out=y_ref)
            ctx.check_equal(f"qpn2_dense_linear M={m}", y, y_ref.get())
            qpn8_dense_linear(x, *fp8[0], out=y, workspace=workspace)
            cp.matmul(x, w16_8[0].T, out=y_ref)
            ctx.check_equal(f"qpn8_dense_linear M={m}", y, y_ref.get())

            configs = {
                "cublas2": lambda i: cp.matmul(x, w16_2[i % slots].T, out=y),
                "qpn2": lambda i: qpn2_dense_linear(x, *nvfp4[i % slots], g, out=y, workspace=workspace),
                "cublas8": lambda i: cp.matmul(x, w16_8[i % slots].T, out=y),
                "qpn8": lambda i: qpn8_dense_linear(x, *fp8[i % slots], out=y, workspace=workspace),
                "dequant2": lambda i: qpn2_dequantize(*nvfp4[i % slots], g, n, k, out=workspace, check=False),
                "dequant8": lambda i: qpn8_dequantize(*fp8[i % slots], n, k, out=workspace, check=False),
            }
            runs: dict[str, list[dict]] = {name: [] for name in configs}
            for _ in range(DENSE_ROUNDS):
                for name, fn in configs.items():
                    runs[name].append(ctx.time_calls(fn, slots))
            t = {name: min(r, key=lambda v: v["us"]) for name, r in runs.items()}
            us = {name: v["us"] for name, v in t.items()}
            flops = 2.0 * m * n * k
            sec.rows.append({
                "n": n, "k": k, "m": m, **{f"{name}_us": v for name, v in us.items()},
                "cublas_tflops": flops / (us["cublas2"] * 1e-6) / 1e12,
                "qpn2_ratio": us["qpn2"] / us["cublas2"], "qpn8_ratio": us["qpn8"] / us["cublas8"],
                "floor2": (us["dequant2"] + us["cublas2"]) / us["cublas2"],
                "floor8": (us["dequant8"] + us["cublas8"]) / us["cublas8"],
                "method": "/".join(sorted({t[name]["method"] for name in ("cublas2", "qpn2", "cublas8", "qpn8")})),
                "slots": slots, "host_us": {name: v["host_us"] for name, v in t.items()},
                "spread_us": {name: [round(v["us"], 1) for v in r] for name, r in runs.items()},
            })
            del x, y, y_ref
        del nvfp4, fp8, w16_2, w16_8, workspace
        cp.get_default_memory_pool().free_all_blocks()
    at_2048 = [r for r in sec.rows if r["m"] == 2048]
    if at_2048:
        worst = max(at_2048, key=lambda r: max(r["qpn2_ratio"], r["qpn8_ratio"]))
        sec.notes.append(
            "target: dense path at M=2048 within 1.15x of cuBLAS; worst: "
            f"{worst['n']}x{worst['k']} qpn2 {worst['qpn2_ratio']:.3f}x, qpn8 {worst['qpn8_ratio']:.3f}x; "
            "M=2048 rows: qpn2 " + ", ".join(f"{r['qpn2_ratio']:.3f}" for r in at_2048)
            + "; qpn8 " + ", ".join(f"{r['qpn8_ratio']:.3f}" for r in at_2048)
        )
        sec.notes.append(
            "serial floor = (dequantize + cuBLAS) / cuBLAS, each timed alone: dequantize-then-GEMM with zero host "
            "overhead and no overlap. cuBLAS through CuPy cannot be captured in a CUDA graph (CuPy refuses cuBLAS "
            "calls during stream capture), so these rows time launch loops; 'host-bound' marks rows where Python's "
            f"enqueue time per call exceeded 80 % of the GPU time (see section host). {DENSE_ROUNDS} interleaved "
            "rounds per configuration, the faster median kept."
        )
    return sec


# ----------------------------------------------------------------------------- sweep


def section_sweep(ctx: Context) -> Section:
    """Dequantize throughput vs groups per lane and staged groups per phase (the kernel macros)."""
    from qpn.cupy_kernels import prepack as pp
    from qpn.cupy_kernels.dequantize import THREADS_PER_BLOCK
    from qpn.cupy_kernels.loader import get_function

    cp = ctx.cp
    sec = Section("sweep", "Dequantize vs groups per lane and staged groups (raw launches)", [
        Column("fmt", "format"), Column("n", "N"), Column("k", "K"), Column("gpt", "groups/thread"),
        Column("stage", "staged groups"),
        Column("us", "us", "{:.1f}"), Column("gbps", "GB/s", "{:.0f}"), Column("pct_read", "% read ceiling", "{:.1f}"),
    ])
    for n, k in [(4096, 4096), (28672, 8192)]:
        groups, n_tiles = k // 16, n // 32
        for fmt in ("qpn2", "qpn8"):
            q_bytes = n * k // 2 + n * k // 16 if fmt == "qpn2" else n * k + 2 * n
            slots = ctx.rotations(q_bytes + 2 * n * k)
            if fmt == "qpn2":
                packed = [pp.qpn2_prepack(*_nvfp4_inputs(cp, n, k, s)) for s in range(slots)]
            else:
                packed = [pp.qpn8_prepack(*_fp8_inputs(cp, n, k, s)) for s in range(slots)]
            outs = [cp.empty((n, k), cp.float16) for _ in range(slots)]
            g = cp.full(1, 1e-3, cp.float32)
            for gpt, stage in SWEEP_CONFIGS:
                macros = {"QPN_GROUPS_PER_THREAD": gpt, "QPN_STAGE_GROUPS": stage,
                          "QPN_WARPS_PER_BLOCK": THREADS_PER_BLOCK // 32}
                kern = get_function(f"{fmt}_dequantize.cu", f"{fmt}_dequantize", macros)
                grid = ((n_tiles * (-(-groups // gpt)) * 32 + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK,)
                if fmt == "qpn2":
                    def launch(i, kern=kern, grid=grid):
                        c, s = packed[i % slots]
                        kern(grid, (THREADS_PER_BLOCK,), (c, s, g, np.int32(0), outs[i % slots],
                                                          np.int32(n_tiles), np.int32(groups)))
                else:
                    def launch(i, kern=kern, grid=grid):
                        c, s = packed[i % slots]
                        kern(grid, (THREADS_PER_BLOCK,), (c, s, np.int64(0), np.int32(32), np.int32(1), outs[i % slots],
                                                          np.int32(n_tiles), np.int32(groups)))
                t = ctx.time_calls(launch, slots)
                rate = gbps(q_bytes + 2 * n * k, t["us"])
                sec.rows.append({"fmt": fmt, "n": n, "k": k, "gpt": gpt, "stage": stage, "us": t["us"], "gbps": rate,
                                 "pct_read": 100 * rate / ctx.ceiling["read"]})
            del packed, outs
            cp.get_default_memory_pool().free_all_blocks()
    return sec


def section_host(ctx: Context) -> Section:
    """Host (Python) time per call of the wrappers, and where it goes (cProfile, printed)."""
    import cProfile
    import io
    import pstats

    from qpn.cupy_kernels import prepack as pp
    from qpn.cupy_kernels.dense import qpn2_dense_linear
    from qpn.cupy_kernels.dequantize import qpn2_dequantize

    cp = ctx.cp
    n, k, m = 4096, 4096, 64
    codes, scales = pp.qpn2_prepack(*_nvfp4_inputs(cp, n, k, 0))
    g = cp.full(n // 32, 1e-3, cp.float32)
    x = cp.ones((m, k), cp.float16)
    y = cp.empty((m, n), cp.float16)
    w = cp.empty((n, k), cp.float16)
    calls = {
        "cupy.matmul(x, w.T, out=y)": lambda: cp.matmul(x, w.T, out=y),
        "qpn2_dequantize(check=False, out=w)": lambda: qpn2_dequantize(codes, scales, g, n, k, out=w, check=False),
        "qpn2_dense_linear(out=y, workspace=w)": lambda: qpn2_dense_linear(x, codes, scales, g, out=y, workspace=w),
    }
    sec = Section("host", f"Host time per call (Python enqueue, {n}x{k}, M={m})",
                  [Column("call", "call"), Column("host_us", "host us per call", "{:.1f}")])
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        cp.cuda.Device().synchronize()
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            best = min(best, (time.perf_counter() - t0) * 1e6 / 50)
            cp.cuda.Device().synchronize()
        sec.rows.append({"call": name, "host_us": best})
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        calls["qpn2_dense_linear(out=y, workspace=w)"]()
    prof.disable()
    cp.cuda.Device().synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    print(text.getvalue(), flush=True)
    return sec


SECTIONS: dict[str, Callable[[Context], Section]] = {
    "ceiling": section_ceiling,  # always first: every other section divides by it
    "layouts": section_layouts,
    "dense": section_dense,  # the decode kernels' sections: bench_decode.py, which builds on this framework
    "sweep": section_sweep,
    "host": section_host,
}


# ----------------------------------------------------------------------------- output


def environment(ctx: Context) -> dict:
    import cupy

    from qpn.cupy_kernels import loader

    rt = cupy.cuda.runtime
    return {
        "gpu": ctx.gpu_name, "sm_count": ctx.sm_count, "l2_bytes": ctx.l2_bytes,
        "driver_version": rt.driverGetVersion(), "runtime_version": rt.runtimeGetVersion(),
        "cupy": cupy.__version__, "numpy": np.__version__, "python": platform.python_version(),
        "kernel_build": loader.describe(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "l2_defeat_factor": L2_DEFEAT_FACTOR, "repeats": REPEATS, "quick": ctx.quick,
        "capture_failures": sorted({" | ".join(r) for r in ctx.capture_failures}),
    }


def render_markdown(env: dict, sections: list[Section]) -> str:
    build = env["kernel_build"]
    lines = [
        f"# qpn kernel benchmark: {env['gpu']}",
        "",
        f"{env['date']}; {env['sm_count']} SMs, L2 {env['l2_bytes'] / 2**20:.0f} MiB; driver {env['driver_version']}, "
        f"runtime {env['runtime_version']}, CuPy {env['cupy']}, NVRTC {build['nvrtc_version']}; kernels built as "
        f"{build['built_as']}. Median of {env['repeats']} timings, each over many calls (CUDA graph replay), rotating "
        f"copies >= {env['l2_defeat_factor']}x L2.",
    ]
    for sec in sections:
        lines += ["", f"## {sec.title}", ""]
        lines.append("| " + " | ".join(c.header for c in sec.columns) + " |")
        lines.append("|" + "|".join("---" for _ in sec.columns) + "|")
        for row in sec.rows:
            cells = []
            for c in sec.columns:
                v = row.get(c.key, "")
                cells.append(c.fmt.format(v) if v != "" else "")
            lines.append("| " + " | ".join(cells) + " |")
        if sec.notes:
            lines.append("")
            lines += [f"- {note}" for note in sec.notes]
    return "\n".join(lines) + "\n"


def profiled_kernels(fn: Callable[[], object], calls: int) -> dict[str, tuple[float, float]]:
    """{kernel name: (launches, GPU us)} per call of `calls` eager calls of fn() under torch.profiler (CUPTI sees
    every kernel on the device, CuPy's too), in first-launch order; one call first, unprofiled (warm-up)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            launches_us = totals.setdefault(event.name, [0, 0.0])
            launches_us[0] += 1
            launches_us[1] += event.time_range.elapsed_us()
    return {name: (n / calls, us / calls) for name, (n, us) in totals.items()}


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file and one rename: a killed run leaves the old file or the new
    one, never a partial one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_results(env: dict, sections: list[Section], out_dir: Path, name: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    payload = {"environment": env, "ceiling_gbps": env.get("ceiling_gbps", {}), "sections": {}}
    for sec in sections:
        payload["sections"][sec.name] = {"title": sec.title, "rows": sec.rows, "notes": sec.notes}
    write_atomic(json_path, json.dumps(payload, indent=1, default=float) + "\n")
    write_atomic(md_path, render_markdown(env, sections))
    return json_path, md_path


# ----------------------------------------------------------------------------- arguments
# Every argument is checked by the parser (one line, exit 2: qpn.apps.arguments' Parser and types, as the `qpn`
# command's own flags), never by the first kernel that trips on it: `qpn bench` parses before it looks for a GPU,
# so bad input exits 2 on any machine.


def sections_arg(sections: Mapping[str, object]) -> Callable[[str], list[str]]:
    """argparse type of --sections: comma-separated names of `sections`, at least one."""
    def parse(text: str) -> list[str]:
        wanted = [s.strip() for s in text.split(",") if s.strip()]
        if not wanted or any(s not in sections for s in wanted):
            raise argparse.ArgumentTypeError(f"choose one or more of {','.join(sections)}, got {text!r}")
        return wanted
    return parse


def result_name(text: str) -> str:
    """argparse type of --name: the stem of NAME.json / NAME.md inside --out, so no folder in it."""
    if not text or text in (".", "..") or "/" in text or os.sep in text:
        raise argparse.ArgumentTypeError(f"must be a file name without a folder (it names NAME.json and NAME.md "
                                         f"inside --out), got {text!r}")
    return text


def add_output_args(parser: argparse.ArgumentParser, name: str | None, default: str | None = None) -> None:
    """--out and --name; `default` describes a default name the script picks itself (name None)."""
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    parser.add_argument("--name", type=result_name, default=name,
                        help=f"writes NAME.json and NAME.md (default {default or name})")


def build_parser() -> argparse.ArgumentParser:
    """The arguments (`qpn bench` checks them before it looks for a GPU: a typo exits 2, not 3)."""
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", type=sections_arg(SECTIONS), default=",".join(SECTIONS),
                        help="comma-separated: " + ",".join(SECTIONS))
    parser.add_argument("--quick", action="store_true", help="two shapes only")
    add_output_args(parser, "h200")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    wanted = list(args.sections)
    if "ceiling" not in wanted:
        wanted.insert(0, "ceiling")  # every ratio needs it
    ctx = Context(args.quick)
    env = environment(ctx)
    print(f"{ctx.gpu_name}: {ctx.sm_count} SMs, L2 {ctx.l2_bytes / 2**20:.0f} MiB; {env['kernel_build']['built_as']}",
          flush=True)
    for name in wanted:
        sec = SECTIONS[name](ctx)
        ctx.sections.append(sec)
        print(render_markdown(env, [sec]).split("\n", 3)[-1], flush=True)  # the section's table
        env = environment(ctx)
        env["ceiling_gbps"] = dict(ctx.ceiling)
        json_path, md_path = write_results(env, ctx.sections, args.out, args.name)  # after every section
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
