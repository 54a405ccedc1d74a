"""The mixture-of-experts block of Qwen3-MoE and Mixtral in numpy: routing, each expert's gated SiLU MLP
on the contract's W16, and the weighted top-k sum (docs/DESIGN.md, "Numerics contract", MoE).

- `route(router_logits, top_k, renormalize)`: what the HF routers compute (transformers 5,
  Qwen3MoeTopKRouter / MixtralTopKRouter; vLLM's fused_topk the same): p = softmax(logits) in fp32,
  the top_k largest (ties: the lower expert index first), divided by their sum when `renormalize`
  (Qwen3-MoE: config.norm_topk_prob; Mixtral: always). Here the softmax is evaluated in float64 and
  rounded once to fp32, the renormalization is one fp32 sum (in top-k order) and one fp32 division:
  torch's fp32 softmax rounds expf and its sum differently, so a torch router's weights may differ
  from these by a few fp32 ulps, and a near-tie may pick another expert. Routing is the caller's
  (vLLM computes it; qpn's MoE ops take `topk_weights` / `topk_ids`), so the contract starts there.
- `moe(x, w13, w2, topk_weights, topk_ids)`: for token m and its j-th choice e = ids[m, j]:
      h_j = linear_gated(x[m], w13[e])            fp16 [I]  (gate rows [0, I), up rows [I, 2I))
      y_j = linear(h_j, w2[e])                    fp16 [H]
      out[m] = RN16(acc_k),  acc_0 = 0,  acc_{j+1} = RN32(acc_j + RN32(weights[m, j] * y_j))
  i.e. the contract's linear and gated epilogue per expert, then one fp32 multiply and one fp32 add
  per choice in top-k order (the router's order: descending weight), one RN16. The order is fixed
  per token: a token's output does not depend on the other tokens of the batch or on which experts
  they hit (batch invariance). HF's experts add the choices in expert-index order, rounding to the
  model dtype at every add, and vLLM sums them in its own kernels: both are within the bound below
  of this reference's result for the same h_j and y_j (tests compare against HF with a tolerance).
- `moe_bounds(...)`: what an implementation may return (fp32 accumulation in any order in both
  linears, CUDA's expf within 2 fp32 ulps, the combine in any fp32 order), propagated as intervals:
    gate, up  in linear_bounds (per expert, per token);
    silu16    over the gate interval (silu falls to its minimum at v* = -1.2784645, rises after),
              widened by one fp16 ulp each way (expf's error moves silu32 by a few fp32 ulps, which
              RN16 turns into at most one fp16 ulp);
    h         = RN16(silu16 * up) over the interval corners, rounded outward;
    y         in [RN16(Smin - d), RN16(Smax + d)], Smin / Smax the least and largest sum of h * w over
              the h box (float64, exact products), d = (gamma_I(u) + gamma64_I) * sum max|h| |w|
              (ref.linear's derivation with the box's largest |h|);
    out       in [RN16(Cmin - e), RN16(Cmax + e)], C = sum_j weights[m, j] * y_j over the y box
              (weights >= 0), e = gamma_k(u) * sum_j weights |y|max (k products and k - 1 adds: a dot
              product of length k, in any order).
  Overflow and NaN reach inf: an interval that admits inf admits it.
  bf16 (`dtype="bfloat16"`): the same propagation with each RN16 an RN_bf16 (outward in bf16, through fp32),
  silu widened by one bf16 ulp, and each linear's bf16 terms (ref.linear.bf16_slack: products in fp32's
  subnormals, the fp16 rows of the kernels' x, whose row exponent a box bounds by its corners' largest |h|;
  rounded_interval: the multiplies after the sum and fp32 overflow), and the combine's k products eps each.
"""

from __future__ import annotations

import numpy as np

from .checks import require_array
from .dtypes import BF16, FP16, require_activations, round_to, step_out, storage
from .linear import (
    FP32_LEAST,
    FP32_TRUNCATING_UNIT_ROUNDOFF,
    FP64_UNIT_ROUNDOFF,
    bf16_slack,
    float64_sum_slack,
    gamma,
    linear,
    linear_bounds,
    linear_gated,
    outward,
    rounded_interval,
)

SILU_ARGMIN = -1.2784645427610738  # silu'(v) = 0: v = -1 - W(1/e) (Lambert W), silu(v*) = -0.27846454


def _check_routing(weights: np.ndarray, ids: np.ndarray, m: int, experts: int) -> tuple[np.ndarray, np.ndarray]:
    weights = require_array("topk_weights", weights, np.float32, ndim=2)
    ids = np.asarray(ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"topk_ids must be an integer array [M, top_k], got {ids.dtype} of shape {ids.shape}")
    if weights.shape != ids.shape or weights.shape[0] != m:
        raise ValueError(f"topk_weights {weights.shape} and topk_ids {ids.shape} must both be [M, top_k] "
                         f"with M = {m} (x's rows)")
    if ids.size and (ids.min() < 0 or ids.max() >= experts):
        raise ValueError(f"topk_ids must lie in [0, {experts}) (the experts of w13 / w2), got "
                         f"{int(ids.min())}..{int(ids.max())}")
    if not (np.all(np.isfinite(weights)) and np.all(weights >= 0)):
        raise ValueError("topk_weights must be finite and >= 0 (softmax probabilities), got "
                         f"{weights[~(np.isfinite(weights) & (weights >= 0))][:4]}")
    return weights, ids.astype(np.int64)


def _check_experts(x: np.ndarray, w13: np.ndarray, w2: np.ndarray,
                   dtype: str = FP16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = require_activations("x", x, dtype, ndim=2)
    w13 = require_array("w13", w13, np.float16, ndim=3)
    w2 = require_array("w2", w2, np.float16, ndim=3)
    e, two_i, h = w13.shape
    if two_i % 2 or x.shape[1] != h or w2.shape != (e, h, two_i // 2):
        raise ValueError(f"w13 must be [E, 2I, H] (gate rows, then up rows), w2 [E, H, I] and x [M, H]; got w13 "
                         f"{w13.shape}, w2 {w2.shape}, x {x.shape}")
    return x, w13, w2


def route(router_logits: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """router_logits [M, E] (any float dtype) -> (topk_weights float32 [M, top_k], topk_ids int64 [M, top_k])
    in descending weight order (module docstring)."""
    logits = np.asarray(router_logits)
    if logits.ndim != 2 or not np.issubdtype(logits.dtype, np.floating):
        raise ValueError(f"router_logits must be a float array [M, E], got {logits.dtype} of shape {logits.shape}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, E = {logits.shape[1]}], got {top_k}")
    z = logits.astype(np.float64)
    p64 = np.exp(z - z.max(axis=1, keepdims=True))
    p = (p64 / p64.sum(axis=1, keepdims=True)).astype(np.float32)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :top_k]  # descending; ties: lower index first
    weights = np.take_along_axis(p, ids, axis=1)
    if renormalize:
        total = np.zeros((weights.shape[0], 1), np.float32)
        for j in range(top_k):  # fp32 adds in top-k order
            total += weights[:, j:j + 1]
        weights = weights / total
    return weights.astype(np.float32), ids.astype(np.int64)


def expert_outputs(x: np.ndarray, w13: np.ndarray, w2: np.ndarray, ids: np.ndarray,
                   dtype: str = FP16) -> np.ndarray:
    """fp16 [M, top_k, H] (bf16: float32 of bf16 values): y for every (token, choice), each expert run once on
    the tokens that chose it."""
    y = np.zeros((*ids.shape, x.shape[1]), storage(dtype))
    for e in np.unique(ids):
        rows, choices = np.nonzero(ids == e)
        h = linear_gated(x[rows], w13[e], dtype=dtype)
        y[rows, choices] = linear(h, w2[e], dtype=dtype)
    return y


def combine(y: np.ndarray, weights: np.ndarray, dtype: str = FP16) -> np.ndarray:
    """fp16 [M, H] = RN16 of the fp32 sum over j (in order) of RN32(weights[:, j] * y[:, j]); dtype
    "bfloat16": y float32 of bf16 values, the one rounding RN_bf16 (ref/dtypes.py)."""
    acc = np.zeros((y.shape[0], y.shape[2]), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for j in range(y.shape[1]):
            acc += weights[:, j:j + 1] * y[:, j].astype(np.float32)  # RN32 product, RN32 add
        return round_to(dtype, acc)


def moe(x: np.ndarray, w13: np.ndarray, w2: np.ndarray, topk_weights: np.ndarray,
        topk_ids: np.ndarray, *, dtype: str = FP16) -> np.ndarray:
    """x fp16 [M, H], w13 fp16 [E, 2I, H], w2 fp16 [E, H, I] (each expert's W16), topk_weights float32
    [M, k], topk_ids int [M, k] -> fp16 [M, H] (module docstring); dtype "bfloat16": x and the result bf16
    values in float32 arrays, every rounding of the activations RN_bf16."""
    x, w13, w2 = _check_experts(x, w13, w2, dtype)
    weights, ids = _check_routing(topk_weights, topk_ids, x.shape[0], w13.shape[0])
    return combine(expert_outputs(x, w13, w2, ids, dtype), weights, dtype)


def _silu64(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return v / (1.0 + np.exp(-v))


def _silu_bounds(g_lo: np.ndarray, g_hi: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    lo64, hi64 = g_lo.astype(np.float64), g_hi.astype(np.float64)
    ends_lo, ends_hi = _silu64(lo64), _silu64(hi64)
    low = np.where((lo64 <= SILU_ARGMIN) & (SILU_ARGMIN <= hi64), _silu64(np.float64(SILU_ARGMIN)),
                   np.minimum(ends_lo, ends_hi))
    high = np.maximum(ends_lo, ends_hi)
    return step_out(dtype, *outward(low, high, dtype))  # one ulp more each way: expf


def _product_bounds(a_lo: np.ndarray, a_hi: np.ndarray, b_lo: np.ndarray,
                    b_hi: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(invalid="ignore", over="ignore"):
        corners = np.stack([a.astype(np.float64) * b.astype(np.float64) for a in (a_lo, a_hi) for b in (b_lo, b_hi)])
    return outward(corners.min(axis=0), corners.max(axis=0), dtype)  # a NaN corner (0 * inf): the whole line


def _box_linear_bounds(h_lo: np.ndarray, h_hi: np.ndarray, w16: np.ndarray,
                       unit_roundoff: float, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """[M, N] of `dtype`: every fp32-accumulated RN16 (RN_bf16) of h @ w.T for h anywhere in the box [h_lo, h_hi]."""
    lo64, hi64, w = h_lo.astype(np.float64), h_hi.astype(np.float64), w16.astype(np.float64)
    pos, neg = np.maximum(w, 0.0), np.minimum(w, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        s_min = lo64 @ pos.T + hi64 @ neg.T
        s_max = hi64 @ pos.T + lo64 @ neg.T
        big = np.maximum(np.abs(lo64), np.abs(hi64))
        abs_sum = big @ np.abs(w).T
        d = float64_sum_slack(w.shape[1], unit_roundoff, abs_sum)
        if dtype == BF16:  # the corners' largest |h| bound each row's fp16-rows exponent (module docstring)
            d = d + bf16_slack(big.astype(np.float32), w16, unit_roundoff)
        return rounded_interval(s_min - d, s_max + d, abs_sum, w.shape[1], unit_roundoff, dtype)


def moe_bounds(x: np.ndarray, w13: np.ndarray, w2: np.ndarray, topk_weights: np.ndarray, topk_ids: np.ndarray,
               unit_roundoff: float = FP32_TRUNCATING_UNIT_ROUNDOFF, *,
               dtype: str = FP16) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) fp16 [M, H]: every implementation of the MoE contract returns out in [lo, hi] (module
    docstring for the derivation); dtype "bfloat16": x, lo and hi bf16 values (float32 arrays)."""
    x, w13, w2 = _check_experts(x, w13, w2, dtype)
    weights, ids = _check_routing(topk_weights, topk_ids, x.shape[0], w13.shape[0])
    inter = w13.shape[1] // 2
    y_lo = np.zeros((*ids.shape, x.shape[1]), storage(dtype))
    y_hi = np.zeros_like(y_lo)
    for e in np.unique(ids):
        rows, choices = np.nonzero(ids == e)
        g_lo, g_hi = linear_bounds(x[rows], w13[e, :inter], unit_roundoff, dtype=dtype)
        u_lo, u_hi = linear_bounds(x[rows], w13[e, inter:], unit_roundoff, dtype=dtype)
        s_lo, s_hi = _silu_bounds(g_lo, g_hi, dtype)
        h_lo, h_hi = _product_bounds(s_lo, s_hi, u_lo, u_hi, dtype)
        y_lo[rows, choices], y_hi[rows, choices] = _box_linear_bounds(h_lo, h_hi, w2[e], unit_roundoff, dtype)
    w64 = weights.astype(np.float64)[:, :, None]
    top_k = ids.shape[1]
    with np.errstate(invalid="ignore", over="ignore"):
        c_lo = (w64 * y_lo.astype(np.float64)).sum(axis=1)
        c_hi = (w64 * y_hi.astype(np.float64)).sum(axis=1)
        a = (w64 * np.maximum(np.abs(y_lo.astype(np.float64)), np.abs(y_hi.astype(np.float64)))).sum(axis=1)
        # k fp32 products and k - 1 fp32 adds (gamma_k), against float64 sums of k exact-enough terms
        slack = (gamma(top_k, unit_roundoff) + gamma(top_k, FP64_UNIT_ROUNDOFF)) * (1.0 + 2.0**-50) * a
        if dtype == BF16:  # a bf16 y's product with its weight may round in fp32's subnormals: eps each
            slack = slack + top_k * FP32_LEAST
        return outward(c_lo - slack, c_hi + slack, dtype)
