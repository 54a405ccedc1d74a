"""GPU prepack (cupy_kernels/prepack.py) against qpn.ref: the same bytes, the same rejections.

Byte equality on random codes, on every non-NaN e4m3 scale code, on real model shapes and on
hypothesis-drawn aligned shapes; every rejection path raises the reference's own message.
All tests need a GPU (marked gpu; tests/conftest.py skips them, with the reason, without one).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qpn.ref import qpn2_prepack as ref_qpn2_prepack
from qpn.ref import qpn8_prepack as ref_qpn8_prepack

pytestmark = pytest.mark.gpu

NON_NAN_E4M3 = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)  # 254 codes
QPN2_SHAPES = [(32, 64), (64, 128), (96, 192), (32, 1024), (256, 64)]  # (N, K): K % 64, N % 32
QPN8_SHAPES = [(32, 16), (32, 48), (64, 80), (96, 256), (128, 128), (256, 384)]  # K % 16 (ragged chunks too)
QPN8_BLOCK_SHAPES = [(128, 128), (256, 384), (384, 256)]  # N, K % 128
REAL_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
SEEDS = (0, 1)


def nvfp4_tensors(rng, n, k):
    weight_packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)  # every nibble, -0 included
    weight_scale = rng.choice(NON_NAN_E4M3, size=(n, k // 16)).astype(np.uint8)
    return weight_packed, weight_scale


def fp8_weight(rng, n, k):
    return rng.choice(NON_NAN_E4M3, size=(n, k)).astype(np.uint8)


def fp8_scale(rng, shape):
    # log-uniform over 2^-40 .. 2^7 (the largest legal s is just below 146.1875): subnormal S16 too
    return np.exp2(rng.uniform(-40, 7, size=shape)).astype(np.float32)


def assert_same_bytes(gpu, ref):
    gpu = gpu.get()
    assert gpu.shape == ref.shape and gpu.dtype == ref.dtype
    assert np.array_equal(gpu.view(np.uint8), np.ascontiguousarray(ref).view(np.uint8))


def run_qpn2(cp, weight_packed, weight_scale):
    from qpn.cupy_kernels import qpn2_prepack

    codes, scales = qpn2_prepack(cp.asarray(weight_packed), cp.asarray(weight_scale))
    ref_codes, ref_scales = ref_qpn2_prepack(weight_packed, weight_scale)
    assert_same_bytes(codes, ref_codes)
    assert_same_bytes(scales, ref_scales)


def run_qpn8(cp, weight, weight_scale, granularity=None):
    from qpn.cupy_kernels import qpn8_prepack

    codes, group_scales = qpn8_prepack(cp.asarray(weight), cp.asarray(weight_scale), granularity)
    ref_codes, ref_scales = ref_qpn8_prepack(weight, weight_scale, granularity)
    assert_same_bytes(codes, ref_codes)
    assert_same_bytes(group_scales, ref_scales)


# ----------------------------------------------------------------------------- QPN2 bytes


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n, k", QPN2_SHAPES)
def test_qpn2_prepack_random(cp, n, k, seed):
    run_qpn2(cp, *nvfp4_tensors(np.random.default_rng(seed), n, k))


def test_qpn2_prepack_every_scale_code(cp):
    n, k = 64, 256  # 1024 scale bytes: every non-NaN code four times, in shuffled places
    rng = np.random.default_rng(7)
    weight_packed, _ = nvfp4_tensors(rng, n, k)
    weight_scale = rng.permutation(np.resize(NON_NAN_E4M3, n * k // 16)).reshape(n, k // 16)
    assert set(np.unique(weight_scale)) == set(NON_NAN_E4M3)
    run_qpn2(cp, weight_packed, weight_scale)


def test_qpn2_prepack_arange_bytes(cp):
    # readable failures: every byte distinct modulo 256 along the row
    n, k = 32, 64
    weight_packed = (np.arange(n * k // 2) % 256).astype(np.uint8).reshape(n, k // 2)
    weight_scale = (np.arange(n * k // 16) % 0x7F).astype(np.uint8).reshape(n, k // 16)
    run_qpn2(cp, weight_packed, weight_scale)


@pytest.mark.slow
@pytest.mark.parametrize("n, k", REAL_SHAPES)
def test_qpn2_prepack_real_shapes(cp, n, k):
    run_qpn2(cp, *nvfp4_tensors(np.random.default_rng(n + k), n, k))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tiles=st.integers(1, 8), k64=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_qpn2_prepack_drawn_shapes(cp, tiles, k64, seed):
    run_qpn2(cp, *nvfp4_tensors(np.random.default_rng(seed), 32 * tiles, 64 * k64))


# ----------------------------------------------------------------------------- QPN8 bytes


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n, k", QPN8_SHAPES)
def test_qpn8_prepack_channel(cp, n, k, seed):
    rng = np.random.default_rng(seed)
    run_qpn8(cp, fp8_weight(rng, n, k), fp8_scale(rng, (n,)))


@pytest.mark.parametrize("scale_shape", [(), (1,), (1, 1)])
def test_qpn8_prepack_tensor(cp, scale_shape):
    rng = np.random.default_rng(3)
    run_qpn8(cp, fp8_weight(rng, 64, 96), np.full(scale_shape, 0.0123, dtype=np.float32))


def test_qpn8_prepack_channel_column_vector(cp):
    rng = np.random.default_rng(4)
    run_qpn8(cp, fp8_weight(rng, 64, 64), fp8_scale(rng, (64, 1)))


@pytest.mark.parametrize("n, k", QPN8_BLOCK_SHAPES)
def test_qpn8_prepack_block(cp, n, k):
    rng = np.random.default_rng(n * k)
    run_qpn8(cp, fp8_weight(rng, n, k), fp8_scale(rng, (n // 128, k // 128)))


def test_qpn8_prepack_single_block_as_block(cp):
    rng = np.random.default_rng(5)
    run_qpn8(cp, fp8_weight(rng, 128, 128), fp8_scale(rng, (1, 1)), granularity="block")


def test_qpn8_prepack_every_weight_code_and_scale_edges(cp):
    n, k = 256, 128
    rng = np.random.default_rng(11)
    weight = rng.permutation(np.resize(NON_NAN_E4M3, n * k)).reshape(n, k)
    # S16 edges: subnormal S16, exact powers of two, ties of RN16(256 s), the largest legal s
    edges = np.array([2.0**-40, 2.0**-33, 2.0**-25, 2.0**-8, 1.0 / 3.0, 0.01, 1.0, 146.0, 146.18749],
                     dtype=np.float32)
    scale = np.resize(edges, n).astype(np.float32)
    run_qpn8(cp, weight, scale)


@pytest.mark.slow
@pytest.mark.parametrize("n, k", REAL_SHAPES)
def test_qpn8_prepack_real_shapes(cp, n, k):
    rng = np.random.default_rng(n * 3 + k)
    run_qpn8(cp, fp8_weight(rng, n, k), fp8_scale(rng, (n,)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tiles=st.integers(1, 8), k16=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_qpn8_prepack_drawn_shapes(cp, tiles, k16, seed):
    rng = np.random.default_rng(seed)
    n, k = 32 * tiles, 16 * k16
    run_qpn8(cp, fp8_weight(rng, n, k), fp8_scale(rng, (n,)))


# ----------------------------------------------------------------------------- rejections


def reference_message(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("nan_byte", [0x7F, 0xFF])
def test_qpn2_prepack_rejects_nan_scale_like_the_reference(cp, nan_byte):
    from qpn.cupy_kernels import qpn2_prepack

    weight_packed, weight_scale = nvfp4_tensors(np.random.default_rng(0), 64, 128)
    weight_scale[37, 5] = nan_byte
    weight_scale[50, 1] = nan_byte
    expected = reference_message(ref_qpn2_prepack, weight_packed, weight_scale)
    with pytest.raises(ValueError) as info:
        qpn2_prepack(cp.asarray(weight_packed), cp.asarray(weight_scale))
    assert str(info.value) == expected


@pytest.mark.parametrize("n, k", [(48, 64), (32, 96), (32, 32)])
def test_qpn2_prepack_rejects_misaligned_dims_like_the_reference(cp, n, k):
    from qpn.cupy_kernels import qpn2_prepack

    weight_packed = np.zeros((n, k // 2), np.uint8)
    weight_scale = np.zeros((n, k // 16), np.uint8)
    expected = reference_message(ref_qpn2_prepack, weight_packed, weight_scale)
    with pytest.raises(ValueError) as info:
        qpn2_prepack(cp.asarray(weight_packed), cp.asarray(weight_scale))
    assert str(info.value) == expected


def test_qpn2_prepack_rejects_bad_arrays(cp):
    from qpn.cupy_kernels import qpn2_prepack

    wp = cp.zeros((32, 32), cp.uint8)
    ws = cp.zeros((32, 4), cp.uint8)
    with pytest.raises(ValueError, match=r"weight_packed must be a cupy.ndarray"):
        qpn2_prepack(np.zeros((32, 32), np.uint8), ws)
    with pytest.raises(ValueError, match=r"weight_scale must have dtype uint8, got float32"):
        qpn2_prepack(wp, ws.astype(cp.float32))
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(32, 4\), got \(32, 8\)"):
        qpn2_prepack(wp, cp.zeros((32, 8), cp.uint8))
    with pytest.raises(ValueError, match=r"weight_packed must be C-contiguous"):
        qpn2_prepack(cp.zeros((32, 64), cp.uint8)[:, ::2], ws)
    with pytest.raises(ValueError, match=r"weight_packed must start on a 16-byte boundary"):
        qpn2_prepack(cp.zeros(32 * 32 + 8, cp.uint8)[8:].reshape(32, 32), ws)


@pytest.mark.parametrize(
    "case",
    ["nan_weight", "zero_scale", "negative_scale", "inf_scale", "nan_scale", "overflow_scale", "s16_inf"],
)
def test_qpn8_prepack_rejects_like_the_reference(cp, case):
    from qpn.cupy_kernels import qpn8_prepack

    rng = np.random.default_rng(1)
    weight, scale = fp8_weight(rng, 64, 64), fp8_scale(rng, (64,))
    if case == "nan_weight":
        weight[9, 17] = 0xFF
        weight[40, 3] = 0x7F
    else:
        scale[21] = {"zero_scale": 0.0, "negative_scale": -0.5, "inf_scale": np.inf, "nan_scale": np.nan,
                     "overflow_scale": 146.1875, "s16_inf": 300.0}[case]
    expected = reference_message(ref_qpn8_prepack, weight, scale)
    with pytest.raises(ValueError) as info:
        qpn8_prepack(cp.asarray(weight), cp.asarray(scale))
    assert str(info.value) == expected


@pytest.mark.parametrize(
    "n, k, scale_shape, granularity",
    [(48, 64, (48,), None), (32, 24, (32,), None), (64, 64, (3,), None), (96, 128, (1, 1), "block"),
     (128, 192, (1, 2), None), (64, 64, (64,), "tensor")],
)
def test_qpn8_prepack_rejects_shapes_like_the_reference(cp, n, k, scale_shape, granularity):
    from qpn.cupy_kernels import qpn8_prepack

    weight = np.zeros((n, k), np.uint8)
    scale = np.ones(scale_shape, np.float32)
    expected = reference_message(ref_qpn8_prepack, weight, scale, granularity)
    with pytest.raises(ValueError) as info:
        qpn8_prepack(cp.asarray(weight), cp.asarray(scale), granularity)
    assert str(info.value) == expected


def test_qpn8_prepack_accepts_host_scales_and_rejects_wrong_dtype(cp):
    from qpn.cupy_kernels import qpn8_prepack

    rng = np.random.default_rng(2)
    weight, scale = fp8_weight(rng, 32, 32), fp8_scale(rng, (32,))
    codes, group_scales = qpn8_prepack(cp.asarray(weight), scale)  # numpy scale is uploaded
    ref_codes, ref_scales = ref_qpn8_prepack(weight, scale)
    assert_same_bytes(codes, ref_codes)
    assert_same_bytes(group_scales, ref_scales)
    with pytest.raises(ValueError, match=r"weight_scale must have dtype float32, got float64"):
        qpn8_prepack(cp.asarray(weight), scale.astype(np.float64))
    with pytest.raises(ValueError, match=r"weight must have dtype uint8"):
        qpn8_prepack(cp.asarray(weight).astype(cp.int8), scale)
