"""MXFP4 in the reference (qpn.ref.mxfp4; issue 23, part 1): the e8m0 codec and the dequantization bit for
bit against ml_dtypes (float4_e2m1fn, float8_e8m0fnu) and against transformers' gpt-oss converter in
float32, scale bytes 0, 0xFE and 0xFF included, and the nibble order of gpt-oss's *_blocks; the OCP
quantizer; the W16 rule (exact within 36 binades of a tile's largest scale, no overflow ever, the derived
bound below, the kernels' one fp16 multiply); the QPNMX layout's bytes and its exact inverse."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qpn.ref import decode_e2m1, qpn2_prepack, unpack_nibbles
from qpn.ref import mxfp4 as mx
from qpn.ref.codecs import decode_e8m0
from qpn.ref.formats import QPNMX
from qpn.ref.geometry import COLUMN_OF_LANE


def random_mxfp4(rng: np.random.Generator, shape: tuple[int, ...], scale_bytes: np.ndarray) -> mx.MXFP4Weight:
    """Random blocks [*shape, 16] and scales [*shape] drawn from `scale_bytes`."""
    blocks = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
    return mx.MXFP4Weight(blocks, rng.choice(scale_bytes, shape).astype(np.uint8))


def ml_dtypes_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """ml_dtypes' decode: each nibble as float4_e2m1fn, each scale as float8_e8m0fnu, multiplied in float64."""
    low, high = blocks & 0xF, blocks >> 4
    codes = np.stack([low, high], axis=-1).reshape(*blocks.shape[:-1], 32)
    e2m1 = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    return (e2m1 * scale[..., None]).reshape(*blocks.shape[:-2], -1)


# ----------------------------------------------------------------------------- decoding


def test_e8m0_decodes_as_ml_dtypes_every_byte():
    bits = np.arange(256, dtype=np.uint8)
    want = bits.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = decode_e8m0(bits)
    assert np.array_equal(got, want, equal_nan=True) and np.isnan(got[0xFF]) and got[0] == 2.0**-127


def test_dequantize_equals_ml_dtypes_every_code_and_the_edge_scales():
    rng = np.random.default_rng(0)
    every = np.arange(256, dtype=np.uint8)
    w = random_mxfp4(rng, (8, 6), np.concatenate([every, [0, 0xFE, 0xFF] * 20]))
    w.blocks[0, 0] = np.arange(16, dtype=np.uint8) * 0x11  # every code in both nibbles
    w.scales[0, :3] = (0x00, 0xFE, 0xFF)
    want = ml_dtypes_values(*w)
    assert np.array_equal(mx.mxfp4_values(*w), want, equal_nan=True)
    with np.errstate(over="ignore"):
        assert np.array_equal(mx.mxfp4_dequantize(*w), want.astype(np.float32), equal_nan=True)
    assert np.isinf(mx.mxfp4_dequantize(*w)[0, 32:64]).any()  # {2, 3, 4, 6} * 2^127 leave float32
    with pytest.raises(ValueError, match=r"e8m0 NaN byte 0xFF at index \(0, 2\)"):
        mx.mxfp4_dequantize(*w, nan="raise")


def test_the_low_nibble_is_the_earlier_element():
    blocks = np.zeros((1, 1, 16), np.uint8)
    blocks[0, 0, 0] = 0x21  # element 0: code 1 (0.5), element 1: code 2 (1.0)
    blocks[0, 0, 15] = 0xF7  # element 30: code 7 (6.0), element 31: code 15 (-6.0)
    got = mx.mxfp4_dequantize(blocks, np.full((1, 1), 127, np.uint8))[0]
    assert (got[0], got[1], got[30], got[31]) == (0.5, 1.0, 6.0, -6.0) and not got[2:30].any()


def test_dequantize_equals_transformers_gpt_oss_converter_in_float32():
    torch = pytest.importorskip("torch")
    converter = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(1)
    w = random_mxfp4(rng, (3, 64, 4), np.arange(0xFF, dtype=np.uint8))  # experts [E, N, K/32]; no NaN byte
    w.scales[0, 0, :2] = (0x00, 0xFE)
    got = converter.convert_moe_packed_tensors(torch.from_numpy(w.blocks), torch.from_numpy(w.scales),
                                               dtype=torch.float32)
    with np.errstate(over="ignore"):
        want = mx.mxfp4_dequantize(*w)
    assert np.array_equal(got.transpose(1, 2).numpy(), want)  # it returns [E, K, N], HF's in-features-first


# ----------------------------------------------------------------------------- quantizing


def test_quantize_follows_the_ocp_rule():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 256)) * np.exp2(rng.integers(-20, 20, (4, 1)))
    q = mx.mxfp4_quantize(w.astype(np.float32))
    blocks = w.astype(np.float32).astype(np.float64).reshape(4, 8, 32)
    x = np.floor(np.log2(np.abs(blocks).max(axis=-1))) - 2
    assert np.array_equal(q.scales, (x + 127).astype(np.uint8))
    scaled = (blocks / np.exp2(x)[..., None]).astype(np.float32)  # in [-8, 8): saturate, then e2m1 RNE
    want = np.clip(scaled, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    assert np.array_equal(np.stack([q.blocks & 0xF, q.blocks >> 4], -1).reshape(4, 8, 32), want)


def test_quantize_round_trips_representable_values_and_clamps_the_range():
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, (2, 64)).astype(np.uint8)
    codes[:, ::32] = 7  # each block holds a 6, so its amax fixes X
    x = rng.integers(-127, 126, (2, 2))  # 6 * 2^x: floor(log2) - 2 = x
    w = np.ldexp(decode_e2m1(codes).astype(np.float64), np.repeat(x, 32, axis=1))
    q = mx.mxfp4_quantize(w)
    assert np.array_equal(mx.mxfp4_values(*q), w)
    tiny, huge = mx.mxfp4_quantize(np.full((1, 32), 2.0**-140)), mx.mxfp4_quantize(np.full((1, 32), 2.0**200))
    assert tiny.scales[0, 0] == 0 and huge.scales[0, 0] == 0xFE  # X clamped to e8m0's [-127, 127]
    assert (mx.mxfp4_values(*huge) == 6 * 2.0**127).all()  # saturated
    zero = mx.mxfp4_quantize(np.array([[0.0] * 31 + [-0.0]]))
    assert zero.scales[0, 0] == 0 and zero.blocks[0, 0, 15] == 0x80  # -0.0 keeps its sign bit
    for bad, match in ((np.full((1, 32), np.nan), "NaN or inf"), (np.zeros((1, 48)), "K % 32"),
                       (np.zeros((1, 32), np.int32), "floating-point")):
        with pytest.raises(ValueError, match=match):
            mx.mxfp4_quantize(bad)


# ----------------------------------------------------------------------------- W16


def test_w16_is_exact_within_36_binades_of_the_tile_and_never_overflows():
    rng = np.random.default_rng(4)
    top = rng.integers(40, 250, (3,))  # each 32-row tile's largest scale byte
    scales = (top[:, None, None] - rng.integers(0, mx.W16_EXACT_SPAN + 1, (3, 32, 4))).reshape(96, 4)
    w = random_mxfp4(rng, (96, 4), np.zeros(1, np.uint8))._replace(scales=scales.astype(np.uint8))
    w16, tile_scale = mx.mxfp4_w16(*w)
    assert np.array_equal(tile_scale, np.exp2(top - 127 - 13).astype(np.float32))
    assert np.abs(w16.astype(np.float64)).max() <= 6 * 2**13
    effective = w16.astype(np.float64) * np.repeat(tile_scale.astype(np.float64), 32)[:, None]
    assert np.array_equal(effective, mx.mxfp4_values(*w))


def test_w16_below_the_span_is_the_kernels_decode_within_the_bound():
    """Blocks 30-59 binades below the tile's top: QPN2's decode with {X, Y} = {2^F, 0} (one fp16 fma, as
    numpy's float16 multiply rounds once) where F >= -24, its exact fp32 path (RN16(RN32(e * 2^F)))
    below, give the W16 bits; the error is one rounding into fp16's subnormals, and it occurs."""
    rng = np.random.default_rng(5)
    scales = np.full((32, 8), 200, np.uint8)
    scales[1:, :] = 200 - rng.integers(30, 60, (31, 8))
    w = random_mxfp4(rng, (32, 8), np.zeros(1, np.uint8))._replace(scales=scales)
    w16, tile_scale = mx.mxfp4_w16(*w)
    t = 200 - 127 - 13
    f = (scales.astype(np.int64) - 127 - t)[..., None]
    e = decode_e2m1(unpack_nibbles(w.blocks))
    fast = e.astype(np.float16) * np.exp2(np.maximum(f, -24)).astype(np.float16)
    exact = (e * np.exp2(f.astype(np.float32))).astype(np.float32).astype(np.float16)
    decoded = np.where(f >= -24, fast, exact)
    assert np.array_equal(w16.reshape(32, 8, 32).view(np.uint16), decoded.view(np.uint16))
    error = np.abs(w16.astype(np.float64) * float(tile_scale[0]) - mx.mxfp4_values(*w))
    assert error.max() <= 2.0 ** (t - 25) and error.max() > 0  # the bound, and it is reached here


def test_nan_scales_have_no_w16():
    scales = np.full((32, 2), 127, np.uint8)
    scales[5, 1] = 0xFF
    with pytest.raises(ValueError, match=r"0xFF at index \(5, 1\)"):
        mx.mxfp4_w16(np.zeros((32, 2, 16), np.uint8), scales)


def test_the_linear_applies_the_tile_power_after_the_sum():
    rng = np.random.default_rng(6)
    w = mx.mxfp4_quantize((rng.standard_normal((64, 128)) * 1e3).astype(np.float32))  # values past fp16's range
    w16, tile_scale = mx.mxfp4_w16(*w)
    x = (rng.standard_normal((3, 128)) * 1e-3).astype(np.float16)
    want = (x.astype(np.float64) @ mx.mxfp4_values(*w).T).astype(np.float16)
    assert np.array_equal(mx.mxfp4_linear(x, w16, tile_scale), want)  # 2^T exact: the same one rounding


# ----------------------------------------------------------------------------- the QPNMX layout


def test_qpnmx_bytes_and_inverse():
    rng = np.random.default_rng(7)
    n, k = 64, 128
    w = random_mxfp4(rng, (n, k // 32), np.arange(100, 140, dtype=np.uint8))
    codes, scales, tile_scale = mx.qpnmx_prepack(*w)
    assert [a.shape for a in (codes, scales, tile_scale)] == list(QPNMX.buffer_shapes(n, k).values())
    assert np.array_equal(codes, qpn2_prepack(w.blocks.reshape(n, k // 2), np.zeros((n, k // 16), np.uint8))[0])
    flat = scales.reshape(-1)  # (t * B + b) * 32 + lane holds scales[32 t + col(lane), b]
    for t in range(n // 32):
        for b in range(k // 32):
            assert np.array_equal(flat[(t * (k // 32) + b) * 32:][:32], w.scales[32 * t + COLUMN_OF_LANE, b])
    blocks, raw = mx.qpnmx_unpack(codes, scales, n, k)
    assert np.array_equal(blocks, w.blocks) and np.array_equal(raw, w.scales)
    w16 = mx.qpnmx_dequantize(codes, scales, tile_scale, n, k)
    assert np.array_equal(w16.view(np.uint16), mx.mxfp4_w16(*w)[0].view(np.uint16))
    wrong = tile_scale.copy()
    wrong[1] *= 2
    with pytest.raises(ValueError, match=r"tile_scale\[1\].*re-run qpnmx_prepack"):
        mx.qpnmx_dequantize(codes, scales, wrong, n, k)


def test_qpnmx_prepack_validates_before_any_work():
    good = mx.MXFP4Weight(np.zeros((32, 2, 16), np.uint8), np.full((32, 2), 127, np.uint8))
    bad_scales = good.scales.copy()
    bad_scales[3, 0] = 0xFF
    for args, match in (((good.blocks[:16], good.scales[:16]), "N must be a positive multiple of 32"),
                        ((good.blocks[:, :1], good.scales[:, :1]), "K must be a positive multiple of 64"),
                        ((good.blocks, bad_scales), "0xFF at index"),
                        ((good.blocks, good.scales[:, :1]), "scales")):
        with pytest.raises(ValueError, match=match):
            mx.qpnmx_prepack(*args)


def test_the_linear_bounds_hold_the_reference_and_an_fp32_sum():
    rng = np.random.default_rng(8)
    w = mx.mxfp4_quantize(rng.standard_normal((64, 512)).astype(np.float32))
    w16, tile_scale = mx.mxfp4_w16(*w)
    x = rng.standard_normal((4, 512)).astype(np.float16)
    lo, hi = mx.mxfp4_linear_bounds(x, w16, tile_scale)
    fp32 = ((x.astype(np.float32) @ w16.astype(np.float32).T) * np.repeat(tile_scale, 32)).astype(np.float16)
    for y in (mx.mxfp4_linear(x, w16, tile_scale), fp32):
        assert ((lo <= y) & (y <= hi)).all()
    width = hi.astype(np.float64) - lo.astype(np.float64)
    assert (width > 0).any() and (width <= 2.0**-4 * (np.abs(fp32.astype(np.float64)) + 1)).all()  # narrow
