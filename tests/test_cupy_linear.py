"""The decode kernels qpn2_linear / qpn8_linear (cupy_kernels/linear.py), M in [1, 32].

1. Accuracy contract: y lies inside qpn.ref.linear_bounds(x, W16) for the contract's W16 (from
   qpn.ref.qpn2_dequantize / qpn8_dequantize, or the GPU dequantize kernels -- byte-identical to
   them, tests/test_cupy_dequantize.py -- for the large real shapes). linear_bounds is the
   derived bound "fp32 accumulation in any order (gamma_K * sum|x*w|, u = 2^-23 to cover the
   tensor core's truncating adds) plus one RN16" (ref/linear.py has the derivation).
2. Batch invariance: row i of an M-row call equals row i computed alone, bit for bit.
3. Gated: out = silu_and_mul(gate, up) on values inside their bounds, with one fp16 ulp of
   slack on silu16 for CUDA's expf (<= 2 fp32 ulp; the reference uses a correctly rounded exp).
4. Every rejection path raises ValueError before any launch.
Data: random codes (NaN scale bytes excluded), fresh per test; real shapes and hypothesis-drawn
aligned shapes. The sanitizer run is tests/test_cupy_sanitizer.py-style: `--drive` at the bottom.
"""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qpn.ref import bf16_bits, bf16_round, linear_bounds, qpn2_dequantize, qpn8_dequantize, silu_and_mul

pytestmark = pytest.mark.gpu

M_VALUES = (1, 2, 3, 7, 8, 9, 16, 17, 31, 32)
REAL_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K)
# (N, K): one tile; ragged warps; 1600 -> 12 warps of 9 groups, the last with 1 (pad groups)
SMALL_SHAPES = [(32, 64), (64, 128), (96, 192), (128, 1024), (1024, 256), (64, 1600)]
NON_NAN_E4M3 = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)
G_SCALAR = np.float32(0.1 / 2688)  # ModelOpt-like: amax 0.1


# ----------------------------------------------------------------------------- data


def qpn2_buffers(rng, n, k, scale_lo=0x28, scale_hi=0x7E):
    """Random QPN2 buffers (any byte order is a valid layout): codes uniform, e4m3 scales 2^-2..448."""
    codes = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scales = rng.integers(scale_lo, scale_hi, size=(n, k // 16), dtype=np.uint8)
    scales |= (rng.random(scales.shape) < 0.1).astype(np.uint8) << 7  # some negative block scales
    return codes, scales


def qpn8_buffers(rng, n, k, block=False):
    codes = rng.choice(NON_NAN_E4M3, size=(n, k)).astype(np.uint8)
    shape = (k // 128, n // 32) if block else (1, n)
    group_scales = (np.exp2(rng.uniform(-6, 4, size=shape))).astype(np.float16)  # S16 = RN16(256 s)
    return codes, group_scales


def w16_qpn2(cp, codes, scales, g, n, k, on_gpu):
    if on_gpu:
        from qpn.cupy_kernels import qpn2_dequantize as gpu_dequantize

        g_dev = cp.asarray(np.asarray(g, np.float32).reshape(-1))
        return gpu_dequantize(cp.asarray(codes), cp.asarray(scales), g_dev if g_dev.size > 1 else float(g), n, k).get()
    return qpn2_dequantize(codes, scales, g, n, k)


def w16_qpn8(cp, codes, group_scales, n, k, on_gpu):
    if on_gpu:
        from qpn.cupy_kernels import qpn8_dequantize as gpu_dequantize

        return gpu_dequantize(cp.asarray(codes), cp.asarray(group_scales), n, k).get()
    return qpn8_dequantize(codes, group_scales, n, k)


def activations(rng, m, k):
    return rng.standard_normal((m, k)).astype(np.float16)


def activations_as(rng, m, k, dtype: str) -> np.ndarray:
    """activations(rng, m, k) as the CuPy kernels take x of `dtype`: fp16, or bf16 bits as int16 (bf16.py)."""
    x = activations(rng, m, k)
    return x if dtype == "float16" else bf16_bits(bf16_round(x.astype(np.float32))).view(np.int16)


# ----------------------------------------------------------------------------- checks


def assert_in_bounds(y, x, w16, what):
    lo, hi = linear_bounds(x, w16)
    bad = ~((lo <= y) & (y <= hi))
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} outputs outside the fp32 bound, "
                             f"first {i}: {y[i]} not in [{lo[i]}, {hi[i]}]")


def assert_gated_matches(out, y_plain, what):
    """out = RN16(silu16(gate16) * up16) with gate16 / up16 the plain kernel's outputs (the gated
    kernel sums every tile exactly like the plain one: same K split), silu16 within one fp16 ulp
    of the reference's RN16(silu32(gate)) (CUDA expf is not correctly rounded: <= 2 fp32 ulp)."""
    half = y_plain.shape[1] // 2
    gate, up = y_plain[:, :half], y_plain[:, half:]
    with np.errstate(all="ignore"):
        silu_ref = silu_and_mul(gate, np.ones_like(gate))  # RN16(silu32(gate)) * 1 (exact)
        cands = [
            (s16.astype(np.float32) * up.astype(np.float32)).astype(np.float16).astype(np.float32)
            for s16 in (np.nextafter(silu_ref, np.float16(-np.inf)), silu_ref,
                        np.nextafter(silu_ref, np.float16(np.inf)))
        ]
    lo, hi = np.minimum.reduce(cands), np.maximum.reduce(cands)
    o = out.astype(np.float32)
    bad = ~((lo <= o) & (o <= hi))
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} gated outputs differ from silu_and_mul(plain outputs), first {i}: "
            f"{out[i]} not in [{lo[i]}, {hi[i]}]"
        )


# ----------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("n,k", SMALL_SHAPES)
@pytest.mark.parametrize("m", M_VALUES)
def test_qpn2_linear_small_shapes(cp, n, k, m):
    from qpn.cupy_kernels import qpn2_linear

    rng = np.random.default_rng(1000 * n + k + m)
    codes, scales = qpn2_buffers(rng, n, k)
    w16 = qpn2_dequantize(codes, scales, G_SCALAR, n, k)
    x = activations(rng, m, k)
    y = qpn2_linear(cp.asarray(x), cp.asarray(codes), cp.asarray(scales), G_SCALAR).get()
    assert y.shape == (m, n) and y.dtype == np.float16
    assert_in_bounds(y, x, w16, f"qpn2 N={n} K={k} M={m}")


QPN8_SMALL_SHAPES = [(32, 16), (64, 48), (128, 256), (256, 1024), (1024, 128)]
# (n, k, block): 128x128 block scales only where N % 128 == 0 and K % 128 == 0
QPN8_SMALL_CASES = [(n, k, False) for n, k in QPN8_SMALL_SHAPES] + [
    (n, k, True) for n, k in QPN8_SMALL_SHAPES if n % 128 == 0 and k % 128 == 0]


@pytest.mark.parametrize("n,k,block", QPN8_SMALL_CASES)
@pytest.mark.parametrize("m", M_VALUES)
def test_qpn8_linear_small_shapes(cp, n, k, m, block):
    from qpn.cupy_kernels import qpn8_linear

    rng = np.random.default_rng(1000 * n + k + m + block)
    codes, group_scales = qpn8_buffers(rng, n, k, block)
    w16 = qpn8_dequantize(codes, group_scales, n, k)
    x = activations(rng, m, k)
    y = qpn8_linear(cp.asarray(x), cp.asarray(codes), cp.asarray(group_scales)).get()
    assert y.shape == (m, n)
    assert_in_bounds(y, x, w16, f"qpn8 N={n} K={k} M={m} block={block}")


@pytest.mark.slow
@pytest.mark.parametrize("n,k", REAL_SHAPES)
def test_real_shapes_all_m_and_batch_invariance(cp, n, k):
    """Real layer shapes: every M of M_VALUES inside the bound, and rows of every M-row call equal
    to the 32-row call's rows and to the rows computed alone (bit for bit)."""
    from qpn.cupy_kernels import qpn2_linear, qpn8_linear

    rng = np.random.default_rng(n + k)
    x = activations(rng, 32, k)
    xd = cp.asarray(x)
    c2, s2 = qpn2_buffers(rng, n, k)
    w2 = w16_qpn2(cp, c2, s2, G_SCALAR, n, k, on_gpu=True)
    c8, s8 = qpn8_buffers(rng, n, k)
    w8 = w16_qpn8(cp, c8, s8, n, k, on_gpu=True)
    calls = {
        "qpn2": (lambda a: qpn2_linear(a, c2d, s2d, G_SCALAR), w2),
        "qpn8": (lambda a: qpn8_linear(a, c8d, s8d), w8),
    }
    c2d, s2d, c8d, s8d = cp.asarray(c2), cp.asarray(s2), cp.asarray(c8), cp.asarray(s8)
    for name, (f, w16) in calls.items():
        y32 = f(xd).get()
        assert_in_bounds(y32, x, w16, f"{name} N={n} K={k} M=32")
        for m in M_VALUES:
            ym = f(xd[:m]).get()
            assert np.array_equal(ym.view(np.uint16), y32[:m].view(np.uint16)), \
                f"{name} M={m} rows differ from the 32-row call"
        for i in range(32):
            yi = f(xd[i : i + 1]).get()
            assert np.array_equal(yi.view(np.uint16), y32[i : i + 1].view(np.uint16)), f"{name} row {i} alone differs"


@settings(max_examples=12, deadline=None)
@given(
    tiles=st.integers(1, 40),
    groups=st.integers(1, 80),
    m=st.sampled_from(M_VALUES),
    seed=st.integers(0, 2**31 - 1),
)
def test_qpn2_and_qpn8_hypothesis_shapes(cp, tiles, groups, m, seed):
    from qpn.cupy_kernels import qpn2_linear, qpn8_linear

    rng = np.random.default_rng(seed)
    n = 32 * tiles
    k8 = 16 * groups
    k2 = 64 * -(-groups // 4)
    x2 = activations(rng, m, k2)
    codes, scales = qpn2_buffers(rng, n, k2)
    y2 = qpn2_linear(cp.asarray(x2), cp.asarray(codes), cp.asarray(scales), G_SCALAR).get()
    assert_in_bounds(y2, x2, qpn2_dequantize(codes, scales, G_SCALAR, n, k2), f"qpn2 N={n} K={k2} M={m}")
    x8 = activations(rng, m, k8)
    c8, s8 = qpn8_buffers(rng, n, k8)
    y8 = qpn8_linear(cp.asarray(x8), cp.asarray(c8), cp.asarray(s8)).get()
    assert_in_bounds(y8, x8, qpn8_dequantize(c8, s8, n, k8), f"qpn8 N={n} K={k8} M={m}")


@pytest.mark.parametrize("m", (1, 5, 32))
def test_qpn2_per_tile_global_scale_and_tiny_blocks(cp, m):
    """Per-tile global scales (fused shards), one tile so small that its blocks leave the fast path."""
    from qpn.cupy_kernels import qpn2_linear

    n, k = 256, 512
    rng = np.random.default_rng(7 + m)
    codes, scales = qpn2_buffers(rng, n, k, scale_lo=0x01, scale_hi=0x7E)  # e4m3 subnormals included
    g = np.exp2(rng.uniform(-14, -4, size=n // 32)).astype(np.float32)
    g[3] = np.float32(2.0**-20)  # tile 3: every block below |S| = 2^-13 (fp16 subnormal weights)
    w16 = qpn2_dequantize(codes, scales, g, n, k)
    x = activations(rng, m, k)
    for g_arg in (g, cp.asarray(g)):
        y = qpn2_linear(cp.asarray(x), cp.asarray(codes), cp.asarray(scales), g_arg).get()
        assert_in_bounds(y, x, w16, f"per-tile g M={m}")


def check_gated(cp, fmt, m, qpn2_fn, qpn8_fn, what):
    """`fmt` ("qpn2", "qpn8", "qpn8-block") through the plain kernel (checked against the fp32
    bound) and gated=True (silu_and_mul on the plain outputs), M tokens, a 512 x 1024 weight."""
    n, k = 512, 1024
    rng = np.random.default_rng(11 + m)
    x = activations(rng, m, k)
    if fmt == "qpn2":
        codes, scales = qpn2_buffers(rng, n, k)
        w16 = qpn2_dequantize(codes, scales, G_SCALAR, n, k)
        args = (cp.asarray(x), cp.asarray(codes), cp.asarray(scales), G_SCALAR)
        f = qpn2_fn
    else:
        codes, gs = qpn8_buffers(rng, n, k, block=fmt.endswith("block"))
        w16 = qpn8_dequantize(codes, gs, n, k)
        args = (cp.asarray(x), cp.asarray(codes), cp.asarray(gs))
        f = qpn8_fn
    y = f(*args).get()
    assert_in_bounds(y, x, w16, f"{fmt} {what} plain M={m}")
    out = f(*args, gated=True).get()
    assert out.shape == (m, n // 2)
    assert_gated_matches(out, y, f"{fmt} {what} gated M={m}")


@pytest.mark.parametrize("fmt", ["qpn2", "qpn8", "qpn8-block"])
@pytest.mark.parametrize("m", (1, 8, 9, 32))
def test_gated(cp, fmt, m):
    """gated=True equals silu_and_mul on the plain kernel's gate / up outputs (which are checked
    against the fp32 bound here too)."""
    from qpn.cupy_kernels import qpn2_linear, qpn8_linear

    check_gated(cp, fmt, m, qpn2_linear, qpn8_linear, "decode")


# (N, K) with too few tiles to fill the GPU: split_k adds blocks per tile (parts, summed across
# blocks in a fixed order): 2, 4 and 2 parts on any GPU of more than 2 SMs
SPLIT_K_SHAPES = [(64, 4096), (32, 8192), (96, 4608)]


def x_fragments_reference(x: np.ndarray) -> np.ndarray:
    """The fragment order of x_fragments.cu, from its header: [K/16][ceil(NB/2)][32 lanes][2 blocks][4 halves],
    lane 4 * gid + t of block j holding x[8j + gid][16g + 4t .. 16g + 4t + 3], zeros past row M."""
    m, k = x.shape
    nb2 = -(-m // 16)
    padded = np.zeros((16 * nb2, k), np.float16)
    padded[:m] = x
    # [row = 16 jp + 8 h + gid][group g][t][4] -> [g][jp][gid][t][h][4]
    v = padded.reshape(nb2, 2, 8, k // 16, 4, 4)
    return np.ascontiguousarray(v.transpose(3, 0, 2, 4, 1, 5)).reshape(k // 16, nb2, 32, 8)


@pytest.mark.parametrize("m", (9, 16, 17, 24, 32))
def test_x_fragments_layout(cp, m):
    """qpn_x_fragments writes exactly the documented layout (every byte, zero rows past M)."""
    from qpn.cupy_kernels import workspace as W

    k = 48
    x = activations(np.random.default_rng(m), m, k)
    out = cp.full(W.fragment_elements(m, k), np.nan, dtype=cp.float32)
    W.queue_x_fragments(cp.asarray(x), out)
    got = out.get().view(np.float16).reshape(k // 16, -(-m // 16), 32, 8)
    assert np.array_equal(got.view(np.uint16), x_fragments_reference(x).view(np.uint16))


@pytest.mark.parametrize("n,k", SPLIT_K_SHAPES)
def test_split_k_across_blocks(cp, n, k):
    """parts > 1: inside the bound, batch-invariant, the same bits on every call (ticket counters
    reset by the last block), the same bits with a caller's workspace, gated matches plain."""
    from qpn.cupy_kernels import linear as L
    from qpn.cupy_kernels import qpn2_linear, qpn8_linear

    parts2, parts8 = L.decode_split("nvfp4", n, k)[0], L.decode_split("fp8", n, k)[0]
    assert parts2 > 1 and parts8 > 1, (parts2, parts8)
    rng = np.random.default_rng(n + k)
    x = activations(rng, 32, k)
    xd = cp.asarray(x)
    c2, s2 = qpn2_buffers(rng, n, k)
    c8, s8 = qpn8_buffers(rng, n, k)
    c2d, s2d, c8d, s8d = cp.asarray(c2), cp.asarray(s2), cp.asarray(c8), cp.asarray(s8)
    calls = {
        "qpn2": (lambda a, **kw: qpn2_linear(a, c2d, s2d, G_SCALAR, **kw), qpn2_dequantize(c2, s2, G_SCALAR, n, k)),
        "qpn8": (lambda a, **kw: qpn8_linear(a, c8d, s8d, **kw), qpn8_dequantize(c8, s8, n, k)),
    }
    for name, (f, w16) in calls.items():
        y32 = f(xd).get()
        assert_in_bounds(y32, x, w16, f"{name} split-K N={n} K={k} M=32")
        for _ in range(3):  # tickets must be back at zero after every launch
            assert np.array_equal(f(xd).get().view(np.uint16), y32.view(np.uint16)), f"{name}: a repeated call differs"
        for m in (1, 8, 9, 31):
            ym = f(xd[:m]).get()
            assert np.array_equal(ym.view(np.uint16), y32[:m].view(np.uint16)), \
                f"{name} M={m} rows differ from the 32-row call"
        ws = cp.full(L.decode_workspace_size({"qpn2": "nvfp4", "qpn8": "fp8"}[name], 32, n, k), np.nan,
                     dtype=cp.float32)
        y_ws = f(xd, workspace=ws).get()
        assert np.array_equal(y_ws.view(np.uint16), y32.view(np.uint16)), f"{name}: workspace= differs"
        if n % 64 == 0:
            assert_gated_matches(f(xd, gated=True).get(), y32, f"{name} split-K gated N={n} K={k}")
        with pytest.raises(ValueError, match="decode_workspace_size"):
            f(xd, workspace=cp.zeros(8, cp.float32))


def test_out_argument_is_written_and_returned(cp):
    from qpn.cupy_kernels import qpn2_linear

    rng = np.random.default_rng(3)
    codes, scales = qpn2_buffers(rng, 64, 128)
    x = cp.asarray(activations(rng, 4, 128))
    out = cp.full((4, 64), np.nan, dtype=cp.float16)  # poison: every element must be written
    y = qpn2_linear(x, cp.asarray(codes), cp.asarray(scales), G_SCALAR, out=out)
    assert y is out and not bool(cp.isnan(out).any())


# ----------------------------------------------------------------------------- rejections


def _qpn2_args(cp, m=2, n=64, k=128):
    rng = np.random.default_rng(5)
    codes, scales = qpn2_buffers(rng, n, k)
    return cp.asarray(activations(rng, m, k)), cp.asarray(codes), cp.asarray(scales), G_SCALAR


def _qpn8_args(cp, m=2, n=64, k=128):
    rng = np.random.default_rng(6)
    codes, gs = qpn8_buffers(rng, n, k)
    return cp.asarray(activations(rng, m, k)), cp.asarray(codes), cp.asarray(gs)


REJECT_QPN2 = {
    "M=0": (lambda cp, a: (a[0][:0], *a[1:]), {}, "M="),
    "M=33": (lambda cp, a: (cp.zeros((33, 128), cp.float16), *a[1:]), {}, "qpn2_dense_linear"),
    "x float32": (lambda cp, a: (a[0].astype(cp.float32), *a[1:]), {}, "dtype"),
    "x not contiguous": (lambda cp, a: (cp.zeros((2, 256), cp.float16)[:, ::2], *a[1:]), {}, "C-contiguous"),
    "x numpy": (lambda cp, a: (a[0].get(), *a[1:]), {}, "cupy.ndarray"),
    "K % 64": (lambda cp, a: (cp.zeros((2, 96), cp.float16), cp.zeros((64, 48), cp.uint8),
                              cp.zeros((64, 6), cp.uint8), a[3]), {}, "multiple of 64"),
    "codes for another K": (lambda cp, a: (cp.zeros((2, 256), cp.float16), *a[1:]), {}, "codes"),
    "N % 32": (lambda cp, a: (a[0], cp.zeros((48, 64), cp.uint8), cp.zeros((48, 8), cp.uint8), a[3]), {},
               "multiple of 32"),
    "codes int8": (lambda cp, a: (a[0], a[1].view(cp.int8), *a[2:]), {}, "uint8"),
    "scales shape": (lambda cp, a: (a[0], a[1], a[2][:32], a[3]), {}, "scales"),
    "global scale float64": (lambda cp, a: (*a[:3], np.array([0.1])), {}, "float32"),
    "global scale per-tile shape": (lambda cp, a: (*a[:3], np.ones(3, np.float32)), {}, "32-column tile"),
    "global scale <= 0": (lambda cp, a: (*a[:3], np.float32(0.0)), {}, "> 0"),
    "gated N/2 % 32": (lambda cp, a: (cp.zeros((2, 128), cp.float16), cp.zeros((96, 64), cp.uint8),
                                      cp.zeros((96, 8), cp.uint8), a[3]), {"gated": True}, "N/2 % 32"),
    "gated not bool": (lambda cp, a: a, {"gated": "yes"}, "bool"),
    "out shape": (lambda cp, a: a, {"out": "shape"}, "shape"),
    "out dtype": (lambda cp, a: a, {"out": "dtype"}, "dtype"),
}


def _out_kw(cp, kw, m, n):
    if kw.get("out") == "shape":
        return {**kw, "out": cp.zeros((m, n + 32), cp.float16)}
    if kw.get("out") == "dtype":
        return {**kw, "out": cp.zeros((m, n), cp.float32)}
    return kw


@pytest.mark.parametrize("case", list(REJECT_QPN2))
def test_qpn2_rejects(cp, case):
    from qpn.cupy_kernels import qpn2_linear

    make, kw, words = REJECT_QPN2[case]
    args = make(cp, _qpn2_args(cp))
    with pytest.raises(ValueError, match=re.escape(words)):
        qpn2_linear(*args, **_out_kw(cp, kw, 2, 64))


REJECT_QPN8 = {
    "M=33": (lambda cp, a: (cp.zeros((33, 128), cp.float16), *a[1:]), {}, "qpn8_dense_linear"),
    "K % 16": (lambda cp, a: (cp.zeros((2, 24), cp.float16), cp.zeros((64, 24), cp.uint8), a[2]), {}, "multiple of 16"),
    "group scales float32": (lambda cp, a: (a[0], a[1], a[2].astype(cp.float32)), {}, "float16"),
    "group scales shape": (lambda cp, a: (a[0], a[1], a[2][:, :32]), {}, "group_scales"),
    "codes shape": (lambda cp, a: (a[0], a[1][:, :64], a[2]), {}, "codes"),
    "gated N/2 % 32": (lambda cp, a: (a[0], cp.zeros((96, 128), cp.uint8), cp.ones((1, 96), cp.float16)),
                       {"gated": True}, "N/2 % 32"),
    "out shape": (lambda cp, a: a, {"out": "shape"}, "shape"),
}


@pytest.mark.parametrize("case", list(REJECT_QPN8))
def test_qpn8_rejects(cp, case):
    from qpn.cupy_kernels import qpn8_linear

    make, kw, words = REJECT_QPN8[case]
    args = make(cp, _qpn8_args(cp))
    with pytest.raises(ValueError, match=re.escape(words)):
        qpn8_linear(*args, **_out_kw(cp, kw, 2, 64))


# ----------------------------------------------------------------------------- sanitizer


def drive() -> None:
    """Small and ragged shapes through every variant (all M blocks, gated, block scales)."""
    import cupy

    from qpn.cupy_kernels import qpn2_linear, qpn8_linear

    cupy.cuda.set_allocator(None)  # exact-size allocations: memcheck sees every overrun
    rng = np.random.default_rng(0)
    for m in (1, 9, 17, 32):
        for n, k in [(32, 64), (64, 192), (96, 1024), (64, 4096)]:  # the last: split-K across blocks
            codes, scales = qpn2_buffers(rng, n, k)
            x = cupy.asarray(activations(rng, m, k))
            qpn2_linear(x, cupy.asarray(codes), cupy.asarray(scales), G_SCALAR)
        codes, scales = qpn2_buffers(rng, 128, 256)
        qpn2_linear(cupy.asarray(activations(rng, m, 256)), cupy.asarray(codes), cupy.asarray(scales),
                    np.full(4, 2.0**-20, np.float32), gated=True)
        for n, k, block in [(32, 16, False), (64, 48, False), (128, 256, True), (256, 384, True), (64, 4096, False)]:
            codes, gs = qpn8_buffers(rng, n, k, block)
            qpn8_linear(cupy.asarray(activations(rng, m, k)), cupy.asarray(codes), cupy.asarray(gs), gated=n % 64 == 0)
        # bf16 x (its bits as int16): the fp16 rows (x_bf16.cu), then the kernels with bf16 outputs
        xb = cupy.asarray(activations(rng, m, 4096)).astype(np.float32).view(np.uint32) >> 16
        codes, scales = qpn2_buffers(rng, 64, 4096)
        qpn2_linear(xb.astype(np.uint16).view(np.int16), cupy.asarray(codes), cupy.asarray(scales), G_SCALAR)
    cupy.cuda.runtime.deviceSynchronize()
    print("driver done")


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer_clean(tool, compute_sanitizer):
    compute_sanitizer(tool, __file__)


if __name__ == "__main__" and "--drive" in sys.argv:
    sys.path.insert(0, os.path.dirname(__file__))
    drive()
