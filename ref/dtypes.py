"""The activations' dtypes of the linear contract, fp16 and bf16, and the one rounding of each (issue 24).

Every output of the reference (a linear, an epilogue, the MoE combine) has its activations' dtype and is
rounded once into it by `round_to(dtype, v)`; `dtype` is "float16" (the default everywhere) or "bfloat16".

How the dtypes travel. numpy has no bfloat16. fp16 values travel as np.float16 arrays. bf16 values travel
as float32 arrays whose every value is a bf16 value (`is_bf16`): float32 holds every bf16 value exactly (bf16
is float32's upper 16 bits), and the reference does arithmetic on activations, so they travel as numbers.
(e4m3 travels as uint8 bit patterns for the opposite reason: its bytes are only ever decoded, through
tables.) `bf16_bits` / `bf16_from_bits` give the uint16 patterns, a shift, for byte comparisons with
torch's bfloat16 (`tensor.view(torch.int16)`).

- `bf16_round(a) -> float32`: round-to-nearest-even of every value of a float array (float16 / float32 /
  float64, each rounded ONCE from its exact value: a float64 is not rounded to float32 first) to bf16.
  8 significant bits; subnormals kept (below 2^-126 the step is 2^-133, bf16's least value); |v| >=
  2^128 - 2^119 (half way from the largest bf16, (2 - 2^-7) * 2^127, to 2^128) becomes +-inf; +-inf stay;
  NaN stays NaN (a quiet NaN, payload not kept); -0.0 keeps its sign.
- `is_bf16(a)`: a float32 array whose every value is a bf16 value (its low 16 bits are 0; a NaN with a
  payload there is not).
- `round_to(dtype, v)`: RN16 (numpy's float16 cast: RNE, +-inf at |v| >= 65520, subnormals kept) or
  `bf16_round`, as stored: np.float16, or float32 holding bf16 values.
- `fp16_rows(x)`: bf16 rows as the fp16 kernels take them (the Turing path: sm_75's tensor cores multiply
  fp16 only; cupy_kernels/x_bf16.cu is this rule): each row's exponent e = min(15 - floor(log2 max|x|), 127)
  over its finite values (0 for a row without a nonzero finite value) brings its largest |x| into fp16's top
  binade [2^15, 2^16) (the cap, for rows below 2^-111, keeps 2^e an fp32 value and already lifts bf16's least
  value, 2^-133, to 2^-6, inside fp16's normal range), and x16 = RN16(x * 2^e). 8 significant bits fit in
  11, so x16 = x * 2^e exactly wherever |x * 2^e| >= 2^-14 (fp16's least normal, 29 binades below the top);
  below, x16 is off by at most 2^-25 (half fp16's subnormal step), i.e. x by at most 2^-25 * 2^-e
  (`fp16_rows_step`). inf and NaN keep their class. The kernels multiply each fp32 sum by 2^-e again before
  the one RN_bf16.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .checks import require_array

FP16 = "float16"
BF16 = "bfloat16"
ACTIVATION_DTYPES = (FP16, BF16)

BF16_SIGNIFICANT_BITS = 8
BF16_MIN_NORMAL_EXP = -126  # 2^-126: below it the step is 2^-133 (bf16's least subnormal, float32's 2^-149 is finer)
BF16_MAX = float(np.ldexp(2.0 - 2.0**-7, 127))  # bit pattern 0x7F7F
BF16_OVERFLOW = 2.0**128 - 2.0**119  # the RNE threshold to inf: half way from BF16_MAX to 2^128
_LOW16 = np.uint32(0xFFFF)  # 0000_0000_0000_0000_1111_1111_1111_1111: the float32 bits bf16 drops


def require_dtype(dtype: str) -> str:
    """`dtype` must name an activations' dtype ("float16" or "bfloat16")."""
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"dtype must be one of {ACTIVATION_DTYPES} (the activations' and the output's dtype), "
                         f"got {dtype!r}")
    return dtype


def storage(dtype: str) -> type[np.floating]:
    """The numpy dtype a `dtype` array travels in: np.float16, or np.float32 for bf16 values."""
    return np.float16 if require_dtype(dtype) == FP16 else np.float32


def bf16_round(a: npt.ArrayLike) -> np.ndarray:
    """float32 array of the bf16 values RNE(a) (module docstring), one rounding from a's exact values."""
    v = np.asarray(a)
    if not np.issubdtype(v.dtype, np.floating):
        raise ValueError(f"bf16_round takes a float array, got dtype {v.dtype}; cast integers explicitly")
    with np.errstate(invalid="ignore", over="ignore"):  # a signalling NaN's cast warns: it stays a NaN
        v = v.astype(np.float64)  # exact for float16 / float32 / float64
        _, e = np.frexp(v)  # |v| in [2^(e-1), 2^e); e = 0 for 0, inf and NaN
        # the bf16 step at v: 2^(e-1) / 2^7 for a normal v, 2^-133 below 2^-126 (subnormals)
        step = np.ldexp(1.0, np.maximum(e, BF16_MIN_NORMAL_EXP + 1) - BF16_SIGNIFICANT_BITS)
        r = np.rint(v / step) * step  # v / step: an exact power-of-two scaling into [2^7, 2^8); rint is RNE
        r = np.where(np.abs(r) >= 2.0**128, np.copysign(np.inf, r), r)  # RNE carried past the largest: inf
        return r.astype(np.float32)  # exact: every bf16 value is a float32 value


def is_bf16(a: object) -> bool:
    """a is a float32 numpy array whose values are all bf16 values (module docstring)."""
    return isinstance(a, np.ndarray) and a.dtype == np.float32 and \
        not np.any(np.ascontiguousarray(a).view(np.uint32) & _LOW16)


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """uint16 bit patterns of a float32 array of bf16 values (its upper halves)."""
    if not is_bf16(a):
        raise ValueError("bf16_bits takes a float32 array of bf16 values (low 16 bits 0); round it with "
                         "qpn.ref.bf16_round first")
    return (np.ascontiguousarray(a).view(np.uint32) >> 16).astype(np.uint16)


def bf16_from_bits(bits: np.ndarray) -> np.ndarray:
    """float32 array of the bf16 values with these uint16 bit patterns (exact; NaN patterns stay NaN)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise ValueError(f"bits must be uint16 bf16 patterns, got dtype {bits.dtype}; view torch's bfloat16 "
                         "data as int16 / uint16")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_to(dtype: str, v: npt.ArrayLike) -> np.ndarray:
    """v (any float array) rounded once to `dtype`, in its storage dtype (module docstring)."""
    if require_dtype(dtype) == FP16:
        with np.errstate(over="ignore"):  # |v| >= 65520 rounds to inf: an answer, not an error
            return np.asarray(v).astype(np.float16)
    return bf16_round(v)


def step_out(dtype: str, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) of `dtype` values moved one step of its grid outward: the next value below lo, above hi (as
    stored: float16, or float32 of bf16 values); +-inf and NaN stay, the largest finite value steps to inf."""
    if require_dtype(dtype) == FP16:
        return np.nextafter(lo, np.float16(-np.inf)), np.nextafter(hi, np.float16(np.inf))
    return _bf16_step(lo, -1), _bf16_step(hi, 1)


def _bf16_step(v: np.ndarray, direction: int) -> np.ndarray:
    """bf16 values one step up (direction 1) or down (-1): on the sign-magnitude patterns as ordered integers."""
    bits = bf16_bits(np.ascontiguousarray(v, np.float32)).astype(np.int32)
    key = np.where(bits >= 0x8000, -(bits & 0x7FFF), bits) + direction  # -0 and +0 are both 0
    stepped = np.where(key >= 0, key, (-key) | 0x8000).astype(np.uint16)
    return np.where(np.isfinite(v), bf16_from_bits(stepped), v).astype(np.float32)


FP16_TOP_EXP = 15  # fp16's top binade [2^15, 2^16): where fp16_rows puts each row's largest |x|
FP16_ROWS_MAX_EXP = 127  # the cap on e: 2^e stays an fp32 value (module docstring)
FP16_ROWS_ERROR_EXP = -25  # half fp16's subnormal step: the most a scaled value below 2^-14 moves


def fp16_row_exponents(x: np.ndarray) -> np.ndarray:
    """int64 [M]: each row's e of `fp16_rows` (module docstring), bf16 values x [M, K] as float32 arrays."""
    x = require_activations("x", x, BF16, ndim=2)
    with np.errstate(invalid="ignore"):
        finite = np.where(np.isfinite(x), np.abs(x), 0.0).astype(np.float64)
    big = finite.max(axis=1, initial=0.0)
    _, e = np.frexp(big)  # big in [2^(e-1), 2^e): floor(log2 big) = e - 1
    return np.where(big > 0, np.minimum(FP16_TOP_EXP - (e - 1), FP16_ROWS_MAX_EXP), 0).astype(np.int64)


def fp16_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x16 float16 [M, K], e int64 [M]): bf16 rows x [M, K] (float32 arrays of bf16 values) as the fp16 kernels
    take them, x16 = RN16(x * 2^e) (module docstring). One rounding: the float64 product is exact."""
    e = fp16_row_exponents(x)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.ldexp(x.astype(np.float64), e[:, None]).astype(np.float16), e


def fp16_rows_step(x: np.ndarray) -> np.ndarray:
    """float64 [M]: the most `fp16_rows` moves a value of each row, in x's units: 2^-25 * 2^-e."""
    return np.ldexp(1.0, FP16_ROWS_ERROR_EXP - fp16_row_exponents(x))


def require_activations(name: str, a: object, dtype: str, ndim: int | None = None) -> np.ndarray:
    """`a` must be `dtype` activations as they travel (module docstring): np.float16, or float32 of bf16 values."""
    a = require_array(name, a, storage(dtype), ndim=ndim)
    if dtype == BF16 and not is_bf16(a):
        bad = np.flatnonzero(np.ascontiguousarray(a).view(np.uint32).reshape(-1) & _LOW16)
        raise ValueError(f"{name} must hold bf16 values (float32 with the low 16 bits 0), got {bad.size} other "
                         f"values, the first {a.reshape(-1)[bad[0]]!r}; round it with qpn.ref.bf16_round(...)")
    return a
