"""The warp-specialised GEMM builds (QPN_WS, QPN_WS_RAW: qpn_mma.cuh) that bench_decode.py's gemm_ws section
explores (issue 25 part 1). They are not what the ops launch; these tests keep them honest while they stay
in the kernel text:

1. CPU: every explored build, and the gated and block-scale builds of the first, compiles for sm_75 under the
   compile check's rules (no spills, no stack, static shared memory <= 48 KiB, Turing PTX only), and its launch
   geometry (gemm.build_geometry) is what its macros say: QPN_WARPS producers + QPN_WS_CZ consumers per tile.
2. GPU: each build gives the shipped GEMM build's bits, call for call (same parts, the same fp32 operations per
   output: the module docstring of qpn_mma.cuh's QPN_WS), on a block whose last tile slots are idle, K split
   into parts, token counts that leave a partial chunk, plain and gated, fp16 and bf16 x.
Skips (with the reason) where the NVRTC wheels are absent (conftest's nvrtc fixture).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_cupy_gemm import run_gemm_build  # noqa: E402
from test_cupy_linear import G_SCALAR, activations_as, qpn2_buffers, qpn8_buffers  # noqa: E402

from qpn.cupy_kernels import compile_check, gemm  # noqa: E402
from qpn.cupy_kernels.variants import KernelVariant  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench_decode():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_decode", BENCH / "bench_decode.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


BD = _bench_decode()
FORMATS = ("qpn2", "qpn8", "qpn8_block")


def _builds() -> list[tuple[str, bool, tuple]]:
    """(format key, gated, bench config): every explored build, plus gated / block scales of the first."""
    out = [(f, False, cfg) for cfg in BD.WS_BUILDS for f in ("qpn2", "qpn8") if not (cfg[-1] and f == "qpn2")]
    first = BD.WS_BUILDS[0]
    out += [("qpn2", True, first), ("qpn8", True, first), ("qpn8_block", False, first)]
    return out


def _variant(fmt: str, gated: bool, cfg: tuple) -> KernelVariant:
    return BD.ws_variant(fmt, cfg, gated)


def _label(build) -> str:
    fmt, gated, cfg = build
    return f"{fmt}{' gated' if gated else ''} {cfg[0]}"


# ----------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("build", _builds(), ids=_label)
def test_ws_build_compiles_for_turing_within_the_rules(nvrtc, build):
    variant = _variant(*build)
    reports, _ = compile_check.check_variants((variant,), nvrtc=nvrtc)
    (report,) = [r for r in reports if r.arch == "sm_75"]
    assert not report.problems, f"{_label(build)}: {report.problems}"
    d = dict(variant.defines)
    tiles, chunks = int(d["QPN_WARPS"]), int(d["QPN_WS_CZ"])
    warps = tiles * (1 + chunks)
    assert gemm.build_geometry(variant.defines) == (tiles, 8 * int(d["QPN_NB"]) * chunks, 32 * warps)
    occupancy = compile_check.occupancy_sm75(report.stats.registers, report.stats.smem, warps)
    assert occupancy.blocks >= 1, f"{_label(build)}: does not fit a Turing SM ({occupancy})"


def test_shipped_gemm_geometry_is_a_warp_per_tile():
    """The one-pass GEMM builds (gemm_macros; the team builds' geometry: tests/test_cupy_gemm.py)."""
    team_builds = {*gemm.QPN8_TEAM.values(), *gemm.QPN2_TEAM.values()}
    for variant in (v for v in gemm.KERNEL_VARIANTS if v not in team_builds):
        d = dict(variant.defines)
        assert gemm.build_geometry(variant.defines) == (gemm.GEMM_WARPS, 8 * int(d["QPN_NB"]), 32 * gemm.GEMM_WARPS)


# ----------------------------------------------------------------------------- GPU

# (N, K): 6 tile slots (a 4-tile block with 2 idle producers and their consumers) and K split into parts on any
# GPU of more than 2 SMs; 32 slots in one part
SHAPES = [(192, 4096), (1024, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("build", _builds(), ids=_label)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ws_build_gives_the_shipped_bits(cp, monkeypatch, build, dtype):
    """Against the one-pass GEMM build at every M (the ops run QPN8's team builds from M = 65, gated 33)."""
    from qpn.cupy_kernels import qpn2_gemm_linear, qpn8_gemm_linear

    fmt, gated, cfg = build
    rng = np.random.default_rng(11)
    for n, k in SHAPES:
        n_rows = 2 * n if gated else n
        if fmt == "qpn2":
            codes, scales = qpn2_buffers(rng, n_rows, k)
            op, weights = qpn2_gemm_linear, (cp.asarray(codes), cp.asarray(scales), G_SCALAR)
            one_pass = gemm.QPN2_GEMM[bool(gated)]
        else:
            codes, gs = qpn8_buffers(rng, n_rows, k, block=fmt == "qpn8_block")
            op, weights = qpn8_gemm_linear, (cp.asarray(codes), cp.asarray(gs))
            one_pass = gemm.QPN8_GEMM[bool(gated), fmt == "qpn8_block"]
        for m in (17, 64, 100):
            x = cp.asarray(activations_as(rng, m, k, dtype))
            shipped = run_gemm_build(monkeypatch, one_pass, op, x, *weights, gated=gated)
            ws = run_gemm_build(monkeypatch, _variant(fmt, gated, cfg), op, x, *weights, gated=gated)
            assert np.array_equal(shipped.view(np.uint16), ws.view(np.uint16)), (
                f"{_label(build)} N={n_rows} K={k} M={m} {dtype}: not the shipped build's bits")
