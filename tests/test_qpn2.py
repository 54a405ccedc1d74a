"""QPN2 layout (ref/qpn2.py): golden bytes, a loop implementation of the spec formula, the exact
inverse, alignment rules, and the weight semantics (contract and upstream variants P / E).

Oracle: `spec_prepack_loop` below is docs/QPN2.md read literally, one byte at a time with Python
ints; it shares no code with ref/qpn2.py (which transposes and delta-swaps uint64 words).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qpn.ref import (
    nvfp4_dequantize,
    nvfp4_quantize,
    qpn2_dequantize,
    qpn2_dequantize_variant_e,
    qpn2_dequantize_variant_p,
    qpn2_prepack,
    qpn2_unpack,
)

# docs/QPN2.md, "Geometry shared with QPN8", typed in again rather than imported
SPEC_KORDER = (0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
SPEC_LANE_COLUMNS = (0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27,
                     4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31)  # fmt: skip

SMALL_SHAPES = [(32, 64), (64, 64), (32, 128), (96, 192)]  # (N, K): one tile, two tiles, ...
REAL_SHAPES = [(4096, 4096), (14336, 4096)]  # Llama-3-8B q_proj / gate_proj
SLOW_SHAPES = [(5120, 17408)]  # Qwen-32B-class down_proj: K = 17408
SEEDS = (0, 1)
SPOT_CHECK_SAMPLES = 4096
E4M3_NAN_BYTES = (0x7F, 0xFF)


def u16(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint16)


def spec_col(lane: int) -> int:
    return 8 * ((lane >> 2) & 3) + (lane & 3) + 4 * ((lane >> 4) & 1)


def spec_code(packed_rows: list, n: int, k: int) -> int:
    """code(n, k) = (weight[n, k>>1] >> 4*(k&1)) & 0xF, docs/QPN2.md, "Codes"."""
    return (packed_rows[n][k >> 1] >> (4 * (k & 1))) & 0xF


def spec_code_byte(packed_rows: list, groups: int, flat: int) -> int:
    """The QPN2 code byte at flat index ((t*G + g)*32 + lane)*8 + b, straight from the spec."""
    b = flat % 8
    lane = (flat // 8) % 32
    g = (flat // 256) % groups
    t = flat // 256 // groups
    n = 32 * t + spec_col(lane)
    low = spec_code(packed_rows, n, 16 * g + SPEC_KORDER[2 * b])
    high = spec_code(packed_rows, n, 16 * g + SPEC_KORDER[2 * b + 1])
    return low | (high << 4)


def spec_prepack_loop(weight_packed: np.ndarray, weight_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n_rows, half_k = weight_packed.shape
    groups = 2 * half_k // 16
    rows, scale_rows = weight_packed.tolist(), weight_scale.tolist()
    codes = [spec_code_byte(rows, groups, i) for i in range(n_rows * half_k)]
    scales = [0] * (n_rows * groups)
    for t in range(n_rows // 32):
        for g in range(groups):
            for lane in range(32):
                scales[(t * groups + g) * 32 + lane] = scale_rows[32 * t + spec_col(lane)][g]
    return np.array(codes, dtype=np.uint8), np.array(scales, dtype=np.uint8)


def random_nvfp4(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Every code byte; every finite e4m3 scale byte (NaN bytes 0x7F / 0xFF moved to 0x7E / 0xFE)."""
    rng = np.random.default_rng(seed)
    weight_packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    weight_scale = rng.integers(0, 256, size=(n, k // 16), dtype=np.uint8)
    weight_scale[(weight_scale & 0x7F) == 0x7F] -= 1
    return weight_packed, weight_scale


def ordered_fp16(x: np.ndarray) -> np.ndarray:
    """fp16 bits -> integers whose difference counts fp16 ulps (+0 and -0 both map to 0)."""
    bits = u16(x).astype(np.int32)
    return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)


# ----------------------------------------------------------------------------- golden bytes

# N = 32, K = 64 (one tile, four groups): code(n, k) = (n + k + k // 16) & 0xF, scale byte
# (n, g) = n | g << 6 (never 0x7F / 0xFF). Each byte below reads  high nibble _ low nibble.
GOLDEN_N, GOLDEN_K = 32, 64
GOLDEN_CODE_BYTES = {
    # (lane, group): flat offset ((t*G + g)*32 + lane)*8 and the 8 bytes; one row each, under the
    # byte diagram it lines up with (so past 120 columns: noqa E501)
    #   byte:       0 {k2|k0}    1 {k6|k4}    2 {k3|k1}    3 {k7|k5}    4 {k10|k8}   5 {k14|k12}  6 {k11|k9}   7 {k15|k13}  # noqa: E501
    (0, 0): (0, [0b0010_0000, 0b0110_0100, 0b0011_0001, 0b0111_0101, 0b1010_1000, 0b1110_1100, 0b1011_1001, 0b1111_1101]),  # noqa: E501
    # lane 4 owns column 8: codes 8..15, 0..7
    (4, 0): (32, [0b1010_1000, 0b1110_1100, 0b1011_1001, 0b1111_1101, 0b0010_0000, 0b0110_0100, 0b0011_0001, 0b0111_0101]),  # noqa: E501
    # lane 16 owns column 4: codes 4..15, 0..3
    (16, 0): (128, [0b0110_0100, 0b1010_1000, 0b0111_0101, 0b1011_1001, 0b1110_1100, 0b0010_0000, 0b1111_1101, 0b0011_0001]),  # noqa: E501
    # lane 0, group 1 (k = 16..31): codes 1..15, 0
    (0, 1): (256, [0b0011_0001, 0b0111_0101, 0b0100_0010, 0b1000_0110, 0b1011_1001, 0b1111_1101, 0b1100_1010, 0b0000_1110]),  # noqa: E501
}  # fmt: skip


def golden_inputs() -> tuple[np.ndarray, np.ndarray]:
    n = np.arange(GOLDEN_N)[:, None]
    k = np.arange(GOLDEN_K)[None, :]
    codes = ((n + k + k // 16) & 0xF).astype(np.uint8)
    weight_packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # k=2j low nibble
    g = np.arange(GOLDEN_K // 16)[None, :]
    weight_scale = (n | (g << 6)).astype(np.uint8)
    return weight_packed, weight_scale


@pytest.mark.parametrize(("lane", "group"), sorted(GOLDEN_CODE_BYTES))
def test_golden_code_bytes(lane, group):
    codes, _ = qpn2_prepack(*golden_inputs())
    offset, expected = GOLDEN_CODE_BYTES[(lane, group)]
    assert offset == ((0 * 4 + group) * 32 + lane) * 8
    assert codes.reshape(-1)[offset : offset + 8].tolist() == expected


def test_golden_spec_example_byte0_k0_k2_byte2_k1_k3():
    # spec: "byte 0 = {k0 low, k2 high}, byte 2 = {k1 low, k3 high}" - lane 0 holds codes 0..15
    codes, _ = qpn2_prepack(*golden_inputs())
    assert codes.reshape(-1)[0] == 0x20 and codes.reshape(-1)[2] == 0x31


def test_golden_scales_follow_lane_columns():
    _, scales = qpn2_prepack(*golden_inputs())
    flat = scales.reshape(-1)
    for g in range(GOLDEN_K // 16):
        assert flat[g * 32 : (g + 1) * 32].tolist() == [c | (g << 6) for c in SPEC_LANE_COLUMNS]


def test_output_dtypes_and_shapes():
    codes, scales = qpn2_prepack(*golden_inputs())
    assert codes.dtype == np.uint8 and codes.shape == (GOLDEN_N, GOLDEN_K // 2)
    assert scales.dtype == np.uint8 and scales.shape == (GOLDEN_N, GOLDEN_K // 16)
    assert codes.flags.c_contiguous and scales.flags.c_contiguous


def test_half2_pairs_in_each_word():
    # spec: nibble i and nibble i+4 of each little-endian 32-bit word hold k = 8w + 2i, 8w + 2i + 1
    weight_packed, weight_scale = golden_inputs()
    codes, _ = qpn2_prepack(weight_packed, weight_scale)
    words = codes.reshape(-1).view("<u4").reshape(4, 32, 2)  # [group][lane][word]
    for g in range(4):
        for lane in range(32):
            n = SPEC_LANE_COLUMNS[lane]
            for w in range(2):
                word = int(words[g, lane, w])
                for i in range(4):
                    k = 16 * g + 8 * w + 2 * i
                    assert (word >> (4 * i)) & 0xF == (n + k + k // 16) & 0xF
                    assert (word >> (4 * (i + 4))) & 0xF == (n + k + 1 + (k + 1) // 16) & 0xF


# ----------------------------------------------------------------------------- loop oracle, inverse


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("n", "k"), SMALL_SHAPES)
def test_prepack_matches_spec_loop(n, k, seed):
    weight_packed, weight_scale = random_nvfp4(n, k, seed)
    codes, scales = qpn2_prepack(weight_packed, weight_scale)
    loop_codes, loop_scales = spec_prepack_loop(weight_packed, weight_scale)
    assert np.array_equal(codes.reshape(-1), loop_codes)
    assert np.array_equal(scales.reshape(-1), loop_scales)


@settings(max_examples=20, deadline=None)
@given(
    tiles=st.integers(1, 3),
    k64=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    transposed_copy=st.booleans(),
)
def test_prepack_matches_spec_loop_and_inverts_hypothesis(tiles, k64, seed, transposed_copy):
    n, k = 32 * tiles, 64 * k64
    weight_packed, weight_scale = random_nvfp4(n, k, seed)
    if transposed_copy:  # non-contiguous input views are accepted and read correctly
        weight_packed = np.asfortranarray(weight_packed)
        weight_scale = np.asfortranarray(weight_scale)
    codes, scales = qpn2_prepack(weight_packed, weight_scale)
    loop_codes, loop_scales = spec_prepack_loop(np.ascontiguousarray(weight_packed), weight_scale)
    assert np.array_equal(codes.reshape(-1), loop_codes)
    assert np.array_equal(scales.reshape(-1), loop_scales)
    back_packed, back_scale = qpn2_unpack(codes, scales, n, k)
    assert np.array_equal(back_packed, weight_packed) and np.array_equal(back_scale, weight_scale)


def test_unpack_accepts_flat_buffers_and_numpy_ints():
    weight_packed, weight_scale = random_nvfp4(64, 128, 3)
    codes, scales = qpn2_prepack(weight_packed, weight_scale)
    back = qpn2_unpack(codes.reshape(-1), scales.reshape(-1), np.int64(64), np.int32(128))
    assert np.array_equal(back[0], weight_packed) and np.array_equal(back[1], weight_scale)


def test_prepack_does_not_modify_inputs():
    weight_packed, weight_scale = random_nvfp4(64, 128, 4)
    before = weight_packed.copy(), weight_scale.copy()
    codes, scales = qpn2_prepack(weight_packed, weight_scale)
    qpn2_unpack(codes, scales, 64, 128)
    assert np.array_equal(weight_packed, before[0]) and np.array_equal(weight_scale, before[1])


def check_real_shape(n: int, k: int) -> None:
    weight_packed, weight_scale = random_nvfp4(n, k, n + k)
    codes, scales = qpn2_prepack(weight_packed, weight_scale)
    back_packed, back_scale = qpn2_unpack(codes, scales, n, k)
    assert np.array_equal(back_packed, weight_packed) and np.array_equal(back_scale, weight_scale)
    # spot check against the spec formula at random flat byte indices
    rng = np.random.default_rng(7)
    rows = weight_packed  # spec_code indexes rows[n][j]; a numpy array supports that too
    flat_codes, flat_scales = codes.reshape(-1), scales.reshape(-1)
    groups = k // 16
    for i in rng.integers(0, codes.size, SPOT_CHECK_SAMPLES).tolist():
        assert flat_codes[i] == spec_code_byte(rows, groups, i)
    for i in rng.integers(0, scales.size, SPOT_CHECK_SAMPLES).tolist():
        lane, g, t = i % 32, (i // 32) % groups, i // 32 // groups
        assert flat_scales[i] == weight_scale[32 * t + spec_col(lane), g]


@pytest.mark.parametrize(("n", "k"), [*REAL_SHAPES, *(pytest.param(*s, marks=pytest.mark.slow) for s in SLOW_SHAPES)])
def test_real_shapes_roundtrip_and_spot_check(n, k):
    check_real_shape(n, k)


# ----------------------------------------------------------------------------- rejections

GOOD_N, GOOD_K = 32, 64
PREPACK_REJECTIONS = [
    # (weight_packed shape, weight_scale shape, message fragment)
    ((48, 32), (48, 4), r"N must be a positive multiple of 32 for QPN2, got N=48"
                        r".*pad the output features N to a multiple of 32 \(QPNLinear pads and crops\)"),
    ((0, 32), (0, 4), r"N must be a positive multiple of 32 for QPN2, got N=0"),
    ((32, 48), (32, 6), r"K must be a positive multiple of 64 for QPN2, got K=96"
                        r".*pad K with zero columns to a multiple of 64"),
    ((32, 8), (32, 1), r"K must be a positive multiple of 64 for QPN2, got K=16"),
    ((32, 32), (32, 8), r"weight_scale must have shape \(32, 4\), got \(32, 8\)"),
    ((32, 32), (64, 4), r"weight_scale must have shape \(32, 4\), got \(64, 4\)"),
]  # fmt: skip


@pytest.mark.parametrize(("packed_shape", "scale_shape", "match"), PREPACK_REJECTIONS)
def test_prepack_rejects_shapes(packed_shape, scale_shape, match):
    with pytest.raises(ValueError, match=match):
        qpn2_prepack(np.zeros(packed_shape, np.uint8), np.zeros(scale_shape, np.uint8))


@pytest.mark.parametrize(
    ("weight_packed", "weight_scale", "match"),
    [
        (np.zeros((GOOD_N, GOOD_K // 2), np.int8), np.zeros((GOOD_N, 4), np.uint8),
         "weight_packed must have dtype uint8"),
        (np.zeros((GOOD_N, GOOD_K // 2), np.uint8), np.zeros((GOOD_N, 4), np.float32),
         "weight_scale must have dtype uint8"),
        (np.zeros(GOOD_N * GOOD_K // 2, np.uint8), np.zeros((GOOD_N, 4), np.uint8), "weight_packed must be 2-D"),
        ([[0] * 32] * 32, np.zeros((GOOD_N, 4), np.uint8), "weight_packed must be a numpy.ndarray"),
    ],
)
def test_prepack_rejects_types(weight_packed, weight_scale, match):
    with pytest.raises(ValueError, match=match):
        qpn2_prepack(weight_packed, weight_scale)


@pytest.mark.parametrize("nan_byte", E4M3_NAN_BYTES)
def test_prepack_rejects_nan_scale_bytes(nan_byte):
    weight_packed, weight_scale = random_nvfp4(GOOD_N, GOOD_K, 0)
    weight_scale[5, 2] = nan_byte
    with pytest.raises(ValueError, match=rf"weight_scale holds NaN e4m3 codes.*index \(5, 2\).*0x{nan_byte:02X}"):
        qpn2_prepack(weight_packed, weight_scale)


@pytest.mark.parametrize(
    ("codes_shape", "scales_shape", "n", "k", "match"),
    [
        ((32, 32), (32, 4), 48, 64, "N must be a positive multiple of 32"),
        ((32, 32), (32, 4), 32, 96, "K must be a positive multiple of 64"),
        ((32, 64), (32, 4), 32, 64, r"codes must have shape \(32, 32\).*or \(1024,\)"),
        ((32, 32), (32, 8), 32, 64, r"scales must have shape \(32, 4\).*or \(128,\)"),
        ((32, 32), (32, 4), 32.0, 64, "n must be an int"),
    ],
)
def test_unpack_rejects(codes_shape, scales_shape, n, k, match):
    with pytest.raises(ValueError, match=match):
        qpn2_unpack(np.zeros(codes_shape, np.uint8), np.zeros(scales_shape, np.uint8), n, k)


# ----------------------------------------------------------------------------- weights


def quantized_layer(n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 1.0, size=(n, 1))).astype(np.float32)
    return nvfp4_quantize(w)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("n", "k"), SMALL_SHAPES)
def test_dequantize_equals_checkpoint_path(n, k, seed):
    layer = quantized_layer(n, k, seed)
    codes, scales = qpn2_prepack(layer.weight_packed, layer.weight_scale)
    expected = nvfp4_dequantize(layer.weight_packed, layer.weight_scale, layer.weight_scale_2)
    got = qpn2_dequantize(codes, scales, layer.weight_scale_2, n, k)
    assert got.dtype == np.float16 and got.shape == (n, k)
    assert np.array_equal(u16(got), u16(expected))


def test_dequantize_every_code_and_scale_byte():
    # random bytes cover all 16 codes and all 254 finite scale bytes; g keeps 6*448*g < 65504
    n, k = 96, 256
    weight_packed, weight_scale = random_nvfp4(n, k, 11)
    g = np.float32(0.0123)
    codes, scales = qpn2_prepack(weight_packed, weight_scale)
    expected = nvfp4_dequantize(weight_packed, weight_scale, g)
    assert np.array_equal(u16(qpn2_dequantize(codes, scales, g, n, k)), u16(expected))


def test_dequantize_per_tile_global_scale():
    n, k = 96, 128
    weight_packed, weight_scale = random_nvfp4(n, k, 12)
    per_tile = np.array([0.0123, 2.0**-7, 0.00037], dtype=np.float32)
    codes, scales = qpn2_prepack(weight_packed, weight_scale)
    got = qpn2_dequantize(codes, scales, per_tile, n, k)
    assert np.array_equal(u16(got), u16(nvfp4_dequantize(weight_packed, weight_scale, per_tile)))
    for t in range(3):  # each tile decodes with its own scale
        rows = slice(32 * t, 32 * (t + 1))
        tile = nvfp4_dequantize(weight_packed[rows], weight_scale[rows], per_tile[t])
        assert np.array_equal(u16(got[rows]), u16(tile))


def test_dequantize_rejects_nan_scale_in_buffer_and_overflow():
    weight_packed, weight_scale = random_nvfp4(32, 64, 13)
    codes, scales = qpn2_prepack(weight_packed, weight_scale)
    corrupt = scales.copy()
    corrupt.reshape(-1)[4] = 0x7F  # lane 4 = column 8, group 0
    with pytest.raises(ValueError, match=r"NaN e4m3 codes.*index \(8, 0\)"):
        qpn2_dequantize(codes, corrupt, np.float32(1e-3), 32, 64)
    for variant in (qpn2_dequantize_variant_p, qpn2_dequantize_variant_e):
        with pytest.raises(ValueError, match="NaN e4m3 codes"):
            variant(codes, corrupt, np.float32(1e-3), 32, 64)
    with pytest.raises(ValueError, match="beyond fp16's"):  # 6 * 448 * 100 > 65504
        qpn2_dequantize(codes, scales, np.float32(100.0), 32, 64)
    with pytest.raises(ValueError, match="global_scale must be float32"):
        qpn2_dequantize(codes, scales, np.array(1e-3), 32, 64)


# Variants P and E against the contract: realistic layers (nvfp4_quantize of random weights),
# scalar and per-tile global scales.
VARIANTS = (qpn2_dequantize_variant_p, qpn2_dequantize_variant_e)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", SEEDS)
def test_variants_within_one_ulp_of_contract(variant, seed):
    n, k = 96, 256
    layer = quantized_layer(n, k, seed)
    codes, scales = qpn2_prepack(layer.weight_packed, layer.weight_scale)
    contract = qpn2_dequantize(codes, scales, layer.weight_scale_2, n, k)
    got = variant(codes, scales, layer.weight_scale_2, n, k)
    assert got.dtype == np.float16 and got.shape == (n, k) and np.all(np.isfinite(got))
    assert np.abs(ordered_fp16(got) - ordered_fp16(contract)).max() <= 1
    # per-tile global scales (fused shards): the same bound
    per_tile = (layer.weight_scale_2 * np.array([1.0, 0.37, 2.9], dtype=np.float32)).astype(np.float32)
    contract = qpn2_dequantize(codes, scales, per_tile, n, k)
    got = variant(codes, scales, per_tile, n, k)
    assert np.abs(ordered_fp16(got) - ordered_fp16(contract)).max() <= 1


def torch_variant_oracle(weight_packed, weight_scale, g_rows, variant: str) -> np.ndarray:
    """Variants P and E as the kernels compute them: torch fp16 tensor ops (CPU half * half is the
    exact product rounded once to fp16, like HMUL); element values from ml_dtypes."""
    n = weight_packed.shape[0]
    codes = np.empty((n, 2 * weight_packed.shape[1]), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = weight_packed & 0xF, weight_packed >> 4
    e2m1 = torch.from_numpy(codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)).reshape(n, -1, 16)
    e4m3 = torch.from_numpy(weight_scale.view(ml_dtypes.float8_e4m3fn).astype(np.float32))[..., None]
    g = torch.from_numpy(g_rows)[:, None, None]
    if variant == "p":
        gs = (g * 2.0**14).half()  # fp32 product exact (power of two), then RN16
        s = e4m3.half() * gs  # every e4m3 value is an fp16 value; half * half -> RN16
        w = (e2m1 * 2.0**-14).half() * s  # e2m1 * 2^-14: the nibble bit trick's exact fp16
    else:
        e = (e4m3 * g).half()  # RN32 (fp32 multiply), then RN16
        w = e2m1.half() * e
    return w.reshape(n, -1).numpy()


@pytest.mark.parametrize("variant", ("p", "e"))
@pytest.mark.parametrize("global_scale", (np.float32(0.0123), np.array([3.1e-4, 0.0377, 1.9e-3], np.float32)))
def test_variants_match_torch_fp16_oracle(variant, global_scale):
    n, k = 96, 256
    weight_packed, weight_scale = random_nvfp4(n, k, 22)
    codes, scales = qpn2_prepack(weight_packed, weight_scale)
    per_tile = np.atleast_1d(global_scale)
    g_rows = np.repeat(per_tile, n // per_tile.size)  # one value per row, float32 [N]
    fn = {"p": qpn2_dequantize_variant_p, "e": qpn2_dequantize_variant_e}[variant]
    expected = torch_variant_oracle(weight_packed, weight_scale, g_rows, variant)
    assert np.array_equal(u16(fn(codes, scales, global_scale, n, k)), u16(expected))


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_equal_contract_for_power_of_two_global_scale(variant):
    # g = 2^-8: every intermediate rounding is exact, only the final RN16 rounds (the same value)
    n, k = 64, 128
    weight_packed, weight_scale = random_nvfp4(n, k, 21)
    codes, scales = qpn2_prepack(weight_packed, weight_scale)
    g = np.float32(2.0**-8)
    assert np.array_equal(u16(variant(codes, scales, g, n, k)), u16(qpn2_dequantize(codes, scales, g, n, k)))


def test_variant_p_shows_overflow_where_contract_is_finite():
    # g = 1, scale 448 (0x7E): contract's largest weight 6 * 448 = 2688 is fine, but variant P's
    # S = RN16(448 * RN16(2^14)) = RN16(7340032) = inf. Codes 0 / 8 give 0 * inf = NaN there.
    n, k = 32, 64
    weight_packed = np.full((n, k // 2), 0x71, np.uint8)  # k even: code 1 (0.5), k odd: code 7 (6.0)
    weight_packed[0, 0] = 0x80  # row 0: k=0 code 0 (+0), k=1 code 8 (-0)
    weight_scale = np.full((n, k // 16), 0x7E, np.uint8)
    codes, scales = qpn2_prepack(weight_packed, weight_scale)
    g = np.float32(1.0)
    contract = qpn2_dequantize(codes, scales, g, n, k)
    assert contract[1, 0] == 224.0 and contract[1, 1] == 2688.0
    p = qpn2_dequantize_variant_p(codes, scales, g, n, k)
    assert np.isposinf(p[1:, :]).all() and np.isnan(p[0, :2]).all()
    e = qpn2_dequantize_variant_e(codes, scales, g, n, k)  # E = RN16(448) = 448: no overflow
    assert np.array_equal(u16(e), u16(contract))
