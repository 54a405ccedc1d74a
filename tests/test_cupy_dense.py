"""The dense prefill path (cupy_kernels/dense.py): dequantize + cuBLAS.

1. Bit identity: y equals cupy.matmul(x, W16_ref.T) on the reference W16 (qpn.ref), byte for byte.
2. Accuracy contract: y lies inside qpn.ref.linear_bounds(x, W16) (fp32-or-wider accumulation in
   any order, one RN16; derivation in ref/linear.py), which an fp16 accumulator would leave.
"""

from __future__ import annotations

import numpy as np
import pytest

from qpn.ref import linear_bounds, qpn2_dequantize, qpn2_prepack, qpn8_dequantize, qpn8_prepack

pytestmark = pytest.mark.gpu

NON_NAN_E4M3 = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)
SHAPES = [(64, 128), (256, 512), (4096, 4096)]  # (N, K)
MS = (1, 7, 64, 300)


def activations(rng, m, k):
    return rng.standard_normal((m, k)).astype(np.float16)


def nvfp4_layer(rng, n, k):
    # realistic magnitudes: e4m3 block scales around 1..448 times g = amax / 2688 with amax ~ 0.1
    weight_packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    weight_scale = rng.integers(0x28, 0x7E, size=(n, k // 16), dtype=np.uint8)  # 2^-2 .. 448
    codes, scales = qpn2_prepack(weight_packed, weight_scale)
    g = np.float32(0.1 / 2688)
    return codes, scales, g, qpn2_dequantize(codes, scales, g, n, k)


def fp8_layer(rng, n, k, block=False):
    weight = rng.choice(NON_NAN_E4M3, size=(n, k)).astype(np.uint8)
    scale_shape = (n // 128, k // 128) if block else (n,)
    scale = (rng.uniform(0.5, 2.0, size=scale_shape) * 1e-3).astype(np.float32)
    codes, group_scales = qpn8_prepack(weight, scale)
    return codes, group_scales, qpn8_dequantize(codes, group_scales, n, k)


def assert_bit_identical_to_cublas(cp, y, x, w_ref):
    y_cublas = cp.matmul(cp.asarray(x), cp.asarray(w_ref).T)
    assert np.array_equal(y.get().view(np.uint16), y_cublas.get().view(np.uint16))


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n, k", SHAPES)
def test_qpn2_dense_is_cublas_on_the_reference_weights(cp, n, k, m):
    from qpn.cupy_kernels import qpn2_dense_linear

    rng = np.random.default_rng(n + k + m)
    codes, scales, g, w_ref = nvfp4_layer(rng, n, k)
    x = activations(rng, m, k)
    y = qpn2_dense_linear(cp.asarray(x), cp.asarray(codes), cp.asarray(scales), cp.asarray(g))
    assert y.shape == (m, n) and y.dtype == cp.float16
    assert_bit_identical_to_cublas(cp, y, x, w_ref)


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n, k", SHAPES[1:])
def test_qpn8_dense_is_cublas_on_the_reference_weights(cp, n, k, m, block):
    from qpn.cupy_kernels import qpn8_dense_linear

    rng = np.random.default_rng(3 * n + k + m)
    codes, group_scales, w_ref = fp8_layer(rng, n, k, block)
    x = activations(rng, m, k)
    y = qpn8_dense_linear(cp.asarray(x), cp.asarray(codes), cp.asarray(group_scales))
    assert_bit_identical_to_cublas(cp, y, x, w_ref)


@pytest.mark.parametrize("fmt", ["qpn2", "qpn8"])
def test_dense_within_the_fp32_accumulation_bound(cp, fmt):
    from qpn.cupy_kernels import qpn2_dense_linear, qpn8_dense_linear

    n, k, m = 256, 4096, 64
    rng = np.random.default_rng(9)
    x = activations(rng, m, k)
    if fmt == "qpn2":
        codes, scales, g, w_ref = nvfp4_layer(rng, n, k)
        y = qpn2_dense_linear(cp.asarray(x), cp.asarray(codes), cp.asarray(scales), g)
    else:
        codes, group_scales, w_ref = fp8_layer(rng, n, k)
        y = qpn8_dense_linear(cp.asarray(x), cp.asarray(codes), cp.asarray(group_scales))
    lo, hi = linear_bounds(x, w_ref)
    y = y.get()
    inside = (lo <= y) & (y <= hi)
    assert inside.all(), f"{int((~inside).sum())} outputs outside the fp32-accumulation bound"


def test_dense_out_workspace_and_flat_buffers(cp):
    from qpn.cupy_kernels import qpn2_dense_linear

    n, k, m = 128, 256, 16
    rng = np.random.default_rng(10)
    codes, scales, g, w_ref = nvfp4_layer(rng, n, k)
    x = activations(rng, m, k)
    out = cp.full((m, n), np.nan, cp.float16)
    workspace = cp.empty((n, k), cp.float16)
    y = qpn2_dense_linear(cp.asarray(x), cp.asarray(codes.reshape(-1)), cp.asarray(scales), g, out=out,
                          workspace=workspace)
    assert y is out
    assert np.array_equal(workspace.get().view(np.uint16), w_ref.view(np.uint16))
    assert_bit_identical_to_cublas(cp, out, x, w_ref)


def test_dense_rejects_bad_arguments(cp):
    from qpn.cupy_kernels import qpn2_dense_linear, qpn8_dense_linear

    n, k = 64, 128
    codes, scales = cp.zeros((n, k // 2), cp.uint8), cp.zeros((n, k // 16), cp.uint8)
    x = cp.zeros((4, k), cp.float16)
    with pytest.raises(ValueError, match=r"x must have dtype float16, got float32"):
        qpn2_dense_linear(x.astype(cp.float32), codes, scales, 1.0)
    with pytest.raises(ValueError, match=r"x must have at least one row"):
        qpn2_dense_linear(cp.zeros((0, k), cp.float16), codes, scales, 1.0)
    with pytest.raises(ValueError,
                       match=r"codes has shape \(64, 64\), which holds rows of 128 inputs, but x has K=256"):
        qpn2_dense_linear(cp.zeros((4, 256), cp.float16), codes, scales, 1.0)
    with pytest.raises(ValueError, match=r"workspace must have shape \(64, 128\)"):
        qpn2_dense_linear(x, codes, scales, 1.0, workspace=cp.empty((n, 64), cp.float16))
    with pytest.raises(ValueError, match=r"out must have shape \(4, 64\)"):
        qpn2_dense_linear(x, codes, scales, 1.0, out=cp.empty((4, 32), cp.float16))
    with pytest.raises(ValueError, match=r"codes holds 1000 bytes"):
        qpn8_dense_linear(x, cp.zeros(1000, cp.uint8), cp.zeros((1, n), cp.float16))
