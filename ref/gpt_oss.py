"""gpt-oss's mixture-of-experts block in numpy (issue 23): its router, its experts' biased linears and their
clamped SwiGLU ("swigluoai"), and the weighted top-k sum, on the contract's W16 (docs/DESIGN.md, "gpt-oss
experts").

- `route(router_logits, top_k)`: what transformers' GptOssTopKRouter and vLLM compute: the top_k largest
  logits (the router's own bias included by the caller; ties: the lower expert index first), then a
  softmax over those k values only. Here in float64, rounded once to fp32 (torch's fp32 softmax may
  differ by a few fp32 ulps).
- `swigluoai_and_mul(gate16, up16)`: vLLM's swigluoai_and_mul kernel, op for op in fp32, one RN16:
      g = min(gate, 7), u = clamp(up, -7, 7), s = 1 / (1 + expf(-(g * 1.702))), glu = g * s,
      h = RN16((u + 1) * glu)                  (alpha = 1.702, limit = 7.0: gpt-oss's config)
  each fp32 operation rounded once (expf: float64 exp rounded to fp32; CUDA's expf is within 2 ulps).
- `moe(x, w13, b13, w2, b2, topk_weights, topk_ids)`: for token m and its j-th choice e:
      gate, up = RN16(S + b) over w13[e]'s rows [0, I) and [I, 2I)   (S = the contract's fp32 sum of x W16;
                                                                    the bias enters before the one RN16)
      h_j      = swigluoai_and_mul(gate, up)
      y_j      = RN16(S(h_j, w2[e]) + b2[e])
      out[m]   = ref.moe.combine: one fp32 multiply and add per choice in top-k order, one RN16
  w13 in qpn's layout: gate rows first, then up. gpt-oss's checkpoints interleave them (row 2i gate, 2i + 1
  up): `deinterleave` is the permutation a loader applies once (exact: rows move, nothing rounds). The
  biases are float32 (gpt-oss stores bf16, which fp32 holds exactly). The sums here are float64 with one
  rounding: the reference; a kernel's fp32 order moves S within ref.linear_bounds.
- `moe_bounds(...)`: what an implementation may return (fp32 sums in any order, CUDA's expf within 2 ulps,
  the combine in top-k order), qpn.ref.moe's interval argument through the biases and swigluoai:
    gate, up, y  RN(RN32(S' + b)) for S' in the box bound of ref.moe (the least and largest float64 sums of
                 the input box, widened by ref.linear's slack; bf16: its bf16 terms, ref.linear.bf16_slack,
                 and the multiplies after the sum), the bias add rounded outward to fp32, then monotone RN;
    h            swigluoai over the (gate, up) box: min(gate, limit) and the clamp are monotone, g
                 sigmoid(alpha g) falls to its minimum at GLU_ARGMIN and rises after; the fp32 chain moves
                 the exact product by at most `_swigluoai_relative` of itself (and 2^-100 where it
                 underflows);
    out          the combine's fixed fp32 order is monotone in each y (weights >= 0): its values at the y
                 box's ends.
"""

from __future__ import annotations

import numpy as np

from .checks import require_array
from .dtypes import BF16, FP16, require_activations, round_to, storage
from .linear import (
    FP32_TRUNCATING_UNIT_ROUNDOFF,
    _expf,
    _float64_sums,
    bf16_slack,
    float64_sum_slack,
    outward,
    rounded_interval,
)
from .moe import SILU_ARGMIN, _check_experts, _check_routing, combine

SWIGLU_ALPHA = 1.702  # gpt-oss config swiglu_alpha (an fp32 constant in vLLM's kernel)
SWIGLU_LIMIT = 7.0  # gpt-oss config swiglu_limit


def route(router_logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """router_logits [M, E] -> (topk_weights float32 [M, top_k], topk_ids int64 [M, top_k]), descending."""
    logits = np.asarray(router_logits)
    if logits.ndim != 2 or not np.issubdtype(logits.dtype, np.floating):
        raise ValueError(f"router_logits must be a float array [M, E], got {logits.dtype} of shape {logits.shape}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, E = {logits.shape[1]}], got {top_k}")
    ids = np.argsort(-logits.astype(np.float64), axis=1, kind="stable")[:, :top_k]
    top = np.take_along_axis(logits.astype(np.float64), ids, axis=1)
    p = np.exp(top - top[:, :1])  # the first is the largest
    return (p / p.sum(axis=1, keepdims=True)).astype(np.float32), ids.astype(np.int64)


def swigluoai_and_mul(gate16: np.ndarray, up16: np.ndarray, alpha: float = SWIGLU_ALPHA,
                      limit: float = SWIGLU_LIMIT, *, dtype: str = FP16) -> np.ndarray:
    """vLLM's swigluoai_and_mul on fp16 tensors of one shape (module docstring); dtype "bfloat16": on bf16
    values (float32 arrays), the one rounding RN_bf16 (vLLM's kernel for scalar_t = bf16)."""
    gate16 = require_activations("gate16", gate16, dtype)
    up16 = require_activations("up16", up16, dtype)
    if gate16.shape != up16.shape:
        raise ValueError(f"gate16 and up16 must have one shape, got {gate16.shape} and {up16.shape}")
    a, lim = np.float32(alpha), np.float32(limit)
    g = np.minimum(gate16.astype(np.float32), lim)  # NaN stays NaN (np.minimum propagates it, as the kernel's ?:)
    u = np.clip(up16.astype(np.float32), -lim, lim)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        s = np.float32(1.0) / (np.float32(1.0) + _expf(-(g * a)))  # each op one RN32
        glu = g * s
        return round_to(dtype, (u + np.float32(1.0)) * glu)


def deinterleave(gate_up: np.ndarray, axis: int) -> np.ndarray:
    """gpt-oss's interleaved gate / up along `axis` (2i gate, 2i + 1 up: -2 for weights [..., 2I, K], -1 for
    biases [..., 2I]) -> qpn's order: the gate rows, then the up rows. A permutation: nothing rounds."""
    gate_up = np.asarray(gate_up)
    if gate_up.shape[axis] % 2:
        raise ValueError(f"gate_up must hold gate and up pairs along axis {axis}, got shape {gate_up.shape}")
    every = [slice(None)] * gate_up.ndim
    gates, ups = list(every), list(every)
    gates[axis], ups[axis] = slice(0, None, 2), slice(1, None, 2)
    return np.concatenate([gate_up[tuple(gates)], gate_up[tuple(ups)]], axis=axis)


def _biased(x: np.ndarray, w16: np.ndarray, b: np.ndarray, dtype: str = FP16) -> np.ndarray:
    """RN16(S + b): the float64 sum of exact products plus the fp32 bias, rounded once (to `dtype`)."""
    return round_to(dtype, _float64_sums(x, w16) + b.astype(np.float64))


def moe(x: np.ndarray, w13: np.ndarray, b13: np.ndarray, w2: np.ndarray, b2: np.ndarray,
        topk_weights: np.ndarray, topk_ids: np.ndarray, *, dtype: str = FP16) -> np.ndarray:
    """x fp16 [M, H]; w13 fp16 [E, 2I, H] (gate rows, then up), b13 float32 [E, 2I]; w2 fp16 [E, H, I],
    b2 float32 [E, H]; the routing -> fp16 [M, H] (module docstring). dtype "bfloat16": x and the result
    bf16 values in float32 arrays, every rounding of the activations RN_bf16."""
    x, w13, b13, w2, b2, weights, ids = _check(x, w13, b13, w2, b2, topk_weights, topk_ids, dtype)
    inter, h = w13.shape[1] // 2, w13.shape[2]
    y = np.zeros((*ids.shape, h), storage(dtype))
    for expert in np.unique(ids):
        rows, choices = np.nonzero(ids == expert)
        gate_up = _biased(x[rows], w13[expert], b13[expert], dtype)
        hidden = swigluoai_and_mul(gate_up[:, :inter], gate_up[:, inter:], dtype=dtype)
        y[rows, choices] = _biased(hidden, w2[expert], b2[expert], dtype)
    return combine(y, weights, dtype)


def _check(x: np.ndarray, w13: np.ndarray, b13: np.ndarray, w2: np.ndarray, b2: np.ndarray, topk_weights: np.ndarray,
           topk_ids: np.ndarray, dtype: str) -> tuple[np.ndarray, ...]:
    """`moe`'s and `moe_bounds`' arguments checked: (x, w13, b13, w2, b2, weights, ids)."""
    x, w13, w2 = _check_experts(x, w13, w2, dtype)
    e, two_i, h = w13.shape
    b13 = require_array("b13", b13, np.float32, ndim=2)
    b2 = require_array("b2", b2, np.float32, ndim=2)
    if b13.shape != (e, two_i) or b2.shape != (e, h):
        raise ValueError(f"b13 must be [E, 2I] = {(e, two_i)} and b2 [E, H] = {(e, h)}, got {b13.shape} and {b2.shape}")
    weights, ids = _check_routing(topk_weights, topk_ids, x.shape[0], e)
    return x, w13, b13, w2, b2, weights, ids


def moe_bounds(x: np.ndarray, w13: np.ndarray, b13: np.ndarray, w2: np.ndarray, b2: np.ndarray,
               topk_weights: np.ndarray, topk_ids: np.ndarray, unit_roundoff: float = FP32_TRUNCATING_UNIT_ROUNDOFF,
               *, dtype: str = FP16) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) [M, H] of `dtype`: every fp32 implementation of `moe`'s contract returns out in [lo, hi] (module
    docstring for the derivation); arguments as `moe`."""
    x, w13, b13, w2, b2, weights, ids = _check(x, w13, b13, w2, b2, topk_weights, topk_ids, dtype)
    inter = w13.shape[1] // 2
    y_lo = np.zeros((*ids.shape, x.shape[1]), storage(dtype))
    y_hi = np.zeros_like(y_lo)
    for e in np.unique(ids):
        rows, choices = np.nonzero(ids == e)
        g_lo, g_hi = _biased_bounds(x[rows], x[rows], w13[e, :inter], b13[e, :inter], unit_roundoff, dtype)
        u_lo, u_hi = _biased_bounds(x[rows], x[rows], w13[e, inter:], b13[e, inter:], unit_roundoff, dtype)
        h_lo, h_hi = _swigluoai_bounds(g_lo, g_hi, u_lo, u_hi, dtype)
        y_lo[rows, choices], y_hi[rows, choices] = _biased_bounds(h_lo, h_hi, w2[e], b2[e], unit_roundoff, dtype)
    return combine(y_lo, weights, dtype), combine(y_hi, weights, dtype)


def _biased_bounds(a_lo: np.ndarray, a_hi: np.ndarray, w16: np.ndarray, bias: np.ndarray, unit_roundoff: float,
                   dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) of RN(RN32(S' + b)) for every fp32 sum S' (any order) of a @ w.T, a anywhere in the box
    [a_lo, a_hi] (module docstring)."""
    lo64, hi64, w = a_lo.astype(np.float64), a_hi.astype(np.float64), w16.astype(np.float64)
    pos, neg = np.maximum(w, 0.0), np.minimum(w, 0.0)
    big = np.maximum(np.abs(lo64), np.abs(hi64))
    abs_sum = big @ np.abs(w).T
    slack = float64_sum_slack(w.shape[1], unit_roundoff, abs_sum)
    if dtype == BF16:  # the corners' largest |a| bound each row's fp16-rows exponent (ref.moe)
        slack = slack + bf16_slack(big.astype(np.float32), w16, unit_roundoff)
    b = bias.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return rounded_interval(lo64 @ pos.T + hi64 @ neg.T - slack + b, hi64 @ pos.T + lo64 @ neg.T + slack + b,
                                abs_sum, w.shape[1], unit_roundoff, dtype, through_fp32=True)  # the bias add: RN32


GLU_ARGMIN = SILU_ARGMIN / float(np.float32(SWIGLU_ALPHA))  # g sigmoid(alpha g) = silu(alpha g) / alpha


def _glu64(g: np.ndarray) -> np.ndarray:
    """g * sigmoid(alpha g) in float64 (the kernels' fp32 alpha)."""
    with np.errstate(over="ignore"):
        return g / (1.0 + np.exp(-float(np.float32(SWIGLU_ALPHA)) * g))


def _swigluoai_relative(g: np.ndarray) -> np.ndarray:
    """The fp32 chain's relative error at |g| <= g (first order, doubled): RN32(g alpha) moves expf's argument by
    |g alpha| 2^-24 relative to 1, expf is within 2 ulps (2^-22), five more roundings of 2^-24; 1 / (1 + e)
    passes e's relative error on at most once."""
    return 2 * (float(np.float32(SWIGLU_ALPHA)) * g + 4 + 5) * 2.0**-24


def _swigluoai_bounds(g_lo: np.ndarray, g_hi: np.ndarray, u_lo: np.ndarray, u_hi: np.ndarray,
                      dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) of swigluoai over the (gate, up) box (module docstring)."""
    lim = float(np.float32(SWIGLU_LIMIT))
    a, b = (np.minimum(v.astype(np.float64), lim) for v in (g_lo, g_hi))
    ends = np.stack([_glu64(a), _glu64(b)])
    f_lo = np.where((a <= GLU_ARGMIN) & (GLU_ARGMIN <= b), _glu64(np.float64(GLU_ARGMIN)), ends.min(axis=0))
    f_hi = ends.max(axis=0)
    c_lo, c_hi = (np.clip(v.astype(np.float64), -lim, lim) + 1.0 for v in (u_lo, u_hi))
    corners = np.stack([f * c for f in (f_lo, f_hi) for c in (c_lo, c_hi)])
    p_lo, p_hi = corners.min(axis=0), corners.max(axis=0)
    rel = _swigluoai_relative(np.maximum(np.abs(a), np.abs(b)))
    return outward(p_lo - rel * np.abs(p_lo) - 2.0**-100, p_hi + rel * np.abs(p_hi) + 2.0**-100, dtype)
