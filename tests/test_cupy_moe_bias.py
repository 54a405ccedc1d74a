"""The fused MoE kernels' expert epilogue (qpn.cupy_kernels.moe, launch_moe's w13_bias / w2_bias / activation;
docs/DESIGN.md, "gpt-oss experts"): per-expert fp32 biases added to each projection's fp32 sum before its one
RN16, and gpt-oss's clamped SwiGLU ("swigluoai") beside silu_and_mul.

- Bit for bit, MXFP4 / NVFP4 / FP8, silu and swigluoai, M 1-100, top-k 2-4 of 8 experts, one part and K split
  across blocks (gate/up and down): weights of e2m1 values times powers of two and x of small integers make
  every fp32 sum of the kernels exact in any order (`exact_sums` checks the span), so the kernel's outputs are
  computable: the sums in float64, then the epilogue's fp32 operations one by one with torch on the GPU (its
  expf is CUDA's, the kernels' function). The slot-ordered hidden rows (the gated epilogue) are compared on
  wide data (both clamps, infinite gates and ups); the combined output where the hidden rows keep the down
  projection's sums exact too.
- Within a derived bound of the float64 reference qpn.ref.gpt_oss.moe on random gpt-oss-like MXFP4 experts
  (qpn.ref.gpt_oss.moe_bounds, the interval argument of qpn.ref.moe.moe_bounds through the biases and swigluoai).
- A zero bias gives the bits of no bias; bad epilogue arguments are rejected before any launch; memcheck clean.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from qpn.cupy_kernels import moe
from qpn.ref import (
    decode_e2m1,
    encode_e4m3,
    nvfp4_dequantize,
    pack_nibbles,
    qpn2_prepack,
    qpn8_dequantize,
    qpn8_prepack,
)
from qpn.ref import gpt_oss as ref_gpt_oss
from qpn.ref import mxfp4 as mx
from qpn.ref.formats import QPN2, QPN8, QPNMX
from qpn.ref.moe import combine

EXPERTS = 8
FORMATS = ("mxfp4", "nvfp4", "fp8")
SHAPE = (256, 128)  # (H, I): every projection one part (one block per output tile)
SPLIT_SHAPES = ((4096, 64), (128, 4096))  # gate/up (N = 128, K = 4096), then down, split K across blocks
CASES = [(1, 2), (5, 3), (32, 4), (33, 2), (100, 4)]  # (M, top_k)
LAYOUT = {"mxfp4": QPNMX, "nvfp4": QPN2, "fp8": QPN8}  # FP8: channel scales
ALPHA, LIMIT = np.float32(ref_gpt_oss.SWIGLU_ALPHA), np.float32(ref_gpt_oss.SWIGLU_LIMIT)  # the kernels' fp32 args


# ----------------------------------------------------------------------------- host rules (CPU)


def test_the_activation_indices_are_the_kernels():
    """moe.ACTIVATIONS' order is the kernels' activation argument (qpn_mma.cuh, QPN_ACT_*)."""
    text = (Path(moe.__file__).parent / "qpn_mma.cuh").read_text()
    defines = {name.lower(): int(v) for name, v in re.findall(r"#define QPN_ACT_(\w+) (\d+)", text)}
    assert defines == {name: i for i, name in enumerate(moe.ACTIVATIONS)}


@pytest.mark.parametrize("kwargs,match", [
    ({"activation": "gelu"}, r"activation must be one of \('silu', 'swigluoai'\), got 'gelu'"),
    ({"swiglu_limit": float("nan")}, "swiglu_limit finite and >= 0"),
    ({"swiglu_alpha": float("inf")}, "swiglu_alpha must be finite"),
    ({"swiglu_limit": -1.0}, "got swiglu_alpha = 1.702, swiglu_limit = -1.0"),
])
def test_bad_activation_arguments_are_named(kwargs, match):
    args = {"activation": "swigluoai", "swiglu_alpha": 1.702, "swiglu_limit": 7.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        moe.require_epilogue(EXPERTS, 256, 128, None, None, **args)


def test_the_defaults_are_gpt_oss_and_silu():
    assert moe.require_epilogue(EXPERTS, 256, 128, None, None, "silu", ref_gpt_oss.SWIGLU_ALPHA,
                                ref_gpt_oss.SWIGLU_LIMIT) == (0, ALPHA, LIMIT)


# ----------------------------------------------------------------------------- exact data


def low_bit(v: np.ndarray) -> np.ndarray:
    """The exponent of each value's lowest set bit (v = odd * 2^low_bit); a large number for zeros."""
    v = np.asarray(v, np.float64)
    mant, exp = np.frexp(np.abs(v))
    ints = (mant * 2.0**53).astype(np.int64)
    lowest = np.log2((ints & -ints).astype(np.float64), where=ints > 0, out=np.zeros_like(mant))
    return np.where(v == 0, 1 << 20, exp - 53 + lowest.astype(np.int64))


def exact_sums(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 [M, N] = a [M, K] @ w [N, K].T, each sum exact in fp32 whatever the order and grouping: every
    product is a multiple of 2^q (q = the lowest bits of a's row and w's row) and the sum of their magnitudes
    stays below 2^(q + 23), one bit inside fp32's 24 (tensor cores align a group's products to the largest and
    truncate below 24 bits: nothing is dropped here either)."""
    a, w = np.asarray(a, np.float64), np.asarray(w, np.float64)
    q = low_bit(a).min(axis=1)[:, None] + low_bit(w).min(axis=1)[None, :]
    magnitude = np.abs(a) @ np.abs(w).T
    assert ((magnitude == 0) | (magnitude < np.exp2(q + 23.0))).all(), "the data leave fp32's exact range"
    return a @ w.T


def signed_e2m1(rng: np.random.Generator, shape: tuple, magnitudes: tuple, density: float) -> np.ndarray:
    """e2m1 codes (sign bit 8) with magnitude codes drawn from `magnitudes`, zero with probability 1 - density."""
    mag = rng.choice(np.asarray(magnitudes, np.uint8), shape)
    mag[rng.random(shape) >= density] = 0
    return mag | (rng.integers(0, 2, shape, dtype=np.uint8) << 3)


def expert_weights(fmt: str, rng: np.random.Generator, n: int, k: int, exponents: tuple[int, int],
                   magnitudes: tuple = tuple(range(8)), density: float = 1.0) -> tuple[tuple, np.ndarray]:
    """One expert's [n, k] weight of e2m1 values times 2^j, j drawn from `exponents` per 32-k block (FP8: per
    row): (its layout's host buffers, its value float64 [n, k]: W16 times MXFP4's 2^T, exactly)."""
    codes = signed_e2m1(rng, (n, k), magnitudes, density)
    per_row = fmt == "fp8"
    j = rng.integers(exponents[0], exponents[1] + 1, (n, 1) if per_row else (n, k // 32))
    want = decode_e2m1(codes).astype(np.float64) * np.exp2(np.repeat(j, 1 if per_row else 32, axis=1))
    if fmt == "mxfp4":
        blocks, scales = pack_nibbles(codes).reshape(n, k // 32, 16), (127 + j).astype(np.uint8)
        buffers = mx.qpnmx_prepack(blocks, scales)
        w16, tile_scale = mx.mxfp4_w16(blocks, scales)
        value = w16.astype(np.float64) * np.repeat(tile_scale, 32)[:, None]
    elif fmt == "nvfp4":
        shift = exponents[1] - 4  # g = 2^shift; the e4m3 block scales 2^(j - shift) lie in 2^-9 .. 2^4
        weight_packed, scale_bytes = pack_nibbles(codes), encode_e4m3(np.exp2(np.repeat(j, 2, axis=1) - shift))
        buffers = (*qpn2_prepack(weight_packed, scale_bytes), np.full(1, 2.0**shift, np.float32))
        value = nvfp4_dequantize(weight_packed, scale_bytes, 2.0**shift).astype(np.float64)
    else:
        buffers = qpn8_prepack(encode_e4m3(decode_e2m1(codes)), np.exp2(j[:, 0]).astype(np.float32))
        value = qpn8_dequantize(*buffers, n, k).astype(np.float64)
    assert np.array_equal(value, want), "the layout's W16 is not the designed value"
    return buffers, value


def stacked(fmt: str, rng: np.random.Generator, n: int, k: int, **kwargs) -> tuple[list[tuple], np.ndarray]:
    parts = [expert_weights(fmt, rng, n, k, **kwargs) for _ in range(EXPERTS)]
    return [b for b, _ in parts], np.stack([v for _, v in parts])


def sum_exponents(k: int, x_rms: float, target: float) -> tuple[int, int]:
    """Two neighbouring binades j that put a K-term sum of x (rms x_rms) times e2m1 * 2^j near `target` rms."""
    j = int(np.floor(np.log2(target / (x_rms * np.sqrt(k * 8.56)))))  # 8.56: the e2m1 codes' mean square
    return j, j + 1


# ----------------------------------------------------------------------------- GPU


def gpu():
    import cupy
    import torch

    assert torch.cuda.is_available(), "the gpu marker found a CUDA device (CuPy), torch must see it too"
    return cupy, torch


def launch(cupy, fmt: str, w13: list[tuple], w2: list[tuple], inter: int, x: np.ndarray, weights: np.ndarray,
           ids: np.ndarray, **epilogue) -> tuple[np.ndarray, np.ndarray]:
    """launch_moe over stacked experts -> (the slot-ordered hidden rows fp16 [M top_k, I], out fp16 [M, H])."""
    from qpn.cupy_kernels.layouts import LAYOUT_KERNELS

    m, h = x.shape
    top_k = ids.shape[1]
    slots = moe.chunk_rows(m, top_k) * top_k
    wf = LAYOUT[fmt]
    size = moe.moe_workspace_size(wf.format, m, top_k, h, inter, EXPERTS)
    hidden, out = cupy.empty((slots, inter), np.float16), cupy.empty((m, h), np.float16)
    stack = [tuple(cupy.stack([cupy.asarray(e[i]) for e in buffers]) for i in range(len(buffers[0])))
             for buffers in (w13, w2)]
    epilogue = {name: cupy.asarray(v) if isinstance(v, np.ndarray) else v for name, v in epilogue.items()}
    moe.launch_moe(LAYOUT_KERNELS[wf.key], cupy.asarray(x), *stack, inter, cupy.asarray(weights), cupy.asarray(ids),
                   cupy.empty(moe.route_size(EXPERTS, slots), np.int32), cupy.empty(size, np.float32) if size else None,
                   hidden, cupy.empty((slots, h), np.float16), out, **epilogue)
    return hidden[:m * top_k].get(), out.get()


def silu_and_mul(torch, gate16, up16):
    """qpn_silu_mul op for op: RN16(RN16(v / (1 + expf(-v))) * up)."""
    v = gate16.float()
    return ((v / (torch.exp(-v) + 1.0)).half().float() * up16.float()).half()


def swigluoai_and_mul(torch, gate16, up16):
    """qpn_swigluoai_mul op for op (qpn.ref.gpt_oss.swigluoai_and_mul's order): the ternaries as torch.where."""
    gate, up = gate16.float(), up16.float()
    alpha, limit = (torch.tensor(float(c), dtype=torch.float32, device=gate.device) for c in (ALPHA, LIMIT))
    g = torch.where(gate > limit, limit, gate)
    u = torch.where(up > limit, limit, torch.where(up < -limit, -limit, up))
    s = torch.ones_like(g) / (torch.exp(-(g * alpha)) + 1.0)
    return ((u + 1.0) * (g * s)).half()


def biased16(torch, sums: np.ndarray, bias: np.ndarray | None, device: str):
    """RN16(RN32(S + b)) of exact fp32 sums S (RN16(S) without a bias), on `device`."""
    s32 = sums.astype(np.float32)
    assert np.array_equal(s32.astype(np.float64), sums), "a sum is not an fp32 number"
    t = torch.from_numpy(s32).to(device)
    if bias is not None:
        t = t + torch.from_numpy(bias).to(device)
    return t.half()


def slot_order(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The route's slots (qpn_moe.cuh): the choices by expert, then (token, choice) -> (choice index m top_k + j
    of each slot, its expert)."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    return order, flat[order]


def expected(torch, activation: str, x: np.ndarray, w13: np.ndarray, b13: np.ndarray | None, w2: np.ndarray | None,
             b2: np.ndarray | None, weights: np.ndarray, ids: np.ndarray, down: bool, device: str = "cuda") -> tuple:
    """The kernels' outputs on exact-sum data (the epilogue's fp32 operations on `device`: the kernels' expf on
    "cuda"): (hidden fp16 [slots, I] in slot order, out fp16 [M, H] or None)."""
    top_k, inter = ids.shape[1], w13.shape[1] // 2
    order, expert = slot_order(ids)
    sums = np.empty((len(order), 2 * inter))
    for e in np.unique(expert):
        at = np.flatnonzero(expert == e)
        sums[at] = exact_sums(x[order[at] // top_k], w13[e])
    gate_up = biased16(torch, sums, None if b13 is None else b13[expert], device)
    act = silu_and_mul if activation == "silu" else swigluoai_and_mul
    hidden = act(torch, gate_up[:, :inter], gate_up[:, inter:]).cpu().numpy()
    if not down:
        return hidden, None
    sums = np.empty((len(order), w2.shape[1]))
    for e in np.unique(expert):
        at = np.flatnonzero(expert == e)
        sums[at] = exact_sums(hidden[at], w2[e])
    y = np.empty((ids.size, w2.shape[1]), np.float16)
    y[order] = biased16(torch, sums, None if b2 is None else b2[expert], device).cpu().numpy()
    return hidden, combine(y.reshape(*ids.shape, -1), weights)


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """fp16 bytes equal; a NaN equals a NaN (its payload is no part of the contract)."""
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{what}: NaN where the epilogue gives none, or none where it does"
    same = got.view(np.uint16) == want.view(np.uint16)
    assert same[~nan].all(), (f"{what}: {(~same & ~nan).sum()} of {got.size} differ, first at "
                              f"{np.argwhere(~same & ~nan)[0]}: {got[~same & ~nan][:4]} vs {want[~same & ~nan][:4]}")


def routing(rng: np.random.Generator, m: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    return ref_gpt_oss.route(rng.standard_normal((m, EXPERTS)).astype(np.float32), top_k)


def narrow_case(fmt: str, shape: tuple[int, int], m: int, top_k: int, seed: int) -> dict:
    """Gate in about [3.5, 7.5] and up in [1, 2.3] (fp32 biases of no particular form plus exact sums of rms 0.1):
    h in about [1, 17], so the down projection's sums of h times w2 (e2m1 magnitudes 0, 0.5, 1 times 2^-4; at
    long K mostly zeros) stay exact too; swigluoai's gate clamp is hit, silu runs on its upper branch."""
    h, inter = shape
    rng = np.random.default_rng(seed)
    w13, v13 = stacked(fmt, rng, 2 * inter, h, exponents=sum_exponents(h, 1.4, 0.1))
    w2, v2 = stacked(fmt, rng, h, inter, exponents=(-4, -4), magnitudes=(1, 2), density=0.1 if inter > 1024 else 1.0)
    b13 = np.concatenate([rng.uniform(4.0, 7.0, (EXPERTS, inter)), rng.uniform(1.5, 1.8, (EXPERTS, inter))],
                         axis=1).astype(np.float32)
    return {"w13": w13, "v13": v13, "b13": b13, "w2": w2, "v2": v2,
            "b2": rng.standard_normal((EXPERTS, h)).astype(np.float32),
            "x": rng.integers(-2, 3, (m, h)).astype(np.float16), "routing": routing(rng, m, top_k)}


def run_exact(fmt: str, activation: str, shape: tuple[int, int], m: int, top_k: int, seed: int) -> None:
    cupy, torch = gpu()
    c = narrow_case(fmt, shape, m, top_k, seed)
    weights, ids = c["routing"]
    hidden, out = launch(cupy, fmt, c["w13"], c["w2"], shape[1], c["x"], weights, ids, w13_bias=c["b13"],
                         w2_bias=c["b2"], activation=activation)
    want_hidden, want_out = expected(torch, activation, c["x"], c["v13"], c["b13"], c["v2"], c["b2"], weights, ids,
                                     down=True)
    assert np.isfinite(want_out).all() and (np.abs(want_hidden.astype(np.float32)) >= 1).all()
    assert_same_bits(hidden, want_hidden, "hidden")
    assert_same_bits(out, want_out, "out")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("activation", moe.ACTIVATIONS)
@pytest.mark.parametrize("m,top_k", CASES)
def test_biased_experts_bit_for_bit(fmt, activation, m, top_k):
    run_exact(fmt, activation, SHAPE, m, top_k, seed=100 * m + top_k)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SPLIT_SHAPES)
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("activation", moe.ACTIVATIONS)
def test_biased_experts_bit_for_bit_with_k_split_across_blocks(shape, fmt, activation):
    """The bias enters in the last block's sum of the parts (qpn_reduce_store's second store)."""
    from qpn.cupy_kernels.linear import decode_split

    h, inter = shape
    parts = max(decode_split(LAYOUT[fmt].format, n, k)[0] for n, k in ((2 * inter, h), (h, inter)))
    assert parts > 1, "the shape no longer splits K across blocks on this GPU"
    for m, top_k in ((5, 2), (33, 4)):
        run_exact(fmt, activation, shape, m, top_k, seed=m + len(fmt))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("activation", moe.ACTIVATIONS)
def test_the_gated_epilogue_on_wide_data_bit_for_bit(fmt, activation):
    """Gate and up over about +-30 (both clamps of swigluoai, silu's negative branch), and biases of +-1e5 on a
    few rows: infinite gates and ups (swigluoai's ternaries keep the reference's NaN and inf, silu(-inf) is NaN).
    The hidden rows, slot by slot."""
    cupy, torch = gpu()
    h, inter = SHAPE
    rng = np.random.default_rng(len(fmt) + 7 * len(activation))
    w13, v13 = stacked(fmt, rng, 2 * inter, h, exponents=sum_exponents(h, 1.9, 12.0))
    w2, _ = stacked(fmt, rng, h, inter, exponents=(-6, -5))
    b13 = (3 * rng.standard_normal((EXPERTS, 2 * inter))).astype(np.float32)
    b13[:, ::37] = rng.choice([-1e5, 1e5], b13[:, ::37].shape)
    for m, top_k in ((7, 4), (64, 2)):
        x = rng.integers(-3, 4, (m, h)).astype(np.float16)
        weights, ids = routing(rng, m, top_k)
        hidden, _ = launch(cupy, fmt, w13, w2, inter, x, weights, ids, w13_bias=b13, activation=activation)
        want, _ = expected(torch, activation, x, v13, b13, None, None, weights, ids, down=False)
        w = want.astype(np.float32)
        assert np.isnan(w).any() and (np.abs(w) > 20).any() and ((0 < np.abs(w)) & (np.abs(w) < 1)).any()
        assert_same_bits(hidden, want, f"hidden, M = {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("activation", moe.ACTIVATIONS)
def test_a_zero_bias_is_no_bias(fmt, activation):
    """bias = zeros gives the bits of bias = None (the sums are never -0: +0 + x = x for every fp32 x but -0)."""
    cupy, _ = gpu()
    h, inter = SHAPE
    rng = np.random.default_rng(3)
    w13, _ = stacked(fmt, rng, 2 * inter, h, exponents=(-8, -3))
    w2, _ = stacked(fmt, rng, h, inter, exponents=(-8, -3))
    x = rng.standard_normal((40, h)).astype(np.float16)
    weights, ids = routing(rng, 40, 4)
    plain = launch(cupy, fmt, w13, w2, inter, x, weights, ids, activation=activation)
    zero = launch(cupy, fmt, w13, w2, inter, x, weights, ids, activation=activation,
                  w13_bias=np.zeros((EXPERTS, 2 * inter), np.float32), w2_bias=np.zeros((EXPERTS, h), np.float32))
    assert np.isfinite(plain[1]).mean() > 0.9
    for a, b in zip(plain, zero, strict=True):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


# ----------------------------------------------------------------------------- against the float64 reference


def bf16_values(v: np.ndarray) -> np.ndarray:
    """float32 values that bf16 holds (gpt-oss stores its biases in bf16): round to 8 significant bits."""
    bits = np.asarray(v, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def gpt_oss_case(rng: np.random.Generator, h: int, inter: int, m: int, top_k: int) -> dict:
    """gpt-oss-like experts: MXFP4 with scale bytes over 5 binades per tile (each tile its own 2^T), bf16 biases,
    gate and up of a few units (clamps hit), normal x."""
    def weight(n: int, k: int):
        blocks = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
        j = sum_exponents(k, 1.0, 4.0)[0]
        scales = (127 + j + rng.integers(-2, 3, (n, k // 32))).astype(np.uint8)
        w16, tile_scale = mx.mxfp4_w16(blocks, scales)
        value = w16.astype(np.float64) * np.repeat(tile_scale, 32)[:, None]
        assert np.array_equal(value.astype(np.float16).astype(np.float64), value)  # the reference's fp16 W
        return mx.qpnmx_prepack(blocks, scales), value.astype(np.float16)

    w13 = [weight(2 * inter, h) for _ in range(EXPERTS)]
    w2 = [weight(h, inter) for _ in range(EXPERTS)]
    return {"w13": [b for b, _ in w13], "v13": np.stack([v for _, v in w13]),
            "w2": [b for b, _ in w2], "v2": np.stack([v for _, v in w2]),
            "b13": bf16_values(rng.standard_normal((EXPERTS, 2 * inter))),
            "b2": bf16_values(rng.standard_normal((EXPERTS, h))),
            "x": rng.standard_normal((m, h)).astype(np.float16), "routing": routing(rng, m, top_k)}


def test_the_reference_lies_in_its_bound():
    """The float64 reference is one implementation the bound admits (CPU; the GPU test's bound, checked here)."""
    rng = np.random.default_rng(11)
    h, inter = SHAPE
    c = gpt_oss_case(rng, h, inter, 33, 4)
    args = (c["x"], c["v13"], c["b13"], c["v2"], c["b2"], *c["routing"])
    lo, hi = ref_gpt_oss.moe_bounds(*args)
    want = ref_gpt_oss.moe(*args)
    assert np.isfinite(want).all() and ((lo <= want) & (want <= hi)).all()
    ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
    width = (hi.astype(np.float64) - lo.astype(np.float64)) / ulp
    # not vacuous: a median 14 fp16 ulps (the worst-case fp32 sums of ref.linear's bound, twice, and swigluoai's
    # slope between them); a bias left out moves outputs by about its size, hundreds of ulps (the GPU test)
    assert np.median(width) <= 32, np.median(width)


@pytest.mark.gpu
@pytest.mark.parametrize("m,top_k", CASES)
def test_gpt_oss_experts_lie_in_the_reference_bound(m, top_k):
    """Random gpt-oss-like MXFP4 experts, swigluoai, bf16 biases: the fused kernels' output inside the derived
    interval around qpn.ref.gpt_oss.moe (float64 sums), and mostly equal to it. (At K = 4096 the worst-case fp32
    sums widen the interval to hundreds of ulps: the split shapes are the bit-exact tests'.)"""
    cupy, _ = gpu()
    h, inter = SHAPE
    rng = np.random.default_rng(m * top_k)
    c = gpt_oss_case(rng, h, inter, m, top_k)
    weights, ids = c["routing"]
    _, out = launch(cupy, "mxfp4", c["w13"], c["w2"], inter, c["x"], weights, ids, w13_bias=c["b13"],
                    w2_bias=c["b2"], activation="swigluoai")
    args = (c["x"], c["v13"], c["b13"], c["v2"], c["b2"], weights, ids)
    lo, hi = ref_gpt_oss.moe_bounds(*args)
    want = ref_gpt_oss.moe(*args)
    assert np.isfinite(out).all()
    inside = (lo <= out) & (out <= hi)
    assert inside.all(), f"{(~inside).sum()} outside, first {np.argwhere(~inside)[0]}"
    assert (out == want).mean() > 0.5  # mostly the reference's own bits (fp32 sums rarely cross an fp16 rounding)
    _, unbiased = launch(cupy, "mxfp4", c["w13"], c["w2"], inter, c["x"], weights, ids, w13_bias=c["b13"],
                         activation="swigluoai")
    assert ((unbiased < lo) | (hi < unbiased)).mean() > 0.5  # the bound sees a down bias left out


@pytest.mark.gpu
def test_bad_biases_are_rejected_before_any_launch():
    cupy, _ = gpu()
    h, inter = SHAPE
    good = cupy.zeros((EXPERTS, 2 * inter), np.float32)
    for bias, match in ((good.astype(np.float16), "w13_bias must have dtype float32"),
                        (cupy.zeros((EXPERTS, inter), np.float32),
                         r"w13_bias must have shape \[E, 2I\] \(gate rows, then up\) = \(8, 256\), one fp32 bias"),
                        (cupy.zeros((EXPERTS, 4 * inter), np.float32)[:, ::2], "must be C-contiguous"),
                        (np.zeros((EXPERTS, 2 * inter), np.float32), "must be a cupy.ndarray"),
                        (good[None], "must be 2-D")):
        with pytest.raises(ValueError, match=match):
            moe.require_epilogue(EXPERTS, h, inter, bias, None, "silu", 1.702, 7.0)
    with pytest.raises(ValueError, match=r"w2_bias must have shape \[E, H\] = \(8, 256\)"):
        moe.require_epilogue(EXPERTS, h, inter, good, cupy.zeros((EXPERTS, inter), np.float32), "silu", 1.702, 7.0)


# ----------------------------------------------------------------------------- sanitizer


def drive() -> None:
    """Exact-size CuPy allocations (no pool), biases included: the epilogue at the classes' edges, MXFP4, NVFP4
    and FP8, silu and swigluoai, one part and K split across blocks (an expert's bias row read out of its row
    shows)."""
    import cupy

    cupy.cuda.set_allocator(None)
    rng = np.random.default_rng(0)
    for fmt, (h, inter) in (("mxfp4", SHAPE), ("nvfp4", SPLIT_SHAPES[0]), ("fp8", SPLIT_SHAPES[1]),
                            ("mxfp4", SPLIT_SHAPES[1])):
        w13, _ = stacked(fmt, rng, 2 * inter, h, exponents=(-6, -5))
        w2, _ = stacked(fmt, rng, h, inter, exponents=(-6, -5))
        b13 = rng.standard_normal((EXPERTS, 2 * inter)).astype(np.float32)
        b2 = rng.standard_normal((EXPERTS, h)).astype(np.float32)
        for activation in moe.ACTIVATIONS:
            for m, top_k in ((1, 2), (9, 4), (33, 2), (150, 3)):
                x = rng.standard_normal((m, h)).astype(np.float16)
                launch(cupy, fmt, w13, w2, inter, x, *routing(rng, m, top_k), w13_bias=b13, w2_bias=b2,
                       activation=activation)
    cupy.cuda.runtime.deviceSynchronize()
    print("driver done")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer_clean(compute_sanitizer, tool):
    compute_sanitizer(tool, __file__)


if __name__ == "__main__" and "--drive" in sys.argv:
    drive()
