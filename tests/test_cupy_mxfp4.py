"""The MXFP4 decode kernels (qpn.cupy_kernels.mxfp4; issue 23, part 3): bit for bit the QPN2 decode kernels on
the NVFP4 encoding of the same W16 (every tile's 2^T = 1, and 2^T moved into x where it is not), gated and
not, M 1-32, one part and K split across blocks; within the derived bound of the float64 reference on
weights whose tiles span 60 binades (F < -24: the exact path) with a different 2^T per tile; memcheck and
racecheck clean. The pipelines' host rules run everywhere."""

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
    for (nb, gated), v in ck_mx.QPNMX_LINEAR.items():
        d = dict(v.defines)
        assert d["QPN_MX"] == "1" and d["QPN_NB"] == str(nb) and d["QPN_GATED"] == str(int(gated))
        assert int(d["QPN_UNROLL"]) == 1 or int(d["QPN_UNROLL"]) % 2 == 0


def weight(rng: np.random.Generator, n: int, k: int, low: int, high: int) -> mx.MXFP4Weight:
    """Random codes; scale bytes in [low, high], every 32-row tile holding `high` (T = high - 140)."""
    scales = rng.integers(low, high + 1, (n, k // 32)).astype(np.uint8)
    scales[::32, 0] = high
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
    """Scale bytes 123 + t .. 140 + t: F in [-4, 13], every tile's T = t; y(x) of the MX kernel equals the
    QPN2 kernel's y(2^t x), bit for bit (the same sums, 2^t exact on both sides)."""
    cupy = gpu()
    from qpn.cupy_kernels import qpn2_linear

    rng = np.random.default_rng(n + k + t + 10 * gated)
    w = weight(rng, n, k, 123 + t, 140 + t)
    assert (mx.mxfp4_tile_exponents(w.scales) == t).all()
    mxb, twin = on_gpu(cupy, w), nvfp4_twin(cupy, w, 5)
    for m in MS:
        # |x| in [1/4, 2): 2^t x stays a normal fp16 number, so moving 2^t into x is exact
        x = (rng.choice([-1, 1], (m, k)) * rng.uniform(0.25, 2, (m, k))).astype(np.float16)
        got = ck_mx.qpnmx_linear(cupy.asarray(x), *mxb, gated=gated)
        want = qpn2_linear(cupy.asarray((x.astype(np.float64) * 2.0**t).astype(np.float16)), *twin, gated=gated)
        assert cupy.array_equal(got.view(np.uint16), want.view(np.uint16)), (m, gated, t)


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
        buffers = on_gpu(cupy, weight(rng, n, k, 80, 140))
        for m in (1, 9, 17, 32):
            x = cupy.asarray(rng.standard_normal((m, k)).astype(np.float16))
            for gated in (False, True):
                ck_mx.qpnmx_linear(x, *buffers, gated=gated)
    cupy.cuda.runtime.deviceSynchronize()
    print("driver done")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer_clean(compute_sanitizer, tool):
    compute_sanitizer(tool, __file__)


if __name__ == "__main__" and "--drive" in sys.argv:
    drive()
