"""Element codecs: e2m1 (FP4), e4m3fn (FP8) and e8m0 (the MX scale), vectorized and exact.

e2m1 (4-bit): bit 3 = sign, bits 0..2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
- Decode: table lookup; code 8 decodes to -0.0 (sign kept). No inf, no NaN codes.
- Encode: round half to even on the grid (ties 0.25->0, 0.75->1, 1.25->1, 1.75->2,
  2.5->2, 3.5->4, 5->4), saturate beyond 6 (inf included). The sign bit follows
  np.signbit, so -0.0 and negatives that round to 0 give code 8, as ml_dtypes does.
  (ModelOpt's quantizer sets the sign only for x < 0; `nvfp4_quantize` applies that rule.)
  NaN input is rejected.

e4m3fn (8-bit): sign, 4 exponent bits (bias 7), 3 mantissa bits.
- Decode: exponent 0 is subnormal, m/8 * 2^-6; 0x7F and 0xFF are NaN; max finite 448.
- Encode: round to nearest even, saturating to +-448 (ModelOpt and PyTorch clamp weights
  to the e4m3 range before the cast); sign from np.signbit (so -0.0 -> 0x80). NaN input is
  rejected. Subnormals round on the fixed 2^-9 grid.

e8m0 (8-bit, the OCP MX block scale): an unsigned biased exponent, value 2^(bits - 127); 0xFF is
NaN; no zero, no sign. Every value 2^-127 .. 2^127 is exact in float32 (2^-127 as a subnormal).

Values travel as uint8 bit patterns; decoded values as float32 (every code is exact there).
All arithmetic is exact: decoding is a table, encoding scales by powers of two (exact in
float64) and rounds once with np.rint (round half to even).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_NAN_CODES = (0x7F, 0xFF)
E8M0_BIAS = 127
E8M0_NAN = 0xFF

# code -> value, 16 entries; code 8 is -0.0
_E2M1_TABLE = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).astype(np.float32)

# Midpoints between consecutive magnitudes and whether a tie there rounds up (to the even
# code above) or stays (even code below): 0.25 stays at code 0, 0.75 goes up to code 2, ...
_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_TIE_ROUNDS_UP = np.array([False, True, False, True, False, True, False])


def _build_e4m3_table() -> np.ndarray:
    bits = np.arange(256)
    exponent = (bits >> 3) & 0xF  # 0xF = 1111
    mantissa = (bits & 0x7).astype(np.float64)  # 0x7 = 0111
    magnitude = np.where(
        exponent == 0,
        mantissa / 8.0 * 2.0**-6,  # subnormal
        (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0),
    )
    value = np.where(bits & 0x80, -magnitude, magnitude)
    value[[0x7F, 0xFF]] = np.nan
    return value.astype(np.float32)


_E4M3_TABLE = _build_e4m3_table()
# 2^-127 .. 2^127 (exact: float64 ldexp, then a cast that keeps every power of two in range), then NaN
_E8M0_TABLE = np.append(np.ldexp(1.0, np.arange(E8M0_NAN) - E8M0_BIAS), np.nan).astype(np.float32)


def decode_e2m1(codes: npt.ArrayLike) -> np.ndarray:
    """uint8 codes (0..15, any shape) -> float32 values. Code 8 is -0.0."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise ValueError(f"codes must be uint8 e2m1 codes, got dtype {codes.dtype}; unpack the nibbles first")
    if codes.size and codes.max() > 0xF:
        raise ValueError(
            f"codes must be 4-bit e2m1 codes (0..15), got a value {int(codes.max())}; "
            "unpack the bytes into nibbles (low nibble first) before decoding"
        )
    return _E2M1_TABLE[codes]


def encode_e2m1(x: npt.ArrayLike) -> np.ndarray:
    """float values (any shape) -> uint8 e2m1 codes, round half to even, saturating at 6."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"x must be a floating-point array, got dtype {x.dtype}")
    if np.isnan(x).any():
        raise ValueError("x contains NaN, which e2m1 cannot represent; clean the tensor before encoding")
    a = np.abs(x)  # the midpoints are exact in every float dtype, so compare in x's own dtype
    magnitude_code = np.zeros(a.shape, dtype=np.uint8)  # counts the midpoints that a passes
    for midpoint, tie_rounds_up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_ROUNDS_UP, strict=True):
        magnitude_code += (a >= midpoint) if tie_rounds_up else (a > midpoint)
    # saturates at code 7 (= 6.0): every value beyond the last midpoint 5.0 has passed all seven
    return magnitude_code | (np.signbit(x).astype(np.uint8) << 3)


def decode_e4m3(bits: npt.ArrayLike) -> np.ndarray:
    """uint8 e4m3fn bit patterns (any shape) -> float32 values; 0x7F/0xFF -> NaN."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint8:
        raise ValueError(
            f"bits must be uint8 e4m3 bit patterns, got dtype {bits.dtype}; view float8 data as uint8"
        )
    return _E4M3_TABLE[bits]


def decode_e8m0(bits: npt.ArrayLike) -> np.ndarray:
    """uint8 e8m0 bit patterns (any shape) -> float32 2^(bits - 127); 0xFF -> NaN."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint8:
        raise ValueError(f"bits must be uint8 e8m0 bit patterns, got dtype {bits.dtype}; view the scales as uint8")
    return _E8M0_TABLE[bits]


def encode_e4m3(x: npt.ArrayLike) -> np.ndarray:
    """float values (any shape) -> uint8 e4m3fn bits, round half to even, saturating to +-448."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"x must be a floating-point array, got dtype {x.dtype}")
    if np.isnan(x).any():
        raise ValueError("x contains NaN; e4m3 NaN is never a valid weight or scale - clean the tensor first")
    a = np.minimum(np.abs(x).astype(np.float64), E4M3_MAX)  # 448 is exact: clamp == saturate
    # Binade exponent e = floor(log2 a), floored at -6 where the subnormal grid (2^-9) begins.
    _, frexp_exp = np.frexp(a)
    e = np.where(a < 2.0**-6, -6, frexp_exp.astype(np.int64) - 1)
    quantum = np.ldexp(1.0, e - 3)  # 3 mantissa bits
    steps = np.rint(a / quantum).astype(np.int64)  # exact division, one RNE rounding
    # bits = (biased exponent << 3) + mantissa; steps in [8, 16] for normals (16 carries into the
    # next binade, which this linear form handles), and for e = -6 the form reduces to `steps`,
    # which also covers subnormals (steps 0..8).
    magnitude_bits = ((e + 7) << 3) + steps - 8
    return (magnitude_bits.astype(np.uint8)) | (np.signbit(x).astype(np.uint8) << 7)
