"""Reference linear layer, the gated SiLU-and-mul epilogue, and the error bound for kernels.

- `linear(x, w16)`: y[m, n] = RN16(sum_k x[m, k] * w16[n, k]). Every fp16 x fp16 product is exact
  in float64 (11 + 11 significant bits, magnitudes 2^-48 .. 2^32); the sum is a float64 sum
  (BLAS order, not specified) rounded once to fp16 (RNE, overflow to +-inf at |S| >= 65520,
  subnormals kept). The float64 sum is exact whenever the products' binary span fits 53 bits
  (e.g. small K with moderate exponents, as in the tests); in general its error is at most
  gamma64_K * sum|x*w| (gamma64_K = K*2^-53 / (1 - K*2^-53)), which can only move y where the
  exact sum lies that close to an fp16 rounding midpoint. No bias: the contract is
  `linear(x, w16)` (docs/DESIGN.md, "Linear"); a bias would be one more RN16 add, done by the caller.
- `linear_bounds` / `linear_error_bound`: what an implementation that accumulates in fp32 (or
  wider), in any order, may return. Derivation:
    S   = exact sum of the products,   S64 = this module's float64 sum,   S' = the kernel's sum.
    Summing K exactly representable terms in any order (a tree of K - 1 additions, each rounded
    with relative error <= u) gives |S' - S| <= gamma_K(u) * sum|x*w|, gamma_K(u) = K*u / (1 - K*u)
    (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., Sec. 4.2). The products
    themselves are exact in fp32 (22 significant bits, |p| >= 2^-48 is far above fp32's normal
    minimum), so only the additions round. u = 2^-24 for round-to-nearest fp32 adds; the default
    u = 2^-23 also covers adders that truncate or round toward zero (tensor-core accumulation is
    known to truncate inside its multi-term adds).
    Hence |S' - S64| <= d = (gamma_K(u) + gamma64_K) * sum|x*w|, where sum|x*w| is itself a
    float64 matmul of non-negative exact products (bounded by (1 + gamma64_K) times its result).
    RN16 is monotone, so S' in [S64 - d, S64 + d] gives RN16(S') in
    [RN16(S64 - d), RN16(S64 + d)]; both ends are computed with outward float64 rounding
    (one nextafter each) so the interval is never too small. This interval (lo, hi) is the
    tightest statement the bound d allows: it already contains the "one fp16 ulp" of the final
    rounding, and |y - linear(x, w16)| <= max(hi - ref, ref - lo) <= d + ulp16(|S64| + d).
    Overflow: if S64 + d >= 65520, hi is +inf and a kernel may return inf there.
- `linear_bounds_fp32`: the same statement, computed from fp32 sums (what `qpn verify` uses: the
  float64 matmuls cost 55 % of its time). S32 and A32 are fp32 BLAS sums (any order, FMA or not)
  of the exact products x*w and |x*w| (exact in fp32, as above), so |S32 - S| <= gamma_K(2^-24) * A
  and A <= A32 / (1 - gamma_K(2^-24)), A = sum|x*w|. With the kernel's |S' - S| <= gamma_K(u) * A:
    |S' - S32| <= d32 = (gamma_K(u) + gamma_K(2^-24)) * A32 / (1 - gamma_K(2^-24)),
  evaluated in float64 from the exact float64 values of S32 and A32 with a (1 + 2^-50) factor for
  its own few roundings, then RN16 of S32 -+ d32 with outward nextafter, as above. fp32 never
  overflows here (|S| <= K * 65504^2 < 2^45) and fp32 additions do not underflow-lose (a sum in the
  subnormal range is exact). The interval is wider than `linear_bounds`' by the gamma_K(2^-24)
  term in place of gamma64_K (about 1.5x at the default u = 2^-23): still a true bound.
- bf16 activations (`dtype="bfloat16"`; ref/dtypes.py: bf16 values travel as float32 arrays): the same
  functions, the output rounded once to bf16 instead (`round_to`), nothing else copied. The bound's
  derivation changes in three places (docs/DESIGN.md, "Linear"):
    Products. x (bf16, 8 significant bits) times W16 (fp16, 11) has 19 significant bits, exact in
    float64 always (bf16 spans 2^-133 .. 2^128, fp16 2^-24 .. 65504: products 2^-157 .. 2^144), and
    exact in fp32 whenever it is neither below fp32's subnormal step nor above its range: every product
    is exact if each nonzero |x| lies in [2^-118, 2^112) (x's step >= 2^-125, times W16's >= 2^-24:
    >= 2^-149; |x w| < 2^112 * 2^16). Below, an fp32 multiply rounds in fp32's subnormal range: an
    absolute error of at most eps = 2^-149 per product (any rounding direction, no flush to zero; an
    FMA does not round the product at all). So |S' - S| <= gamma_K(u) * (A + K eps) + K eps, and d
    gains (gamma_K(u) * K eps + K eps) * (1 + 2^-50), zero for fp16 (fp16 x fp16 products are exact).
    Overflow. The fp32 partial sums of an order may exceed fp32's range where A is near 2^128 (fp16
    never: |S| <= K * 65504^2 < 2^45): where (1 + gamma_K(u)) * (A + K eps) * (1 + 2^-50) >= 2^128 -
    2^104 (the largest fp32) the interval is the whole line (-inf, +inf); such a kernel may return inf or
    NaN there, which no interval holds: the contract promises nothing for such x.
    Rounding. The ends are taken outward to fp32 (down / up) before the RN_bf16: the kernel's last fp32
    operation (the sum, or MXFP4's 2^T scaling, which rounds once in fp32 where the scaled sum falls
    below 2^-126) may round by more than the float64 nextafter; RN32 and RN_bf16 are monotone.
    fp16 rows (the Turing path: the CUDA kernels' x is `fp16_rows(x)`, ref/dtypes.py). The kernel sums
    x~ = x16 * 2^-e, where |x~ - x| <= c = 2^-25 * 2^-e (only values below 2^-14 of the scaled row move),
    exactly (fp16 x fp16 products), then multiplies the fp32 sum by 2^-e (MXFP4: after the 2^T), at most
    two fp32 multiplies by powers of two, exact unless the result falls below 2^-126, then each off by at
    most eps. So |S' - S| <= gamma_K(u) * (A + c W) + c W with W = sum_k |W16[n, k]|, then 2 eps after the
    2^T: d gains (1 + gamma_K(u)) * c * W * (1 + gamma64_K) * (1 + 2^-50) (`fp16_rows_slack`), the scaled
    ends 2 eps more (`FP16_ROWS_POST`). One bound for
    every path: the CPU's native bf16 sums lie inside it too. For a row of ordinary activations c * W is
    about 2^-40 of the row's largest |x| times W: far below the sum's own term.
  The fp16 results and bounds are unchanged, byte for byte.
- `silu_and_mul(gate16, up16)`: vLLM's silu_and_mul CUDA kernel, element by element:
  silu16 = RN16(silu32(gate)) with silu32(v) = RN32(v / RN32(1 + expf(-v))) in fp32, then
  out = RN16(silu16 * up16) (a half * half multiply: the exact product rounded once).
  expf here is float64 exp rounded to fp32: correctly rounded except when exp(-v) lies within
  about 2^-53 relative of an fp32 midpoint. CUDA's expf is specified to within 2 fp32 ulp (1 ulp
  typical), so a GPU result can differ from this reference; kernel tests need a bound for the
  gated path (one fp16 ulp of silu16, carried through the multiply). Inputs propagate as IEEE
  says: silu(+inf) = +inf, silu(-inf) = NaN (-inf / inf), exp overflow gives -0.0 for very
  negative gates. NaN is not rejected here.
- `linear_gated(x, w16)`: gate = rows [0, N/2) of w16, up = rows [N/2, N);
  out = silu_and_mul(linear(x, gate rows), linear(x, up rows)), i.e. "linear, then vLLM's
  silu_and_mul kernel" (docs/DESIGN.md, "Gated epilogue").
- In bf16 the epilogue is vLLM's kernel for scalar_t = bf16, the same operations: silu_bf = RN_bf16(silu32
  (gate)), out = RN_bf16(RN32(silu_bf * up)) (c10::BFloat16's multiply: an fp32 product, exact unless
  below 2^-126, then one RN_bf16).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .checks import require_array, require_finite
from .dtypes import BF16, FP16, fp16_rows_step, require_activations, require_dtype, round_to

FP32_UNIT_ROUNDOFF = 2.0**-24  # round-to-nearest fp32 addition
FP32_TRUNCATING_UNIT_ROUNDOFF = 2.0**-23  # fp32 addition that truncates (tensor-core accumulators)
FP64_UNIT_ROUNDOFF = 2.0**-53
FP32_LEAST = 2.0**-149  # fp32's subnormal step: a bf16 x fp16 product rounded in fp32 moves by at most this
FP32_MAX = float(np.finfo(np.float32).max)  # (2 - 2^-23) * 2^127
FP16_ROWS_POST = 2 * FP32_LEAST  # bf16 x: the fp16 rows' two power-of-two multiplies after the sum (docstring)


def product_error(dtype: str) -> float:
    """eps: how far one fp32 product of x (of `dtype`) and a W16 value may lie from the exact product: 0 for
    fp16 (22 significant bits, |p| >= 2^-48), 2^-149 for bf16 (module docstring)."""
    return 0.0 if require_dtype(dtype) == FP16 else FP32_LEAST


def _validate_linear_inputs(x: np.ndarray, w16: np.ndarray, *, dtype: str = FP16,
                            check_w16_values: bool = True) -> tuple[np.ndarray, np.ndarray]:
    x = require_activations("x", x, dtype, ndim=2)
    w16 = require_array("w16", w16, np.float16, ndim=2)
    if x.shape[1] != w16.shape[1]:
        raise ValueError(
            f"x is [M, K] = {x.shape} and w16 is [N, K] = {w16.shape}: their K must agree; "
            "w16 is stored [out_features, in_features], not transposed"
        )
    if x.shape[1] == 0:
        raise ValueError(f"K must be >= 1, got x of shape {x.shape}")
    require_finite("x", x)
    if check_w16_values:
        require_finite("w16", w16)
    return x, w16


def _float64_sums(x: np.ndarray, w16: np.ndarray) -> np.ndarray:
    """float64 [M, N]: sum_k x[m,k] * w16[n,k], every product exact, the sum in float64."""
    return x.astype(np.float64) @ w16.astype(np.float64).T


def linear(x: np.ndarray, w16: np.ndarray, *, column_scale: np.ndarray | None = None,
           dtype: str = FP16) -> np.ndarray:
    """x float16 [M, K], w16 float16 [N, K] -> float16 [M, N] = RN16(float64 sum of exact products).

    column_scale: float [N] powers of two each output column's sum is multiplied by before the RN16
    (exact: MXFP4's per-tile 2^T, ref/mxfp4.py); None: 1. Rejects non-finite inputs and mismatched K.
    dtype: the activations' and output's dtype, "float16" or "bfloat16" (x and the result then float32
    arrays of bf16 values, the one rounding RN_bf16; ref/dtypes.py).
    """
    x, w16 = _validate_linear_inputs(x, w16, dtype=dtype)
    return round_to(dtype, _scaled(_float64_sums(x, w16), column_scale))


def _scaled(v: np.ndarray, column_scale: np.ndarray | None) -> np.ndarray:
    return v if column_scale is None else v * np.asarray(column_scale, np.float64)


def gamma(k: int, u: float) -> float:
    """gamma_K(u) = K*u / (1 - K*u): the relative error bound of K rounded additions (Higham, Sec. 4.2)."""
    if k * u >= 0.5:
        raise ValueError(f"K = {k} is too large for the accumulation bound with unit roundoff {u} (needs K*u < 1/2)")
    return k * u / (1.0 - k * u)


def linear_bounds(x: np.ndarray, w16: np.ndarray, unit_roundoff: float = FP32_TRUNCATING_UNIT_ROUNDOFF, *,
                  column_scale: np.ndarray | None = None, dtype: str = FP16) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi), float16 [M, N] each: every fp32-or-wider accumulation of x @ w16.T, in any order,
    (times column_scale, powers of two: exact; as `linear`) rounded once to fp16, lies in [lo, hi]
    (module docstring for the derivation).

    unit_roundoff: 2^-23 (default: covers truncating adders) or 2^-24 (round-to-nearest adds).
    dtype: "float16" or "bfloat16" (x, lo and hi then float32 arrays of bf16 values; the products'
    underflow and the fp32 overflow terms of the module docstring).
    A kernel test asserts `(lo <= y) & (y <= hi)`, which also handles +-inf correctly.
    """
    x, w16 = _validate_linear_inputs(x, w16, dtype=dtype)
    k = x.shape[1]
    s64 = _float64_sums(x, w16)
    abs_sum = np.abs(x.astype(np.float64)) @ np.abs(w16.astype(np.float64)).T
    # d = (gamma_K(u) + gamma64_K) * (1 + gamma64_K) * abs_sum: the true sum|x*w| is at most
    # abs_sum / (1 - gamma64_K); the factor (1 + 2^-50) covers the rest of that and the few
    # float64 roundings of this very expression.
    d = float64_sum_slack(k, unit_roundoff, abs_sum)
    if dtype == BF16:  # products that round in fp32's subnormal range, the fp16 rows (module docstring)
        d = d + bf16_slack(x, w16, unit_roundoff)
    return rounded_interval(_scaled(s64 - d, column_scale), _scaled(s64 + d, column_scale), abs_sum, k,
                            unit_roundoff, dtype)


def bf16_slack(x: np.ndarray, w16: np.ndarray, unit_roundoff: float) -> np.ndarray:
    """float64 [M, N]: what bf16 x adds to d (module docstring): K products that may round in fp32's subnormals,
    (gamma_K(u) + 1) K eps (1 + 2^-50), and the fp16 rows' term (fp16_rows_slack). x: bf16 values [M, K] whose
    rows' largest |x| is at least the real rows' (the rows' term grows with it: an interval's corners serve)."""
    k = w16.shape[1]
    products = (gamma(k, unit_roundoff) + 1.0) * k * FP32_LEAST * (1.0 + 2.0**-50)
    return products + fp16_rows_slack(x, np.abs(w16.astype(np.float64)).sum(axis=1), k, unit_roundoff)


def rounded_interval(lo: np.ndarray, hi: np.ndarray, abs_sum: np.ndarray, k: int, unit_roundoff: float,
                     dtype: str = FP16, *, through_fp32: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """float64 bounds on a kernel's K-term fp32 sums (their magnitudes summing to at most abs_sum) -> the `dtype`
    interval of the one rounding (`outward`; through_fp32: of RN(RN32(v)), where one more fp32 operation, a
    bias add, comes first). bf16: also the fp16 rows' two power-of-two multiplies after the sum
    (FP16_ROWS_POST), and the whole line where an fp32 partial sum may overflow (never for fp16: |S| < 2^45)."""
    if dtype == FP16:
        return outward_through_fp32(lo, hi, FP16) if through_fp32 else outward_fp16(lo, hi)
    lo, hi = outward_through_fp32(lo - FP16_ROWS_POST, hi + FP16_ROWS_POST, dtype)
    return _unbounded_where(_may_overflow_fp32(abs_sum * (1.0 + gamma(k, FP64_UNIT_ROUNDOFF)), k, unit_roundoff,
                                               FP32_LEAST), lo, hi)


def fp16_rows_slack(x: np.ndarray, w_abs: np.ndarray, k: int, unit_roundoff: float) -> np.ndarray:
    """float64 [M, N]: what the fp16 rows of bf16 x add to d, (1 + gamma_K(u)) * c_m * W_n * (1 + gamma64_K) *
    (1 + 2^-50), c_m = fp16_rows_step(x)[m], W_n >= sum_k |W16[n, k]| given as w_abs [N] (a float64 sum: the
    (1 + gamma64_K) factor covers its rounding; module docstring, "fp16 rows")."""
    c = fp16_rows_step(x)
    slack = (1.0 + gamma(k, unit_roundoff)) * (1.0 + gamma(k, FP64_UNIT_ROUNDOFF)) * (1.0 + 2.0**-50)
    return slack * np.outer(c, w_abs)


def _may_overflow_fp32(abs_sum: np.ndarray, k: int, unit_roundoff: float, eps: float) -> np.ndarray:
    """bool: where an fp32 partial sum of the K products (magnitudes summing to at most abs_sum) may reach fp32's
    overflow: (1 + gamma_K(u)) * (A + K eps) * (1 + 2^-50) >= the largest fp32 (module docstring)."""
    with np.errstate(over="ignore", invalid="ignore"):
        bound = (1.0 + gamma(k, unit_roundoff)) * (abs_sum + k * eps) * (1.0 + 2.0**-50)
        return ~(bound < FP32_MAX)  # NaN / inf: may


def _unbounded_where(mask: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if not mask.any():
        return lo, hi
    return np.where(mask, -np.inf, lo).astype(lo.dtype), np.where(mask, np.inf, hi).astype(hi.dtype)


def float64_sum_slack(k: int, unit_roundoff: float, abs_sum: np.ndarray) -> np.ndarray:
    """d = (gamma_K(u) + gamma64_K) * (1 + gamma64_K) * (1 + 2^-50) * abs_sum: how far a kernel's K-term
    sum (unit roundoff u) may lie from a float64 sum of the same exact products, abs_sum the float64
    sum of their magnitudes (module docstring)."""
    gamma64 = gamma(k, FP64_UNIT_ROUNDOFF)
    return (gamma(k, unit_roundoff) + gamma64) * (1.0 + gamma64) * (1.0 + 2.0**-50) * abs_sum


def outward(lo: np.ndarray, hi: np.ndarray, dtype: str = FP16) -> tuple[np.ndarray, np.ndarray]:
    """float64 bounds -> the `dtype` interval that contains every rounding of a value in [lo, hi] (as stored:
    float16, or float32 of bf16 values): `outward_fp16`, or `outward_bf16`."""
    return outward_fp16(lo, hi) if require_dtype(dtype) == FP16 else outward_bf16(lo, hi)


def outward_bf16(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 bounds -> float32 arrays of the bf16 interval that contains RN_bf16(RN32(v)) and RN_bf16(v) for
    every v in [lo, hi] (`outward_through_fp32`: the kernel's last fp32 operation may round: module docstring)."""
    return outward_through_fp32(lo, hi, BF16)


def outward_through_fp32(lo: np.ndarray, hi: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """float64 bounds -> the `dtype` interval that contains RN(RN32(v)) for every v in [lo, hi]: one float64
    nextafter outward, rounded down / up to fp32, then the dtype's rounding (monotone); a NaN end becomes the
    whole line."""
    with np.errstate(over="ignore", invalid="ignore"):
        lo64 = np.nextafter(np.where(np.isnan(lo), -np.inf, lo), -np.inf)
        hi64 = np.nextafter(np.where(np.isnan(hi), np.inf, hi), np.inf)
        return round_to(dtype, _fp32_toward(lo64, -np.inf)), round_to(dtype, _fp32_toward(hi64, np.inf))


def _fp32_toward(v: np.ndarray, direction: float) -> np.ndarray:
    """float32: v (float64) rounded toward -inf (direction -inf) or +inf: RN32, then one fp32 step back where it
    went past v."""
    with np.errstate(over="ignore", invalid="ignore"):
        f = np.asarray(v).astype(np.float32)
        past = f.astype(np.float64) < v if direction > 0 else f.astype(np.float64) > v
        return np.where(past, np.nextafter(f, np.float32(direction)), f).astype(np.float32)


def outward_fp16(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 bounds -> the fp16 interval that contains every RN16 of a value in [lo, hi]: one nextafter
    outward before the cast (so the float64 bounds' own last rounding cannot shrink it); +-inf where it
    overflows; a NaN end (inf - inf) becomes the whole line."""
    with np.errstate(over="ignore", invalid="ignore"):
        lo16 = np.nextafter(np.where(np.isnan(lo), -np.inf, lo), -np.inf).astype(np.float16)
        hi16 = np.nextafter(np.where(np.isnan(hi), np.inf, hi), np.inf).astype(np.float16)
    return lo16, hi16


# (w16 [N, K], x32 [M + 1, K], M) -> (S32, A32): the fp32 matmuls of `linear_bounds_fp32`
Fp32Sums = Callable[[np.ndarray, np.ndarray, int], tuple[np.ndarray, np.ndarray]]


def linear_bounds_fp32(x: np.ndarray, w16: np.ndarray, unit_roundoff: float = FP32_TRUNCATING_UNIT_ROUNDOFF, *,
                       fp32_sums: Fp32Sums | None = None, dtype: str = FP16
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi), float16 [M, N]: as `linear_bounds`, but from fp32 matmuls (module docstring for the
    derivation): a true bound, slightly wider, at about a quarter of the cost for large layers.

    fp32_sums(w16, x32, m) -> (S32 [N, m], A32 [N, R]): w16 [N, K] widened once to fp32 (exact),
    S32 = w32 @ x32[:m].T and A32 = |w32| @ |x32|.T, both accumulated in fp32 (any order, FMA or not).
    Default numpy's (`numpy_fp32_sums`); a caller with a faster fp32 matmul passes its own (qpn
    verify: torch's, whose fp16 widening is vectorized). dtype: as `linear_bounds`.
    """
    x, w16 = _validate_linear_inputs(x, w16, dtype=dtype, check_w16_values=False)
    m, k = x.shape
    x32 = np.concatenate([x.astype(np.float32), np.ones((1, k), np.float32)])  # exact; the ones row: below
    with np.errstate(invalid="ignore"):  # inf * 0 in a non-finite weight's row: judged just below
        s32, a32 = (fp32_sums or numpy_fp32_sums)(w16, x32, m)
    s32 = np.asarray(s32).T.astype(np.float64)
    a32 = np.asarray(a32).T.astype(np.float64)
    # w16's finiteness without its own pass over the weight (np.isfinite on fp16 costs 0.1 s per
    # 14336 x 4096 layer, 15 % of this function): the ones row's sums sum_k |w[n, k]| (<= K * 65504,
    # finite in fp32) are NaN or inf exactly where row n holds a NaN or inf, whatever x is
    if not np.isfinite(a32[m]).all():
        require_finite("w16", w16)  # raises, counting every NaN / inf
    rows = None
    if dtype == BF16:  # the ones row's fp32 sums bound W = sum_k |W16[n, k]| within gamma32
        rows = fp16_rows_slack(x, a32[m] / (1.0 - gamma(k, FP32_UNIT_ROUNDOFF)), k, unit_roundoff)
    return linear_bounds_of_fp32_sums(s32, a32[:m], k, unit_roundoff, dtype=dtype, rows_slack=rows)


def numpy_fp32_sums(w16: np.ndarray, x32: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """`linear_bounds_fp32`'s default fp32_sums. [N, K] @ [K, R]: OpenBLAS runs a 14336 x 4096 weight
    with R = 41 about 25 % faster with the weight as the left operand (measured on the 2-core
    benchmark machine)."""
    w32 = w16.astype(np.float32)  # exact
    s32 = w32 @ x32[:m].T
    np.abs(w32, out=w32)
    return s32, w32 @ np.abs(x32).T


def linear_bounds_of_fp32_sums(s32: np.ndarray, a32: np.ndarray, k: int,
                               unit_roundoff: float = FP32_TRUNCATING_UNIT_ROUNDOFF, *,
                               dtype: str = FP16, rows_slack: np.ndarray | None = None
                               ) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi), float16 [M, N], from S32 = sum x*w and A32 = sum |x*w| [M, N] accumulated in fp32 by
    any BLAS (any order, FMA or not; values in float32 or float64) over K exact fp16 products: the
    `linear_bounds_fp32` statement (module docstring), for callers whose fp32 matmul is faster than
    numpy's (qpn verify uses torch's). The caller checks the weights are finite.

    dtype "bfloat16": x was bf16 (lo, hi float32 arrays of bf16 values). Each of the K products may then
    round in fp32 by eps = 2^-149 in the kernel and in S32 and A32 alike, so with A <= A32 / (1 -
    gamma32) + K eps: |S' - S32| <= d32 + ((gamma_K(u) + gamma32) * 2K eps + 2K eps) * (1 + 2^-50);
    where A32 may reach fp32's overflow (as `linear_bounds`), the whole line. rows_slack [M, N]: the fp16 rows'
    term (`fp16_rows_slack`), added to d where given (linear_bounds_fp32 gives it for bf16)."""
    s32 = np.asarray(s32, dtype=np.float64)
    a32 = np.asarray(a32, dtype=np.float64)
    if s32.shape != a32.shape:
        raise ValueError(f"s32 and a32 must have one shape [M, N], got {s32.shape} and {a32.shape}")
    gamma32 = gamma(k, FP32_UNIT_ROUNDOFF)
    with np.errstate(over="ignore", invalid="ignore"):  # bf16: an inf A32 gives the whole line below
        d = (gamma(k, unit_roundoff) + gamma32) / (1.0 - gamma32) * (1.0 + 2.0**-50) * a32
        eps = product_error(dtype)
        if eps:  # bf16 (a no-op for fp16: d unchanged)
            d = d + ((gamma(k, unit_roundoff) + gamma32) * 2 * k * eps + 2 * k * eps) * (1.0 + 2.0**-50)
        if rows_slack is not None:
            d = d + rows_slack + FP16_ROWS_POST
        lo, hi = outward(s32 - d, s32 + d, dtype)
    if dtype == BF16:
        lo, hi = _unbounded_where(_may_overflow_fp32(a32 / (1.0 - gamma32), k, unit_roundoff, eps), lo, hi)
    return lo, hi


def linear_error_bound(x: np.ndarray, w16: np.ndarray,
                       unit_roundoff: float = FP32_TRUNCATING_UNIT_ROUNDOFF, *, dtype: str = FP16) -> np.ndarray:
    """float64 [M, N]: |y - linear(x, w16)| may not exceed this for any y that `linear_bounds` admits.

    = max(hi - ref, ref - lo) with ref = linear(x, w16); 0 where lo == hi == ref (also at +-inf),
    +inf where the interval reaches an fp16 (bf16) overflow that ref does not share.
    """
    lo, hi = linear_bounds(x, w16, unit_roundoff, dtype=dtype)
    ref = linear(x, w16, dtype=dtype).astype(np.float64)
    lo64, hi64 = lo.astype(np.float64), hi.astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf where the interval is a single infinity
        above = np.where(hi64 == ref, 0.0, hi64 - ref)
        below = np.where(lo64 == ref, 0.0, ref - lo64)
    return np.maximum(above, below)


def _expf(v: np.ndarray) -> np.ndarray:
    """fp32 exp: float64 exp rounded once to fp32 (overflow -> inf, as expf does)."""
    with np.errstate(over="ignore"):
        return np.exp(v.astype(np.float64)).astype(np.float32)


def silu_and_mul(gate16: np.ndarray, up16: np.ndarray, *, dtype: str = FP16) -> np.ndarray:
    """vLLM's silu_and_mul on fp16 tensors of one shape: RN16(RN16(silu32(gate)) * up) (module docstring);
    dtype "bfloat16": on bf16 values (float32 arrays), each RN16 an RN_bf16."""
    gate16 = require_activations("gate16", gate16, dtype)
    up16 = require_activations("up16", up16, dtype)
    if gate16.shape != up16.shape:
        raise ValueError(f"gate16 and up16 must have one shape, got {gate16.shape} and {up16.shape}")
    v = gate16.astype(np.float32)  # exact
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        denominator = np.float32(1.0) + _expf(-v)  # RN32
        silu16 = round_to(dtype, v / denominator)  # RN32 division, then RN16 (RN_bf16)
        # half * half: 22 significant bits and |product| >= 2^-48, exact in fp32; then one RN16. bf16 * bf16:
        # 16 bits, exact in fp32 unless below 2^-126 (then RN32 first, as the kernel's fp32 multiply)
        return round_to(dtype, silu16.astype(np.float32) * up16.astype(np.float32))


def linear_gated(x: np.ndarray, w16: np.ndarray, *, dtype: str = FP16) -> np.ndarray:
    """x float16 [M, K], fused w16 float16 [N, K] (gate rows [0, N/2), up rows [N/2, N)) ->
    float16 [M, N/2] = silu_and_mul(linear(x, gate), linear(x, up)). N must be even. dtype: as `linear`."""
    x, w16 = _validate_linear_inputs(x, w16, dtype=dtype)
    n = w16.shape[0]
    if n == 0 or n % 2 != 0:
        raise ValueError(
            f"w16 must stack gate rows [0, N/2) and up rows [N/2, N), so N must be even and >= 2, got N={n}"
        )
    half = n // 2
    return silu_and_mul(linear(x, w16[:half], dtype=dtype), linear(x, w16[half:], dtype=dtype), dtype=dtype)
