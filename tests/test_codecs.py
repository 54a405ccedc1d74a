"""Element codecs (ref/codecs.py) against independent oracles: ml_dtypes and torch.

Every comparison is on bit patterns: decoded values as float32 bits (NaN codes by isnan),
encoded values as uint8 codes. Oracles are test-only; ref/ never imports them.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from qpn.ref import decode_e2m1, decode_e4m3, encode_e2m1, encode_e4m3

E2M1_CODES = np.arange(16, dtype=np.uint8)
E4M3_CODES = np.arange(256, dtype=np.uint8)
E4M3_NAN_CODES = (0x7F, 0xFF)  # 0b0_1111_111, 0b1_1111_111
E4M3_FINITE_CODES = np.array([c for c in range(256) if c not in E4M3_NAN_CODES], dtype=np.uint8)
FLOAT_DTYPES = (np.float16, np.float32, np.float64)

# e2m1 code = s mmm: bit 3 is the sign, bits 0..2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1_GOLDEN = {
    0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5,
    0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0, 0b0111: 6.0,
    0b1000: -0.0, 0b1001: -0.5, 0b1010: -1.0, 0b1011: -1.5,
    0b1100: -2.0, 0b1101: -3.0, 0b1110: -4.0, 0b1111: -6.0,
}  # fmt: skip

# e4m3fn byte = s eeee mmm (bias 7); exponent 0 is subnormal: m/8 * 2^-6.
E4M3_GOLDEN = {
    0b0_0000_000: 0.0,
    0b1_0000_000: -0.0,
    0b0_0000_001: 2.0**-9,  # smallest subnormal
    0b0_0000_111: 7 * 2.0**-9,  # largest subnormal
    0b0_0001_000: 2.0**-6,  # smallest normal
    0b0_0111_000: 1.0,
    0b0_0111_100: 1.5,
    0b1_1000_001: -2.25,
    0b0_1111_110: 448.0,  # largest finite
    0b1_1111_110: -448.0,
}

# e2m1 ties: each midpoint goes to the neighbour with the even code (docs/FORMATS.md, "Element codecs").
E2M1_TIES = {0.25: 0b0000, 0.75: 0b0010, 1.25: 0b0010, 1.75: 0b0100, 2.5: 0b0100, 3.5: 0b0110, 5.0: 0b0110}

E2M1_SATURATING = (7.0, 100.0, np.inf)
E4M3_SATURATING = (449.0, 464.0, 500.0, 1e30, np.inf)
E4M3_MAX_CODE = 0b0_1111_110  # 0x7E = 448


def f32_bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def assert_same_floats(actual: np.ndarray, expected: np.ndarray) -> None:
    """float32 arrays equal bit for bit, except that NaN only has to be NaN (payloads differ)."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(actual), nan)
    assert np.array_equal(f32_bits(actual)[~nan], f32_bits(expected)[~nan])


def torch_e4m3_bits(x: np.ndarray) -> np.ndarray:
    """torch's float -> float8_e4m3fn cast (RNE), as uint8 bits."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def ml_dtypes_e4m3_bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def ml_dtypes_e2m1_codes(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)


E4M3_ORACLES = {"torch": torch_e4m3_bits, "ml_dtypes": ml_dtypes_e4m3_bits}


# ----------------------------------------------------------------------------- decode


def test_decode_e2m1_all_codes_match_ml_dtypes():
    expected = E2M1_CODES.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    actual = decode_e2m1(E2M1_CODES)
    assert actual.dtype == np.float32
    assert_same_floats(actual, expected)


def test_decode_e2m1_golden_table():
    codes = np.array(list(E2M1_GOLDEN), dtype=np.uint8)
    assert_same_floats(decode_e2m1(codes), np.array(list(E2M1_GOLDEN.values())))
    assert f32_bits(decode_e2m1(np.array([0b1000], np.uint8)))[0] == 0x8000_0000  # code 8 keeps -0


@pytest.mark.parametrize("oracle", ["torch", "ml_dtypes"])
def test_decode_e4m3_all_codes_match_oracle(oracle):
    if oracle == "torch":
        expected = torch.from_numpy(E4M3_CODES.copy()).view(torch.float8_e4m3fn).float().numpy()
    else:
        expected = E4M3_CODES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    actual = decode_e4m3(E4M3_CODES)
    assert actual.dtype == np.float32
    assert_same_floats(actual, expected)
    assert np.isnan(actual[list(E4M3_NAN_CODES)]).all()
    assert np.isfinite(np.delete(actual, list(E4M3_NAN_CODES))).all()


def test_decode_e4m3_golden_values():
    codes = np.array(list(E4M3_GOLDEN), dtype=np.uint8)
    assert_same_floats(decode_e4m3(codes), np.array(list(E4M3_GOLDEN.values())))


def test_decode_keeps_shape():
    codes = np.arange(16, dtype=np.uint8).reshape(2, 2, 4)
    assert decode_e2m1(codes).shape == (2, 2, 4)
    assert decode_e4m3(codes).shape == (2, 2, 4)


# ----------------------------------------------------------------------------- encode: exact codes


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_encode_e2m1_round_trips_every_code(dtype):
    assert np.array_equal(encode_e2m1(decode_e2m1(E2M1_CODES).astype(dtype)), E2M1_CODES)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_encode_e4m3_round_trips_every_finite_code(dtype):
    values = decode_e4m3(E4M3_FINITE_CODES).astype(dtype)  # every e4m3 value is exact in fp16 too
    assert np.array_equal(encode_e4m3(values), E4M3_FINITE_CODES)


def test_encode_negative_zero_keeps_sign():
    assert encode_e2m1(np.array([-0.0], np.float32))[0] == 0b1000
    assert encode_e4m3(np.array([-0.0], np.float32))[0] == 0b1_0000_000
    assert encode_e2m1(np.array([0.0], np.float32))[0] == 0b0000
    assert encode_e4m3(np.array([0.0], np.float32))[0] == 0b0_0000_000


# ----------------------------------------------------------------------------- encode: ties


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_encode_e2m1_ties_go_to_even(dtype):
    ties = np.array(list(E2M1_TIES), dtype=dtype)
    even = np.array(list(E2M1_TIES.values()), dtype=np.uint8)
    assert np.array_equal(encode_e2m1(ties), even)
    assert np.array_equal(encode_e2m1(-ties), even | 0b1000)
    both = np.concatenate([ties, -ties])
    assert np.array_equal(encode_e2m1(both), ml_dtypes_e2m1_codes(both.astype(np.float32)))


def e4m3_midpoints() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Midpoints between consecutive positive finite e4m3 values (subnormals included), with the
    codes below and above. Each midpoint has 5 significant bits, so it is exact in fp16/32/64."""
    low = np.arange(0, 0x7E, dtype=np.uint8)  # 0x00 .. 0x7D; neighbour above is low + 1
    high = low + 1
    mid = (decode_e4m3(low).astype(np.float64) + decode_e4m3(high)) / 2
    return mid, low, high


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_encode_e4m3_midpoints_go_to_even(dtype):
    mid, low, high = e4m3_midpoints()
    even = np.where(low % 2 == 0, low, high).astype(np.uint8)  # even mantissa = even code
    assert np.array_equal(mid.astype(dtype).astype(np.float64), mid)  # exact in this dtype
    assert np.array_equal(encode_e4m3(mid.astype(dtype)), even)
    assert np.array_equal(encode_e4m3(-mid.astype(dtype)), even | 0b1_0000_000)


def test_encode_e4m3_midpoint_goldens():
    cases = {
        2.0**-10: 0b0_0000_000,  # between 0 and the smallest subnormal: stays at 0
        1.5 * 2.0**-9: 0b0_0000_010,  # between subnormals 1 and 2: up to 2
        7.5 * 2.0**-9: 0b0_0001_000,  # between the largest subnormal and 2^-6: up to the even normal
        1.0625: 0b0_0111_000,  # between 1 and 1.125: stays at 1
        1.1875: 0b0_0111_010,  # between 1.125 and 1.25: up to 1.25
        432.0: 0b0_1111_110,  # between 416 and 448: up to 448
    }
    x = np.array(list(cases), dtype=np.float32)
    assert np.array_equal(encode_e4m3(x), np.array(list(cases.values()), dtype=np.uint8))


@pytest.mark.parametrize("oracle", list(E4M3_ORACLES))
def test_encode_e4m3_midpoints_and_neighbours_match_oracle(oracle):
    mid, low, high = e4m3_midpoints()
    mid32 = mid.astype(np.float32)
    below = np.nextafter(mid32, np.float32(0))  # one fp32 ulp under the tie: must round down
    above = np.nextafter(mid32, np.float32(np.inf))  # one ulp over: must round up
    assert np.array_equal(encode_e4m3(below[1:]), low[1:])  # below[0] = 2^-10 - ulp -> 0 too
    assert np.array_equal(encode_e4m3(above), high)
    x = np.concatenate([mid32, below, above])
    x = np.concatenate([x, -x])
    assert np.array_equal(encode_e4m3(x), E4M3_ORACLES[oracle](x))


# ----------------------------------------------------------------------------- encode: saturation


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_encode_e4m3_saturates(dtype):
    with np.errstate(over="ignore"):  # 1e30 becomes inf in fp16: it saturates all the same
        x = np.array(E4M3_SATURATING, dtype=dtype)
    assert np.array_equal(encode_e4m3(x), np.full(x.shape, E4M3_MAX_CODE, np.uint8))
    assert np.array_equal(encode_e4m3(-x), np.full(x.shape, 0b1_1111_110, np.uint8))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_encode_e2m1_saturates(dtype):
    x = np.array(E2M1_SATURATING, dtype=dtype)
    assert np.array_equal(encode_e2m1(x), np.full(x.shape, 0b0111, np.uint8))
    assert np.array_equal(encode_e2m1(-x), np.full(x.shape, 0b1111, np.uint8))


# ----------------------------------------------------------------------------- encode: rejections


@pytest.mark.parametrize("encode", [encode_e2m1, encode_e4m3])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_encode_rejects_nan(encode, dtype):
    x = np.array([1.0, np.nan, 2.0], dtype=dtype)
    with pytest.raises(ValueError, match="NaN"):
        encode(x)


@pytest.mark.parametrize("encode", [encode_e2m1, encode_e4m3])
@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.bool_])
def test_encode_rejects_non_float(encode, dtype):
    with pytest.raises(ValueError, match="floating-point"):
        encode(np.zeros(4, dtype=dtype))


@pytest.mark.parametrize("decode", [decode_e2m1, decode_e4m3])
@pytest.mark.parametrize("dtype", [np.int8, np.int64, np.uint16, np.float32])
def test_decode_rejects_non_uint8(decode, dtype):
    with pytest.raises(ValueError, match="uint8"):
        decode(np.zeros(4, dtype=dtype))


def test_decode_e2m1_rejects_bytes_above_15():
    with pytest.raises(ValueError, match="0..15"):
        decode_e2m1(np.array([3, 0b0001_0000], dtype=np.uint8))


# ----------------------------------------------------------------------------- sweeps


def random_float32_over_binades(rng: np.random.Generator, size: int, lo_exp: int, hi_exp: int) -> np.ndarray:
    """Random sign, exponent uniform in [lo_exp, hi_exp], all 23 mantissa bits random."""
    sign = rng.integers(0, 2, size, dtype=np.uint32) << 31
    biased = (rng.integers(lo_exp, hi_exp + 1, size) + 127).astype(np.uint32) << 23
    mantissa = rng.integers(0, 1 << 23, size, dtype=np.uint32)
    return (sign | biased | mantissa).view(np.float32)


SWEEP_SIZE = 1 << 18
SWEEP_SEEDS = (0, 1)


@pytest.mark.parametrize("seed", SWEEP_SEEDS)
def test_encode_e4m3_random_float32_sweep_matches_torch(seed):
    rng = np.random.default_rng(seed)
    # binades 2^-14 .. 2^9: below the subnormal range, through it, up to past 448; clip to +-448
    x = np.clip(random_float32_over_binades(rng, SWEEP_SIZE, -14, 9), -448, 448)
    assert np.array_equal(encode_e4m3(x), torch_e4m3_bits(x))


@pytest.mark.parametrize("oracle", list(E4M3_ORACLES))
def test_encode_e4m3_every_finite_float16_matches_oracle(oracle):
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    x = np.clip(x[np.isfinite(x)], -448, 448)  # 63488 finite halves, fp16 -> fp32 is exact
    assert np.array_equal(encode_e4m3(x), E4M3_ORACLES[oracle](x.astype(np.float32)))


def test_encode_e2m1_every_finite_float16_matches_ml_dtypes():
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    x = np.clip(x[np.isfinite(x)], -6, 6)
    assert np.array_equal(encode_e2m1(x), ml_dtypes_e2m1_codes(x.astype(np.float32)))


@pytest.mark.parametrize("seed", SWEEP_SEEDS)
def test_encode_e2m1_random_float32_sweep_matches_ml_dtypes(seed):
    rng = np.random.default_rng(seed)
    x = np.clip(random_float32_over_binades(rng, SWEEP_SIZE, -4, 3), -6, 6)  # 2^-4 .. 2^3 covers 0.25 .. 6
    assert np.array_equal(encode_e2m1(x), ml_dtypes_e2m1_codes(x))
