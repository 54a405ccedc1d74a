"""bf16 activations (issue 24, part 1; docs/DESIGN.md, "bf16 activations"): qpn.ref's bf16 rounding against
ml_dtypes bit for bit; the bf16 reference and its bound; the torch ops in bf16 on every CPU path inside that
bound, gated = linear then the bf16 epilogue, opcheck, torch.compile, QPNLinear in a bf16 model, the MoE ops
in bf16 against the reference. GPU tests (marked gpu, skipped without CUDA) mirror the CPU ones on the CUDA
dense path that bf16 takes there."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import qpn.torch_bridge  # noqa: F401  (registers torch.ops.qpn.*)
from qpn import ref
from qpn.ref import gpt_oss
from qpn.ref import mxfp4 as mx
from qpn.ref.dtypes import BF16, BF16_MAX, BF16_OVERFLOW

# ----------------------------------------------------------------------------- helpers

ALL_BF16_BITS = np.arange(1 << 16, dtype=np.uint32) << 16  # every bf16 pattern as float32 bits


def as_f32(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint32).view(np.float32)


def oracle(a: np.ndarray) -> np.ndarray:
    """ml_dtypes' float32 -> bfloat16 (RNE), back to float32: the independent oracle."""
    with np.errstate(invalid="ignore"):  # a NaN pattern with a payload warns: it stays a NaN
        return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """bit for bit, any NaN equal to any NaN."""
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


def bf16_of(t: torch.Tensor) -> np.ndarray:
    """A torch bf16 tensor -> float32 numpy of the same bf16 values (exact)."""
    assert t.dtype == torch.bfloat16
    return t.detach().cpu().float().numpy()


def bf16_x(rng: np.random.Generator, m: int, k: int, scale: float = 1.0) -> np.ndarray:
    return ref.bf16_round(rng.standard_normal((m, k)) * scale)


# ----------------------------------------------------------------------------- ref: the rounding


def test_every_bf16_value_rounds_to_itself_and_ml_dtypes_agrees():
    values = as_f32(ALL_BF16_BITS)
    assert same_values(ref.bf16_round(values), values)
    assert same_values(oracle(values), values)
    assert ref.is_bf16(values[~np.isnan(values)])
    assert np.array_equal(ref.bf16_bits(values), np.arange(1 << 16, dtype=np.uint16))
    assert same_values(ref.bf16_from_bits(np.arange(1 << 16, dtype=np.uint16)), values)


@pytest.mark.parametrize("offset", [0x8000, 0x7FFF, 0x8001, 0x0001, 0xFFFF, 0x4000, 0xC000])
def test_midpoints_and_their_neighbours_round_as_ml_dtypes(offset):
    """offset 0x8000: the exact midpoint between consecutive bf16 patterns (ties to even), 0x7FFF / 0x8001
    one float32 step below / above it, the rest in between; every sign and binade, subnormals, the
    overflow threshold (0x7F7F8000 = 2^128 - 2^119 rounds to inf) and NaNs included."""
    a = as_f32(ALL_BF16_BITS | offset)
    assert same_values(ref.bf16_round(a), oracle(a))


def test_float64_and_float16_round_once_from_their_exact_value():
    """A float64 just above a bf16 midpoint must round up; a float32 cast first would land on the midpoint
    and round to even (down). ml_dtypes gets float32 inputs only here (its float64 cast is not specified)."""
    rng = np.random.default_rng(0)
    mids = as_f32((rng.integers(0, 1 << 15, 4096, dtype=np.uint32) << 17) | 0x8000)  # even pattern + half
    mids = mids[np.isfinite(mids) & (mids != 0)].astype(np.float64)
    up = mids + np.abs(mids) * 2.0**-40  # toward +inf by far less than a float32 step: the float32 one step up
    assert same_values(ref.bf16_round(up), oracle(np.nextafter(mids.astype(np.float32), np.float32(np.inf))))
    assert same_values(ref.bf16_round(mids), oracle(mids.astype(np.float32)))  # exact float32: ties to even
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    assert same_values(ref.bf16_round(halves), oracle(halves.astype(np.float32)))


def test_edges_of_the_range():
    r = ref.bf16_round
    assert r(np.float64(BF16_MAX)) == BF16_MAX
    assert r(np.float64(BF16_OVERFLOW)) == np.inf and r(np.float64(-BF16_OVERFLOW)) == -np.inf
    assert r(np.nextafter(BF16_OVERFLOW, 0.0)) == BF16_MAX
    assert r(np.float64(2.0**-133)) == 2.0**-133  # the least subnormal
    assert r(np.float64(2.0**-134)) == 0.0 and r(np.nextafter(2.0**-134, 1.0)) == 2.0**-133
    assert np.signbit(r(np.float64(-0.0))) and np.signbit(r(np.float64(-2.0**-135)))
    assert np.isnan(r(np.float64(np.nan))) and r(np.float64(np.inf)) == np.inf
    with pytest.raises(ValueError, match="float array"):
        r(np.arange(3))
    with pytest.raises(ValueError, match="bf16 values"):
        ref.linear(np.full((1, 64), 1.0 + 2.0**-10, np.float32), np.zeros((32, 64), np.float16), dtype=BF16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        ref.linear(np.zeros((1, 64), np.float16), np.zeros((32, 64), np.float16), dtype="float32")


# ----------------------------------------------------------------------------- ref: linear and its bound


def test_fp16_stays_the_default_byte_for_byte():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 128)).astype(np.float16)
    w = (rng.standard_normal((64, 128)) / 8).astype(np.float16)
    assert np.array_equal(ref.linear(x, w).view(np.uint16), ref.linear(x, w, dtype="float16").view(np.uint16))
    for a, b in zip(ref.linear_bounds(x, w), ref.linear_bounds(x, w, dtype="float16"), strict=True):
        assert a.dtype == np.float16 and np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_bf16_reference_is_the_float64_sum_rounded_once_and_inside_its_bound():
    """ref.linear in bf16 = bf16_round of the exact sum (K small, moderate exponents: the float64 sum is exact);
    torch's fp32 matmul (another order) rounded by torch to bf16 lies in the bound, both bound functions."""
    rng = np.random.default_rng(2)
    for scale in (1.0, 2.0**-120, 2.0**100):  # ordinary; products in fp32's subnormals; large
        x = bf16_x(rng, 7, 192, scale)
        w = (rng.standard_normal((96, 192))).astype(np.float16)
        y = ref.linear(x, w, dtype=BF16)
        assert y.dtype == np.float32 and ref.is_bf16(y)
        exact = x.astype(np.float64) @ w.astype(np.float64).T
        assert same_values(y, ref.bf16_round(exact))
        torch_y = bf16_of((torch.from_numpy(x) @ torch.from_numpy(w).float().T).bfloat16())
        for lo, hi in (ref.linear_bounds(x, w, dtype=BF16), ref.linear_bounds_fp32(x, w, dtype=BF16)):
            assert ref.is_bf16(lo) and ref.is_bf16(hi)
            assert np.all((lo <= y) & (y <= hi)) and np.all((lo <= torch_y) & (torch_y <= hi))


def test_the_bound_is_tight_and_opens_only_where_fp32_may_overflow():
    rng = np.random.default_rng(3)
    x = bf16_x(rng, 3, 64)
    w = rng.standard_normal((32, 64)).astype(np.float16)
    lo, hi = ref.linear_bounds(x, w, dtype=BF16)
    err = ref.linear_error_bound(x, w, dtype=BF16)
    y = ref.linear(x, w, dtype=BF16).astype(np.float64)
    # at most the summation term plus one bf16 ulp of the result: |y| 2^-7 covers the ulp, d is tiny here
    assert np.all(err <= np.abs(y) * 2.0**-7 + 2.0**-100)
    assert (lo == hi).mean() > 0.5  # most outputs have one admissible bf16 value
    big = ref.bf16_round(np.full((1, 64), 2.0**120))
    lo, hi = ref.linear_bounds(big, np.full((32, 64), 60000.0, np.float16), dtype=BF16)
    assert np.all(lo == -np.inf) and np.all(hi == np.inf)  # A >= 2^128: an fp32 sum may be inf or NaN


def test_mxfp4_bound_in_bf16_scales_before_the_one_rounding():
    rng = np.random.default_rng(4)
    blocks = rng.integers(0, 256, (64, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 126, (64, 4)).astype(np.uint8)  # within 36 binades: 2^T * W16 is the value
    w16, tile_scale = mx.mxfp4_w16(blocks, scales)
    x = bf16_x(rng, 5, 128)
    y = mx.mxfp4_linear(x, w16, tile_scale, dtype=BF16)
    values = mx.mxfp4_values(blocks, scales).reshape(64, 128)
    assert same_values(y, ref.bf16_round(x.astype(np.float64) @ values.T))  # 2^T * W16 = the value here
    lo, hi = mx.mxfp4_linear_bounds(x, w16, tile_scale, dtype=BF16)
    assert np.all((lo <= y) & (y <= hi))


def test_epilogues_in_bf16_are_the_fp32_operations_rounded_to_bf16():
    """silu_and_mul: RN_bf16(RN32(RN_bf16(silu32(gate)) * up)); swigluoai: its fp32 operations, one RN_bf16 (as
    vLLM's kernels for scalar_t = bf16: torch's bf16 ops on the CPU do the same roundings)."""
    rng = np.random.default_rng(5)
    gate, up = (ref.bf16_round(rng.standard_normal((64, 64)) * 4) for _ in range(2))
    out = ref.silu_and_mul(gate, up, dtype=BF16)
    g32 = gate.astype(np.float64)
    silu = ref.bf16_round((g32 / (1.0 + np.exp(-g32))).astype(np.float32))
    assert np.abs(ref.bf16_round(silu * up) - out).max() <= np.abs(out).max() * 2.0**-7  # expf within an ulp
    gt, ut = torch.from_numpy(gate).bfloat16(), torch.from_numpy(up).bfloat16()
    torch_out = bf16_of(torch.nn.functional.silu(gt) * ut)
    assert (torch_out == out).mean() > 0.95  # torch's vectorized expf may move silu by an fp32 ulp
    h = gpt_oss.swigluoai_and_mul(gate, up, dtype=BF16)
    h16 = gpt_oss.swigluoai_and_mul(gate.astype(np.float16), up.astype(np.float16))
    assert ref.is_bf16(h) and np.all(np.abs(h - h16.astype(np.float32)) <= np.abs(h) * 2.0**-7 + 2.0**-14)
    fused = np.concatenate([np.eye(32, 64, dtype=np.float16), np.eye(32, 64, 32, dtype=np.float16)])
    x = bf16_x(rng, 3, 64)
    assert same_values(ref.linear_gated(x, fused, dtype=BF16),
                       ref.silu_and_mul(x[:, :32].copy(), x[:, 32:].copy(), dtype=BF16))


def test_moe_combine_in_bf16_is_fp32_in_top_k_order_then_one_rounding():
    rng = np.random.default_rng(6)
    y = bf16_x(rng, 5 * 3, 16).reshape(5, 3, 16)
    weights = rng.random((5, 3)).astype(np.float32)
    acc = np.zeros((5, 16), np.float32)
    for j in range(3):
        acc = acc + weights[:, j:j + 1] * y[:, j]
    assert same_values(ref.moe.combine(y, weights, dtype=BF16), ref.bf16_round(acc))
