"""Decode-kernel benchmark (qpn2_linear / qpn8_linear, M <= 32): a script for the GPU machine.

    python benchmarks/bench_decode.py [--sections ceiling,decode,variants,ablate,targets,gemm,l2rate] [--quick]
                                      [--shapes 4096x4096,...]
                                      [--out benchmarks/results] [--name decode_h200]

Uses bench_kernels.py's framework (the same ceiling kernel, CUDA-graph timing, L2-defeating
weight rotation, writer); bench_kernels.py does not import this file (one-way).

Per (N, K) of the part-1 shapes and M in {1, 2, 4, 8, 16, 32}: microseconds of the decode
kernels, effective GB/s on the bytes they must read (codes + scales + x, plus y written), % of
the streaming-read ceiling measured in the same run, speed-up over cuBLAS fp16 (cupy.matmul on
the same weights resident in fp16, fp32 accumulation), and the dense path (dequantize + cuBLAS)
at the same M. Correctness is checked before timing (qpn.ref.linear_bounds on the first two
tiles' columns of every call shape).

Section "l2rate" (issue 25): every decode build's K-loop rate with its weight resident in L2, in weight
bytes per SM per clock, against the rate each Turing card needs (T4: 5.03 at 1.59 GHz, 6.40 at 1.25):
the H200 cross-check of benchmarks/turing_model.py's estimates.

Weights: random codes; e4m3 block scales 0x28..0x7D (2^-2..416) times g = 1e-3, i.e. every
block on the fast decode path, as in real checkpoints (tests/test_decode_math.py: blocks whose
weights are all below 7.3e-4 take the exact fp32 path; `variants` times that case too).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from qpn.apps.arguments import Parser, integer_in
from qpn.benchmarks import ablate
from qpn.benchmarks import bench_kernels as bk
from qpn.ref.formats import QPN2

DECODE_MS = (1, 2, 4, 8, 16, 32)
G = 1e-3  # global scale: with e4m3 scales 0x28..0x7D every block is on the fast decode path


def _qpn2_copies(cp, n, k, slots, seed=0, tiny_fraction=0.0):
    """Random QPN2 buffers (random bytes are random in any byte order: no prepack needed)."""
    out = []
    for s in range(slots):
        rs = cp.random.RandomState(seed + s)
        codes = rs.randint(0, 256, size=(n, k // 2), dtype=cp.uint8)
        scales = rs.randint(0x28, 0x7E, size=(n, k // 16), dtype=cp.uint8)
        if tiny_fraction:
            scales = cp.where(rs.uniform(size=scales.shape) < tiny_fraction, cp.uint8(0x01), scales).astype(cp.uint8)
        out.append((codes, scales))
    return out


def _qpn8_copies(cp, n, k, slots, seed=0):
    """Random QPN8 buffers: e4m3 bytes without the NaN codes, channel scales S16 in [2^-6, 2^2]."""
    out = []
    for s in range(slots):
        rs = cp.random.RandomState(seed + s)
        codes = rs.randint(0, 256, size=(n, k), dtype=cp.uint8)
        codes = cp.where((codes & 0x7F) == 0x7F, codes - 1, codes).astype(cp.uint8)
        group_scales = cp.exp2(rs.uniform(-6.0, 2.0, size=(1, n))).astype(cp.float16)
        out.append((codes, group_scales))
    return out


def _buffers(ctx, n, k):
    """(rotation slots, {"qpn2": copies, "qpn8": copies}) of random [N, K] weights for timing."""
    slots = ctx.rotations(n * k // 2, minimum=2, maximum=16)
    return slots, {"qpn2": _qpn2_copies(ctx.cp, n, k, slots), "qpn8": _qpn8_copies(ctx.cp, n, k, slots)}


def _layer(ctx, n, k):
    """One layer's timing inputs: (rotation slots, QPN2 copies, QPN8 copies, resident fp16 W16 copies
    for cuBLAS (rotated, >= 4x L2), the QPN8 W16 for the checks, the dense path's fp16 workspace)."""
    from qpn.cupy_kernels import qpn2_dequantize, qpn8_dequantize

    slots, bufs = _buffers(ctx, n, k)
    q2, q8 = bufs["qpn2"], bufs["qpn8"]
    w_slots = ctx.rotations(2 * n * k, minimum=2, maximum=16)
    w16 = [qpn2_dequantize(*q2[i % slots], G, n, k) for i in range(w_slots)]
    return slots, q2, q8, w16, qpn8_dequantize(*q8[0], n, k), ctx.cp.empty((n, k), ctx.cp.float16)


def weight_bytes(fmt, n, k):
    """Bytes a decode call must read for its weight: the packed buffers of its format description
    (QPN2 codes + e4m3 block scales + per-tile global scales, QPN8 codes + fp16 channel scales)."""
    from qpn.ref.formats import BY_KEY

    return BY_KEY[fmt].weight_bytes(n, k)


def shipped_macros(fmt, nb):
    """The wrapper's own build for M <= 8 * nb (channel scales for QPN8), as a dict to override."""
    from qpn.cupy_kernels import linear as L

    return dict(L.decode_macros(fmt, nb, False))


def _check(ctx, what, y, x, w16_rows, n_check):
    """y[:, :n_check] inside qpn.ref.linear_bounds for the first n_check weight rows."""
    from qpn.ref import linear_bounds

    lo, hi = linear_bounds(x.get(), w16_rows[:n_check].get())
    got = y[:, :n_check].get()
    if not np.all((lo <= got) & (got <= hi)):
        raise AssertionError(f"{what}: outputs outside the fp32 accumulation bound; refusing to time a wrong kernel")


def _torch_linear_us(ctx, x, weights, reps: int = 7) -> float:
    """torch.nn.functional.linear (cuBLAS, fp16 in / fp32 accumulate) on the same fp16 weights,
    captured into a torch CUDA graph (cupy.matmul cannot be captured: its per-call Python cost
    would swamp small shapes) and replayed; median microseconds per call."""
    import statistics

    import torch
    import torch.nn.functional as F

    xt = torch.from_dlpack(x)
    wts = [torch.from_dlpack(w) for w in weights]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in wts:
            F.linear(xt, w)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for w in wts:
            F.linear(xt, w)
        end.record(stream)
        end.synchronize()
        estimate = start.elapsed_time(end) * 1000.0 / len(wts)
        calls = len(wts) * max(1, min(400, int(3000.0 / max(estimate, 0.5))) // len(wts))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                F.linear(xt, wts[i % len(wts)])
        times = []
        for _ in range(reps):
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / calls)
    torch.cuda.synchronize()
    return statistics.median(times)


def section_decode(ctx: bk.Context) -> bk.Section:
    """Decode kernels vs cuBLAS fp16 and vs the dense path, M in DECODE_MS."""
    from qpn.cupy_kernels import (
        qpn2_dense_linear,
        qpn2_linear,
        qpn8_dense_linear,
        qpn8_linear,
    )

    cp = ctx.cp
    read = ctx.ceiling["read"]
    g_dev = cp.full(1, G, dtype=cp.float32)  # device scalar: no host upload per call (graph capture)
    sec = bk.Section("decode", "Decode kernels (M <= 32) vs cuBLAS fp16 and the dense path, same weights", [
        bk.Column("n", "N"), bk.Column("k", "K"), bk.Column("m", "M"),
        bk.Column("qpn2_us", "qpn2 us", "{:.1f}"), bk.Column("qpn2_gbps", "qpn2 GB/s", "{:.0f}"),
        bk.Column("qpn2_pct", "qpn2 % ceil", "{:.1f}"), bk.Column("qpn2_x", "qpn2 x cuBLAS", "{:.2f}"),
        bk.Column("qpn8_us", "qpn8 us", "{:.1f}"), bk.Column("qpn8_gbps", "qpn8 GB/s", "{:.0f}"),
        bk.Column("qpn8_pct", "qpn8 % ceil", "{:.1f}"), bk.Column("qpn8_x", "qpn8 x cuBLAS", "{:.2f}"),
        bk.Column("cublas_us", "cuBLAS fp16 us", "{:.1f}"), bk.Column("cublas_pct", "cuBLAS % ceil", "{:.1f}"),
        bk.Column("dense2_us", "qpn2 dense us", "{:.1f}"), bk.Column("dense8_us", "qpn8 dense us", "{:.1f}"),
        bk.Column("method", "timing"),
    ])
    for n, k in ctx.shapes:
        slots, q2, q8, w16, w16_8, workspace = _layer(ctx, n, k)
        w_slots = len(w16)
        for m in DECODE_MS:
            x = (cp.random.RandomState(m).standard_normal((m, k)) * 0.5).astype(cp.float16)
            y = cp.empty((m, n), cp.float16)
            _check(ctx, f"qpn2_linear N={n} K={k} M={m}", qpn2_linear(x, *q2[0], g_dev, out=y), x, w16[0], 64)
            _check(ctx, f"qpn8_linear N={n} K={k} M={m}", qpn8_linear(x, *q8[0], out=y), x, w16_8, 64)
            io = 2 * m * k + 2 * m * n
            configs = {
                "qpn2": lambda i: qpn2_linear(x, *q2[i % slots], g_dev, out=y),
                "qpn8": lambda i: qpn8_linear(x, *q8[i % slots], out=y),
                "cublas": lambda i: cp.matmul(x, w16[i % w_slots].T, out=y),
                "dense2": lambda i: qpn2_dense_linear(x, *q2[i % slots], g_dev, out=y, workspace=workspace),
                "dense8": lambda i: qpn8_dense_linear(x, *q8[i % slots], out=y, workspace=workspace),
            }
            t = {name: ctx.time_calls(fn, slots if name != "cublas" else w_slots) for name, fn in configs.items()}
            us = {name: v["us"] for name, v in t.items()}
            try:  # the baseline: torch F.linear in a CUDA graph (cuBLAS without Python overhead)
                us["cublas"] = _torch_linear_us(ctx, x, w16)
                t["cublas"]["method"] = "torch graph"
            except Exception as exc:  # noqa: BLE001 - no torch: keep cupy.matmul's timing, say so
                sec.notes.append(f"torch F.linear timing failed ({type(exc).__name__}: {exc}); "
                                 "cuBLAS = cupy.matmul loop")
            row = {"n": n, "k": k, "m": m, **{f"{name}_us": v for name, v in us.items()},
                   "method": "/".join(sorted({v["method"] for v in t.values()})), "slots": slots}
            for name in ("qpn2", "qpn8"):
                row[f"{name}_gbps"] = bk.gbps(weight_bytes(name, n, k) + io, us[name])
                row[f"{name}_pct"] = 100.0 * row[f"{name}_gbps"] / read
                row[f"{name}_x"] = us["cublas"] / us[name]
            row["cublas_pct"] = 100.0 * bk.gbps(2 * n * k + io, us["cublas"]) / read
            sec.rows.append(row)
        del q2, q8, w16, w16_8, workspace
        cp.get_default_memory_pool().free_all_blocks()
    sec.notes.append(
        "GB/s = (weight bytes + x + y) / time: QPN2 0.5625 B/weight (codes + e4m3 scales), QPN8 1 B/weight; "
        "cuBLAS fp16 = torch.nn.functional.linear on the same W16 (2 B/weight, rotated copies >= 4x L2), "
        "timed as a replayed torch CUDA graph; the dense paths are timed in a launch loop (cuBLAS through "
        "cupy.matmul cannot be captured), so their small-shape times include Python launch overhead."
    )
    return sec


# Load-batch variants (groups per batch, blocks per SM the registers must allow) and K-split warp
# targets timed by "variants"; the wrapper's own choice is one of them.
PIPELINE_VARIANTS = {1: ((4, 2), (4, 1), (2, 2)), 4: ((4, 1), (2, 1), (1, 2))}
WARP_TARGETS = (4096, 8192)


def section_variants(ctx: bk.Context) -> bk.Section:
    """Load-pipeline and K-split variants at M = 1, 8 and 32 (correctness-checked, then timed)."""
    from qpn.cupy_kernels import linear as L

    def builds(fmt, m):
        nb = -(-m // 8)
        shipped = L.PIPELINE[fmt, nb, False]
        for pipe in PIPELINE_VARIANTS[nb]:
            for target in WARP_TARGETS:
                if target != L.TARGET_WARPS and pipe != shipped:
                    continue  # the warp target only around the shipped pipeline
                label = f"unroll {pipe[0]} blocks/SM {pipe[1]} target {target}"
                if pipe == shipped and target == L.TARGET_WARPS:
                    label += " (shipped)"
                yield label, {**shipped_macros(fmt, nb), **dict(L.pipeline_macros(*pipe))}, target

    return _build_rows(ctx, "variants", "Decode kernel variants: load batches (unroll, blocks/SM) and warp target",
                       ctx.shapes, (1, 8, 32), builds)


def _build_rows(ctx: bk.Context, name: str, title: str, shapes, ms, builds) -> bk.Section:
    """One row per decode-kernel build that builds(fmt, m) yields as (label, macros dict, warp target
    or None) on every shape and M: checked against the fp32 accumulation bound, then timed; a
    build that fails is a row saying why; a build equal to an earlier one of the same (fmt, m) is
    skipped."""
    from qpn.cupy_kernels import qpn2_dequantize, qpn8_dequantize

    cp = ctx.cp
    read = ctx.ceiling["read"]
    g_dev = cp.full(1, G, dtype=cp.float32)
    sec = bk.Section(name, title, [
        bk.Column("fmt", "format"), bk.Column("n", "N"), bk.Column("k", "K"), bk.Column("m", "M"),
        bk.Column("variant", "variant"), bk.Column("us", "us", "{:.1f}"), bk.Column("pct", "% ceil", "{:.1f}"),
    ])
    for n, k in shapes:
        slots, bufs = _buffers(ctx, n, k)
        w16 = {"qpn2": qpn2_dequantize(*bufs["qpn2"][0], G, n, k), "qpn8": qpn8_dequantize(*bufs["qpn8"][0], n, k)}
        for m in ms:
            x = (cp.random.RandomState(m).standard_normal((m, k)) * 0.5).astype(cp.float16)
            y = cp.empty((m, n), cp.float16)
            for fmt in ("qpn2", "qpn8"):
                seen = set()
                for label, macros, target in builds(fmt, m):
                    macros = tuple(sorted(macros.items()))
                    if (macros, target) in seen:
                        continue
                    seen.add((macros, target))
                    row = {"fmt": fmt, "n": n, "k": k, "m": m}
                    try:
                        t, split = _launch_variant(ctx, fmt, macros, n, k, m, bufs[fmt], x, y, slots, g_dev, target,
                                                   check=w16[fmt])
                    except Exception as exc:  # noqa: BLE001 - a variant that fails is a row, not a crash
                        sec.rows.append({**row, "variant": f"{label}: {exc}"[:120]})
                        continue
                    sec.rows.append({**row, "variant": f"{label} ({split})", "us": t["us"],
                                     "pct": 100.0 * bk.gbps(weight_bytes(fmt, n, k), t["us"]) / read})
        del bufs, w16
        cp.get_default_memory_pool().free_all_blocks()
    return sec


def _launch_variant(ctx, fmt, macros, n, k, m, bufs, x, y, slots, g_dev, target=None, check=None, source=None):
    """Time one macro build of a decode kernel through the wrapper's launch (x fragments where the
    build reads them, split-K reset, split and grid), the workspace allocated once as the torch op
    passes it; `target` overrides linear.TARGET_WARPS. With `check` (the W16 of bufs[0]), first
    verify its outputs against the fp32 accumulation bound. `source`: another kernel file (an
    ablation's path) instead of the shipped one."""
    from qpn.cupy_kernels import linear as L
    from qpn.cupy_kernels import workspace as W
    from qpn.cupy_kernels.loader import get_function
    from qpn.ref.formats import BY_KEY

    fn = get_function(str(source or ablate.kernel_source(fmt)), f"{fmt}_linear", macros)
    x_frag = dict(macros).get("QPN_X_FRAG") == "1"
    saved, L.TARGET_WARPS = L.TARGET_WARPS, target or L.TARGET_WARPS
    try:
        parts, split, gpw = L.decode_split(BY_KEY[fmt].format, n, k)
        split_k = sum(W.split_k_elements(parts, m, n, False))
        workspace = ctx.cp.empty((W.fragment_elements(m, k) if x_frag else 0) + split_k, ctx.cp.float32)

        def launch(i):
            if fmt == "qpn2":
                weights = (*bufs[i % slots], g_dev, np.int32(0))
            else:
                weights = (bufs[i % slots][0], bufs[i % slots][1], np.int32(0))
            L.launch_decode(BY_KEY[fmt], fn, weights, x, y, n, False, workspace, x_frag, macros)

        if check is not None:
            launch(0)
            _check(ctx, f"{fmt}_linear {dict(macros)} N={n} K={k} M={m}", y, x, check, 64)
        return ctx.time_calls(launch, slots), f"{parts}x{split}x{gpw}"
    finally:
        L.TARGET_WARPS = saved


# Split-K across blocks on the per-linear shapes of an 8B decoder (transformers' Llama: q / o 4096x4096, k / v
# 1024x4096, gate / up 14336x4096, down 4096x14336), where bench_model's linears alone run the QPN2 decode at
# ~29 % of the read ceiling (results/model_linears_h200.md): the shipped parts (split_k) against forced ones.
PARTS_SHAPES = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336))
PARTS = (1, 2, 4)


def _split_with_parts(split_k, parts: int):
    """split_k with `parts` blocks per tile in place of its own choice (its K-slices per block kept)."""
    from qpn.cupy_kernels.linear import split_in_parts

    def forced(n_tiles: int, groups: int, multiple: int, sms: int) -> tuple[int, int, int]:
        return split_in_parts(groups, parts, split_k(n_tiles, groups, multiple, sms)[1], multiple)

    return forced


def section_parts(ctx: bk.Context) -> bk.Section:
    """The decode kernels at M = 1, 8, 32 with 1, 2, 4 blocks per tile on PARTS_SHAPES (ctx.shapes if given),
    each checked against the fp32 accumulation bound, then timed (L2-cold rotation, CUDA graphs)."""
    from qpn.cupy_kernels import linear as L
    from qpn.cupy_kernels import qpn2_dequantize, qpn8_dequantize
    from qpn.ref.formats import BY_KEY

    cp = ctx.cp
    read = ctx.ceiling["read"]
    g_dev = cp.full(1, G, dtype=cp.float32)
    sec = bk.Section("parts", "Decode split-K across blocks (parts) on an 8B decoder's per-linear shapes", [
        bk.Column("fmt", "format"), bk.Column("n", "N"), bk.Column("k", "K"), bk.Column("m", "M"),
        bk.Column("split", "parts x warps x groups"), bk.Column("shipped", "shipped"),
        bk.Column("us", "us", "{:.1f}"), bk.Column("pct", "% ceil", "{:.1f}"),
    ])
    shapes = PARTS_SHAPES if list(ctx.shapes) == list(bk.QUICK_SHAPES if ctx.quick else bk.SHAPES) else ctx.shapes
    original = L.split_k
    for n, k in shapes:
        slots, bufs = _buffers(ctx, n, k)
        w16 = {"qpn2": qpn2_dequantize(*bufs["qpn2"][0], G, n, k), "qpn8": qpn8_dequantize(*bufs["qpn8"][0], n, k)}
        for m in (1, 8, 32):
            x = (cp.random.RandomState(m).standard_normal((m, k)) * 0.5).astype(cp.float16)
            y = cp.empty((m, n), cp.float16)
            for fmt in ("qpn2", "qpn8"):
                shipped = L.decode_split(BY_KEY[fmt].format, n, k)
                for parts in PARTS:
                    L.split_k = _split_with_parts(original, parts)
                    try:
                        t, split = _launch_variant(ctx, fmt, tuple(sorted(shipped_macros(fmt, -(-m // 8)).items())),
                                                   n, k, m, bufs[fmt], x, y, slots, g_dev, check=w16[fmt])
                    finally:
                        L.split_k = original
                    sec.rows.append({"fmt": fmt, "n": n, "k": k, "m": m, "split": split, "us": t["us"],
                                     "shipped": "yes" if split == "x".join(map(str, shipped)) else "",
                                     "pct": 100.0 * bk.gbps(weight_bytes(fmt, n, k), t["us"]) / read})
        del bufs, w16
        cp.get_default_memory_pool().free_all_blocks()
    return sec


# M = 9-32 (issue 13, part 1): where x comes from (rows of x, or fragments: x_fragments.cu) and the
# load batches (groups, blocks of 16 warps per SM the registers allow), around the shipped build.
# The exploration behind the shipped choice (tile slots sharing x, L2 prefetch, .cg weights,
# register caps): results/decode_m32_explore/README.md.
MID_VARIANTS = (  # (label, macros over the shipped build)
    ("shipped", ()),
    ("x rows", (("QPN_X_FRAG", "0"),)),
    ("4 groups, 1 block/SM", (("QPN_UNROLL", "4"), ("QPN_MIN_BLOCKS", "1"))),
    ("2 groups, 1 block/SM", (("QPN_UNROLL", "2"), ("QPN_MIN_BLOCKS", "1"))),
)
MID_MS = (1, 8, 16, 24, 32)
MID_SHAPES = ((28672, 8192), (34816, 5120), (5120, 17408))


def section_mid(ctx: bk.Context) -> bk.Section:
    """Decode-kernel builds at M = 1 .. 32 (correctness-checked, then timed): MID_VARIANTS."""

    def builds(fmt, m):
        for label, extra in MID_VARIANTS:
            yield label, {**shipped_macros(fmt, -(-m // 8)), **dict(extra)}, None

    shapes = [s for s in MID_SHAPES if s in ctx.shapes] or ctx.shapes
    title = "Decode kernels at M = 1-32: x rows or fragments, load batches"
    return _build_rows(ctx, "mid", title, shapes, MID_MS, builds)


# (format, label): where the time goes (method: leave one stage out). "full" is the shipped kernel;
# the others are source transforms of it (benchmarks/ablate), built with the shipped macros.
ABLATIONS = (("qpn2", "full"), *(a for a in ablate.ABLATIONS if a[0] == "qpn2"),
             ("qpn8", "full"), *(a for a in ablate.ABLATIONS if a[0] == "qpn8"))


def section_ablate(ctx: bk.Context) -> bk.Section:
    """Stage ablations at M = 1 (not correct outputs: timing only)."""
    cp = ctx.cp
    read = ctx.ceiling["read"]
    g_dev = cp.full(1, G, dtype=cp.float32)
    sec = bk.Section("ablate", "Decode kernel stage ablations (M = 1; timing only)", [
        bk.Column("fmt", "format"), bk.Column("n", "N"), bk.Column("k", "K"), bk.Column("variant", "variant"),
        bk.Column("split", "split"), bk.Column("us", "us", "{:.1f}"), bk.Column("pct", "% ceil", "{:.1f}"),
    ])
    for n, k in [(28672, 8192), (4096, 14336)]:
        slots, bufs = _buffers(ctx, n, k)
        x = (cp.random.RandomState(1).standard_normal((1, k)) * 0.5).astype(cp.float16)
        y = cp.empty((1, n), cp.float16)
        for fmt, label in ABLATIONS:
            source = None if label == "full" else ablate.write_source(fmt, label)
            macros = tuple(sorted(shipped_macros(fmt, 1).items()))
            t, split = _launch_variant(ctx, fmt, macros, n, k, 1, bufs[fmt], x, y, slots, g_dev, source=source)
            sec.rows.append({"fmt": fmt, "n": n, "k": k, "variant": label, "split": split, "us": t["us"],
                             "pct": 100.0 * bk.gbps(weight_bytes(fmt, n, k), t["us"]) / read})
        del bufs
        cp.get_default_memory_pool().free_all_blocks()
    return sec


# Issue 4's targets on shapes with >= 64 MB of quantized weight: (format, M, metric, threshold).
TARGETS = (("qpn2", 1, "pct", 85.0), ("qpn2", 8, "pct", 75.0), ("qpn2", 32, "x", 2.0),
           ("qpn8", 1, "pct", 85.0), ("qpn8", 8, "pct", 75.0))
SMALL_TARGET = ((4096, 4096), 1, "x", 2.0)  # 4096x4096 (fits in L2) at M = 1: >= 2x cuBLAS fp16
FLAT_TARGETS = ((16, 1.15), (32, 1.25))  # issue 13: time(M) / time(M = 1) at most
M32_VS_CUBLAS = {"qpn2": 1.4, "qpn8": 1.6}  # issue 13: M = 32 x cuBLAS fp16 at least


def section_targets(ctx: bk.Context) -> bk.Section:
    """Issues 4 and 13's targets checked against this run's "decode" rows (run that section first)."""
    sec = bk.Section("targets", "Targets (issues 4 and 13), from the decode rows of this run", [
        bk.Column("target", "target"), bk.Column("shape", "shape"), bk.Column("measured", "measured"),
        bk.Column("met", "met"),
    ])
    decode = next((sec_ for sec_ in ctx.sections if sec_.name == "decode"), None)
    if decode is None:
        sec.notes.append("no decode section in this run: nothing to check")
        return sec
    rows = {(r["n"], r["k"], r["m"]): r for r in decode.rows}

    def add(fmt, n, k, m, metric, threshold):
        row = rows.get((n, k, m))
        if row is None:
            return
        value = row[f"{fmt}_{metric}"]
        unit = "% of the read ceiling" if metric == "pct" else "x cuBLAS fp16"
        sec.rows.append({"target": f"{fmt.upper()} >= {threshold:g} {unit}, M={m}", "shape": f"{n}x{k}",
                         "measured": f"{value:.1f} %" if metric == "pct" else f"{value:.2f}x",
                         "met": "yes" if value >= threshold else "no"})

    for fmt, m, metric, threshold in TARGETS:
        for n, k in ctx.shapes:
            if weight_bytes(fmt, n, k) >= 64e6:
                add(fmt, n, k, m, metric, threshold)
    # issue 13: flat cost in M, and M = 32 against cuBLAS fp16
    for fmt in ("qpn2", "qpn8"):
        for n, k in ctx.shapes:
            if weight_bytes(fmt, n, k) < 64e6 or (n, k, 1) not in rows:
                continue
            for m, most in FLAT_TARGETS:
                if (n, k, m) in rows:
                    ratio = rows[n, k, m][f"{fmt}_us"] / rows[n, k, 1][f"{fmt}_us"]
                    target = f"{fmt.upper()} time(M={m}) <= {most:g} x time(M=1)"
                    sec.rows.append({"target": target, "shape": f"{n}x{k}", "measured": f"{ratio:.2f}x",
                                     "met": "yes" if ratio <= most else "no"})
            if (n, k, 32) in rows:
                add(fmt, n, k, 32, "x", M32_VS_CUBLAS[fmt])
    (n, k), m, metric, threshold = SMALL_TARGET
    for fmt in ("qpn2", "qpn8"):
        add(fmt, n, k, m, metric, threshold)
    # the decode/prefill threshold (decode_threshold): decode vs the dense path at every measured M
    ratios = [r[f"dense{f[-1]}_us"] / r[f"{f}_us"] for r in decode.rows for f in ("qpn2", "qpn8")]
    losing = sorted({(r["n"], r["k"], r["m"]) for r in decode.rows for f in ("qpn2", "qpn8")
                     if r[f"dense{f[-1]}_us"] < r[f"{f}_us"]})
    sec.notes.append(
        f"decode/prefill threshold: the decode kernels beat dequantize + cuBLAS by {min(ratios):.2f}x to "
        f"{max(ratios):.1f}x at every measured M <= 32 on every shape"
        + (f", except {losing}" if losing else "; decode_threshold keeps M <= 32 (the kernels' limit) for every shape")
    )
    return sec


GEMM_MS = (48, 64, 96, 128, 256, 512, 1024, 2048)
GEMM_SHAPES = ((28672, 8192), (34816, 5120), (5120, 17408), (14336, 4096), (4096, 14336))  # >= 64 MB, split-K


def section_gemm(ctx: bk.Context) -> bk.Section:
    """The fused-dequantize GEMM vs the dense path (dequantize + cuBLAS) and cuBLAS fp16, M in GEMM_MS,
    with the path the dispatch policy picks (torch_bridge/dispatch.py) and the faster one measured."""
    import torch

    from qpn.cupy_kernels import (
        qpn2_dense_linear,
        qpn2_gemm_linear,
        qpn8_dense_linear,
        qpn8_gemm_linear,
    )
    from qpn.ref.formats import QPN2
    from qpn.torch_bridge import dispatch

    cp = ctx.cp
    g_dev = cp.full(1, G, dtype=cp.float32)
    sec = bk.Section("gemm", "Fused-dequantize GEMM (M > 32) vs the dense path and cuBLAS fp16, same weights", [
        bk.Column("n", "N"), bk.Column("k", "K"), bk.Column("m", "M"),
        bk.Column("cublas_us", "cuBLAS fp16 us", "{:.1f}"),
        bk.Column("gemm2_us", "qpn2 GEMM us", "{:.1f}"), bk.Column("dense2_us", "qpn2 dense us", "{:.1f}"),
        bk.Column("gemm2_x", "qpn2 GEMM x cuBLAS", "{:.2f}"),
        bk.Column("gemm8_us", "qpn8 GEMM us", "{:.1f}"), bk.Column("dense8_us", "qpn8 dense us", "{:.1f}"),
        bk.Column("gemm8_x", "qpn8 GEMM x cuBLAS", "{:.2f}"),
        bk.Column("faster", "faster (qpn2/qpn8)"), bk.Column("picked", "dispatch picks"), bk.Column("method", "timing"),
    ])
    shapes = [s for s in GEMM_SHAPES if s in ctx.shapes] or ctx.shapes
    for n, k in shapes:
        slots, q2, q8, w16, w16_8, workspace = _layer(ctx, n, k)
        for m in GEMM_MS:
            x = (cp.random.RandomState(m).standard_normal((m, k)) * 0.5).astype(cp.float16)
            y = cp.empty((m, n), cp.float16)
            _check(ctx, f"qpn2_gemm_linear N={n} K={k} M={m}", qpn2_gemm_linear(x, *q2[0], g_dev, out=y), x, w16[0], 64)
            _check(ctx, f"qpn8_gemm_linear N={n} K={k} M={m}", qpn8_gemm_linear(x, *q8[0], out=y), x, w16_8, 64)
            configs = {
                "gemm2": lambda i: qpn2_gemm_linear(x, *q2[i % slots], g_dev, out=y),
                "gemm8": lambda i: qpn8_gemm_linear(x, *q8[i % slots], out=y),
                "dense2": lambda i: qpn2_dense_linear(x, *q2[i % slots], g_dev, out=y, workspace=workspace),
                "dense8": lambda i: qpn8_dense_linear(x, *q8[i % slots], out=y, workspace=workspace),
            }
            t = {name: ctx.time_calls(fn, slots) for name, fn in configs.items()}
            us = {name: v["us"] for name, v in t.items()}
            us["cublas"] = _torch_linear_us(ctx, x, w16)
            faster = "/".join("gemm" if us[f"gemm{f}"] < us[f"dense{f}"] else "dense" for f in "28")
            picked = dispatch.choose(torch.device("cuda"), QPN2, m, n, k, False)
            sec.rows.append({"n": n, "k": k, "m": m, **{f"{name}_us": v for name, v in us.items()},
                             "gemm2_x": us["cublas"] / us["gemm2"], "gemm8_x": us["cublas"] / us["gemm8"],
                             "faster": faster, "picked": picked,
                             "method": "/".join(sorted({v["method"] for v in t.values()})) + "/torch graph"})
        del q2, q8, w16, w16_8, workspace
        cp.get_default_memory_pool().free_all_blocks()
    sec.notes.append(
        "cuBLAS fp16 = torch.nn.functional.linear on the same W16 (rotated copies), a replayed torch CUDA graph; "
        "GEMM and dense = the CuPy wrappers in a CUDA graph (dense: cupy.matmul in a launch loop where capture "
        "fails); 'dispatch picks' = the path qpn's ops choose at that M (dispatch.choose on this GPU)."
    )
    return sec


# L2-resident rate (issue 25 part 4): each decode build's compute rate with its weight held in the
# H200's L2 (one copy, called back to back), in weight bytes per SM per clock, against the rate a
# Turing card must reach for DRAM, not the SMs, to set the pace: spec GB/s / (SMs x clock). The rate
# is the K loop's: the same N (so the same blocks and split, linear.split_k) at two K, the bytes and
# the time of the extra groups per warp (launch, prologue, epilogue and wave tail cancel; one call of
# these layers is only 3-7x a 3-4 us launch). (N, K1, K2): 16-warp blocks (256 tiles, ~2 blocks per
# SM) and 8-warp blocks (512 tiles, ~4 per SM), 8 more groups per warp, <= 34 MB of weight.
L2_PAIRS = ((8192, 2048, 4096), (16384, 1024, 2048))
L2_MS = (1, 8, 16, 24, 32)  # one per build (QPN_NB = ceil(M / 8)), M = 1 and 8 both on the M <= 8 build
TURING_NEEDS = (("T4 1.59 GHz", 320.0, 40, 1.59), ("T4 1.25 GHz", 320.0, 40, 1.25),
                ("2080 Ti", 616.0, 68, 1.545), ("RTX 8000", 672.0, 72, 1.77))  # (card, GB/s spec, SMs, GHz)


def turing_need(gbps_spec: float, sms: int, ghz: float) -> float:
    """Weight bytes per SM per clock at which a card's SMs keep up with its DRAM spec."""
    return gbps_spec / (sms * ghz)


class ClockSampler:
    """SM clock (MHz) sampled by `nvidia-smi -lms` while the block runs; `mhz` = the samples' median
    (None without nvidia-smi)."""

    def __enter__(self):
        import shutil
        import subprocess
        import tempfile

        self.samples: list[float] = []
        self._log = tempfile.TemporaryFile(mode="w+")
        exe = shutil.which("nvidia-smi")
        self._proc = None if exe is None else subprocess.Popen(
            [exe, "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-lms", "100"],
            stdout=self._log, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        self._log.seek(0)
        self.samples = [float(v) for v in self._log.read().split() if v.replace(".", "", 1).isdigit()]
        self._log.close()
        return False

    @property
    def mhz(self) -> float | None:
        import statistics

        return statistics.median(self.samples) if self.samples else None


def _qpn8_block_copy(cp, n, k, seed=0):
    """One QPN8 weight with 128x128 block scales: e4m3 codes without NaN, S16 in [2^-6, 2^2]."""
    rs = cp.random.RandomState(seed)
    codes = rs.randint(0, 256, size=(n, k), dtype=cp.uint8)
    codes = cp.where((codes & 0x7F) == 0x7F, codes - 1, codes).astype(cp.uint8)
    return codes, cp.exp2(rs.uniform(-6.0, 2.0, size=(k // 128, n // 32))).astype(cp.float16)


def section_l2rate(ctx: bk.Context) -> bk.Section:
    """Every decode build with its weight resident in L2: the K loop's weight bytes per SM-clock
    (two K, same N: L2_PAIRS) against what each Turing card needs."""
    from qpn.cupy_kernels import decode_workspace_size, qpn2_dequantize, qpn2_linear, qpn8_dequantize, qpn8_linear
    from qpn.cupy_kernels import linear as L

    cp = ctx.cp
    g_dev = cp.full(1, G, dtype=cp.float32)
    needs = {name: turing_need(*spec) for name, *spec in TURING_NEEDS}
    sec = bk.Section("l2rate", "Decode builds, weight resident in L2: the K loop's weight bytes per SM per clock", [
        bk.Column("fmt", "format"), bk.Column("gated", "gated"), bk.Column("n", "N"), bk.Column("ks", "K1 / K2"),
        bk.Column("m", "M"), bk.Column("split", "parts x warps x groups (K2)"),
        bk.Column("us", "us K1 / K2"), bk.Column("gbps", "loop GB/s", "{:.0f}"),
        bk.Column("vs_dram", "x read ceiling", "{:.2f}"), bk.Column("b_per_clk", "B/clk/SM", "{:.2f}"),
        bk.Column("call_b_per_clk", "whole call K2 B/clk/SM", "{:.2f}"), bk.Column("verdict", "vs T4 5.03 / 6.40"),
    ])
    rows = []
    with ClockSampler() as clock:
        for n, k1, k2 in L2_PAIRS:
            for fmt in ("qpn2", "qpn8", "qpn8_block"):
                family = "nvfp4" if fmt == "qpn2" else "fp8"  # the public format name the sizers take
                if weight_bytes(fmt, n, k2) > 0.8 * ctx.l2_bytes:
                    sec.notes.append(f"{fmt} {n}x{k2}: {weight_bytes(fmt, n, k2) / 1e6:.1f} MB > 0.8 x L2: skipped")
                    continue
                for gated in (False, True):
                    for m in L2_MS:
                        t, split = {}, ""
                        for k in (k1, k2):
                            if fmt == "qpn2":
                                a, b = _qpn2_copies(cp, n, k, 1)[0]
                            elif fmt == "qpn8":
                                a, b = _qpn8_copies(cp, n, k, 1)[0]
                            else:
                                a, b = _qpn8_block_copy(cp, n, k)
                            x = (cp.random.RandomState(m).standard_normal((m, k)) * 0.5).astype(cp.float16)
                            y = cp.empty((m, n // 2 if gated else n), cp.float16)
                            ws = cp.empty(max(1, decode_workspace_size(family, m, n, k, gated)), cp.float32)
                            if fmt == "qpn2":
                                def call(i, x=x, y=y, ws=ws, gated=gated, a=a, b=b):
                                    qpn2_linear(x, a, b, g_dev, out=y, gated=gated, workspace=ws)
                            else:
                                def call(i, x=x, y=y, ws=ws, gated=gated, a=a, b=b):
                                    qpn8_linear(x, a, b, out=y, gated=gated, workspace=ws)
                            call(0)
                            if not gated and fmt != "qpn8_block":  # gated / block scales: the GPU tests check them
                                w16 = qpn2_dequantize(a, b, G, n, k) if fmt == "qpn2" else qpn8_dequantize(a, b, n, k)
                                _check(ctx, f"{fmt} {n}x{k} M={m}", y, x, w16, 64)
                            t[k] = ctx.time_calls(call, 1)["us"]
                            parts, warps, gpw = L.decode_split(family, n, k)
                            split = f"{parts}x{warps}x{gpw}"
                        extra = weight_bytes(fmt, n, k2) - weight_bytes(fmt, n, k1)
                        rows.append({"fmt": fmt, "gated": "yes" if gated else "no", "n": n, "ks": f"{k1} / {k2}",
                                     "m": m, "split": split, "us": f"{t[k1]:.2f} / {t[k2]:.2f}",
                                     "us_k1": t[k1], "us_k2": t[k2], "bytes_k2": weight_bytes(fmt, n, k2),
                                     "gbps": bk.gbps(extra, t[k2] - t[k1]),
                                     "vs_dram": bk.gbps(extra, t[k2] - t[k1]) / ctx.ceiling["read"]})
                        cp.get_default_memory_pool().free_all_blocks()
    mhz = clock.mhz
    hz = (mhz or 1980.0) * 1e6
    for row in rows:
        row["clock_mhz"] = mhz
        row["b_per_clk"] = row["gbps"] * 1e9 / (ctx.sm_count * hz)
        row["call_b_per_clk"] = bk.gbps(row["bytes_k2"], row["us_k2"]) * 1e9 / (ctx.sm_count * hz)
        ok = [row["b_per_clk"] >= needs[c] for c in ("T4 1.59 GHz", "T4 1.25 GHz")]
        row["verdict"] = "above both" if all(ok) else "above 1.59 GHz's only" if ok[0] else "below both"
        sec.rows.append(row)
    sec.notes += [
        f"SM clock: median of {len(clock.samples)} nvidia-smi samples during the section: "
        + (f"{mhz:.0f} MHz (min {min(clock.samples):.0f}, max {max(clock.samples):.0f})" if mhz else
           "unavailable, 1980 MHz (boost) assumed"),
        "Loop rate = (weight bytes at K2 - at K1) / (time at K2 - at K1): the same blocks and split, 8 more groups "
        "per warp; B/clk/SM = that / (SMs x the clock). Whole call = all of K2's weight bytes / its time (launch, "
        "prologue, epilogue and wave tail included). A Turing card's SMs keep up with its DRAM spec at "
        + ", ".join(f"{name} {v:.2f}" for name, v in needs.items())
        + " B/clk/SM (spec GB/s / (SMs x clock)); GDDR6 streams ~80-90 % of spec, which lowers the need in "
        "proportion. The H200 runs the compute_75 PTX JIT-compiled for sm_90, with twice sm_75's fp32 / fp16x2 "
        "rate per SM: benchmarks/turing_model.py scales this rate to the T4's pipes for its estimate.",
        "x read ceiling: the loop rate over this run's DRAM read ceiling (> 1: faster than DRAM could feed it, "
        "the bytes came from L2). One weight copy, called back to back (no rotation); split = linear.split_k on "
        "this GPU's SM count.",
    ]
    return sec


# Issue 25 part 1: the warp-specialised GEMM builds (QPN_WS, qpn_mma.cuh) against the shipped GEMM build
# and cuBLAS fp16, same weights, same parts (gemm_split), so each build must give the shipped build's
# bits: checked on every row before it is timed. Builds: (label, NT tiles = producer warps, CZ consumer
# warps per tile, ring stages, groups per batch, blocks per SM the registers must allow, batches in flight).
WS_BUILDS = (("ws 4x1 d2", 4, 1, 2, 2, 2, 2, 0), ("ws 4x1 d4", 4, 1, 2, 2, 2, 4, 0),
             ("raw 4x1 d4", 4, 1, 2, 2, 2, 4, 1), ("raw 4x1 s4 d4", 4, 1, 4, 2, 2, 4, 1),
             ("raw 4x2 d4", 4, 2, 2, 2, 1, 4, 1), ("raw 8x1 d2", 8, 1, 2, 2, 1, 2, 1))
WS_MS = (64, 128, 256)
WS_SHAPES = ((28672, 8192), (14336, 4096), (4096, 4096))


def ws_variant(fmt_key: str, cfg: tuple, gated: bool = False):
    """The warp-specialised build of a WS_BUILDS entry over the shipped GEMM build's macros (gemm.gemm_macros)
    of format family fmt_key ("qpn2", "qpn8", "qpn8_block"); tests/test_gemm_ws.py checks each."""
    from qpn.cupy_kernels import gemm
    from qpn.cupy_kernels.variants import KernelVariant
    from qpn.ref.formats import BY_KEY

    _, nt, cz, stages, unroll, min_blocks, depth, raw = cfg
    macros = dict(gemm.gemm_macros(BY_KEY[fmt_key], gated))
    macros.update(QPN_WS="1", QPN_WS_CZ=str(cz), QPN_WS_STAGES=str(stages), QPN_WARPS=str(nt),
                  QPN_UNROLL=str(unroll), QPN_MIN_BLOCKS=str(min_blocks), QPN_WS_DEPTH=str(depth))
    if raw:  # QPN8 only: producers copy the codes, consumers decode (QPN_WS_RAW)
        macros["QPN_WS_RAW"] = "1"
    source = "qpn2_linear.cu" if fmt_key == "qpn2" else "qpn8_linear.cu"
    return KernelVariant(source, source[:-3], tuple(sorted(macros.items())), archs=("sm_75",))


def section_gemm_ws(ctx: bk.Context) -> bk.Section:
    """Warp-specialised GEMM builds vs the shipped GEMM build and cuBLAS fp16 (QPN2 and QPN8, M in WS_MS)."""
    from qpn.cupy_kernels import gemm
    from qpn.ref.formats import QPN2, QPN8

    cp = ctx.cp
    g_dev = cp.full(1, G, dtype=cp.float32)
    builds = [("shipped", None)] + [(cfg[0], cfg) for cfg in WS_BUILDS]
    sec = bk.Section("gemm_ws", "Warp-specialised GEMM builds (QPN_WS) vs the shipped GEMM build, us", [
        bk.Column("n", "N"), bk.Column("k", "K"), bk.Column("m", "M"), bk.Column("fmt", "format"),
        bk.Column("cublas_us", "cuBLAS fp16 us", "{:.1f}"),
        *[bk.Column(f"b{i}_us", label, "{:.1f}") for i, (label, _) in enumerate(builds)],
        bk.Column("best", "best build"), bk.Column("best_x", "best x cuBLAS", "{:.2f}"),
        bk.Column("mma_frac", "best / m16n8k8 rate", "{:.2f}"),
        bk.Column("wrong", "builds whose bits differ (not timed)"),
    ])
    shapes = [s for s in WS_SHAPES if s in ctx.shapes] or ctx.shapes
    for n, k in shapes:
        slots, q2, q8, w16, _, _ = _layer(ctx, n, k)
        for m in WS_MS:
            x = (cp.random.RandomState(m).standard_normal((m, k)) * 0.5).astype(cp.float16)
            cublas = _torch_linear_us(ctx, x, w16)
            for wf, bufs in ((QPN2, q2), (QPN8, q8)):
                size = max(gemm.gemm_workspace_size(wf.format, m, n, k), 1) + 4096  # + tickets of any geometry
                workspace = cp.empty(size, cp.float32)
                ys = [cp.empty((m, n), cp.float16) for _ in builds]
                variants = [(wf.key == "qpn2" and gemm.QPN2_GEMM[False] or gemm.QPN8_GEMM[False, False])
                            if cfg is None else None if cfg[-1] and wf is QPN2 else ws_variant(wf.key, cfg)
                            for _, cfg in builds]

                def call(i, b, y):
                    w = bufs[i % slots]
                    weights = (*w, g_dev, np.int32(0)) if wf is QPN2 else (w[0], w[1], np.int32(0))
                    gemm.launch_gemm(wf, variants[b], weights, x, y, n, False, workspace)

                row = {"n": n, "k": k, "m": m, "fmt": wf.key, "cublas_us": cublas, "wrong": ""}
                for b, y in enumerate(ys):  # every build on the same weights first (timing rotates them)
                    if variants[b] is None:
                        continue
                    call(0, b, y)
                    if b and not bool((ys[0].view(cp.uint16) == y.view(cp.uint16)).all()):
                        row["wrong"] = row.get("wrong", "") + builds[b][0] + ";"  # not timed: a wrong kernel
                        variants[b] = None
                for b, y in enumerate(ys):
                    row[f"b{b}_us"] = (float("nan") if variants[b] is None
                                       else ctx.time_calls(lambda i, b=b, y=y: call(i, b, y), slots)["us"])
                best = min((b for b in range(len(builds)) if variants[b] is not None), key=lambda b: row[f"b{b}_us"])
                row.update(best=builds[best][0], best_x=cublas / row[f"b{best}_us"],
                           mma_frac=2.0 * m * n * k / (row[f"b{best}_us"] * 1e-6) / MMA_RATE)
                sec.rows.append(row)
                print(" ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row.values()), flush=True)
        del q2, q8, w16
        cp.get_default_memory_pool().free_all_blocks()
    sec.notes.append("bits: every build's output equals the shipped build's (same parts); cuBLAS fp16 = "
                     "F.linear on the same W16 in a torch CUDA graph; m16n8k8 rate = MMA_RATE (mma_rate.py)")
    return sec


MMA_RATE = 472e12  # m16n8k8 f32-accumulate FLOP/s measured on the H200 (benchmarks/mma_rate.py)


# Issue 25 parts 1 and 2: team builds (QPN_TEAM, qpn_mma.cuh): T warps share a tile's decode through shared
# memory, each multiplying its own 16 tokens, against the shipped build they replace, same weights and split,
# so each must give the shipped build's bits (checked before it is timed). GEMM builds (M = 64-256) and decode
# builds (M = 17-32, against the shipped nb = 3 / 4 build): (label, T, groups per batch, the formats whose sm_75
# build keeps the compile check's rules: 64 registers, no spills; tests/test_team_builds.py pins both ways).
TEAM_GEMM_BUILDS = (("team 4 u1", 4, 1, ("qpn8",)), ("team 4 u2", 4, 2, ("qpn8",)), ("team 4 u4", 4, 4, ("qpn8",)),
                    ("team 8 u1", 8, 1, ("qpn8",)), ("team 8 u2", 8, 2, ("qpn8",)))
TEAM_DECODE_BUILDS = (("team 2 u1", 2, 1, ("qpn2", "qpn8")), ("team 2 u2", 2, 2, ()))
# gated QPN2 and QPN8 (the 64-token build's gated form multiplies 32 tokens per pass): (label, T, groups per batch,
# tile slots per block: 16 warps, <= 128 registers, all spill-free on sm_75)
TEAM_GATED_BUILDS = (("gated team 4", 4, 1, 4), ("gated team 8 u1", 8, 1, 2), ("gated team 8 u2", 8, 2, 2))
TEAM_GEMM_MS = (64, 96, 128, 256)
TEAM_DECODE_MS = (24, 32)


def team_variant(fmt_key: str, team: int, unroll: int, gemm_build: bool, gated: bool = False, slots: int = 0):
    """A team build (16 tokens per warp and tile) of format family fmt_key over the 64-token GEMM build's macros
    (gemm_build; `slots` tiles per block, default 32 warps at 64 registers) or the shipped M = 25-32 decode
    build's."""
    from qpn.cupy_kernels import gemm
    from qpn.cupy_kernels import linear as L
    from qpn.cupy_kernels.variants import KernelVariant
    from qpn.ref.formats import BY_KEY

    if gemm_build:
        macros = dict(gemm.gemm_macros(BY_KEY[fmt_key], gated))
        macros.update(QPN_WARPS=str(slots or 32 // team))  # tiles per block
    else:
        macros = dict(L.decode_macros(fmt_key, 4, False))
        macros.update(QPN_WARPS=str(L.MAX_WARPS), QPN_X_FRAG="1")
    macros.update(QPN_TEAM=str(team), QPN_NB="2", QPN_MIN_BLOCKS="1", QPN_UNROLL=str(unroll))
    source = "qpn2_linear.cu" if fmt_key == "qpn2" else "qpn8_linear.cu"
    return KernelVariant(source, source[:-3], tuple(sorted(macros.items())), archs=("sm_75",))


def section_team(ctx: bk.Context) -> bk.Section:
    """Team builds vs the 64-token GEMM build (M = 64-256; gated QPN8: its 32-token form) and the shipped decode
    build (M = 24, 32), and cuBLAS fp16."""
    from qpn.cupy_kernels import gemm
    from qpn.cupy_kernels import linear as L
    from qpn.cupy_kernels.loader import kernel
    from qpn.ref.formats import QPN2, QPN8

    cp = ctx.cp
    g_dev = cp.full(1, G, dtype=cp.float32)
    sec = bk.Section("team", "Team builds (QPN_TEAM) vs the shipped builds, us", [
        bk.Column("n", "N"), bk.Column("k", "K"), bk.Column("m", "M"), bk.Column("fmt", "format"),
        bk.Column("cublas_us", "cuBLAS fp16 us", "{:.1f}"), bk.Column("m1_us", "shipped M=1 us", "{:.1f}"),
        bk.Column("shipped_us", "baseline us", "{:.1f}"), bk.Column("builds", "team builds: us (x baseline)"),
        bk.Column("best_x", "best x cuBLAS", "{:.2f}"), bk.Column("best_m1", "best / M=1", "{:.2f}"),
        bk.Column("wrong", "builds whose bits differ (not timed)"),
    ])
    shapes = [s for s in WS_SHAPES if s in ctx.shapes] or ctx.shapes
    for n, k in shapes:
        slots, q2, q8, w16, _, _ = _layer(ctx, n, k)
        x1 = (cp.random.RandomState(1).standard_normal((1, k)) * 0.5).astype(cp.float16)
        for m in (*TEAM_DECODE_MS, *TEAM_GEMM_MS):
            is_gemm = m > L.MAX_M
            x = (cp.random.RandomState(m).standard_normal((m, k)) * 0.5).astype(cp.float16)
            cublas = _torch_linear_us(ctx, x, w16)
            gated_rows = ((QPN2, q2, True), (QPN8, q8, True)) if is_gemm else ()
            for wf, bufs, gated in ((QPN2, q2, False), (QPN8, q8, False), *gated_rows):
                nb = -(-m // 8)
                # the build a team build would replace: the 64-token GEMM build (gated: 32) or the decode build
                shipped = ((gemm.QPN2_GEMM[gated] if wf is QPN2 else gemm.QPN8_GEMM[gated, False]) if is_gemm
                           else (L.QPN2_LINEAR[nb, False] if wf is QPN2 else L.QPN8_LINEAR[nb, False, False]))
                if gated:
                    teams = [team_variant(wf.key, t, u, True, True, sl) for _, t, u, sl in TEAM_GATED_BUILDS]
                    labels = ["GEMM-32"] + [c[0] for c in TEAM_GATED_BUILDS]
                else:
                    cfgs = TEAM_GEMM_BUILDS if is_gemm else TEAM_DECODE_BUILDS
                    teams = [team_variant(wf.key, t, u, is_gemm) for _, t, u, _ in cfgs]
                    labels = ["GEMM-64" if is_gemm else "shipped"] + [c[0] for c in cfgs]
                    if is_gemm and wf is QPN8:  # the paired team of 8 the ops run where N % 64 == 0 (gemm.py)
                        teams.append(gemm.QPN8_TEAM[False, False, 8, True])
                        labels.append("team 8 pair")
                variants = [shipped, *teams]
                size = (max(gemm._workspace_ends(wf, m, n, k, gated, False, v)[-1] for v in variants) if is_gemm
                        else L.decode_workspace_size(wf.format, m, n, k)) + 4096
                workspace = cp.empty(size, cp.float32)

                def call(i, v, y, xx=x, gated=gated):
                    w = bufs[i % slots]
                    weights = (*w, g_dev, np.int32(0)) if wf is QPN2 else (w[0], w[1], np.int32(0))
                    if dict(v.defines).get("QPN_GEMM") == "1":
                        gemm.launch_gemm(wf, v, weights, xx, y, n, gated, workspace)
                    else:
                        L.launch_decode(wf, kernel(v), weights, xx, y, n, False, workspace, xx.shape[0] > 8,
                                        v.defines)

                ys = [cp.empty((m, n // 2 if gated else n), cp.float16) for _ in variants]
                row = {"n": n, "k": k, "m": m, "fmt": wf.key + (" gated" if gated else ""), "cublas_us": cublas,
                       "wrong": ""}
                y1 = cp.empty((1, n), cp.float16)
                m1 = L.QPN2_LINEAR[1, False] if wf is QPN2 else L.QPN8_LINEAR[1, False, False]
                row["m1_us"] = ctx.time_calls(lambda i: call(i, m1, y1, x1), slots)["us"]
                live = []
                for b, (v, y) in enumerate(zip(variants, ys, strict=True)):
                    call(0, v, y)
                    if b and not bool((ys[0].view(cp.uint16) == y.view(cp.uint16)).all()):
                        row["wrong"] += labels[b] + ";"
                        continue
                    live.append(b)
                us = {b: ctx.time_calls(lambda i, v=variants[b], y=ys[b]: call(i, v, y), slots)["us"] for b in live}
                row["shipped_us"] = us[0]
                row["builds"] = "; ".join(f"{labels[b]} {us[b]:.1f} ({us[b] / us[0]:.2f})" for b in live if b)
                best = min(us.values())
                row.update(best_x=cublas / best, best_m1=best / row["m1_us"])
                sec.rows.append(row)
                print(" | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row.values()), flush=True)
        del q2, q8, w16
        cp.get_default_memory_pool().free_all_blocks()
    sec.notes.append("baseline: the build a team build replaces -- GEMM rows the 64-token GEMM build (GEMM-64; gated: "
                     "GEMM-32, its gated form), decode rows the shipped M = 17-32 decode build; bits: every team "
                     "build's output equals the baseline's (same split / parts); cuBLAS fp16 = F.linear on the same "
                     "W16 (gated rows: the plain layer) in a torch CUDA graph; M=1: the shipped plain decode build")
    return sec


SECTIONS = {"ceiling": bk.section_ceiling, "decode": section_decode, "variants": section_variants,
            "ablate": section_ablate, "mid": section_mid, "targets": section_targets, "gemm": section_gemm,
            "l2rate": section_l2rate, "gemm_ws": section_gemm_ws, "team": section_team, "parts": section_parts}


# --shapes: every layer is built in both layouts, so K must suit QPN2 (the stricter); N and K up to 2^17 (the
# largest benchmarked layer, 28672 x 8192, is well inside; 2^17 x 2^17 fp16 already needs 32 GiB)
SHAPE_K_MULTIPLE = QPN2.k_multiple
MAX_SHAPE_DIM = 1 << 17


def shapes_arg(text: str) -> list[tuple[int, int]]:
    """argparse type of --shapes: comma-separated N x K."""
    shapes = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        n_text, x, k_text = item.partition("x")
        if not x:
            raise argparse.ArgumentTypeError(f"{item!r} is not N x K (e.g. 4096x4096)")
        try:
            n, k = (integer_in(1, MAX_SHAPE_DIM, "N and K")(v) for v in (n_text, k_text))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{item!r}: {exc} (N x K, e.g. 4096x4096)") from None
        if k % SHAPE_K_MULTIPLE:
            raise argparse.ArgumentTypeError(f"{item!r}: K must be a multiple of {SHAPE_K_MULTIPLE} (QPN2), got {k}")
        shapes.append((n, k))
    if not shapes:
        raise argparse.ArgumentTypeError(f"give one or more N x K, e.g. 4096x4096, got {text!r}")
    return shapes


def build_parser() -> argparse.ArgumentParser:
    """The arguments (`qpn bench` checks them before it looks for a GPU: a typo exits 2, not 3)."""
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", type=bk.sections_arg(SECTIONS), default="ceiling,decode,variants,ablate,targets",
                        help="comma-separated: " + ",".join(SECTIONS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shapes", type=shapes_arg, default=None,
                        help="N x K list, e.g. 4096x4096,5120x17408 (default: all)")
    bk.add_output_args(parser, "decode_h200")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    wanted = list(args.sections)
    if "ceiling" not in wanted:
        wanted.insert(0, "ceiling")
    ctx = bk.Context(args.quick)
    if args.shapes:
        ctx.shapes = args.shapes
    env = bk.environment(ctx)
    print(f"{ctx.gpu_name}: {ctx.sm_count} SMs; {env['kernel_build']['built_as']}", flush=True)
    for name in wanted:
        sec = SECTIONS[name](ctx)
        ctx.sections.append(sec)
        print(bk.render_markdown(env, [sec]).split("\n", 3)[-1], flush=True)
        env = bk.environment(ctx)
        env["ceiling_gbps"] = dict(ctx.ceiling)
        json_path, md_path = bk.write_results(env, ctx.sections, args.out, args.name)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
