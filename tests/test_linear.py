"""Reference linear (ref/linear.py): exact against rational arithmetic, the gated epilogue on
hand-computed values, and the fp32-accumulation bound (never violated, attained when it can be).

Oracle for RN16: `rn16_fraction` below rounds an exact Fraction to fp16 with integer arithmetic
(round half to even, subnormals, overflow at 65520), independent of numpy's casts.
"""

from __future__ import annotations

import importlib
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qpn.ref import linear, linear_bounds, linear_bounds_fp32, linear_error_bound, linear_gated, silu_and_mul

FP16_MAX = 65504
ACCUMULATION_ORDERS = ("forward", "backward", "blocked16", "pairwise", "permuted")
BOUND_SHAPES = [(4, 64, 1024), (3, 16, 4096), (1, 8, 17408)]  # (M, N, K)
SEEDS = (0, 1)
linear_mod = importlib.import_module("qpn.ref.linear")  # the module (qpn.ref.linear is the function)


def u16(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint16)


def rn16_fraction(q: Fraction) -> float:
    """Exact rational -> nearest fp16 (ties to even), as a Python float (inf beyond 65520)."""
    if q == 0:
        return 0.0
    sign = -1.0 if q < 0 else 1.0
    a = abs(q)
    e = max(math.floor(math.log2(a)), -14)  # binade, floored where fp16 subnormals begin
    while Fraction(2) ** e > a and e > -14:  # log2 of a Fraction can be off by one near powers of 2
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    quantum = Fraction(2) ** (e - 10)
    steps = round(a / quantum)  # Fraction.__round__ rounds half to even
    value = steps * quantum
    if value >= 65536:  # RN16 overflow (|q| >= 65520 rounds to 2^16, which fp16 lacks)
        return sign * math.inf
    return sign * float(value)


def exact_linear(x: np.ndarray, w16: np.ndarray) -> np.ndarray:
    xf = [[Fraction(float(v)) for v in row] for row in x]
    wf = [[Fraction(float(v)) for v in row] for row in w16]
    return np.array([[rn16_fraction(sum(a * b for a, b in zip(xr, wr, strict=True))) for wr in wf] for xr in xf],
                    dtype=np.float16)


def assert_same_fp16(y: np.ndarray, expected: np.ndarray) -> None:
    """Bits equal, except that an exact zero sum may carry either sign (a rational 0 has none)."""
    nonzero = expected != 0
    assert np.array_equal(u16(y)[nonzero], u16(expected)[nonzero])
    assert np.all(y[~nonzero] == 0)


def fp16_window(draw_bits: np.ndarray) -> np.ndarray:
    """uint16 noise -> fp16 with unbiased exponent in [-7, 7] (or zero): multiples of 2^-17 below 2^8."""
    sign = draw_bits & 0x8000
    mantissa = draw_bits & 0x03FF
    exponent = ((draw_bits >> 10) & 0x1F) % 15 + 8  # biased 8..22
    bits = sign | (exponent << 10) | mantissa
    bits[(draw_bits & 0x1F) == 0] = 0  # some zeros
    return bits.astype(np.uint16).view(np.float16)


# ----------------------------------------------------------------------------- RN16 itself


RN16_CASES = [
    # (exact value, fp16 result) - pins numpy's float64 -> float16 cast as one RNE step
    (1 + 2.0**-11, 1.0),  # tie -> even mantissa 0
    (1 + 3 * 2.0**-11, 1 + 2.0**-9),  # tie -> even mantissa 2
    (1 + 2.0**-11 + 2.0**-40, 1 + 2.0**-10),  # just above the tie: up (double rounding via fp32 would give 1)
    (65519.99, 65504.0),
    (65520.0, math.inf),  # tie between 65504 (odd) and 2^16: overflow
    (2.0**-25, 0.0),  # half the smallest subnormal: tie -> 0
    (3 * 2.0**-25, 2.0**-23),  # 1.5 subnormal steps: tie -> even step 2
]


@pytest.mark.parametrize(("value", "expected"), RN16_CASES)
def test_rn16_cast_and_oracle_agree_on_ties(value, expected):
    with np.errstate(over="ignore"):  # 65520 -> inf is the expected answer
        assert np.float64(value).astype(np.float16) == expected
    assert rn16_fraction(Fraction(value)) == expected


# ----------------------------------------------------------------------------- linear, exact


LINEAR_HAND_CASES = [
    # (x row, w row, y): ties, overflow and tiny sums through the whole function
    ([1.0, 1.0], [1.0, 2.0**-11], 1.0),  # 1 + 2^-11: tie -> even (1)
    ([1.0, 1.0], [1.0, 3 * 2.0**-11], 1 + 2.0**-9),  # 1 + 1.5 * 2^-10: tie -> even mantissa 2
    ([1.0, 1.0], [65504.0, 16.0], math.inf),  # 65520: tie between 65504 and 2^16 -> overflow
    ([1.0, 1.0], [65504.0, 15.0], 65504.0),
    ([1.0, -1.0], [-65504.0, 16.0], -math.inf),
    ([2.0**-12, 1.0], [2.0**-14, 0.0], 0.0),  # 2^-26: below half the smallest subnormal
]


@pytest.mark.parametrize(("xr", "wr", "expected"), LINEAR_HAND_CASES)
def test_linear_hand_cases(xr, wr, expected):
    x = np.array([xr], np.float16)
    w16 = np.array([wr], np.float16)
    y = linear(x, w16)
    assert y.dtype == np.float16 and y.shape == (1, 1)
    assert y[0, 0] == expected
    assert exact_linear(x, w16)[0, 0] == expected


def test_linear_subnormal_sums():
    # 2^-24 + 2^-25 = 1.5 steps of 2^-24: a tie, to the even step 2 (2^-23)
    x = np.array([[2.0**-12, 2.0**-12]], np.float16)
    w16 = np.array([[2.0**-12, 2.0**-13]], np.float16)
    assert linear(x, w16)[0, 0] == 2.0**-23
    # 2^-25 alone: half a step, a tie, to 0
    assert u16(linear(x[:, :1], np.array([[2.0**-13]], np.float16))).tolist() == [[0x0000]]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("m", "n", "k"), [(3, 5, 8), (1, 7, 1), (4, 4, 6)])
def test_linear_matches_exact_rational(m, n, k, seed):
    # Inputs in the window 2^-17 .. 2^8: products are multiples of 2^-34 below 2^16 and K <= 8 of
    # them stay below 2^19, so every float64 partial sum is exact and y must equal the rational RN16.
    rng = np.random.default_rng(seed)
    x = fp16_window(rng.integers(0, 2**16, size=(m, k), dtype=np.uint16))
    w16 = fp16_window(rng.integers(0, 2**16, size=(n, k), dtype=np.uint16))
    assert_same_fp16(linear(x, w16), exact_linear(x, w16))


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 3),
    n=st.integers(1, 4),
    k=st.integers(1, 8),
    data=st.data(),
)
def test_linear_matches_exact_rational_hypothesis(m, n, k, data):
    bits = st.integers(0, 2**16 - 1)
    x = fp16_window(np.array(data.draw(st.lists(bits, min_size=m * k, max_size=m * k)), np.uint16).reshape(m, k))
    w16 = fp16_window(np.array(data.draw(st.lists(bits, min_size=n * k, max_size=n * k)), np.uint16).reshape(n, k))
    assert_same_fp16(linear(x, w16), exact_linear(x, w16))


@pytest.mark.parametrize(
    ("x", "w16", "match"),
    [
        (np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float16), "x must have dtype float16"),
        (np.zeros((2, 3), np.float16), np.zeros((4, 5), np.float16), "their K must agree"),
        (np.zeros(3, np.float16), np.zeros((4, 3), np.float16), "x must be 2-D"),
        (np.full((2, 3), np.nan, np.float16), np.zeros((4, 3), np.float16), "x must be finite"),
        (np.zeros((2, 3), np.float16), np.full((4, 3), np.inf, np.float16), "w16 must be finite"),
    ],
)
def test_linear_rejects(x, w16, match):
    with pytest.raises(ValueError, match=match):
        linear(x, w16)


# ----------------------------------------------------------------------------- gated epilogue

# (gate, up, expected out bits), each worked out by hand from
# out = RN16(RN16(RN32(g / RN32(1 + expf(-g)))) * up):
SILU_AND_MUL_CASES = [
    # silu(1) = 1/(1 + e^-1) = 0.7310586: fp16 step 2^-11 in [0.5, 1), 0.7310586 * 2048 = 1497.2
    # -> 1497 / 2048 = 0.73095703125 = (1 + 473/1024) / 2 -> bits 14 << 10 | 473
    (1.0, 1.0, (14 << 10) | 473),
    # silu(2) = 2/(1 + e^-2) = 1.7615942 -> step 2^-10: 1803.87 -> 1804/1024 = 1.76171875;
    # * 3 = 5.28515625 = 4 * (1 + 329/1024), exact -> bits 17 << 10 | 329
    (2.0, 3.0, (17 << 10) | 329),
    # the inner RN16 matters: silu16(1) * 5 = 7485/2048 = 3.65478515625 -> step 2^-9: 1871.25 ->
    # 1871/512 = 3.654296875 = 2 * (1 + 847/1024) -> bits 16 << 10 | 847 (unrounded silu would
    # give 0.7310586 * 5 = 3.6552929 -> 1871.5+ -> 1872/512)
    (1.0, 5.0, (16 << 10) | 847),
    # silu(-20) = -20 / (1 + 4.85e8) = -4.12e-8: above half the smallest subnormal (2.98e-8) -> -2^-24
    (-20.0, 1.0, 0x8001),
    # exp(65504) overflows fp32 to inf: -65504 / inf = -0.0; -0.0 * 2 = -0.0
    (-65504.0, 2.0, 0x8000),
    # exp(-65504) = 0: silu = 65504; * 2 = 131008 -> inf
    (65504.0, 2.0, 0x7C00),
    # silu(0) = 0, * -1 = -0.0
    (0.0, -1.0, 0x8000),
    # silu(-1) = -1 / (1 + e) = -0.26894142 -> step 2^-12 in [0.25, 0.5): 1101.58 -> -1102/4096
    # = -(1 + 78/1024) / 4; * -0.5 = +(1 + 78/1024) / 8, exact -> bits 12 << 10 | 78
    (-1.0, -0.5, (12 << 10) | 78),
]


@pytest.mark.parametrize(("gate", "up", "bits"), SILU_AND_MUL_CASES)
def test_silu_and_mul_hand_values(gate, up, bits):
    out = silu_and_mul(np.array([gate], np.float16), np.array([up], np.float16))
    assert out.dtype == np.float16
    assert u16(out).tolist() == [bits]


def test_silu_every_fp16_gate_within_one_ulp_of_exact_silu():
    # the fp32 pipeline rounds three times before RN16; it stays within one fp16 ulp of
    # RN16(exact silu), measured against float64 silu on every finite fp16 value
    bits = np.arange(2**16, dtype=np.uint16)
    gate = bits.view(np.float16)
    gate = gate[np.isfinite(gate)]
    out = silu_and_mul(gate, np.ones_like(gate))
    g64 = gate.astype(np.float64)
    with np.errstate(over="ignore"):
        exact = (g64 / (1.0 + np.exp(-g64))).astype(np.float16)
    ordered = lambda v: np.where(u16(v) & 0x8000, -(u16(v).astype(np.int32) & 0x7FFF), u16(v).astype(np.int32))  # noqa: E731
    assert np.abs(ordered(out) - ordered(exact)).max() <= 1


def test_linear_gated_hand_value():
    # x = [1], gate row [2], up row [3]: linear gives gate 2, up 3 -> the silu(2) * 3 case above
    x = np.array([[1.0], [2.0]], np.float16)
    w16 = np.array([[2.0], [3.0]], np.float16)
    out = linear_gated(x, w16)
    assert out.shape == (2, 1)
    assert u16(out)[0, 0] == (17 << 10) | 329
    # row 2: gate 4, up 6: silu(4) = 4 / (1 + e^-4) = 3.92805516 -> step 2^-9: 2011.16 -> 2011/512
    # = 3.927734375; * 6 = 23.56640625 = 16 * (1 + 0.47290...) -> step 2^-6: 1508.25 -> 1508/64 = 23.5625
    assert out[1, 0] == 23.5625


def test_linear_gated_is_linear_then_silu_and_mul():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 64)).astype(np.float16)
    w16 = (rng.standard_normal((96, 64)) * 0.2).astype(np.float16)
    out = linear_gated(x, w16)
    assert out.shape == (5, 48)
    assert np.array_equal(u16(out), u16(silu_and_mul(linear(x, w16[:48]), linear(x, w16[48:]))))
    with pytest.raises(ValueError, match="N must be even"):
        linear_gated(x, w16[:95])
    with pytest.raises(ValueError, match="one shape"):
        silu_and_mul(x[:, :3], x[:, :4])


# ----------------------------------------------------------------------------- the error bound


def fp32_sum(x: np.ndarray, w16: np.ndarray, order: str, seed: int = 0) -> np.ndarray:
    """fp32 accumulation of the exact fp32 products in a given order, then RN16: float16 [M, N]."""
    p = x.astype(np.float32)[:, None, :] * w16.astype(np.float32)[None, :, :]  # exact (22-bit products)
    if order == "backward":
        p = p[..., ::-1]
    if order == "permuted":
        p = p[..., np.random.default_rng(seed).permutation(p.shape[-1])]
    if order == "blocked16":  # 16-term sequential partials, then sequential over the blocks
        block = np.cumsum(p.reshape(*p.shape[:2], -1, 16), axis=-1, dtype=np.float32)[..., -1]
        s = np.cumsum(block, axis=-1, dtype=np.float32)[..., -1]
    elif order == "pairwise":
        s = np.sum(p, axis=-1, dtype=np.float32)  # numpy's pairwise summation
    else:  # add.accumulate is strictly sequential in fp32
        s = np.cumsum(p, axis=-1, dtype=np.float32)[..., -1]
    with np.errstate(over="ignore"):  # |s| >= 65520 -> inf, as a kernel's final cast
        return s.astype(np.float16)


def wide_range_inputs(m: int, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * 2.0 ** rng.integers(-6, 6, size=(m, k))).astype(np.float16)
    w16 = (rng.standard_normal((n, k)) * 0.05 * 2.0 ** rng.integers(-4, 4, size=(n, k))).astype(np.float16)
    return x, w16


@pytest.mark.parametrize("unit_roundoff", (2.0**-24, 2.0**-23))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("m", "n", "k"), BOUND_SHAPES)
def test_bound_holds_for_fp32_orders(m, n, k, seed, unit_roundoff):
    x, w16 = wide_range_inputs(m, n, k, seed)
    ref = linear(x, w16).astype(np.float64)
    lo, hi = linear_bounds(x, w16, unit_roundoff)
    bound = linear_error_bound(x, w16, unit_roundoff)
    assert bound.shape == (m, n) and bound.dtype == np.float64
    assert np.all(lo <= linear(x, w16)) and np.all(linear(x, w16) <= hi)
    for order in ACCUMULATION_ORDERS:
        y = fp32_sum(x, w16, order, seed)
        assert np.all((lo <= y) & (y <= hi)), order
        assert np.all(np.abs(y.astype(np.float64) - ref) <= bound), order


def test_fp32_orders_really_differ_from_the_reference():
    # guards the test above against vacuity: fp32 accumulation does move some outputs by an ulp
    x, w16 = wide_range_inputs(4, 64, 1024, 0)
    ref = linear(x, w16)
    assert any(np.any(fp32_sum(x, w16, order) != ref) for order in ACCUMULATION_ORDERS)


def test_bound_is_attained():
    # x = 1, w = [2048, 2^-13 x (K-1)], K = 2^16. Sequential fp32: 2048 + 2^-13 is a tie at
    # 2048's half-ulp (2^-13) and rounds to even, so the sum stays 2048 -> y = 2048. Exact sum
    # 2048 + 65535 * 2^-13 = 2055.99988 -> ref = 2056 (fp16 step 2 there): an error of 8.
    # Bound (u = 2^-24): d = gamma_K * 2056 = 2^-8 / (1 - 2^-8) * 2056 = 8.06; hi = RN16(2064.06)
    # = 2064, lo = RN16(2047.94) = 2048: max distance 8 - attained exactly.
    k = 2**16
    x = np.ones((1, k), np.float16)
    w16 = np.full((1, k), 2.0**-13, np.float16)
    w16[0, 0] = 2048.0
    y = fp32_sum(x, w16, "forward")
    ref = linear(x, w16)
    assert y[0, 0] == 2048.0 and ref[0, 0] == 2056.0
    assert linear_error_bound(x, w16, 2.0**-24)[0, 0] == 8.0
    # the default (truncating adders, u = 2^-23) is twice as wide: d = 16.25 -> [2040, 2072]
    assert linear_error_bound(x, w16)[0, 0] == 16.0


def test_bound_at_fp16_overflow():
    # S = 65520 exactly: ref = inf; an fp32 kernel may land just below (65504) or on inf
    x = np.array([[1.0, 1.0]], np.float16)
    w16 = np.array([[65504.0, 16.0], [1.0, 2.0]], np.float16)
    lo, hi = linear_bounds(x, w16)
    assert lo[0, 0] == 65504.0 and np.isposinf(hi[0, 0])
    bound = linear_error_bound(x, w16)
    assert np.isposinf(bound[0, 0]) and bound[0, 1] == 0.0  # 1 + 2 = 3 exactly: no error possible
    y = fp32_sum(x, w16, "forward")
    assert np.all((lo <= y) & (y <= hi))


@pytest.mark.parametrize("unit_roundoff", (2.0**-24, 2.0**-23))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("m", "n", "k"), BOUND_SHAPES)
def test_fp32_computed_bound_contains_the_float64_one(m, n, k, seed, unit_roundoff):
    """linear_bounds_fp32 (what `qpn verify` uses) holds every fp32 order, and on these inputs also
    contains linear_bounds' interval (its d is larger by about gamma_K(2^-24) * sum|x*w|, which
    exceeds the fp32 - float64 distance of the sums it is centred on but for 2 gamma64_K)."""
    x, w16 = wide_range_inputs(m, n, k, seed)
    lo, hi = linear_bounds_fp32(x, w16, unit_roundoff)
    lo64, hi64 = linear_bounds(x, w16, unit_roundoff)
    assert np.all(lo <= lo64) and np.all(hi64 <= hi)
    for order in ACCUMULATION_ORDERS:
        y = fp32_sum(x, w16, order, seed)
        assert np.all((lo <= y) & (y <= hi)), order


@pytest.mark.parametrize("bad", (np.nan, np.inf, -np.inf))
def test_fp32_computed_bound_finds_non_finite_weights_without_a_pass_of_its_own(monkeypatch, bad):
    """linear_bounds_fp32 learns w16's finiteness from its |W| @ |x| sums (a row of ones rides along
    with |x|), not from np.isfinite over the whole weight (0.1 s per 14336 x 4096 layer): a NaN or
    inf weight still raises, also where every x is 0 (a BLAS may skip zero multipliers)."""
    checked = []
    real = linear_mod.require_finite
    monkeypatch.setattr(linear_mod, "require_finite", lambda name, v: (checked.append(name), real(name, v))[1])
    x = np.ones((3, 64), np.float16)
    w16 = np.full((40, 64), 0.5, np.float16)
    linear_bounds_fp32(x, w16)
    assert checked == ["x"]
    w16[17, 5] = bad
    for xs in (x, np.zeros_like(x)):
        with pytest.raises(ValueError, match="w16 must be finite, got 1 NaN/inf values"):
            linear_bounds_fp32(xs, w16)


def test_fp32_computed_bound_at_the_attained_case():
    # test_bound_is_attained's input: the fp32 matmul itself lands 8 below the exact sum; the
    # bound must still reach y = 2048 and ref = 2056 (u = 2^-24: d32 = 2 gamma_K * 2056 / (1 - gamma_K) = 16.2)
    k = 2**16
    x = np.ones((1, k), np.float16)
    w16 = np.full((1, k), 2.0**-13, np.float16)
    w16[0, 0] = 2048.0
    lo, hi = linear_bounds_fp32(x, w16, 2.0**-24)
    assert lo[0, 0] <= 2048.0 and hi[0, 0] >= 2056.0
    # not vacuous: s32 lies in [2048, 2056] (positive terms, 2048 among them) and d = 0.00787 * s32
    # in [16.1, 16.2], so lo = RN16(s32 - d) in [2032, 2040] and hi = RN16(s32 + d) in [2064, 2072]
    # (fp16 steps 1 below 2048, 2 above): within [2031, 2074], about 2x the float64 interval
    assert lo[0, 0] >= 2031.0 and hi[0, 0] <= 2074.0
