"""QPN8 layout (ref/qpn8.py): golden bytes and S16 values, a loop implementation of the spec
formula, the exact inverse, per-tensor / per-channel / 128x128-block scales, the weight
contract, and the overflow / NaN / alignment rejections.

Oracles: `spec_prepack_loop` is docs/QPN8.md read literally with Python ints; element values come
from ml_dtypes.float8_e4m3fn; RN16 of an exact float64 value is numpy's float64 -> float16 cast
(one correctly rounded step, pinned on tie cases in test_linear.py).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qpn.ref import fp8_dequantize, fp8_quantize, qpn8_dequantize, qpn8_prepack, qpn8_unpack

SPEC_KORDER = (0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
SPEC_LANE_COLUMNS = (0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27,
                     4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31)  # fmt: skip

GRANULARITIES = ("tensor", "channel", "block")
CHANNEL_SHAPES = [(32, 16), (64, 48), (96, 128), (32, 256)]  # N % 32, K % 16
BLOCK_SHAPES = [(128, 128), (256, 384)]  # N % 128, K % 128
REAL_SHAPES = [((4096, 4096), "channel"), ((14336, 4096), "block"), ((4096, 4096), "tensor")]
SLOW_SHAPES = [((5120, 17408), "block"), ((5120, 17408), "channel")]
SEEDS = (0, 1)
SPOT_CHECK_SAMPLES = 4096
E4M3_NAN_BYTES = (0x7F, 0xFF)
E4M3_FINITE_BYTES = np.array([b for b in range(256) if b not in E4M3_NAN_BYTES], dtype=np.uint8)


def u16(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint16)


def ordered_fp16(x: np.ndarray) -> np.ndarray:
    """fp16 bits -> integers whose difference counts fp16 ulps (+0 and -0 both map to 0)."""
    bits = u16(x).astype(np.int32)
    return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)


def spec_col(lane: int) -> int:
    return 8 * ((lane >> 2) & 3) + (lane & 3) + 4 * ((lane >> 4) & 1)


def spec_code_byte(weight, groups: int, flat: int) -> int:
    """QPN8 byte at flat ((t*G + g)*32 + lane)*16 + p = W[32t + col(lane)][16g + KORDER[p]]."""
    p = flat % 16
    lane = (flat // 16) % 32
    g = (flat // 512) % groups
    t = flat // 512 // groups
    return weight[32 * t + spec_col(lane)][16 * g + SPEC_KORDER[p]]


def spec_prepack_loop(weight: np.ndarray) -> np.ndarray:
    n, k = weight.shape
    rows = weight.tolist()
    return np.array([spec_code_byte(rows, k // 16, i) for i in range(n * k)], dtype=np.uint8)


def random_codes(n: int, k: int, seed: int) -> np.ndarray:
    """Every finite e4m3 byte (NaN bytes 0x7F / 0xFF moved to 0x7E / 0xFE)."""
    weight = np.random.default_rng(seed).integers(0, 256, size=(n, k), dtype=np.uint8)
    weight[(weight & 0x7F) == 0x7F] -= 1
    return weight


def random_scale(n: int, k: int, granularity: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 1000)
    shape = {"tensor": (), "channel": (n,), "block": (n // 128, k // 128)}[granularity]
    return (10.0 ** rng.uniform(-5, 0.5, size=shape)).astype(np.float32)


def expected_s16_map(scale: np.ndarray, granularity: str, n: int, k: int) -> np.ndarray:
    """float16 [n, k/16] straight from docs/QPN8.md (S16 = RN16(256 s)), via float64 -> fp16."""
    s16 = (scale.astype(np.float64) * 256.0).astype(np.float16)
    if granularity == "tensor":
        return np.full((n, k // 16), s16.reshape(()), np.float16)
    if granularity == "channel":
        return np.repeat(s16.reshape(n, 1), k // 16, axis=1)
    rows, groups = np.arange(n)[:, None], np.arange(k // 16)[None, :]
    return s16[rows // 128, groups // 8]  # row r, group g: block (r // 128, 16 g // 128)


def oracle_w16(weight: np.ndarray, s16_map: np.ndarray) -> np.ndarray:
    """W16 = RN16(e4m3 * 2^-8 * S16): ml_dtypes decode, exact float64 product, one RN16."""
    e4m3 = weight.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    n, k = weight.shape
    product = e4m3.reshape(n, k // 16, 16) * 2.0**-8 * s16_map.astype(np.float64)[..., None]
    return product.astype(np.float16).reshape(n, k)


# ----------------------------------------------------------------------------- golden


def test_golden_bytes_korder():
    # W[n, k] = k: every lane's 16 bytes are KORDER itself
    weight = np.tile(np.arange(16, dtype=np.uint8), (32, 1))
    codes, _ = qpn8_prepack(weight, np.float32(1.0))
    expected_lane = [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    assert codes.reshape(32, 16).tolist() == [expected_lane] * 32


def test_golden_bytes_lane_columns():
    # W[n, k] = n: lane l's 16 bytes all hold col(l); lane 4 -> column 8, lane 16 -> column 4
    weight = np.repeat(np.arange(32, dtype=np.uint8)[:, None], 16, axis=1)
    codes, _ = qpn8_prepack(weight, np.float32(1.0))
    lanes = codes.reshape(32, 16)
    assert lanes[4].tolist() == [8] * 16 and lanes[16].tolist() == [4] * 16
    assert lanes[:, 0].tolist() == list(SPEC_LANE_COLUMNS)


def test_golden_half2_pairs():
    # bytes (i, 4+i) of each 8-byte half are (k, k+1) with k = 8h + 2i
    weight = np.tile(np.arange(16, dtype=np.uint8), (32, 1))
    lane0 = qpn8_prepack(weight, np.float32(1.0))[0].reshape(-1)[:16].tolist()
    for h in range(2):
        for i in range(4):
            assert (lane0[8 * h + i], lane0[8 * h + 4 + i]) == (8 * h + 2 * i, 8 * h + 2 * i + 1)


# s (fp32) -> S16 bits = RN16(256 s), worked out by hand:
GOLDEN_S16 = [
    (1.0, 0x5C00),  # 256 exact: exponent 8 -> biased 23 << 10
    (2.0**-10, 0x3400),  # 0.25 exact
    (1.0 / 448.0, 0x3892),  # 256/448 = 4/7 = 0.5714...: (1 + m/1024) / 2 with m = 146.29 -> 146
    ((1 + 2.0**-11) / 256, 0x3C00),  # 1 + 2^-11: a tie between 1 and 1 + 2^-10, to even (1)
    ((1 + 3 * 2.0**-11) / 256, 0x3C02),  # 1 + 1.5 * 2^-10: a tie, to even mantissa 2
    (146.0, 0x7890),  # 37376 = 32768 * (1 + 144/1024): exact
    (2.0**-30, 0x0004),  # 2^-22: fp16 subnormal 4 * 2^-24
    (146.18, 0x7891),  # 37422.08 -> 37408 = 32768 * (1 + 145/1024)
]


@pytest.mark.parametrize(("s", "bits"), GOLDEN_S16)
def test_golden_s16(s, bits):
    weight = np.zeros((32, 16), np.uint8)
    _, group_scales = qpn8_prepack(weight, np.full(32, s, dtype=np.float32))
    assert group_scales.dtype == np.float16 and group_scales.shape == (1, 32)
    assert u16(group_scales).tolist() == [[bits] * 32]


def test_golden_block_scales_layout():
    # N = 256, K = 384: s[i, j] = i + 10 j (exact in fp16 after * 256); S16[kb, t] = 256 s[t // 4, kb]
    scale = np.array([[i + 10 * j for j in range(3)] for i in range(2)], dtype=np.float32) + 1
    _, group_scales = qpn8_prepack(np.zeros((256, 384), np.uint8), scale)
    assert group_scales.shape == (3, 8)
    assert (group_scales.astype(np.float64) / 256).tolist() == [
        [1, 1, 1, 1, 2, 2, 2, 2],
        [11, 11, 11, 11, 12, 12, 12, 12],
        [21, 21, 21, 21, 22, 22, 22, 22],
    ]


# ----------------------------------------------------------------------------- loop oracle, inverse


def check_layout(weight: np.ndarray, scale: np.ndarray, granularity: str, explicit: bool) -> None:
    n, k = weight.shape
    codes, group_scales = qpn8_prepack(weight, scale, granularity if explicit else None)
    assert codes.dtype == np.uint8 and codes.shape == (n, k) and codes.flags.c_contiguous
    expected_scale_shape = (k // 128, n // 32) if granularity == "block" else (1, n)
    assert group_scales.dtype == np.float16 and group_scales.shape == expected_scale_shape
    assert np.array_equal(codes.reshape(-1), spec_prepack_loop(np.ascontiguousarray(weight)))
    back, s16_map = qpn8_unpack(codes, group_scales, n, k)
    assert np.array_equal(back, weight)
    assert s16_map.dtype == np.float16 and s16_map.shape == (n, k // 16)
    assert np.array_equal(u16(s16_map), u16(expected_s16_map(scale, granularity, n, k)))


LAYOUT_CASES = [(shape, g) for shape in CHANNEL_SHAPES for g in ("tensor", "channel")] + [
    (shape, g) for shape in BLOCK_SHAPES for g in GRANULARITIES
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("shape", "granularity"), LAYOUT_CASES)
def test_prepack_matches_spec_loop_and_inverts(shape, granularity, seed):
    n, k = shape
    check_layout(random_codes(n, k, seed), random_scale(n, k, granularity, seed), granularity, explicit=True)


@settings(max_examples=20, deadline=None)
@given(tiles=st.integers(1, 3), groups=st.integers(1, 8), seed=st.integers(0, 2**32 - 1), fortran=st.booleans())
def test_prepack_matches_spec_loop_hypothesis(tiles, groups, seed, fortran):
    n, k = 32 * tiles, 16 * groups
    weight = random_codes(n, k, seed)
    if fortran:  # non-contiguous input is accepted and read correctly
        weight = np.asfortranarray(weight)
    check_layout(weight, random_scale(n, k, "channel", seed), "channel", explicit=False)


@pytest.mark.parametrize(
    ("scale", "granularity"),
    [
        (np.float32(0.01), "tensor"),
        (np.array(0.01, np.float32), "tensor"),
        (np.array([0.01], np.float32), "tensor"),
        (np.array([[0.01]], np.float32), "tensor"),
        (np.full(64, 0.01, np.float32), "channel"),
        (np.full((64, 1), 0.01, np.float32), "channel"),
    ],
)
def test_scale_shapes_accepted(scale, granularity):
    weight = random_codes(64, 32, 5)
    codes, group_scales = qpn8_prepack(weight, scale)
    assert group_scales.shape == (1, 64)
    assert np.array_equal(u16(group_scales), u16(np.full((1, 64), np.float16(2.56))))


def test_single_block_scale_is_tensor_unless_asked():
    # (1, 1) fits both a per-tensor scale and the one 128x128 block of a 128x128 weight
    weight = random_codes(128, 128, 6)
    scale = np.array([[0.003]], np.float32)
    codes_t, scales_t = qpn8_prepack(weight, scale)
    codes_b, scales_b = qpn8_prepack(weight, scale, granularity="block")
    assert scales_t.shape == (1, 128) and scales_b.shape == (1, 4)
    assert np.array_equal(codes_t, codes_b)
    assert np.array_equal(
        u16(qpn8_dequantize(codes_t, scales_t, 128, 128)), u16(qpn8_dequantize(codes_b, scales_b, 128, 128))
    )


def check_real_shape(shape, granularity) -> None:
    n, k = shape
    weight = random_codes(n, k, 3)
    scale = random_scale(n, k, granularity, 3)
    codes, group_scales = qpn8_prepack(weight, scale)
    back, s16_map = qpn8_unpack(codes, group_scales, n, k)
    assert np.array_equal(back, weight)
    assert np.array_equal(u16(s16_map), u16(expected_s16_map(scale, granularity, n, k)))
    flat = codes.reshape(-1)
    rng = np.random.default_rng(8)
    for i in rng.integers(0, flat.size, SPOT_CHECK_SAMPLES).tolist():
        assert flat[i] == spec_code_byte(weight, k // 16, i)


@pytest.mark.parametrize(("shape", "granularity"),
                         [*REAL_SHAPES, *(pytest.param(*s, marks=pytest.mark.slow) for s in SLOW_SHAPES)])
def test_real_shapes_roundtrip_and_spot_check(shape, granularity):
    check_real_shape(shape, granularity)


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("shape", "granularity"), LAYOUT_CASES)
def test_dequantize_matches_oracle(shape, granularity, seed):
    n, k = shape
    weight, scale = random_codes(n, k, seed), random_scale(n, k, granularity, seed)
    codes, group_scales = qpn8_prepack(weight, scale)
    got = qpn8_dequantize(codes, group_scales, n, k)
    assert got.dtype == np.float16 and got.shape == (n, k)
    assert np.array_equal(u16(got), u16(oracle_w16(weight, expected_s16_map(scale, granularity, n, k))))


def test_dequantize_every_code_keeps_sign_and_subnormals():
    # one row per scale, every finite byte in each row; S16 = 1 and S16 = 2^-24 (subnormal)
    weight = np.zeros((32, 256), np.uint8)
    weight[:, :254] = E4M3_FINITE_BYTES
    scale = np.full(32, 1.0 / 256, np.float32)
    scale[1] = 2.0**-32  # S16 = 2^-24
    codes, group_scales = qpn8_prepack(weight, scale)
    w16 = qpn8_dequantize(codes, group_scales, 32, 256)
    exact = weight[0, :254].view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0**-8
    assert np.array_equal(u16(w16[0, :254]), u16(exact.astype(np.float16)))
    assert weight[0, 127] == 0x80 and u16(w16[0, 127:128]).tolist() == [0x8000]  # e4m3 -0 stays -0
    assert np.array_equal(u16(w16[1, :254]), u16((exact * 2.0**-24).astype(np.float16)))


@pytest.mark.parametrize("granularity", ("tensor", "channel", "block"))
def test_contract_vs_checkpoint_semantics(granularity):
    """qpn8_dequantize vs fp8_dequantize (RN16(RN32(e4m3 * s))): identical where RN16(256 s) == 256 s,
    at most one fp16 ulp elsewhere (S16 normal here)."""
    n, k = 256, 256
    rng = np.random.default_rng(40)
    weight = np.tile(np.concatenate([E4M3_FINITE_BYTES, [0, 0x80]]).astype(np.uint8), (n, 1))
    weight = np.ascontiguousarray(rng.permuted(weight, axis=1))
    shape = {"tensor": (), "channel": (n,), "block": (n // 128, k // 128)}[granularity]
    scale = (10.0 ** rng.uniform(-4, 0, size=shape)).astype(np.float32)
    exact_s16 = rng.random(size=shape) < 0.5  # half of the scales: 256 s has 11 significant bits
    scale = np.where(exact_s16, np.float16(scale).astype(np.float32), scale).astype(np.float32)
    s16_exact = np.float16(scale.astype(np.float64) * 256).astype(np.float64) == scale.astype(np.float64) * 256
    codes, group_scales = qpn8_prepack(weight, scale)
    contract = qpn8_dequantize(codes, group_scales, n, k)
    checkpoint = fp8_dequantize(weight, scale)
    ulps = np.abs(ordered_fp16(contract) - ordered_fp16(checkpoint))
    assert ulps.max() <= 1
    exact_map = expected_s16_map(np.where(s16_exact, 1.0, 0.0).astype(np.float32), granularity, n, k) != 0
    exact_elements = np.repeat(exact_map, 16, axis=1)
    assert np.all(ulps[exact_elements] == 0)
    if granularity != "tensor" or not s16_exact:
        assert np.any(ulps == 1)  # the rounding of S16 is visible somewhere


def test_contract_vs_checkpoint_on_quantized_weights():
    rng = np.random.default_rng(41)
    w = (rng.standard_normal((128, 256)) * rng.uniform(0.01, 2.0, size=(128, 1))).astype(np.float32)
    for granularity in GRANULARITIES:
        layer = fp8_quantize(w, granularity)
        codes, group_scales = qpn8_prepack(layer.weight, layer.weight_scale)
        contract = qpn8_dequantize(codes, group_scales, 128, 256)
        ulps = np.abs(ordered_fp16(contract) - ordered_fp16(fp8_dequantize(*layer)))
        assert ulps.max() <= 1


# ----------------------------------------------------------------------------- rejections

OVERFLOW_CASES = [
    (146.1875, r"largest weight RN16\(448 \* 2\^-8 \* S16\) is inf"),  # S16 = 37440 (tie to even), 1.75 * 37440 = 65520
    (256.0, r"S16 = RN16\(256 \* s\) = inf"),
    (1e30, r"S16 = RN16\(256 \* s\) = inf"),
]


@pytest.mark.parametrize(("s", "match"), OVERFLOW_CASES)
def test_rejects_overflowing_scales(s, match):
    scale = np.full(32, 0.01, np.float32)
    scale[7] = s
    with pytest.raises(ValueError, match=rf"weight_scale\[7\] = .*{match}"):
        qpn8_prepack(np.zeros((32, 16), np.uint8), scale)


def test_largest_accepted_scale_decodes_finite():
    # s = 146.18: S16 = 37408, 448/256 * 37408 = 65464 -> RN16 65472 (finite)
    weight = np.full((32, 16), 0x7E, np.uint8)  # 448
    codes, group_scales = qpn8_prepack(weight, np.float32(146.18))
    assert np.all(qpn8_dequantize(codes, group_scales, 32, 16) == 65472.0)


@pytest.mark.parametrize("s", (0.0, -0.0, -1.0, np.nan, np.inf, -np.inf))
def test_rejects_bad_scale_values(s):
    scale = np.full(32, 0.01, np.float32)
    scale[3] = s
    with pytest.raises(ValueError, match=r"weight_scale must be finite and > 0.*index \(3,\)"):
        qpn8_prepack(np.zeros((32, 16), np.uint8), scale)


@pytest.mark.parametrize("nan_byte", E4M3_NAN_BYTES)
def test_rejects_nan_weight_bytes(nan_byte):
    weight = np.zeros((32, 16), np.uint8)
    weight[9, 4] = nan_byte
    with pytest.raises(ValueError, match=rf"weight holds NaN e4m3 codes.*index \(9, 4\).*0x{nan_byte:02X}"):
        qpn8_prepack(weight, np.float32(0.01))


SHAPE_REJECTIONS = [
    # (weight shape, scale shape, granularity, message)
    ((48, 16), (48,), None, r"N must be a positive multiple of 32 for QPN8, got N=48.*pad the output features N"),
    ((32, 24), (), None, r"K must be a positive multiple of 16 for QPN8, got K=24.*pad K with zero columns"),
    ((160, 128), (2, 1), None, r"N must be a positive multiple of 128 for QPN8 with 128x128 block scales, got N=160"),
    ((128, 192), (1, 2), None, r"K must be a positive multiple of 128 for QPN8 with 128x128 block scales, got K=192"),
    ((128, 256), (2, 2), None, r"weight_scale has shape \(2, 2\), which fits no FP8 granularity"),
    ((128, 256), (256,), None, r"weight_scale has shape \(256,\)"),
    ((128, 256), (1, 2), "tensor", r"does not fit granularity 'tensor'"),
    ((128, 256), (128,), "block", r"does not fit granularity 'block'.*\(1, 2\) for 128x128 block"),
    ((128, 256), (), "channel", r"does not fit granularity 'channel'"),
    ((128, 256), (128,), "row", r"granularity must be None or one of"),
    ((32, 16, 1), (), None, r"weight must be 2-D"),
]


@pytest.mark.parametrize(("weight_shape", "scale_shape", "granularity", "match"), SHAPE_REJECTIONS)
def test_rejects_shapes(weight_shape, scale_shape, granularity, match):
    with pytest.raises(ValueError, match=match):
        qpn8_prepack(np.zeros(weight_shape, np.uint8), np.full(scale_shape, 0.01, np.float32), granularity)


def test_rejects_dtypes():
    with pytest.raises(ValueError, match="weight must have dtype uint8"):
        qpn8_prepack(np.zeros((32, 16), ml_dtypes.float8_e4m3fn), np.float32(1.0))
    with pytest.raises(ValueError, match="weight_scale must have dtype float32"):
        qpn8_prepack(np.zeros((32, 16), np.uint8), np.full(32, 0.01))
    with pytest.raises(ValueError, match="weight_scale must be a numpy.ndarray"):
        qpn8_prepack(np.zeros((32, 16), np.uint8), 0.01)


def test_unpack_and_dequantize_reject_bad_buffers():
    codes, group_scales = qpn8_prepack(random_codes(64, 32, 1), np.float32(0.01))
    with pytest.raises(ValueError, match=r"codes must have shape \(64, 32\).*or \(2048,\)"):
        qpn8_unpack(codes[:32], group_scales, 64, 32)
    with pytest.raises(ValueError, match=r"group_scales must be float16 \[1, 64\]"):
        qpn8_unpack(codes, group_scales[:, :32], 64, 32)
    with pytest.raises(ValueError, match="group_scales must have dtype float16"):
        qpn8_unpack(codes, group_scales.astype(np.float32), 64, 32)
    with pytest.raises(ValueError, match="K must be a positive multiple of 16"):
        qpn8_unpack(codes, group_scales, 64, 40)
    corrupt = codes.copy()
    corrupt.reshape(-1)[17] = 0xFF
    with pytest.raises(ValueError, match="codes holds NaN e4m3 codes"):
        qpn8_dequantize(corrupt, group_scales, 64, 32)
    for bad, match in ((np.float16(np.inf), "finite and >= 0"), (np.float16(-1), "finite and >= 0"),
                       (np.float16(40000), r"largest weight RN16\(448 \* 2\^-8 \* S16\) is inf")):  # fmt: skip
        scales = group_scales.copy()
        scales[0, 5] = bad
        with pytest.raises(ValueError, match=match):
            qpn8_dequantize(codes, scales, 64, 32)
    # flat buffers are accepted
    assert np.array_equal(qpn8_unpack(codes.reshape(-1), group_scales, 64, 32)[0],
                          qpn8_unpack(codes, group_scales, 64, 32)[0])
