"""The team builds (QPN_TEAM: qpn_mma.cuh) that bench_decode.py's team section explores (issue 25 parts 1 and
2): T warps share a K-slice's (decode builds) or a tile's (GEMM builds) decode through shared memory, each
multiplying its own 16 tokens. The ops launch none of these explored builds (the QPN8 team builds they run,
gemm.QPN8_TEAM, are tested in tests/test_cupy_gemm.py); these tests keep them honest while they stay in the
kernel text:

1. CPU: every explored build compiles for sm_75 at <= 64 registers (32 warps per Turing SM with its team
   slots, 1 KiB per warp of dynamic shared memory), its launch geometry is what its macros say, and it keeps
   the compile check's rules exactly where bench_decode's TEAM_*_BUILDS say so; elsewhere its only problem is
   the register spill that keeps it from shipping (pinned both ways).
2. GPU: each build gives the bits of the build it would replace (GEMM: the 64-token build), call for call
   (the same groups in the same order through the same mma per output): decode builds at M = 17-32 on layers
   split 8-16 ways inside a block (16-32 warps: teams sharing named barriers) and into parts, with a trailing
   slice shorter than the rest (pad rounds); GEMM builds at M = 17-200 (warps whose tokens lie past M), fp16
   and bf16 x.
Skips (with the reason) where the NVRTC wheels are absent (conftest's nvrtc fixture).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_cupy_gemm import run_gemm_build  # noqa: E402
from test_cupy_linear import G_SCALAR, activations_as, qpn2_buffers, qpn8_buffers  # noqa: E402
from test_gemm_ws import BD  # noqa: E402

from qpn.cupy_kernels import compile_check, gemm  # noqa: E402
from qpn.cupy_kernels import linear as L  # noqa: E402

SPILL_PROBLEMS = ("register spills", "stack frame")


def _builds() -> list[tuple[str, bool, tuple]]:
    """(format key, GEMM build?, bench config) of every explored team build."""
    return [(f, is_gemm, cfg) for is_gemm, cfgs in ((True, BD.TEAM_GEMM_BUILDS), (False, BD.TEAM_DECODE_BUILDS))
            for cfg in cfgs for f in ("qpn2", "qpn8")]


def _variant(build):
    fmt, is_gemm, (_, team, unroll, _) = build
    return BD.team_variant(fmt, team, unroll, is_gemm)


def _label(build) -> str:
    fmt, is_gemm, cfg = build
    return f"{fmt} {'gemm' if is_gemm else 'decode'} {cfg[0]}"


# ----------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("build", _builds(), ids=_label)
def test_team_build_compiles_for_turing(nvrtc, build):
    fmt, is_gemm, cfg = build
    variant = _variant(build)
    reports, _ = compile_check.check_variants((variant,), nvrtc=nvrtc)
    (report,) = [r for r in reports if r.arch == "sm_75"]
    assert report.stats is not None, f"{_label(build)}: {report.problems}"
    d = dict(variant.defines)
    team, tiles = int(d["QPN_TEAM"]), int(d["QPN_WARPS"])
    if fmt in cfg[3]:
        assert not report.problems, f"{_label(build)}: {report.problems}"
    else:  # the explored build that does not ship: its sm_75 build spills, and nothing else is wrong with it
        assert report.problems and all(p.startswith(SPILL_PROBLEMS) for p in report.problems), report.problems
    assert report.stats.registers <= 64
    warps = tiles * team  # decode builds: the most, 16 K-slices of a team each
    if is_gemm:
        assert gemm.build_geometry(variant.defines) == (tiles, 16 * team, 32 * warps)
    smem = report.stats.smem + L.team_shared_bytes(variant.defines, warps)
    occupancy = compile_check.occupancy_sm75(report.stats.registers, smem, warps)
    assert occupancy.blocks * warps == 32, f"{_label(build)}: {occupancy}"


def test_team_slots_are_a_kib_per_warp_and_tile():
    assert L.team_shared_bytes(L.QPN2_LINEAR[4, True].defines, 16) == 0  # no team: no slots
    assert L.team_shared_bytes((("QPN_GATED", "0"), ("QPN_TEAM", "2")), 32) == 32 * 1024
    assert L.team_shared_bytes((("QPN_GATED", "1"), ("QPN_TEAM", "4")), 32) == 64 * 1024  # gate and up tiles
    assert L.team_shared_bytes((("QPN_PAIR", "1"), ("QPN_TEAM", "8")), 16) == 32 * 1024  # two tiles per warp
    assert L.team_of(L.QPN2_LINEAR[4, False].defines) == 1


# ----------------------------------------------------------------------------- GPU

# (N, K): decode splits 8 and 16 K-slices per block, parts across blocks, and (QPN8, K = 2064: 129 groups) a
# trailing slice shorter than the others; GEMM: idle tile slots in the last block, K in parts
DECODE_SHAPES = {"qpn2": [(192, 4096), (4096, 2048), (1024, 1024)], "qpn8": [(192, 4096), (4096, 2064), (1024, 1024)]}
GEMM_SHAPES = [(192, 4096), (1024, 1024)]


def _weights(cp, fmt, rng, n, k):
    if fmt == "qpn2":
        codes, scales = qpn2_buffers(rng, n, k)
        return cp.asarray(codes), cp.asarray(scales), G_SCALAR
    codes, gs = qpn8_buffers(rng, n, k, block=False)
    return cp.asarray(codes), cp.asarray(gs)


@pytest.mark.gpu
@pytest.mark.parametrize("build", _builds(), ids=_label)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_team_build_gives_the_shipped_bits(cp, monkeypatch, build, dtype):
    from qpn.cupy_kernels import qpn2_gemm_linear, qpn2_linear, qpn8_gemm_linear, qpn8_linear

    fmt, is_gemm, _ = build
    rng = np.random.default_rng(5)
    if is_gemm:
        op = qpn2_gemm_linear if fmt == "qpn2" else qpn8_gemm_linear
        shapes, ms = GEMM_SHAPES, (17, 64, 100, 200)
    else:
        op = qpn2_linear if fmt == "qpn2" else qpn8_linear
        shapes, ms = DECODE_SHAPES[fmt], (17, 24, 29, 32)
    for n, k in shapes:
        weights = _weights(cp, fmt, rng, n, k)
        for m in ms:
            x = cp.asarray(activations_as(rng, m, k, dtype))
            if is_gemm:  # against the 64-token build (the ops run QPN8's own team build from M = 65)
                sixty_four = gemm.QPN2_GEMM[False] if fmt == "qpn2" else gemm.QPN8_GEMM[False, False]
                shipped = run_gemm_build(monkeypatch, sixty_four, op, x, *weights)
                team = run_gemm_build(monkeypatch, _variant(build), op, x, *weights)
            else:
                shipped = op(x, *weights).get()
                nb = -(-m // 8)
                table, key = (L.QPN2_LINEAR, (nb, False)) if fmt == "qpn2" else (L.QPN8_LINEAR, (nb, False, False))
                with monkeypatch.context() as patch:
                    patch.setitem(table, key, _variant(build))
                    team = op(x, *weights).get()
            assert np.array_equal(shipped.view(np.uint16), team.view(np.uint16)), (
                f"{_label(build)} N={n} K={k} M={m} {dtype}: not the shipped build's bits")
