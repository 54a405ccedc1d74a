"""bf16 activations (issue 24, part 1; docs/DESIGN.md, "bf16 activations"): qpn.ref's bf16 rounding against
ml_dtypes bit for bit; the bf16 reference and its bound; the torch ops in bf16 on every CPU path inside that
bound, gated = linear then the bf16 epilogue, opcheck, torch.compile, QPNLinear in a bf16 model, the MoE ops
in bf16 against the reference. GPU tests (marked gpu, skipped without CUDA) run every CUDA path (the decode,
GEMM and MoE kernels through fp16 rows, dense) against the same bound and epilogue, batch invariant, in
CUDA graphs."""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

import qpn.torch_bridge  # noqa: F401  (registers torch.ops.qpn.*)
from qpn import ref
from qpn.ref import gpt_oss
from qpn.ref import mxfp4 as mx
from qpn.ref.dtypes import BF16, BF16_MAX, BF16_OVERFLOW
from qpn.ref.formats import QPN2, QPNMX, weight_format
from qpn.torch_bridge import QPNLinear, _cpu_ops, _cuda, convert, dispatch, epilogue, pack_nvfp4
from qpn.torch_bridge.experts import QPNExperts
from qpn.torch_bridge.packed_experts import PackedExperts
from qpn.torch_bridge.packed_weight import PackedWeight

sys.path.insert(0, os.path.dirname(__file__))
from test_mxfp4_ops import experts as mxfp4_experts  # noqa: E402  (MXFP4 experts with biases and swigluoai)

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


# ----------------------------------------------------------------------------- torch ops: inputs

CPU_PATHS = ["cpu_fused", "cpu_blas", "op"]
# (format, variant, N, K): NVFP4 with one global scale per tile and a scalar; FP8 per tensor, channel and
# 128x128 block; MXFP4 with tiles of different 2^T
LINEAR_CASES = [("nvfp4", "per_tile", 96, 192), ("nvfp4", "scalar", 64, 128), ("fp8", "tensor", 64, 128),
                ("fp8", "channel", 96, 192), ("fp8", "block", 128, 256), ("mxfp4", "tiles", 96, 192)]
MS = [1, 5, 33]


def devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def packed_case(fmt: str, variant: str, n: int, k: int, seed: int, device: str = "cpu"):
    """(op, buffers on device, layout, W16 [N, K], column scale [N] or None): random bytes of every code, scales
    that keep W16 finite (the recipes of tests/test_torch_ops.py and tests/test_mxfp4_ops.py)."""
    rng = np.random.default_rng(seed)
    if fmt == "nvfp4":
        wp = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        ws = rng.integers(0, 0x7F, (n, k // 16), dtype=np.uint8)  # positive, no NaN
        g = np.exp2(rng.uniform(-8, 4, n // 32)).astype(np.float32) if variant == "per_tile" \
            else np.array(0.75, np.float32)
        codes, scales = ref.qpn2_prepack(wp, ws)
        arrays, wf = (codes, scales, g), QPN2
        w16, col = ref.qpn2_dequantize(codes, scales, g, n, k), None
    elif fmt == "fp8":
        w = rng.integers(0, 0x7F, (n, k), dtype=np.uint8) | (rng.integers(0, 2, (n, k), dtype=np.uint8) << 7)
        s = {"tensor": np.array(0.01, np.float32),
             "channel": np.exp2(rng.uniform(-12, 6, n)).astype(np.float32),
             "block": np.exp2(rng.uniform(-12, 6, (n // 128, k // 128))).astype(np.float32)}[variant]
        codes, group_scales = ref.qpn8_prepack(w, s)
        arrays, wf = (codes, group_scales), weight_format("fp8", variant)
        w16, col = ref.qpn8_dequantize(codes, group_scales, n, k), None
    else:
        scales = rng.integers(100, 131, (n, k // 32)).astype(np.uint8)
        scales[:32] -= 9
        blocks = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
        arrays, wf = mx.qpnmx_prepack(blocks, scales), QPNMX
        w16, tile_scale = mx.mxfp4_w16(blocks, scales)
        col = np.repeat(tile_scale, 32)
    buffers = tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays)
    return getattr(torch.ops.qpn, f"{fmt}_linear"), buffers, wf, w16, col


def x_for(rng: np.random.Generator, m: int, w16: np.ndarray, col, spread: float = 1.0) -> np.ndarray:
    """bf16 x whose sums stay moderate: |x| about 1 / (max|2^T W16| sqrt(K)), times `spread`."""
    k = w16.shape[1]
    top = float(np.abs(w16.astype(np.float64) * (1.0 if col is None else col[:, None])).max())
    return bf16_x(rng, m, k, spread / max(top * np.sqrt(k), 1e-30))


def assert_in_bf16_bound(y: torch.Tensor, x: np.ndarray, w16: np.ndarray, col) -> None:
    assert y.dtype == torch.bfloat16
    lo, hi = ref.linear_bounds(x, w16, column_scale=col, dtype=BF16)
    got = bf16_of(y)
    bad = ~((lo <= got) & (got <= hi))
    assert not bad.any(), f"{int(bad.sum())} outputs outside the bf16 bound, first at {np.argwhere(bad)[0]}"


def run_path(path: str, op, wf, x: torch.Tensor, buffers, n: int, gated: bool = False) -> torch.Tensor:
    if path == "op":
        return op(x, *buffers, gated=gated)
    y = _cpu_ops.linear_on(path, wf, x, buffers, n)
    return epilogue.silu_and_mul(y) if gated else y


# ----------------------------------------------------------------------------- torch ops: linear


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("fmt,variant,n,k", LINEAR_CASES)
def test_cpu_linear_in_bf16_is_inside_the_bf16_bound(fmt, variant, n, k, path):
    op, buffers, wf, w16, col = packed_case(fmt, variant, n, k, seed=n + k)
    rng = np.random.default_rng(k)
    for m in MS:
        for spread in (1.0, 2.0**-100):  # the second: products in fp32's subnormal range
            x = x_for(rng, m, w16, col, spread)
            y = run_path(path, op, wf, torch.from_numpy(x).bfloat16(), buffers, n)
            assert y.shape == (m, n) and y.is_contiguous()
            assert_in_bf16_bound(y, x, w16, col)


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("fmt,variant,n,k", [c for c in LINEAR_CASES if c[2] % 64 == 0])
def test_cpu_gated_in_bf16_is_linear_then_the_bf16_epilogue(fmt, variant, n, k, path):
    """Bit for bit: the op's ungated bf16 result through ref.silu_and_mul(dtype=bf16) (the CPU epilogue's expf
    is ref's); and ref.linear_gated(dtype=bf16) wherever the linear agrees with ref.linear."""
    op, buffers, wf, w16, col = packed_case(fmt, variant, n, k, seed=3 * n + k)
    rng = np.random.default_rng(n)
    half = n // 2
    for m in MS:
        x = x_for(rng, m, w16, col, 64.0)  # gates of order 1..10
        xt = torch.from_numpy(x).bfloat16()
        y = bf16_of(run_path(path, op, wf, xt, buffers, n))
        out = run_path(path, op, wf, xt, buffers, n, gated=True)
        assert out.dtype == torch.bfloat16 and out.shape == (m, half)
        assert same_values(bf16_of(out), ref.silu_and_mul(y[:, :half].copy(), y[:, half:].copy(), dtype=BF16))
        if col is None:
            y_ref = ref.linear(x, w16, dtype=BF16)
            agree = np.all(y == y_ref, axis=1)
            gated_ref = ref.linear_gated(x, w16, dtype=BF16)
            assert same_values(bf16_of(out)[agree], gated_ref[agree])


def test_fp16_outputs_do_not_change():
    """The fp16 op is what it was: the same bits as before bf16 existed (its own ref bound and the fp16 path)."""
    op, buffers, wf, w16, col = packed_case("nvfp4", "per_tile", 96, 192, seed=7)
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((5, 192)) / 64).astype(np.float16)
    y = op(torch.from_numpy(x), *buffers)
    assert y.dtype == torch.float16
    assert torch.equal(y, _cpu_ops.sums_on("cpu_fused", wf, torch.from_numpy(x), buffers, 96).half())


def test_bf16_takes_fp16s_path_and_reaches_the_kernels_as_int16_bits(monkeypatch):
    """_cuda.linear on bf16 x (the launches recorded, no GPU): the path dispatch.choose names for the shape (it
    takes no dtype), a workspace sized for bf16 (its fp16 rows), x and the bf16 output handed over as their
    int16 bits (CuPy has no bfloat16), the output bf16; fp16 x as it is."""
    import contextlib

    seen: list[tuple] = []

    class Recorder:
        def __init__(self, wf):
            self.family = wf

        def workspace_size(self, path, m, n, k, gated, bf16=False):
            seen.append(("workspace", path, bf16))
            return 0

        def __getattr__(self, name):
            return lambda x, buffers, n, out, gated, workspace: seen.append((name, x.dtype, out.dtype))

    monkeypatch.setattr(_cuda, "_layout_kernels", Recorder)
    monkeypatch.setattr(_cuda, "_on_torch_stream", lambda device: contextlib.nullcontext(lambda t: t))
    monkeypatch.setattr(dispatch, "choose", lambda device, wf, m, n, k, gated: {1: "decode", 48: "gemm"}[m])
    _, buffers, wf, _, _ = packed_case("nvfp4", "scalar", 64, 128, seed=1)
    for m, path in ((1, "decode"), (48, "gemm")):
        for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float16, torch.float16)):
            seen.clear()
            y = _cuda.linear(wf, torch.zeros((m, 128), dtype=dtype), buffers, 64, 128, 64, False)
            assert y.dtype == dtype and y.shape == (m, 64)
            assert seen == [("workspace", path, dtype == torch.bfloat16), (path, bits, bits)]


# ----------------------------------------------------------------------------- opcheck, compile, modules


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("fmt,variant,n,k", [c for c in LINEAR_CASES if c[2] % 64 == 0])
def test_opcheck_in_bf16(fmt, variant, n, k, gated, device):
    op, buffers, _, w16, col = packed_case(fmt, variant, n, k, seed=11, device=device)
    x = torch.from_numpy(x_for(np.random.default_rng(2), 3, w16, col)).bfloat16().to(device)
    torch.library.opcheck(op, (x, *buffers), {"gated": gated})


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "mxfp4"])
def test_torch_compile_fullgraph_on_bf16_x(fmt):
    torch.manual_seed(3)
    q = QPNLinear.from_linear(nn.Linear(128, 64), fmt)
    f = torch.compile(q, fullgraph=True)
    for m in (1, 9, 40):
        x = torch.randn(m, 128, dtype=torch.bfloat16)
        y = f(x)
        assert y.dtype == torch.bfloat16 and torch.equal(y, q(x))


def test_a_converted_bf16_model_stays_bf16():
    """convert() on a bf16 nn.Sequential: every QPNLinear runs the op in bf16 (no fp16 round trip), the bias
    added in fp32 and rounded once more (module.py's docstring)."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64, bias=False)).bfloat16()
    convert(model, "nvfp4")
    assert all(isinstance(model[i], QPNLinear) for i in (0, 2))
    x = torch.randn(2, 7, 128, dtype=torch.bfloat16)
    y = model(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 7, 64)
    first, second = model[0], model[2]
    h = torch.ops.qpn.nvfp4_linear(x.reshape(-1, 128), first.codes, first.scales, first.global_scale)
    assert h.dtype == torch.bfloat16
    h = torch.relu((h.float() + first.bias).to(torch.bfloat16))
    want = torch.ops.qpn.nvfp4_linear(h, second.codes, second.scales, second.global_scale)[:, :64]
    assert torch.equal(y.reshape(-1, 64), want)


# ----------------------------------------------------------------------------- mixture of experts


def nvfp4_experts(rng: np.random.Generator, e: int, h: int, inter: int):
    """NVFP4 experts (gate and up with their own global scales), SiLU, no biases; the reference's W16."""
    def one(n: int, k: int, scale: float) -> PackedWeight:
        q = ref.nvfp4_quantize((rng.standard_normal((n, k)) * scale / np.sqrt(k)).astype(np.float32))
        return pack_nvfp4(q.weight_packed, q.weight_scale, q.weight_scale_2)

    packed = PackedExperts.stack([(PackedWeight.stack_rows([one(inter, h, 1.0), one(inter, h, 3.0)]),
                                   one(h, inter, 1.0)) for _ in range(e)])
    pairs = [packed.expert(i) for i in range(e)]
    w13, w2 = (np.stack([w.reference_dequantize() for w in ws]) for ws in zip(*pairs, strict=True))
    return packed, w13, w2


def assert_in_gpt_oss_bound(got: torch.Tensor, x, w13, b13, w2, b2, weights, ids) -> None:
    """Inside qpn.ref.gpt_oss.moe_bounds in bf16 (biases, swigluoai, the fp16 rows), mostly the reference's bits."""
    lo, hi = gpt_oss.moe_bounds(x, w13, b13, w2, b2, weights, ids, dtype=BF16)
    got32 = bf16_of(got)
    assert np.all((lo <= got32) & (got32 <= hi))
    assert (got32 == gpt_oss.moe(x, w13, b13, w2, b2, weights, ids, dtype=BF16)).mean() > 0.8


def test_mxfp4_moe_with_biases_and_swigluoai_in_bf16_is_inside_the_bf16_bound():
    rng = np.random.default_rng(12)
    e, h, inter = 8, 128, 64
    packed, w13, b13, w2, b2 = mxfp4_experts(rng, e, h, inter)
    for m in (1, 5, 33):
        x = bf16_x(rng, m, h)
        weights, ids = gpt_oss.route(rng.standard_normal((m, e)).astype(np.float32), 2)
        got = packed.forward(torch.from_numpy(x).bfloat16(), torch.from_numpy(weights), torch.from_numpy(ids))
        assert_in_gpt_oss_bound(got, x, w13, b13, w2, b2, weights, ids)
        # QPNExperts keeps bf16 on the CPU: the op's bf16 bits
        module = QPNExperts(packed)
        out = module(torch.from_numpy(x).bfloat16(), torch.from_numpy(ids), torch.from_numpy(weights))
        assert out.dtype == torch.bfloat16 and torch.equal(out, got)


def assert_in_moe_bound(got: torch.Tensor, x, w13, w2, weights, ids) -> None:
    """Inside ref.moe.moe_bounds in bf16 (the interval argument through both linears, the bf16 epilogue, the fp16
    rows of the CUDA kernels' x, the combine), and mostly the reference's own bits."""
    lo, hi = ref.moe.moe_bounds(x, w13, w2, weights, ids, dtype=BF16)
    got32 = bf16_of(got)
    assert np.all((lo <= got32) & (got32 <= hi))
    assert (got32 == ref.moe.moe(x, w13, w2, weights, ids, dtype=BF16)).mean() > 0.8


def test_nvfp4_moe_in_bf16_is_inside_the_bf16_moe_bound_and_batch_invariant():
    rng = np.random.default_rng(13)
    e, h, inter = 8, 128, 64
    packed, w13, w2 = nvfp4_experts(rng, e, h, inter)
    m = 40
    x = bf16_x(rng, m, h)
    weights, ids = ref.moe.route(rng.standard_normal((m, e)).astype(np.float32), 2, renormalize=True)
    args = [torch.from_numpy(a) for a in (weights, ids)]
    full = packed.forward(torch.from_numpy(x).bfloat16(), *args)
    assert_in_moe_bound(full, x, w13, w2, weights, ids)
    for i in (0, 17, 39):
        one = packed.forward(torch.from_numpy(x[i:i + 1]).bfloat16(), *(a[i:i + 1] for a in args))
        assert torch.equal(one, full[i:i + 1])


def test_moe_opcheck_in_bf16():
    rng = np.random.default_rng(14)
    packed = mxfp4_experts(rng, 4, 64, 64)[0]
    x = torch.from_numpy(bf16_x(rng, 3, 64)).bfloat16()
    weights, ids = (torch.from_numpy(a) for a in gpt_oss.route(rng.standard_normal((3, 4)).astype(np.float32), 2))
    torch.library.opcheck(torch.ops.qpn.mxfp4_moe, (x, *packed.w13.values(), *packed.w2.values(), weights, ids),
                          {"w13_bias": packed.w13_bias, "w2_bias": packed.w2_bias, "activation": "swigluoai"})


# ----------------------------------------------------------------------------- CUDA (every path, fp16 rows)

CUDA_PATHS = {"decode": [1, 5, 8, 17, 32], "gemm": [1, 33, 100], "dense": [1, 40, 300]}


def wide_x(rng: np.random.Generator, m: int, w16: np.ndarray, col) -> np.ndarray:
    """bf16 rows spanning 40 binades: many values round in the fp16 rows' subnormals (the bound's rows term)."""
    return ref.bf16_round(x_for(rng, m, w16, col) * np.exp2(rng.uniform(-40, 0, (m, w16.shape[1]))))


@pytest.mark.gpu
@pytest.mark.parametrize("path", [*CUDA_PATHS, "op"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("fmt,variant,n,k", LINEAR_CASES)
def test_cuda_linear_in_bf16_is_inside_the_bound_and_gated_is_linear_then_the_epilogue(fmt, variant, n, k, gated,
                                                                                       path):
    """Each CUDA path (the decode and GEMM kernels, dense, the op's own choice) on bf16 x: inside the bf16 bound
    (ordinary rows, rows near bf16's bottom, wide rows); gated = the path's own linear through
    epilogue.silu_and_mul on CUDA (CUDA's expf), bit for bit; a row alone = the same row in the batch."""
    if gated and n % 64:
        pytest.skip("gated needs N % 64")
    op, buffers, wf, w16, col = packed_case(fmt, variant, n, k, seed=n + k, device="cuda")
    rng = np.random.default_rng(k)
    width = n // 2 if gated else n

    def run(xt: torch.Tensor, gate: bool) -> torch.Tensor:
        if path == "op":
            return op(xt, *buffers, gated=gate)
        return _cuda.linear_on(path, wf, xt, buffers, n, k, n // 2 if gate else n, gate)

    for m in CUDA_PATHS.get(path, MS + [300]):
        for x in (x_for(rng, m, w16, col, 64.0 if gated else 1.0), x_for(rng, m, w16, col, 2.0**-100),
                  wide_x(rng, m, w16, col)):
            xt = torch.from_numpy(x).bfloat16().cuda()
            y = run(xt, False)
            assert y.device.type == "cuda" and y.is_contiguous() and y.shape == (m, n)
            assert_in_bf16_bound(y, x, w16, col)
            if gated:
                out = run(xt, True)
                assert out.dtype == torch.bfloat16 and out.shape == (m, width)
                assert torch.equal(out, epilogue.silu_and_mul(y))
            if path != "dense" and m > 1:
                assert torch.equal(run(xt[m - 1:], gated), run(xt, gated)[m - 1:])


@pytest.mark.gpu
def test_cuda_bf16_paths_capture_in_a_cuda_graph():
    op, buffers, wf, w16, col = packed_case("mxfp4", "tiles", 96, 192, seed=21, device="cuda")
    rng = np.random.default_rng(21)
    for m in (4, 40):
        static_x = torch.from_numpy(x_for(rng, m, w16, col)).bfloat16().cuda()
        eager = op(static_x, *buffers)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            op(static_x, *buffers)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = op(static_x, *buffers)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, eager)


@pytest.mark.gpu
def test_cuda_mxfp4_moe_in_bf16_is_inside_the_bf16_bound_batch_invariant_and_qpn_experts_keeps_bf16():
    rng = np.random.default_rng(22)
    e, h, inter = 8, 128, 64
    packed, w13, b13, w2, b2 = mxfp4_experts(rng, e, h, inter)
    packed = packed.to("cuda")
    m = 40
    x = bf16_x(rng, m, h)
    weights, ids = gpt_oss.route(rng.standard_normal((m, e)).astype(np.float32), 2)
    xt, wt, it = (torch.from_numpy(a).cuda() for a in (x, weights, ids))
    xt = xt.bfloat16()
    got = packed.forward(xt, wt, it)
    assert_in_gpt_oss_bound(got, x, w13, b13, w2, b2, weights, ids)
    for i in (0, 17, 39):
        assert torch.equal(packed.forward(xt[i:i + 1], wt[i:i + 1], it[i:i + 1]), got[i:i + 1])
    out = QPNExperts(packed)(xt, it, wt)
    assert out.dtype == torch.bfloat16 and torch.equal(out, got)


@pytest.mark.gpu
def test_cuda_nvfp4_moe_in_bf16_is_inside_the_bf16_moe_bound_and_graph_captures():
    rng = np.random.default_rng(23)
    e, h, inter = 8, 128, 64
    packed, w13, w2 = nvfp4_experts(rng, e, h, inter)
    cuda = packed.to("cuda")
    m = 9
    x = bf16_x(rng, m, h)
    weights, ids = ref.moe.route(rng.standard_normal((m, e)).astype(np.float32), 2, renormalize=True)
    args = [torch.from_numpy(a).cuda() for a in (weights, ids)]
    static_x = torch.from_numpy(x).bfloat16().cuda()
    got = cuda.forward(static_x, *args)
    assert_in_moe_bound(got, x, w13, w2, weights, ids)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cuda.forward(static_x, *args)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        static_y = cuda.forward(static_x, *args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, got)
