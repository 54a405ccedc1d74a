"""The MXFP4 kernels (qpn.cupy_kernels.mxfp4; issue 23, part 3): the GPU prepack and dequantize bit for bit the
reference's bytes and W16; the decode kernels and their GEMM build bit for bit the QPN2 kernels on the NVFP4
encoding of the same W16 (2^T moved into x), gated and not, M 1-100, one part and K split across blocks;
within the derived bound of the float64 reference on weights whose tiles span 60 binades (F < -24: the
exact path) with a different 2^T per tile; the fused MoE build bit for bit a loop of the decode kernels per
expert; memcheck and racecheck clean. The builds' host rules run everywhere."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from qpn.cupy_kernels import mxfp4 as ck_mx
from qpn.ref import encode_e4m3, qpn2_prepack
from qpn.ref import mxfp4 as mx

SHAPES = [(256, 512), (64, 2048)]  # many tiles, one part; few tiles, K split across blocks
MS = [1, 5, 8, 9, 16, 17, 24, 25, 32]


def test_every_build_loads_whole_32k_blocks():
    from qpn.cupy_kernels import gemm, moe
    from qpn.ref.formats import QPNMX

    builds = [*ck_mx.QPNMX_LINEAR.values(), *gemm.QPNMX_GEMM.values(),
              *(v for (key, _, _), v in moe.EXPERT_DECODE.items() if key == QPNMX.key)]
    for v in builds:
        d = dict(v.defines)
        assert d["QPN_MX"] == "1" and (int(d["QPN_UNROLL"]) == 1 or int(d["QPN_UNROLL"]) % 2 == 0), v.label
    for (nb, gated), v in ck_mx.QPNMX_LINEAR.items():
        d = dict(v.defines)
        assert d["QPN_MX"] == "1" and d["QPN_NB"] == str(nb) and d["QPN_GATED"] == str(int(gated))
        assert int(d["QPN_UNROLL"]) == 1 or int(d["QPN_UNROLL"]) % 2 == 0


def weight(rng: np.random.Generator, n: int, k: int, low: int, high: int, top: int | None = None) -> mx.MXFP4Weight:
    """Random codes; scale bytes in [low, high], one block of every 32-row tile at `top` (default high:
    T = top - 140), so most sums stay inside fp16 while each tile keeps its T."""
    scales = rng.integers(low, high + 1, (n, k // 32)).astype(np.uint8)
    scales[::32, 0] = high if top is None else top
    return mx.MXFP4Weight(rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8), scales)


def gpu():
    import cupy

    return cupy


def on_gpu(cupy, w: mx.MXFP4Weight) -> tuple:
    return tuple(cupy.asarray(a) for a in mx.qpnmx_prepack(*w))


def nvfp4_twin(cupy, w: mx.MXFP4Weight, shift: int) -> tuple:
    """QPN2 buffers of the same W16 when every block exponent lies in [shift - 9, shift + 8]: e4m3 holds
    2^-9 .. 2^8 exactly, g = 2^shift, so RN32(e4m3 * g) = 2^F and QPN2's W16 = RN16(e2m1 * 2^F)."""
    n, blocks = w.scales.shape
    f = w.scales.astype(np.int64) - 127 - np.repeat(mx.mxfp4_tile_exponents(w.scales), 32)[:, None]
    assert f.min() >= shift - 9 and f.max() <= shift + 8
    e4m3 = encode_e4m3(np.exp2(f - shift).astype(np.float32))
    codes, scales = qpn2_prepack(w.blocks.reshape(n, -1), np.repeat(e4m3, 2, axis=1))
    return cupy.asarray(codes), cupy.asarray(scales), cupy.full(1, 2.0**shift, np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("t", [0, -3, 2])
def test_the_mx_kernel_is_the_qpn2_kernel_on_the_same_w16(n, k, gated, t):
    """Scale bytes 123 + t .. 126 + t and one block per tile at 140 + t: F in [-4, 13], every tile's T = t;
    y(x) of the MX kernel equals the QPN2 kernel's y(2^t x), bit for bit (the same sums, 2^t exact on both
    sides)."""
    cupy = gpu()
    from qpn.cupy_kernels import qpn2_linear

    rng = np.random.default_rng(n + k + t + 10 * gated)
    w = weight(rng, n, k, 123 + t, 126 + t, top=140 + t)
    assert (mx.mxfp4_tile_exponents(w.scales) == t).all()
    mxb, twin = on_gpu(cupy, w), nvfp4_twin(cupy, w, 5)
    for m in MS:
        # |x| in [1/4, 2): 2^t x stays a normal fp16 number, so moving 2^t into x is exact
        x = (rng.choice([-1, 1], (m, k)) * rng.uniform(0.25, 2, (m, k))).astype(np.float16)
        got = ck_mx.qpnmx_linear(cupy.asarray(x), *mxb, gated=gated)
        want = qpn2_linear(cupy.asarray((x.astype(np.float64) * 2.0**t).astype(np.float16)), *twin, gated=gated)
        assert cupy.array_equal(got.view(np.uint16), want.view(np.uint16)), (m, gated, t)
        # the bits compared are mostly values, not infinities: only outputs reading a tile's top block
        # (weights up to 6 * 2^13; gated, through silu(gate) * up) may leave fp16
        assert float(cupy.isfinite(got).mean()) > 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
def test_tiles_of_their_own_scale_and_blocks_far_below_stay_in_the_bound(n, k):
    """Scale bytes spanning 60 binades (F < -24 takes the exact fp32 path), each tile its own T: every
    output inside mxfp4_linear_bounds (the sum's interval for any fp32 order, scaled by 2^T, rounded)."""
    cupy = gpu()
    rng = np.random.default_rng(k)
    w = weight(rng, n, k, 80, 140)
    w.scales[32:64] -= 7  # a tile with another T
    w16, tile_scale = mx.mxfp4_w16(*w)
    f = w.scales.astype(np.int64) - 127 - np.repeat(mx.mxfp4_tile_exponents(w.scales), 32)[:, None]
    assert (f < -24).any() and len(set(tile_scale.tolist())) > 1
    buffers = on_gpu(cupy, w)
    for m in MS:
        x = rng.standard_normal((m, k)).astype(np.float16)
        got = ck_mx.qpnmx_linear(cupy.asarray(x), *buffers).get()
        lo, hi = mx.mxfp4_linear_bounds(x, w16, tile_scale)
        assert ((lo <= got) & (got <= hi)).all(), m


@pytest.mark.gpu
def test_prepack_and_dequantize_are_the_references_bytes():
    cupy = gpu()
    rng = np.random.default_rng(11)
    w = weight(rng, 96, 256, 60, 140)
    got = ck_mx.qpnmx_prepack(cupy.asarray(w.blocks), cupy.asarray(w.scales))
    want = mx.qpnmx_prepack(*w)
    for g, r in zip(got, want, strict=True):
        assert np.array_equal(g.get().view(np.uint8), r.view(np.uint8))
    w16 = ck_mx.qpnmx_dequantize(*got, 96, 256).get()
    assert np.array_equal(w16.view(np.uint16), mx.mxfp4_w16(*w)[0].view(np.uint16))
    bad = w.scales.copy()
    bad[40, 3] = 0xFF
    with pytest.raises(ValueError, match=r"0xFF at index \(40, 3\)"):
        ck_mx.qpnmx_prepack(cupy.asarray(w.blocks), cupy.asarray(bad))


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_the_gemm_build_is_the_qpn2_gemm_on_the_same_w16(gated):
    cupy = gpu()
    from qpn.cupy_kernels import qpn2_gemm_linear

    for n, k in SHAPES:
        rng = np.random.default_rng(n + 3 * gated)
        w = weight(rng, n, k, 121, 124, top=138)  # T = -2
        mxb, twin = on_gpu(cupy, w), nvfp4_twin(cupy, w, 5)
        for m in (1, 33, 64, 100):
            x = (rng.choice([-1, 1], (m, k)) * rng.uniform(0.25, 2, (m, k))).astype(np.float16)
            got = ck_mx.qpnmx_gemm_linear(cupy.asarray(x), *mxb, gated=gated)
            want = qpn2_gemm_linear(cupy.asarray((x.astype(np.float64) / 4).astype(np.float16)), *twin, gated=gated)
            assert cupy.array_equal(got.view(np.uint16), want.view(np.uint16)), (n, k, m, gated)
            assert float(cupy.isfinite(got).mean()) > 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("m,top_k", [(1, 4), (7, 4), (40, 2)])
def test_the_fused_moe_is_the_decode_loop_bit_for_bit(m, top_k):
    """gpt-oss-like stacked experts (8, top-k): the fused MoE kernels' MX builds equal qpnmx_linear per hit
    expert (gated, then down) and the reference combine, bit for bit."""
    cupy = gpu()
    from qpn.cupy_kernels import moe
    from qpn.cupy_kernels.layouts import LAYOUT_KERNELS
    from qpn.ref import moe as ref_moe
    from qpn.ref.formats import QPNMX

    h, inter, experts = 256, 128, 8
    rng = np.random.default_rng(m)
    packed = {name: [on_gpu(cupy, weight(rng, n, k, 100, 118, top=122)) for _ in range(experts)]
              for name, (n, k) in (("w13", (2 * inter, h)), ("w2", (h, inter)))}
    w13, w2 = (tuple(cupy.stack([e[i] for e in packed[name]]) for i in range(3)) for name in ("w13", "w2"))
    x = rng.standard_normal((m, h)).astype(np.float16)
    weights, ids = ref_moe.route(rng.standard_normal((m, experts)).astype(np.float32), top_k, renormalize=True)
    slots = moe.chunk_rows(m, top_k) * top_k
    out = cupy.empty((m, h), np.float16)
    size = moe.moe_workspace_size(QPNMX.format, m, top_k, h, inter, experts)
    moe.launch_moe(LAYOUT_KERNELS[QPNMX.key], cupy.asarray(x), w13, w2, inter, cupy.asarray(weights),
                   cupy.asarray(ids), cupy.empty(moe.route_size(experts, slots), np.int32),
                   cupy.empty(size, np.float32) if size else None, cupy.empty((slots, inter), np.float16),
                   cupy.empty((slots, h), np.float16), out)
    y = np.zeros((m, top_k, h), np.float16)
    for e in np.unique(ids):
        rows, choices = np.nonzero(ids == e)
        hidden = ck_mx.qpnmx_linear(cupy.asarray(x[rows]), *packed["w13"][e], gated=True)
        y[rows, choices] = ck_mx.qpnmx_linear(hidden, *packed["w2"][e]).get()
    want = ref_moe.combine(y, weights)
    assert np.isfinite(want).all() and np.array_equal(out.get().view(np.uint16), want.view(np.uint16))


def test_bad_buffers_are_rejected_before_any_launch():
    cupy = pytest.importorskip("cupy", reason="CuPy arrays are the API's inputs; GPU tests need CuPy")
    if not cupy.is_available():
        pytest.skip("no CUDA device")
    w = weight(np.random.default_rng(0), 64, 128, 120, 130)
    codes, scales, tile_scale = on_gpu(cupy, w)
    x = cupy.zeros((2, 128), np.float16)
    for args, match in (((codes, scales, tile_scale[:1]), "tile_scale must have shape"),
                        ((codes, scales[:, :2], tile_scale), "scales"),
                        ((codes, scales, tile_scale.astype(np.float64)), "float32")):
        with pytest.raises(ValueError, match=match):
            ck_mx.qpnmx_linear(x, *args)
    with pytest.raises(ValueError, match="M=33"):
        ck_mx.qpnmx_linear(cupy.zeros((33, 128), np.float16), codes, scales, tile_scale)


# ----------------------------------------------------------------------------- sanitizer


def drive() -> None:
    """Exact-size CuPy allocations (no pool): the MX builds at every M class, gated and not, split-K."""
    import cupy

    cupy.cuda.set_allocator(None)
    rng = np.random.default_rng(0)
    for n, k in SHAPES:
        w = weight(rng, n, k, 80, 140)
        buffers = ck_mx.qpnmx_prepack(cupy.asarray(w.blocks), cupy.asarray(w.scales))
        ck_mx.qpnmx_dequantize(*buffers, n, k)
        for m in (1, 9, 17, 32, 70):
            x = cupy.asarray(rng.standard_normal((m, k)).astype(np.float16))
            for gated in (False, True):
                if m <= 32:
                    ck_mx.qpnmx_linear(x, *buffers, gated=gated)
                ck_mx.qpnmx_gemm_linear(x, *buffers, gated=gated)
    cupy.cuda.runtime.deviceSynchronize()
    print("driver done")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer_clean(compute_sanitizer, tool):
    compute_sanitizer(tool, __file__)


if __name__ == "__main__" and "--drive" in sys.argv:
    drive()
