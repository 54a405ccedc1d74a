"""GPU dequantization (cupy_kernels/dequantize.py) against qpn.ref: identical fp16 bytes.

QPN2: W16 = RN16(RN32(e2m1 * RN32(e4m3 * g))) with g scalar or per 32-column tile, host or
device; every non-NaN scale code at several global scales (fp16 subnormal weights, the largest
legal g), random and drawn shapes, real shapes. QPN8: W16 = RN16(e4m3 * 2^-8 * S16) for
channel, tensor and 128x128 block scales, every weight code. Rejections match the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qpn.ref import qpn2_dequantize as ref_qpn2_dequantize
from qpn.ref import qpn2_prepack, qpn8_prepack
from qpn.ref import qpn8_dequantize as ref_qpn8_dequantize

pytestmark = pytest.mark.gpu

NON_NAN_E4M3 = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)
# Global scales: 1; 2^-14 (weights down to fp16's smallest subnormal 2^-24); an amax/2688-like
# inexact value; 24, the largest power-of-two-ish g with 6 * 448 * g = 64512 < 65520.
GLOBAL_SCALES = (1.0, 2.0**-14, 3.7e-5, 24.0)
QPN2_SHAPES = [(32, 64), (64, 128), (96, 320), (160, 1024)]
QPN8_SHAPES = [(32, 16), (32, 48), (64, 80), (96, 256), (256, 384)]
QPN8_BLOCK_SHAPES = [(128, 128), (256, 384), (384, 256)]
REAL_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]


def qpn2_buffers(rng, n, k, scale_bytes=None):
    weight_packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    weight_scale = rng.choice(NON_NAN_E4M3, size=(n, k // 16)).astype(np.uint8) if scale_bytes is None else scale_bytes
    return qpn2_prepack(weight_packed, weight_scale)


def per_tile_scales(rng, n):
    # one fp32 per tile, log-uniform 2^-20 .. 2^4 (all below 24: never overflows)
    return np.exp2(rng.uniform(-20, 4, size=n // 32)).astype(np.float32)


def assert_same_fp16(gpu, ref):
    gpu = gpu.get()
    assert gpu.dtype == np.float16 and gpu.shape == ref.shape
    mismatch = gpu.view(np.uint16) != ref.view(np.uint16)
    assert not mismatch.any(), (
        f"{int(mismatch.sum())} of {mismatch.size} weights differ, first at {tuple(np.argwhere(mismatch)[0])}: "
        f"gpu 0x{int(gpu.view(np.uint16)[mismatch][0]):04X} ref 0x{int(ref.view(np.uint16)[mismatch][0]):04X}"
    )


def run_qpn2(cp, codes, scales, g, n, k, device_g=False, **kwargs):
    from qpn.cupy_kernels import qpn2_dequantize

    g_arg = cp.asarray(g) if device_g else g
    out = qpn2_dequantize(cp.asarray(codes), cp.asarray(scales), g_arg, n, k, **kwargs)
    assert_same_fp16(out, ref_qpn2_dequantize(codes, scales, g, n, k))
    return out


# ----------------------------------------------------------------------------- QPN2 bytes


@pytest.mark.parametrize("g", GLOBAL_SCALES)
def test_qpn2_every_scale_code(cp, g):
    n, k = 64, 256  # 1024 blocks: every non-NaN scale code four times
    rng = np.random.default_rng(1)
    scale_bytes = rng.permutation(np.resize(NON_NAN_E4M3, n * k // 16)).reshape(n, k // 16)
    codes, scales = qpn2_buffers(rng, n, k, scale_bytes)
    run_qpn2(cp, codes, scales, np.float32(g), n, k)


@pytest.mark.parametrize("device_g", [False, True])
@pytest.mark.parametrize("n, k", QPN2_SHAPES)
def test_qpn2_random_scalar_and_per_tile(cp, n, k, device_g):
    rng = np.random.default_rng(n + k)
    codes, scales = qpn2_buffers(rng, n, k)
    run_qpn2(cp, codes, scales, np.float32(0.0123), n, k, device_g=device_g)
    run_qpn2(cp, codes, scales, per_tile_scales(rng, n), n, k, device_g=device_g)


def test_qpn2_python_float_and_flat_buffers_and_out(cp):
    from qpn.cupy_kernels import qpn2_dequantize

    n, k = 64, 128
    rng = np.random.default_rng(2)
    codes, scales = qpn2_buffers(rng, n, k)
    ref = ref_qpn2_dequantize(codes, scales, 0.5, n, k)
    out = cp.full((n, k), np.nan, dtype=cp.float16)  # poisoned: every element must be written
    got = qpn2_dequantize(cp.asarray(codes.reshape(-1)), cp.asarray(scales.reshape(-1)), 0.5, n, k, out=out)
    assert got is out
    assert_same_fp16(out, ref)
    assert_same_fp16(qpn2_dequantize(cp.asarray(codes), cp.asarray(scales), 0.5, n, k, check=False), ref)


@pytest.mark.slow
@pytest.mark.parametrize("n, k", REAL_SHAPES)
def test_qpn2_real_shapes(cp, n, k):
    rng = np.random.default_rng(n * 7 + k)
    codes, scales = qpn2_buffers(rng, n, k)
    run_qpn2(cp, codes, scales, per_tile_scales(rng, n), n, k, device_g=True)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tiles=st.integers(1, 6), k64=st.integers(1, 10), seed=st.integers(0, 2**31 - 1), per_tile=st.booleans())
def test_qpn2_drawn_shapes(cp, tiles, k64, seed, per_tile):
    rng = np.random.default_rng(seed)
    n, k = 32 * tiles, 64 * k64
    codes, scales = qpn2_buffers(rng, n, k)
    g = per_tile_scales(rng, n) if per_tile else np.float32(np.exp2(rng.uniform(-20, 4)))
    run_qpn2(cp, codes, scales, g, n, k)


# ----------------------------------------------------------------------------- QPN8 bytes


def fp8(rng, n, k):
    return rng.choice(NON_NAN_E4M3, size=(n, k)).astype(np.uint8)


def run_qpn8(cp, codes, group_scales, n, k, **kwargs):
    from qpn.cupy_kernels import qpn8_dequantize

    out = qpn8_dequantize(cp.asarray(codes), cp.asarray(group_scales), n, k, **kwargs)
    assert_same_fp16(out, ref_qpn8_dequantize(codes, group_scales, n, k))
    return out


@pytest.mark.parametrize("n, k", QPN8_SHAPES)
def test_qpn8_channel(cp, n, k):
    rng = np.random.default_rng(n * k)
    scale = np.exp2(rng.uniform(-40, 7, size=n)).astype(np.float32)  # subnormal S16 included
    codes, group_scales = qpn8_prepack(fp8(rng, n, k), scale)
    run_qpn8(cp, codes, group_scales, n, k)


def test_qpn8_tensor_every_weight_code(cp):
    n, k = 128, 256
    rng = np.random.default_rng(3)
    weight = rng.permutation(np.resize(NON_NAN_E4M3, n * k)).reshape(n, k)
    for s in (2.0**-30, 0.01, 1.0, 146.0):
        codes, group_scales = qpn8_prepack(weight, np.float32(s))
        run_qpn8(cp, codes, group_scales, n, k)


@pytest.mark.parametrize("n, k", QPN8_BLOCK_SHAPES)
def test_qpn8_block(cp, n, k):
    rng = np.random.default_rng(n + 3 * k)
    scale = np.exp2(rng.uniform(-30, 7, size=(n // 128, k // 128))).astype(np.float32)
    codes, group_scales = qpn8_prepack(fp8(rng, n, k), scale)
    run_qpn8(cp, codes, group_scales, n, k)


def test_qpn8_zero_scale_channel_and_out(cp):
    from qpn.cupy_kernels import qpn8_dequantize

    n, k = 64, 64
    rng = np.random.default_rng(4)
    codes, group_scales = qpn8_prepack(fp8(rng, n, k), np.full(n, 0.02, np.float32))
    group_scales[0, 5] = 0.0  # an all-zero channel's S16 (qpn.ref accepts +0)
    out = cp.full((n, k), np.nan, dtype=cp.float16)
    assert qpn8_dequantize(cp.asarray(codes.reshape(-1)), cp.asarray(group_scales), n, k, out=out) is out
    assert_same_fp16(out, ref_qpn8_dequantize(codes, group_scales, n, k))


@pytest.mark.slow
@pytest.mark.parametrize("n, k", REAL_SHAPES)
def test_qpn8_real_shapes(cp, n, k):
    rng = np.random.default_rng(n * 5 + k)
    codes, group_scales = qpn8_prepack(fp8(rng, n, k), np.exp2(rng.uniform(-12, 0, size=n)).astype(np.float32))
    run_qpn8(cp, codes, group_scales, n, k)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tiles=st.integers(1, 6), k16=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_qpn8_drawn_shapes(cp, tiles, k16, seed):
    rng = np.random.default_rng(seed)
    n, k = 32 * tiles, 16 * k16
    codes, group_scales = qpn8_prepack(fp8(rng, n, k), np.exp2(rng.uniform(-20, 7, size=n)).astype(np.float32))
    run_qpn8(cp, codes, group_scales, n, k)


# ----------------------------------------------------------------------------- rejections


def reference_message(fn, *args) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args)
    return str(info.value)


@pytest.mark.parametrize("case", ["nan_scale", "overflow", "overflow_per_tile", "bad_device_g", "negative_device_g"])
def test_qpn2_rejects_like_the_reference(cp, case):
    from qpn.cupy_kernels import qpn2_dequantize

    n, k = 64, 128
    rng = np.random.default_rng(5)
    weight_packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    weight_scale = np.full((n, k // 16), 0x38, np.uint8)  # e4m3 1.0
    g = np.float32(1.0)
    if case == "overflow":
        weight_scale[33, 6] = 0x7E  # 448: 6 * 448 * 25 = 67200 > 65504
        g = np.float32(25.0)
    elif case == "overflow_per_tile":
        weight_scale[40, 2] = 0x7E
        g = np.array([1.0, 25.0], np.float32)  # only tile 1 overflows
    elif case in ("bad_device_g", "negative_device_g"):
        g = np.array([1.0, np.nan if case == "bad_device_g" else -2.0], np.float32)
    codes, scales = qpn2_prepack(weight_packed, weight_scale)
    if case == "nan_scale":
        scales = scales.copy()
        scales[0, 5] = 0xFF  # a NaN scale byte smuggled into the packed buffer
    expected = reference_message(ref_qpn2_dequantize, codes, scales, g, n, k)
    out = cp.full((n, k), 7, dtype=cp.float16)
    with pytest.raises(ValueError) as info:
        qpn2_dequantize(cp.asarray(codes), cp.asarray(scales), cp.asarray(g), n, k, out=out)
    assert str(info.value) == expected
    assert bool((out == 7).all()), "a rejected call must not write the output"


def test_qpn2_rejects_bad_arguments(cp):
    from qpn.cupy_kernels import qpn2_dequantize

    n, k = 32, 64
    codes, scales = cp.zeros((n, k // 2), cp.uint8), cp.zeros((n, k // 16), cp.uint8)
    with pytest.raises(ValueError, match=r"K must be a positive multiple of 64 for QPN2, got K=96"):
        qpn2_dequantize(codes, scales, 1.0, n, 96)
    with pytest.raises(ValueError, match=r"N must be a positive multiple of 32 for QPN2, got N=40"):
        qpn2_dequantize(codes, scales, 1.0, 40, k)
    with pytest.raises(ValueError, match=r"codes must have shape \(32, 32\) .* or \(1024,\), got \(32, 16\)"):
        qpn2_dequantize(cp.zeros((n, 16), cp.uint8), scales, 1.0, n, k)
    with pytest.raises(ValueError, match=r"global_scale must be float32"):
        qpn2_dequantize(codes, scales, np.array(1.0), n, k)
    with pytest.raises(ValueError, match=r"global_scale must be a scalar or hold one value per 32-column tile"):
        qpn2_dequantize(codes, scales, np.ones(3, np.float32), n, k)
    with pytest.raises(ValueError, match=r"global_scale must be finite and > 0"):
        qpn2_dequantize(codes, scales, np.float32(np.inf), n, k)
    with pytest.raises(ValueError, match=r"out must have shape \(32, 64\)"):
        qpn2_dequantize(codes, scales, 1.0, n, k, out=cp.empty((64, 32), cp.float16))
    with pytest.raises(ValueError, match=r"out must have dtype float16"):
        qpn2_dequantize(codes, scales, 1.0, n, k, out=cp.empty((n, k), cp.float32))
    with pytest.raises(ValueError, match=r"n must be an int"):
        qpn2_dequantize(codes, scales, 1.0, 32.0, k)


@pytest.mark.parametrize("case", ["nan_code", "negative_scale", "nan_scale", "overflow_scale"])
def test_qpn8_rejects_like_the_reference(cp, case):
    from qpn.cupy_kernels import qpn8_dequantize

    n, k = 64, 64
    rng = np.random.default_rng(6)
    codes, group_scales = qpn8_prepack(fp8(rng, n, k), np.full(n, 0.02, np.float32))
    codes, group_scales = codes.copy(), group_scales.copy()
    if case == "nan_code":
        codes[10, 33] = 0x7F
    else:
        group_scales[0, 12] = {"negative_scale": -1.0, "nan_scale": np.nan, "overflow_scale": 40000.0}[case]
    expected = reference_message(ref_qpn8_dequantize, codes, group_scales, n, k)
    out = cp.full((n, k), 7, dtype=cp.float16)
    with pytest.raises(ValueError) as info:
        qpn8_dequantize(cp.asarray(codes), cp.asarray(group_scales), n, k, out=out)
    assert str(info.value) == expected
    assert bool((out == 7).all()), "a rejected call must not write the output"


def test_qpn8_rejects_bad_group_scale_shapes_like_the_reference(cp):
    from qpn.cupy_kernels import qpn8_dequantize

    n, k = 64, 128
    codes = np.zeros((n, k), np.uint8)
    for shape in [(1, 32), (2, 2), (64,)]:
        group_scales = np.ones(shape, np.float16)
        if len(shape) == 2:
            expected = reference_message(ref_qpn8_dequantize, codes, group_scales, n, k)
            with pytest.raises(ValueError) as info:
                qpn8_dequantize(cp.asarray(codes), cp.asarray(group_scales), n, k)
            assert str(info.value) == expected
        else:
            with pytest.raises(ValueError, match=r"group_scales must be 2-D"):
                qpn8_dequantize(cp.asarray(codes), cp.asarray(group_scales), n, k)
