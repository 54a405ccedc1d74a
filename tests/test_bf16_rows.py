"""bf16 x on fp16 tensor cores (issue 24, part 1, the Turing path; docs/DESIGN.md, "bf16 activations"):
qpn.ref.fp16_rows, the rule the CUDA kernels' x_bf16.cu applies (each row times 2^e into fp16's top binade),
and the bound's term for it. On the CPU: the rule on crafted rows, and the path emulated in numpy (fp16 rows,
fp32 sums in several orders, times 2^-e, one RN_bf16) inside ref.linear_bounds / linear_bounds_fp32, on a case
where the term is what keeps it inside. The kernel's bytes against this rule: tests/test_cupy_bf16.py (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from qpn import ref
from qpn.ref.dtypes import BF16, fp16_row_exponents, fp16_rows_step
from qpn.ref.linear import FP16_ROWS_POST, float64_sum_slack, fp16_rows_slack, gamma, outward


def bf16(values) -> np.ndarray:
    return ref.bf16_round(np.asarray(values, dtype=np.float64))


def test_each_rows_largest_value_lands_in_fp16s_top_binade():
    rng = np.random.default_rng(0)
    for top in (-110, -60, -14, 0, 15, 16, 60, 127):  # down to the cap .. bf16's largest binade
        row = bf16(rng.uniform(-1, 1, (1, 64)) * 2.0**top)
        x16, e = ref.fp16_rows(row)
        biggest = np.abs(x16.astype(np.float64)).max()
        assert 2.0**15 <= biggest < 2.0**16, (top, e)
        assert e[0] == 15 - (np.frexp(np.abs(row.astype(np.float64)).max())[1] - 1)
    assert fp16_row_exponents(bf16([[3.0e38]]))[0] == -112  # bf16's largest binade


def test_rows_below_the_cap_get_2_to_the_127_and_convert_exactly():
    rng = np.random.default_rng(3)
    for top in (-133, -126, -112):  # bf16's subnormals .. just below the cap
        row = bf16(rng.uniform(-1, 1, (1, 64)) * 2.0**top)
        row[0, 0] = 2.0**-133  # bf16's least value
        x16, e = ref.fp16_rows(row)
        assert e[0] == 127
        assert np.array_equal(x16.astype(np.float64), np.ldexp(row.astype(np.float64), 127))
        assert np.abs(x16.astype(np.float64)).max() < 2.0**16


def test_values_inside_fp16s_normal_range_convert_exactly_and_the_rest_within_half_a_subnormal_step():
    rng = np.random.default_rng(1)
    # one row spanning 60 binades: the top 29 convert exactly, the rest round in fp16's subnormals
    row = bf16(rng.choice([-1, 1], 512) * np.exp2(rng.uniform(-60, 0, 512)))[None, :]
    x16, e = ref.fp16_rows(row)
    scaled = np.ldexp(row.astype(np.float64), e[:, None])
    normal = np.abs(scaled) >= 2.0**-14
    assert normal.sum() > 100 and (~normal).sum() > 100
    assert np.array_equal(x16.astype(np.float64)[normal], scaled[normal])
    err = np.abs(x16.astype(np.float64) - scaled)
    assert err.max() <= 2.0**-25 and err[~normal].max() > 0
    assert np.all(np.ldexp(err, -e[:, None]) <= fp16_rows_step(row)[:, None])


def test_zero_rows_and_non_finite_values():
    x = bf16([[0.0, -0.0, 0.0, 0.0], [np.inf, 2.0, -np.inf, 0.5], [np.nan, 1.0, 0.0, 0.0], [np.inf, 0, 0, np.nan]])
    x16, e = ref.fp16_rows(x)
    assert e.tolist() == [0, 14, 15, 0]  # infinities and NaN are left out of the max
    assert np.signbit(x16[0, 1]) and not x16[0].any()
    assert x16[1, 0] == np.inf and x16[1, 2] == -np.inf and x16[1, 1] == 2.0**15
    assert np.isnan(x16[2, 0]) and x16[2, 1] == 2.0**15


def turing_path(x: np.ndarray, w16: np.ndarray, order: str, column_scale=None) -> np.ndarray:
    """The CUDA kernels' bf16 arithmetic in numpy: fp16 rows, fp32 products (exact) summed in fp32 in `order`,
    times the column's 2^T, times the row's 2^-e (each an fp32 multiply), one RN_bf16."""
    x16, e = ref.fp16_rows(x)
    p = x16.astype(np.float32)[:, None, :] * w16.astype(np.float32)[None, :, :]  # [M, N, K], exact
    if order == "reversed":
        p = p[..., ::-1]
    s = np.zeros(p.shape[:2], np.float32)
    if order == "pairwise":
        s = p.sum(axis=-1, dtype=np.float32)
    else:
        for j in range(p.shape[-1]):
            s = (s + p[..., j]).astype(np.float32)
    if column_scale is not None:
        s = (s * np.asarray(column_scale, np.float32)).astype(np.float32)
    s = (s * np.ldexp(np.float32(1.0), -e)[:, None].astype(np.float32)).astype(np.float32)
    return ref.bf16_round(s)


@pytest.mark.parametrize("order", ["sequential", "reversed", "pairwise"])
def test_the_emulated_turing_path_is_inside_the_bf16_bound(order):
    rng = np.random.default_rng(2)
    m, n, k = 6, 40, 256
    w16 = (rng.standard_normal((n, k)) * 0.05).astype(np.float16)
    x = bf16(rng.standard_normal((m, k)) * np.exp2(rng.uniform(-40, 0, (m, k))))  # wide rows
    x[1] *= 2.0**-120  # a row near bf16's bottom: products in fp32's subnormals, factor 2^-e tiny
    x[2] *= 2.0**100
    x = ref.bf16_round(x)
    col = np.exp2(rng.integers(-6, 6, n)).astype(np.float64)
    for column_scale in (None, col):
        y = turing_path(x, w16, order, column_scale)
        lo, hi = ref.linear_bounds(x, w16, column_scale=column_scale, dtype=BF16)
        assert np.all((lo <= y) & (y <= hi))
    lo, hi = ref.linear_bounds_fp32(x, w16, dtype=BF16)
    y = turing_path(x, w16, order)
    assert np.all((lo <= y) & (y <= hi))


def test_the_rows_term_is_what_holds_a_row_whose_small_values_round_away():
    """A row whose one large value meets a zero weight, and whose 64 values of 2^-41 the fp16 rows round to 0
    (2^-41 * 2^15 = 2^-26, under half fp16's least step): the exact sum is 64 * 2^-41 = 2^-35, the path's 0.
    The bound holds it; without the rows term the same bound would not."""
    k = 65
    x = np.full((1, k), 2.0**-41, np.float32)
    x[0, 0] = 1.0
    w16 = np.ones((1, k), np.float16)
    w16[0, 0] = 0
    y = turing_path(x, w16, "sequential")
    assert y[0, 0] == 0.0 and ref.linear(x, w16, dtype=BF16)[0, 0] == 2.0**-35
    lo, hi = ref.linear_bounds(x, w16, dtype=BF16)
    assert lo[0, 0] <= 0.0 <= hi[0, 0]
    term = fp16_rows_slack(x, np.abs(w16.astype(np.float64)).sum(axis=1), k, 2.0**-23)[0, 0]
    assert 2.0**-35 <= term + FP16_ROWS_POST < 2.0**-33  # 64 half steps of 2^-40: it spans the gap
    # the same bound without the term: d for 64 exact products of 2^-41, no fp16 rows
    a = np.array([[2.0**-35]])
    d = float64_sum_slack(k, 2.0**-23, a) + (gamma(k, 2.0**-23) + 1.0) * k * 2.0**-149 * (1.0 + 2.0**-50)
    lo_without, _ = outward(a - d, a + d, BF16)
    assert lo_without[0, 0] > 0.0
