"""The fused-dequantize GEMM (cupy_kernels/gemm.py): the decode kernels' GEMM build, M = 33-512.

1. Accuracy contract: y inside qpn.ref.linear_bounds(x, W16) for the contract's W16, for every M of
   a sweep that crosses the decode / GEMM / dense thresholds, plain and ragged shapes (tile slots
   that do not fill the last block, K split into parts, a partial last token block).
2. Batch invariance within the GEMM: row i of an M-row call equals the row computed alone by the
   GEMM and inside calls of other M, bit for bit (the split depends on N, K and the SM count only).
   The decode kernels (M <= 32) split K differently: their rows agree within the bound, not bitwise
   (gemm.py's docstring says why).
3. Gated: silu_and_mul on the plain GEMM's gate / up outputs.
4. The torch ops run the path dispatch.choose picks, bit-equal to that kernel's direct call.
5. CPU: the split never depends on M and covers K in whole batches; every GEMM build is in the
   Turing compile check's registry.
The sanitizer run: `--drive` at the bottom (tests/test_cupy_sanitizer.py style).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_cupy_linear import (  # noqa: E402  (the decode kernels' data and checks)
    G_SCALAR,
    activations,
    activations_as,
    assert_gated_matches,
    assert_in_bounds,
    check_gated,
    qpn2_buffers,
    qpn8_buffers,
)

from qpn.ref import qpn2_dequantize, qpn8_dequantize  # noqa: E402

GEMM_MS = (33, 40, 63, 64, 65, 96, 128, 200, 257)
# (N, K): one block of 8 slots; 3 slots (a block with 5 idle warps); ragged slots (12 tiles: 1.5 blocks);
# K split into parts on any GPU of more than 2 SMs (few tiles, many groups)
SHAPES = [(256, 512), (96, 1024), (384, 192), (64, 8192)]
QPN8_CASES = [(256, 512, False), (96, 1024, False), (384, 256, True), (128, 8192, True), (64, 2064, False)]


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16)


def run_gemm_build(monkeypatch, variant, op, *args, **kwargs) -> np.ndarray:
    """op(*args, **kwargs) (a GEMM wrapper) with the GEMM build `variant` in place of the one gemm.gemm_variant
    picks for the call's M and N, as a host array."""
    from qpn.cupy_kernels import gemm

    with monkeypatch.context() as patch:
        patch.setattr(gemm, "gemm_variant", lambda wf, gated, m, n: variant)
        return op(*args, **kwargs).get()


# ----------------------------------------------------------------------------- CPU


def test_split_covers_k_in_whole_batches_and_ignores_m():
    from qpn.cupy_kernels.gemm import GEMM_MAX_PARTS, GEMM_MIN_GROUPS_PER_PART, gemm_split

    for tiles in (1, 3, 12, 160, 896, 1088):
        for groups in (4, 12, 64, 129, 320, 512, 1088):
            for multiple in (1, 4):
                if groups % multiple:
                    continue
                for sms in (0, 40, 132):
                    parts, per_part = gemm_split(tiles, groups, multiple, sms)
                    assert 1 <= parts <= GEMM_MAX_PARTS and per_part % multiple == 0
                    assert (parts - 1) * per_part < groups <= parts * per_part  # every part holds groups
                    assert parts == 1 or per_part >= GEMM_MIN_GROUPS_PER_PART


def test_threshold_by_card_and_format(monkeypatch):
    """Turing: the model's crossovers (QPN2 512, QPN8 512 where its team build pairs tiles, N % 64 == 0, else
    256); newer cards: the H200's measured 64; never below the decode kernels' 32; the arguments are checked as
    decode_threshold's."""
    from qpn.cupy_kernels import gemm

    for major, want in ((7, {"nvfp4": 512, "fp8": 512}), (9, {"nvfp4": 64, "fp8": 64}), (12, {"nvfp4": 64, "fp8": 64})):
        monkeypatch.setattr(gemm, "_device", lambda major=major: (40, major))
        assert {fmt: gemm.gemm_threshold(fmt, 4096, 4096) for fmt in want} == want
    monkeypatch.setattr(gemm, "_device", lambda: (40, 7))
    assert (gemm.gemm_threshold("fp8", 4096 + 32, 4096), gemm.gemm_threshold("nvfp4", 4096 + 32, 4096)) == (256, 512)
    monkeypatch.setattr(gemm, "_device", lambda: (132, 9))  # the H200
    assert gemm.gemm_threshold("nvfp4", 4096, 14336) == 32  # 16 parts: the dense path wins from M = 33
    assert gemm.gemm_threshold("nvfp4", 5120, 17408) == 64  # 13 parts
    for call in (gemm.gemm_threshold, lambda f, n, k: gemm.gemm_workspace_size(f, 64, n, k)):
        with pytest.raises(ValueError, match="format must be one of"):  # one vocabulary: "nvfp4" | "fp8"
            call("qpn2", 4096, 4096)


def test_workspace_is_sized_for_the_build_the_call_runs(monkeypatch):
    """gemm_workspace_size(format, ...) covers the ticket grid of the build that format's launch runs (taken from
    the launch itself, the kernel call intercepted): team builds where gemm_variant picks one (NVFP4 gated, FP8
    with channel or block scales), MXFP4's one-pass build at every M (QPN2's kernel and split, no teams)."""
    from qpn.cupy_kernels import gemm, mxfp4
    from qpn.ref.formats import QPN8, QPN8_BLOCK

    monkeypatch.setattr(gemm, "_device", lambda: (132, 9))
    launched = []
    for module in (gemm, mxfp4):
        monkeypatch.setattr(module, "launch_gemm", lambda family, variant, *_: launched.append((family, variant)))
    n, k = 128, 8192  # K in parts: the workspace ends with the tickets
    launches = (("nvfp4", lambda x, gated: gemm.launch_qpn2_gemm(x, None, None, None, 0, n, None, gated, None)),
                ("fp8", lambda x, gated: gemm.launch_qpn8_gemm(x, None, None, QPN8, n, None, gated, None)),
                ("fp8", lambda x, gated: gemm.launch_qpn8_gemm(x, None, None, QPN8_BLOCK, n, None, gated, None)),
                ("mxfp4", lambda x, gated: mxfp4.launch_qpnmx_gemm(x, None, None, None, n, None, gated, None)))
    for m in (33, 64, 65, 130, 512):
        x = np.empty((m, k), np.float16)  # the launches read its shape only
        for gated in (False, True):
            for fmt, launch in launches:
                launched.clear()
                launch(x, gated)
                [(family, variant)] = launched
                want = gemm._workspace_ends(family, m, n, k, gated, False, variant)[-1]
                assert gemm.gemm_workspace_size(fmt, m, n, k, gated) == want, (fmt, m, gated, variant.label)
    # the grids differ (gated M = 130: NVFP4's team of 8 runs 2 token blocks, MXFP4's 32-token build 5)
    assert gemm.gemm_workspace_size("nvfp4", 130, n, k, True) != gemm.gemm_workspace_size("mxfp4", 130, n, k, True)


def test_gemm_builds_are_in_the_compile_registry():
    from qpn.cupy_kernels import gemm
    from qpn.cupy_kernels.variants import all_variants

    registered = all_variants()
    assert gemm.KERNEL_VARIANTS and all(v in registered for v in gemm.KERNEL_VARIANTS)
    assert all(dict(v.defines)["QPN_GEMM"] == "1" for v in gemm.KERNEL_VARIANTS)


def test_gemm_runs_team_builds_past_one_pass(nvrtc):
    """Which build a GEMM call runs (gemm.gemm_variant): QPN8 from M = 65 the team of 8 (128 tokens per pass;
    its warps take tiles s and s + N/64 where N % 64 == 0), gated QPN8 and QPN2 from M = 33 the team of 4 (64)
    and from 65 the team of 8; QPN2 plain and every smaller M the build of gemm_macros. Each team build keeps
    the compile check's rules on sm_75 and holds 32 warps per Turing SM (two tiles per warp: 16, at <= 128
    registers) with its shared-memory slots, and its launch geometry is what its macros say."""
    from qpn.cupy_kernels import compile_check, gemm
    from qpn.cupy_kernels import linear as L
    from qpn.ref.formats import QPN2, QPN8, QPN8_BLOCK

    def geometry(wf, gated, m, n=4096):
        variant = gemm.gemm_variant(wf, gated, m, n)
        return gemm.build_geometry(variant.defines)[1], L.tiles_per_warp(variant.defines)

    for wf in (QPN8, QPN8_BLOCK):
        assert [geometry(wf, False, m) for m in (1, 33, 64, 65, 128, 512)] == [(64, 1)] * 3 + [(128, 2)] * 3
        assert [geometry(wf, False, m, 4096 + 32) for m in (64, 65)] == [(64, 1), (128, 1)]  # N % 64: unpaired
    for wf in (QPN8, QPN8_BLOCK, QPN2):
        gated = [geometry(wf, True, m) for m in (1, 32, 33, 64, 65, 512)]
        assert gated == [(32, 2)] * 2 + [(64, 2)] * 2 + [(128, 2)] * 2
    assert {geometry(QPN2, False, m) for m in (1, 65, 512)} == {(64, 1)}
    teams = (*gemm.QPN8_TEAM.values(), *gemm.QPN2_TEAM.values())
    reports, _ = compile_check.check_variants(teams, nvrtc=nvrtc)
    for variant in teams:
        team = L.team_of(variant.defines)
        (report,) = [r for r in reports if r.label == variant.label and r.arch == "sm_75"]
        assert report.stats is not None and not report.problems, f"{variant.label}: {report.problems}"
        slots, _, threads = gemm.build_geometry(variant.defines)
        warps, tiles = threads // 32, L.tiles_per_warp(variant.defines)
        assert warps == gemm.GEMM_TEAM_WARPS[tiles] == slots * team
        smem = report.stats.smem + L.team_shared_bytes(variant.defines, warps)
        assert compile_check.occupancy_sm75(report.stats.registers, smem, warps).warps == (16 if tiles == 2 else 32)


# ----------------------------------------------------------------------------- GPU: accuracy


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", GEMM_MS)
def test_qpn2_gemm_in_bounds(cp, n, k, m):
    from qpn.cupy_kernels import qpn2_gemm_linear

    rng = np.random.default_rng(7 * n + k + m)
    codes, scales = qpn2_buffers(rng, n, k)
    x = activations(rng, m, k)
    y = qpn2_gemm_linear(cp.asarray(x), cp.asarray(codes), cp.asarray(scales), G_SCALAR).get()
    assert y.shape == (m, n) and y.dtype == np.float16
    assert_in_bounds(y, x, qpn2_dequantize(codes, scales, G_SCALAR, n, k), f"qpn2 gemm N={n} K={k} M={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,block", QPN8_CASES)
@pytest.mark.parametrize("m", GEMM_MS)
def test_qpn8_gemm_in_bounds(cp, n, k, block, m):
    from qpn.cupy_kernels import qpn8_gemm_linear

    rng = np.random.default_rng(7 * n + k + m + block)
    codes, gs = qpn8_buffers(rng, n, k, block)
    x = activations(rng, m, k)
    y = qpn8_gemm_linear(cp.asarray(x), cp.asarray(codes), cp.asarray(gs)).get()
    assert y.shape == (m, n)
    assert_in_bounds(y, x, qpn8_dequantize(codes, gs, n, k), f"qpn8 gemm N={n} K={k} M={m} block={block}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", (40, 300))
def test_qpn2_gemm_per_tile_global_scale_and_tiny_blocks(cp, m):
    """One global scale per tile, and blocks below the fast decode's range (|S| < 2^-13: the exact path)."""
    from qpn.cupy_kernels import qpn2_gemm_linear

    n, k = 256, 1024
    rng = np.random.default_rng(m)
    codes, scales = qpn2_buffers(rng, n, k, scale_lo=0x01, scale_hi=0x7E)
    g = np.exp2(rng.uniform(-20, -8, size=n // 32)).astype(np.float32)
    x = activations(rng, m, k)
    y = qpn2_gemm_linear(cp.asarray(x), cp.asarray(codes), cp.asarray(scales), cp.asarray(g)).get()
    assert_in_bounds(y, x, qpn2_dequantize(codes, scales, g, n, k), f"qpn2 gemm per-tile g M={m}")


# ----------------------------------------------------------------------------- GPU: invariance, gated


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["qpn2", "qpn8", "qpn8-block"])
@pytest.mark.parametrize("n,k", [(512, 2048), (128, 8192)])
def test_gemm_batch_invariance(cp, fmt, n, k):
    """Row i of M = 200 equals the row alone (M = 1 through the GEMM) and inside M = 37 and M = 64 calls."""
    from qpn.cupy_kernels import qpn2_gemm_linear, qpn8_gemm_linear

    rng = np.random.default_rng(3)
    x = activations(rng, 200, k)
    if fmt == "qpn2":
        codes, scales = qpn2_buffers(rng, n, k)
        weights = (cp.asarray(codes), cp.asarray(scales), G_SCALAR)
        f = qpn2_gemm_linear
    else:
        codes, gs = qpn8_buffers(rng, n, k, block=fmt.endswith("block"))
        weights = (cp.asarray(codes), cp.asarray(gs))
        f = qpn8_gemm_linear
    y = f(cp.asarray(x), *weights).get()
    for i in (0, 36, 63, 64, 199):
        alone = f(cp.asarray(x[i:i + 1]), *weights).get()
        assert np.array_equal(_bits(alone[0]), _bits(y[i])), f"{fmt}: row {i} alone differs"
    for m in (37, 64):
        part = f(cp.asarray(x[:m]), *weights).get()
        assert np.array_equal(_bits(part), _bits(y[:m])), f"{fmt}: rows of the M={m} call differ"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["qpn2", "qpn8", "qpn8-block"])
@pytest.mark.parametrize("m", (33, 100))
def test_gemm_gated(cp, fmt, m):
    from qpn.cupy_kernels import qpn2_gemm_linear, qpn8_gemm_linear

    check_gated(cp, fmt, m, qpn2_gemm_linear, qpn8_gemm_linear, "gemm")


@pytest.mark.gpu
@pytest.mark.parametrize("family,gated", [("qpn8", False), ("qpn8_block", False), ("qpn8", True),
                                          ("qpn8_block", True), ("qpn2", True)])  # every family with team builds
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_team_builds_give_the_one_pass_builds_bits(cp, monkeypatch, family, gated, dtype):
    """Every team build the GEMM runs gives, call for call, the bits of the build of gemm_macros (64 tokens per
    pass; gated 32): the same split and the same fp32 sums in the same order (gemm.GEMM_TEAMS). Every M is one a
    team build runs (the teams of 4 and 8 for gated) and most leave warps with no tokens; K in parts (8192) and
    one part (256); N = 96: an odd tile count, whose plain team does not pair its tiles."""
    from qpn.cupy_kernels import gemm, qpn2_gemm_linear, qpn8_gemm_linear
    from qpn.cupy_kernels import linear as L
    from qpn.ref.formats import BY_KEY

    wf = BY_KEY[family]
    rng = np.random.default_rng(11)
    for n, k in ((384, 256), (128, 8192), *(() if gated else ((96, 1024),))):
        if family == "qpn2":
            codes, scales = qpn2_buffers(rng, n, k)
            op, weights = qpn2_gemm_linear, (cp.asarray(codes), cp.asarray(scales), G_SCALAR)
            one_pass = gemm.QPN2_GEMM[gated]
        else:
            codes, gs = qpn8_buffers(rng, n, k, block=family == "qpn8_block")
            op, weights = qpn8_gemm_linear, (cp.asarray(codes), cp.asarray(gs))
            one_pass = gemm.QPN8_GEMM[gated, family == "qpn8_block"]
        for m in (33, 64, 65, 100, 200) if gated else (65, 100, 200):  # where a team build runs
            assert L.team_of(gemm.gemm_variant(wf, gated, m, n).defines) > 1
            x = cp.asarray(activations_as(rng, m, k, dtype))
            ran = op(x, *weights, gated=gated).get()
            want = run_gemm_build(monkeypatch, one_pass, op, x, *weights, gated=gated)
            assert np.array_equal(ran.view(np.uint16), want.view(np.uint16)), f"N={n} K={k} M={m}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,m,gated", [("nvfp4", 70, False), ("fp8", 70, False), ("fp8", 40, True),
                                         ("fp8", 130, True), ("nvfp4", 40, True), ("nvfp4", 130, True)])
def test_gemm_workspace_from_the_caller(cp, fmt, m, gated):
    """A caller-provided workspace of gemm_workspace_size elements gives the same bits; a smaller one is refused
    (the team builds' ticket grid included: gated M = 40 and 130, plain QPN8 M = 70)."""
    from qpn.cupy_kernels import gemm_workspace_size, qpn2_gemm_linear, qpn8_gemm_linear

    n, k = 128, 8192  # parts > 1: fragments, partials and tickets all in the workspace
    rng = np.random.default_rng(5)
    if fmt == "nvfp4":
        codes, scales = qpn2_buffers(rng, n, k)
        op, args = qpn2_gemm_linear, (cp.asarray(codes), cp.asarray(scales), G_SCALAR)
    else:
        codes, gs = qpn8_buffers(rng, n, k)
        op, args = qpn8_gemm_linear, (cp.asarray(codes), cp.asarray(gs))
    args = (cp.asarray(activations(rng, m, k)), *args)
    size = gemm_workspace_size(fmt, m, n, k, gated)
    y = op(*args, gated=gated, workspace=cp.full(size, np.nan, dtype=np.float32)).get()
    assert np.array_equal(_bits(y), _bits(op(*args, gated=gated).get()))
    with pytest.raises(ValueError, match="gemm_workspace_size"):
        op(*args, gated=gated, workspace=cp.empty(size - 1, dtype=np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_ops_run_the_path_dispatch_chooses(cp, fmt):
    """torch.ops.qpn.*_linear equals, bit for bit, the CuPy kernel of the path dispatch.choose picks;
    each forced path (torch_bridge/_cuda.linear_on) equals its CuPy API call: the layouts' launches and
    the validating wrappers end in the same kernels."""
    torch = pytest.importorskip("torch")
    import qpn.torch_bridge  # noqa: F401  (registers the ops)
    from qpn.cupy_kernels import qpn2_gemm_linear, qpn2_linear, qpn8_gemm_linear, qpn8_linear
    from qpn.ref.formats import QPN2, QPN8
    from qpn.torch_bridge import _cuda, dispatch

    n, k = 256, 1024
    rng = np.random.default_rng(9)
    if fmt == "nvfp4":
        codes, scales = qpn2_buffers(rng, n, k)
        g = np.full(n // 32, G_SCALAR, np.float32)
        host, wf = (codes, scales, g), QPN2
        kernels = {"decode": qpn2_linear, "gemm": qpn2_gemm_linear}
        op = torch.ops.qpn.nvfp4_linear
    else:
        host, wf = qpn8_buffers(rng, n, k), QPN8
        kernels = {"decode": qpn8_linear, "gemm": qpn8_gemm_linear}
        op = torch.ops.qpn.fp8_linear
    buffers = tuple(torch.from_numpy(b).cuda() for b in host)
    for m in (8, 48, 200):
        x = activations(rng, m, k)
        xt = torch.from_numpy(x).cuda()
        direct = {path: _bits(f(cp.asarray(x), *(cp.asarray(b) for b in host)).get())
                  for path, f in kernels.items() if path != "decode" or m <= 32}
        for path, bits in direct.items():
            forced = _cuda.linear_on(path, wf, xt, buffers, n, k, n, False).cpu().numpy()
            assert np.array_equal(_bits(forced), bits), (path, m)
        chosen = dispatch.choose(xt.device, wf, m, n, k, False)
        forced = _bits(_cuda.linear_on(chosen, wf, xt, buffers, n, k, n, False).cpu().numpy())
        assert np.array_equal(_bits(op(xt, *buffers).cpu().numpy()), forced), (chosen, m)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_ops_sweep_across_the_tiers(cp, fmt):
    """torch.ops.qpn.*_linear at every M of a sweep across both thresholds (decode <= 32 < GEMM <=
    gemm_threshold < dense) stays inside the contract's bound, plain and gated."""
    torch = pytest.importorskip("torch")
    import qpn.torch_bridge  # noqa: F401  (registers the ops)
    from qpn.cupy_kernels import gemm_threshold

    n, k = 256, 1024
    top = gemm_threshold(fmt, n, k)
    rng = np.random.default_rng(21)
    if fmt == "nvfp4":
        codes, scales = qpn2_buffers(rng, n, k)
        w16 = qpn2_dequantize(codes, scales, G_SCALAR, n, k)
        weights = (torch.from_numpy(codes).cuda(), torch.from_numpy(scales).cuda(),
                   torch.full((n // 32,), G_SCALAR, dtype=torch.float32, device="cuda"))
        op = torch.ops.qpn.nvfp4_linear
    else:
        codes, gs = qpn8_buffers(rng, n, k)
        w16 = qpn8_dequantize(codes, gs, n, k)
        weights = (torch.from_numpy(codes).cuda(), torch.from_numpy(gs).cuda())
        op = torch.ops.qpn.fp8_linear
    for m in sorted({1, 31, 32, 33, 47, top - 1, top, top + 1, 2 * top + 3}):
        x = activations(rng, m, k)
        y = op(torch.from_numpy(x).cuda(), *weights).cpu().numpy()
        assert_in_bounds(y, x, w16, f"{fmt} op M={m} (gemm_threshold {top})")
        out = op(torch.from_numpy(x).cuda(), *weights, gated=True).cpu().numpy()
        assert_gated_matches(out, y, f"{fmt} op gated M={m}")


# ----------------------------------------------------------------------------- sanitizer


def drive() -> None:
    """Every GEMM build on small and ragged shapes, parts > 1 included, partial last token blocks."""
    import cupy

    from qpn.cupy_kernels import qpn2_gemm_linear, qpn8_gemm_linear

    cupy.cuda.set_allocator(None)  # exact-size allocations: memcheck sees every overrun
    rng = np.random.default_rng(0)
    for m in (33, 70):
        for n, k in [(96, 1024), (384, 192), (64, 8192)]:
            codes, scales = qpn2_buffers(rng, n, k)
            args = (cupy.asarray(activations(rng, m, k)), cupy.asarray(codes), cupy.asarray(scales), G_SCALAR)
            qpn2_gemm_linear(*args, gated=n % 64 == 0)
            qpn2_gemm_linear(*args)
        for n, k, block in [(96, 1024, False), (384, 256, True), (128, 8192, True)]:
            codes, gs = qpn8_buffers(rng, n, k, block)
            args = (cupy.asarray(activations(rng, m, k)), cupy.asarray(codes), cupy.asarray(gs))
            qpn8_gemm_linear(*args, gated=n % 64 == 0)
            qpn8_gemm_linear(*args)
    cupy.cuda.runtime.deviceSynchronize()
    print("driver done")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer_clean(tool, compute_sanitizer):
    compute_sanitizer(tool, __file__)


if __name__ == "__main__" and "--drive" in sys.argv:
    drive()
