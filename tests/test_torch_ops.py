"""torch.ops.qpn.*: bytes against qpn.ref, linear within ref's derived bound, opcheck, errors.

CPU tests run everywhere (the numba backend). `gpu` tests compare the CUDA ops with
qpn.cupy_kernels bit for bit, capture the decode path in a CUDA graph, and check that rows
agree across the decode / dense threshold.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qpn.torch_bridge  # noqa: F401  (registers torch.ops.qpn.*)
from qpn import ref
from qpn.cupy_kernels import decode_threshold
from qpn.ref.formats import QPN2
from qpn.ref.qpn8 import qpn8_group_scales_format
from qpn.torch_bridge import dispatch

# (N, K): one tile; several tiles and groups; the 128-multiples that block scales need; a
# MiniLM shape (K = 384 = 6 * 64 is not a multiple of 128: the split-K decode's "practical" rule).
NVFP4_SHAPES = [(32, 64), (96, 192), (128, 256), (384, 384)]
FP8_SHAPES = [(32, 16), (64, 48), (128, 256), (256, 128)]
FP8_GRANULARITIES = ["tensor", "channel", "block"]
# global scale: a plain scalar, a tiny scalar (2^-20: weights land on fp16 subnormals), one per tile
GLOBAL_SCALE_KINDS = ["scalar", "tiny", "per_tile"]
M_VALUES = [0, 1, 5, 32, 33, 64]
GATED_M_VALUES = [1, 7, 40]
E4M3_NAN_BYTES = (0x7F, 0xFF)


def devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# ----------------------------------------------------------------------------- inputs


def random_e4m3_bytes(rng, shape, positive=False) -> np.ndarray:
    """Every e4m3 byte but the NaNs, uniformly: subnormals, +-0 and 448 included."""
    bits = rng.integers(0, 0x7F, size=shape, dtype=np.uint8)  # 0x00..0x7E: +0 .. 448
    if not positive:
        bits |= (rng.integers(0, 2, size=shape, dtype=np.uint8) << 7)
    return bits


def random_nvfp4(rng, n, k, kind):
    """ModelOpt NVFP4 tensors with every code, every positive non-NaN scale byte, and a global
    scale small enough that 6 * 448 * g < 65520 (no fp16 overflow: g < 24.4)."""
    weight_packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    weight_scale = random_e4m3_bytes(rng, (n, k // 16), positive=True)
    if kind == "scalar":
        g = np.array(0.75, dtype=np.float32)
    elif kind == "tiny":
        g = np.array(2.0**-20, dtype=np.float32)
    else:
        g = np.exp2(rng.uniform(-8, 4, size=n // 32)).astype(np.float32)
    return weight_packed, weight_scale, g


def random_fp8(rng, n, k, granularity):
    """FP8 weight bytes (no NaN) and scales below ref's overflow limit (s < 146.1875), with
    some tiny ones so that S16 = RN16(256 s) is an fp16 subnormal."""
    weight = random_e4m3_bytes(rng, (n, k))
    if granularity == "tensor":
        scale = np.array(0.01, dtype=np.float32)
    elif granularity == "channel":
        scale = np.exp2(rng.uniform(-30, 7, size=n)).astype(np.float32)
    else:
        scale = np.exp2(rng.uniform(-30, 7, size=(-(-n // 128), -(-k // 128)))).astype(np.float32)
    return weight, scale


def fp16_bits(a) -> np.ndarray:
    a = a.cpu().numpy() if isinstance(a, torch.Tensor) else a
    return a.view(np.uint16)


def qpn2_buffers(rng, n, k, kind, device="cpu"):
    wp, ws, g = random_nvfp4(rng, n, k, kind)
    codes, scales = ref.qpn2_prepack(wp, ws)
    t = [torch.from_numpy(a).to(device) for a in (codes, scales, g)]
    w16 = ref.qpn2_dequantize(codes, scales, g, n, k)
    return t, w16


def qpn8_buffers(rng, n, k, granularity, device="cpu"):
    w, s = random_fp8(rng, n, k, granularity)
    codes, group_scales = ref.qpn8_prepack(w, s)
    t = [torch.from_numpy(a).to(device) for a in (codes, group_scales)]
    w16 = ref.qpn8_dequantize(codes, group_scales, n, k)
    return t, w16


def fp8_cases():
    return [(n, k, gran) for gran in FP8_GRANULARITIES for n, k in FP8_SHAPES
            if gran != "block" or (n % 128 == 0 and k % 128 == 0)]


# ----------------------------------------------------------------------------- prepack


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float8_e4m3fn])
@pytest.mark.parametrize("n,k", NVFP4_SHAPES)
def test_nvfp4_prepack_bytes_equal_ref(n, k, scale_dtype, device):
    rng = np.random.default_rng(n * 1000 + k)
    wp, ws, _ = random_nvfp4(rng, n, k, "scalar")
    codes, scales = torch.ops.qpn.nvfp4_prepack(
        torch.from_numpy(wp).to(device), torch.from_numpy(ws).view(scale_dtype).to(device))
    ref_codes, ref_scales = ref.qpn2_prepack(wp, ws)
    assert codes.dtype == scales.dtype == torch.uint8
    assert codes.shape == (n, k // 2) and scales.shape == (n, k // 16)
    assert np.array_equal(codes.cpu().numpy(), ref_codes)
    assert np.array_equal(scales.cpu().numpy(), ref_scales)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("weight_dtype", [torch.uint8, torch.float8_e4m3fn])
@pytest.mark.parametrize("n,k,granularity", fp8_cases())
def test_fp8_prepack_bytes_equal_ref(n, k, granularity, weight_dtype, device):
    rng = np.random.default_rng(n * 1000 + k)
    w, s = random_fp8(rng, n, k, granularity)
    codes, group_scales = torch.ops.qpn.fp8_prepack(
        torch.from_numpy(w).view(weight_dtype).to(device), torch.from_numpy(s).to(device))
    ref_codes, ref_group_scales = ref.qpn8_prepack(w, s)
    assert np.array_equal(codes.cpu().numpy(), ref_codes)
    assert group_scales.dtype == torch.float16
    assert np.array_equal(fp16_bits(group_scales), ref_group_scales.view(np.uint16))


# ----------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kind", GLOBAL_SCALE_KINDS)
@pytest.mark.parametrize("n,k", NVFP4_SHAPES)
def test_nvfp4_dequantize_bytes_equal_ref(n, k, kind, device):
    rng = np.random.default_rng(n + k)
    (codes, scales, g), w16 = qpn2_buffers(rng, n, k, kind, device)
    out = torch.ops.qpn.nvfp4_dequantize(codes, scales, g)
    assert out.dtype == torch.float16 and out.shape == (n, k) and out.device.type == device
    assert np.array_equal(fp16_bits(out), w16.view(np.uint16))


def test_nvfp4_dequantize_keeps_negative_zero_and_subnormals():
    """Code 8 is -0 (0x8000); scale 0x01 (2^-9) and g = 2^-8 put every weight on the fp16
    subnormal grid: code 1 (0.5) gives 2^-18 = 64 * 2^-24 -> bits 0x0040, code 7 (6) gives
    6 * 2^-17 = 768 * 2^-24 -> 0x0300. A global scale of shape (1,) reads like shape ()."""
    n, k = 32, 64
    nibbles = np.tile(np.arange(16, dtype=np.uint8), (n, k // 16))  # codes 0..15 in every block
    wp = ref.pack_nibbles(nibbles)
    ws = np.full((n, k // 16), 0x01, dtype=np.uint8)
    g = np.array([2.0**-8], dtype=np.float32)
    codes, scales = ref.qpn2_prepack(wp, ws)
    out = torch.ops.qpn.nvfp4_dequantize(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(g))
    bits = fp16_bits(out)
    assert np.all(bits[:, 8::16] == 0x8000)  # code 8 -> -0.0
    assert np.all(bits[:, 1::16] == 0x0040)
    assert np.all(bits[:, 7::16] == 0x0300)
    assert np.all(bits[:, 15::16] == 0x8300)
    assert np.array_equal(bits, ref.nvfp4_dequantize(wp, ws, g).view(np.uint16))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("n,k,granularity", fp8_cases())
def test_fp8_dequantize_bytes_equal_ref(n, k, granularity, device):
    rng = np.random.default_rng(n + k)
    (codes, group_scales), w16 = qpn8_buffers(rng, n, k, granularity, device)
    out = torch.ops.qpn.fp8_dequantize(codes, group_scales)
    assert out.dtype == torch.float16 and out.shape == (n, k) and out.device.type == device
    assert np.array_equal(fp16_bits(out), w16.view(np.uint16))


# ----------------------------------------------------------------------------- linear


def assert_within_linear_bounds(y, x, w16):
    """y (the op's fp16 output) lies in ref.linear_bounds: every fp32-or-wider accumulation of the
    exact products, in any order, rounded once (ref/linear.py derives the interval)."""
    lo, hi = ref.linear_bounds(x, w16)
    y = y.cpu().numpy()
    assert y.dtype == np.float16 and y.shape == lo.shape
    bad = ~((lo <= y) & (y <= hi))
    assert not bad.any(), f"{int(bad.sum())} outputs outside the bound, first at {np.argwhere(bad)[0]}"


def run_linear(fmt, x, buffers, gated=False):
    if fmt == "nvfp4":
        return torch.ops.qpn.nvfp4_linear(x, *buffers, gated=gated)
    return torch.ops.qpn.fp8_linear(x, *buffers, gated=gated)


def linear_cases():
    return ([("nvfp4", n, k, kind) for n, k in NVFP4_SHAPES for kind in ("scalar", "per_tile")]
            + [("fp8", n, k, gran) for n, k, gran in fp8_cases()])


def buffers_for(fmt, n, k, variant, device, seed):
    rng = np.random.default_rng(seed)
    if fmt == "nvfp4":
        return qpn2_buffers(rng, n, k, variant, device)
    return qpn8_buffers(rng, n, k, variant, device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fmt,n,k,variant", linear_cases())
def test_linear_within_ref_bound(fmt, n, k, variant, device):
    buffers, w16 = buffers_for(fmt, n, k, variant, device, seed=n * 7 + k)
    # Weights have magnitudes up to 6 * 448 * g; scale x so that sums stay far below 65504.
    x_scale = 1.0 / max(1.0, float(np.abs(w16.astype(np.float32)).max()) * np.sqrt(k))
    rng = np.random.default_rng(k)
    for m in M_VALUES:
        x = (rng.standard_normal((m, k)) * x_scale).astype(np.float16)
        y = run_linear(fmt, torch.from_numpy(x).to(device), buffers)
        assert y.shape == (m, n) and y.dtype == torch.float16
        if m:
            assert_within_linear_bounds(y, x, w16)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fmt,n,k,variant", [c for c in linear_cases() if c[1] % 64 == 0])
def test_gated_linear_is_linear_then_silu_and_mul(fmt, n, k, variant, device):
    """gated = silu_and_mul(linear): exactly ref.silu_and_mul of the op's own ungated result
    (the CPU epilogue uses ref's expf definition; on CUDA expf may move silu16 by one fp16 ulp),
    and exactly ref.linear_gated wherever the ungated rows equal ref.linear."""
    buffers, w16 = buffers_for(fmt, n, k, variant, device, seed=n + 3 * k)
    x_scale = 1.0 / max(1.0, float(np.abs(w16.astype(np.float32)).max()) * np.sqrt(k))
    rng = np.random.default_rng(n)
    half = n // 2
    for m in GATED_M_VALUES:
        x = (rng.standard_normal((m, k)) * x_scale * 64).astype(np.float16)  # gates of order 1..10
        xt = torch.from_numpy(x).to(device)
        y = run_linear(fmt, xt, buffers).cpu().numpy()
        out = run_linear(fmt, xt, buffers, gated=True).cpu().numpy()
        assert out.shape == (m, half) and out.dtype == np.float16
        expected = ref.silu_and_mul(y[:, :half], y[:, half:])
        if device == "cpu":
            assert np.array_equal(out.view(np.uint16), expected.view(np.uint16))
        else:
            silu_ulp = np.abs(np.spacing(np.abs(ref.silu_and_mul(y[:, :half], np.ones_like(y[:, half:])))))
            bound = silu_ulp.astype(np.float32) * np.abs(y[:, half:].astype(np.float32)) \
                + np.abs(np.spacing(expected)).astype(np.float32)
            assert np.all(np.abs(out.astype(np.float32) - expected.astype(np.float32)) <= bound)
        y_ref = ref.linear(x, w16)
        agree = (y[:, :half] == y_ref[:, :half]) & (y[:, half:] == y_ref[:, half:])
        if device == "cpu":
            gated_ref = ref.linear_gated(x, w16)
            assert np.array_equal(out[agree].view(np.uint16), gated_ref[agree].view(np.uint16))
        assert agree.mean() > 0.5  # that comparison covers most outputs (fp32 vs float64 sums rarely differ)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_linear_m0_gives_empty_result(fmt):
    n, k = 64, 128
    buffers, _ = buffers_for(fmt, n, k, "scalar" if fmt == "nvfp4" else "channel", "cpu", seed=1)
    x = torch.empty((0, k), dtype=torch.float16)
    assert run_linear(fmt, x, buffers).shape == (0, n)
    assert run_linear(fmt, x, buffers, gated=True).shape == (0, n // 2)


# ----------------------------------------------------------------------------- opcheck


def opcheck_cases(device):
    rng = np.random.default_rng(5)
    n, k = 64, 128
    wp, ws, g = random_nvfp4(rng, n, k, "per_tile")
    w8, s8 = random_fp8(rng, 128, 128, "block")
    (c2, s2, g2), _ = qpn2_buffers(rng, n, k, "scalar", device)
    (c8, gs8), _ = qpn8_buffers(rng, n, k, "channel", device)
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float16) / 64).to(device)
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    # e4m3 inputs as uint8: opcheck's schema test does arithmetic on the inputs, which float8
    # tensors do not support (the float8_e4m3fn view is covered by the prepack byte tests)
    return {
        "nvfp4_prepack": (torch.ops.qpn.nvfp4_prepack, (t(wp), t(ws)), {}),
        "fp8_prepack": (torch.ops.qpn.fp8_prepack, (t(w8), t(s8)), {}),
        "nvfp4_dequantize": (torch.ops.qpn.nvfp4_dequantize, (c2, s2, g2), {}),
        "fp8_dequantize": (torch.ops.qpn.fp8_dequantize, (c8, gs8), {}),
        "nvfp4_linear": (torch.ops.qpn.nvfp4_linear, (x, c2, s2, g2), {}),
        "nvfp4_linear_gated": (torch.ops.qpn.nvfp4_linear, (x, c2, s2, g2), {"gated": True}),
        "fp8_linear": (torch.ops.qpn.fp8_linear, (x, c8, gs8), {}),
        "fp8_linear_gated": (torch.ops.qpn.fp8_linear, (x, c8, gs8), {"gated": True}),
    }


OPCHECK_NAMES = ["nvfp4_prepack", "fp8_prepack", "nvfp4_dequantize", "fp8_dequantize",
                 "nvfp4_linear", "nvfp4_linear_gated", "fp8_linear", "fp8_linear_gated"]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", OPCHECK_NAMES)
def test_opcheck(name, device):
    op, args, kwargs = opcheck_cases(device)[name]
    torch.library.opcheck(op, args, kwargs)


# ----------------------------------------------------------------------------- errors


def error_cases():
    rng = np.random.default_rng(9)
    n, k = 64, 128
    (c2, s2, g2), _ = qpn2_buffers(rng, n, k, "scalar")
    (c8, gs8), _ = qpn8_buffers(rng, n, k, "channel")
    x = torch.zeros((2, k), dtype=torch.float16)
    wp, ws, _ = random_nvfp4(rng, n, k, "scalar")
    nan_ws = ws.copy()
    nan_ws[3, 1] = 0x7F
    w8, s8 = random_fp8(rng, n, k, "channel")
    q = torch.ops.qpn
    t = torch.from_numpy
    f16 = torch.float16
    return {
        "x fp32": (lambda: q.nvfp4_linear(x.float(), c2, s2, g2),
                   r"x must have dtype torch.float16.*to\(torch.float16\)"),
        "x fp64": (lambda: q.fp8_linear(x.double(), c8, gs8),
                   r"x must have dtype torch.float16 or torch.bfloat16.*or x.to\(torch.bfloat16\)"),
        "x not contiguous": (lambda: q.nvfp4_linear(torch.zeros((k, 2), dtype=f16).t(), c2, s2, g2),
                             r"x must be contiguous.*\.contiguous\(\)"),
        "x wrong K": (lambda: q.nvfp4_linear(torch.zeros((2, k + 64), dtype=f16), c2, s2, g2),
                      r"K = 128.*flatten leading"),
        "x 3-D": (lambda: q.fp8_linear(x[None], c8, gs8), r"x must be 2-D"),
        "codes wrong dtype": (lambda: q.nvfp4_linear(x, c2.to(torch.int16), s2, g2),
                              r"codes must have dtype torch.uint8"),
        "scales mismatch": (lambda: q.nvfp4_linear(x, c2, s2[:, :4].contiguous(), g2),
                            r"scales must have shape \(N, K/16\) = \(64, 8\)"),
        "K not multiple of 64": (lambda: q.nvfp4_dequantize(c2[:, :16].contiguous(), s2[:, :2].contiguous(), g2),
                                 r"K must be a positive multiple of 64.*K=32.*pad the input features"),
        "N not multiple of 32": (lambda: q.fp8_dequantize(c8[:48].contiguous(), gs8[:, :48].contiguous()),
                                 r"N must be a positive multiple of 32.*N=48.*pad the output features"),
        "global scale per row": (lambda: q.nvfp4_linear(x, c2, s2, torch.ones(n)),
                                 r"global_scale must hold one float32.*\(2,\)"),
        "global scale fp64": (lambda: q.nvfp4_linear(x, c2, s2, torch.ones((), dtype=torch.float64)),
                              r"global_scale must have dtype torch.float32"),
        "group scales fp32": (lambda: q.fp8_linear(x, c8, gs8.float()), r"group_scales must have dtype torch.float16"),
        "group scales shape": (lambda: q.fp8_linear(x, c8, gs8[:, :32].contiguous()),
                               r"group_scales must be float16 \[1, N\]"),
        "gated N not multiple of 64": (lambda: q.fp8_linear(x, c8[:32].contiguous(), gs8[:, :32].contiguous(),
                                                            gated=True),
                                       r"N must be a positive multiple of 64 for gated=True"),
        "prepack NaN scale byte": (lambda: q.nvfp4_prepack(t(wp), t(nan_ws)), r"NaN e4m3 codes.*0x7F"),
        "prepack scale shape": (lambda: q.nvfp4_prepack(t(wp), t(ws[:, :4].copy())),
                                r"weight_scale must have shape \(N, K/16\)"),
        "prepack fp8 transposed scale": (lambda: q.fp8_prepack(t(w8), t(np.ones((1, n), np.float32))),
                                         r"fits no FP8 granularity"),
        "prepack fp8 weight fp16": (lambda: q.fp8_prepack(t(w8).half(), t(s8)),
                                    r"weight must have dtype torch.uint8 or torch.float8_e4m3fn"),
    }


@pytest.mark.parametrize("case", list(error_cases()))
def test_bad_input_raises_value_error(case):
    call, pattern = error_cases()[case]
    with pytest.raises(ValueError, match=pattern):
        call()


# ----------------------------------------------------------------------------- CUDA only


def cupy_and_kernels():
    import cupy

    import qpn.cupy_kernels as kernels

    return cupy, kernels


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("fmt,n,k,variant", [c for c in linear_cases() if c[1] % 64 == 0])
def test_cuda_decode_path_equals_cupy_kernels_bit_for_bit(fmt, n, k, variant, gated):
    """M <= decode_threshold where the dispatch policy picks the decode kernel (every test shape: the
    measured tables put decode first there): same bytes as calling the CuPy decode kernel directly."""
    cupy, kernels = cupy_and_kernels()
    buffers, w16 = buffers_for(fmt, n, k, variant, "cuda", seed=n * 11 + k)
    threshold = decode_threshold(fmt, n, k)
    x_scale = 1.0 / max(1.0, float(np.abs(w16.astype(np.float32)).max()) * np.sqrt(k))
    rng = np.random.default_rng(3)
    for m in sorted({1, threshold // 2 or 1, threshold}):
        x = torch.from_numpy((rng.standard_normal((m, k)) * x_scale).astype(np.float16)).cuda()
        wf = QPN2 if fmt == "nvfp4" else qpn8_group_scales_format(tuple(buffers[1].shape), n, k)
        assert dispatch.choose(x.device, wf, m, n, k, gated) == "decode", (fmt, n, k, m)
        y = run_linear(fmt, x, buffers, gated=gated)
        direct = cupy.empty((m, n // 2 if gated else n), dtype=cupy.float16)
        cx = cupy.asarray(x.cpu().numpy())
        cb = [cupy.asarray(b.cpu().numpy()) for b in buffers]
        if fmt == "nvfp4":
            kernels.qpn2_linear(cx, cb[0], cb[1], cb[2].reshape(-1), out=direct, gated=gated)
        else:
            kernels.qpn8_linear(cx, cb[0], cb[1], out=direct, gated=gated)
        assert np.array_equal(fp16_bits(y), cupy.asnumpy(direct).view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,n,k,variant", [("nvfp4", 384, 384, "per_tile"), ("fp8", 256, 128, "block")])
def test_cuda_rows_agree_across_threshold(fmt, n, k, variant):
    """The same rows computed at M <= threshold (decode kernel) and inside a larger M (dense
    path) use the same W16: both lie in ref's bound, and they differ by no more than that bound
    allows (accumulation order differs, so bit equality is not promised; the fraction of
    identical outputs is printed for the record)."""
    buffers, w16 = buffers_for(fmt, n, k, variant, "cuda", seed=17)
    threshold = decode_threshold(fmt, n, k)
    x_scale = 1.0 / max(1.0, float(np.abs(w16.astype(np.float32)).max()) * np.sqrt(k))
    rng = np.random.default_rng(4)
    big = threshold + 16
    x = (rng.standard_normal((big, k)) * x_scale).astype(np.float16)
    xt = torch.from_numpy(x).cuda()
    dense = run_linear(fmt, xt, buffers)
    decode = torch.cat([run_linear(fmt, xt[i:i + threshold].contiguous(), buffers)
                        for i in range(0, big, threshold)])
    assert_within_linear_bounds(dense, x, w16)
    assert_within_linear_bounds(decode, x, w16)
    same = (fp16_bits(dense) == fp16_bits(decode)).mean()
    print(f"{fmt} {n}x{k}: {same:.4%} of outputs bit-identical across the threshold ({threshold})")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("n,k", [(256, 256), (64, 4096)])  # the second: split-K across blocks
def test_cuda_graph_capture_and_replay_of_decode_path(fmt, n, k):
    buffers, w16 = buffers_for(fmt, n, k, "per_tile" if fmt == "nvfp4" else "channel", "cuda", seed=23)
    threshold = decode_threshold(fmt, n, k)
    m = min(4, threshold)
    static_x = torch.zeros((m, k), dtype=torch.float16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernel compile / module load happen outside capture
        for _ in range(2):
            run_linear(fmt, static_x, buffers)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = run_linear(fmt, static_x, buffers)
    rng = np.random.default_rng(6)
    for _ in range(3):
        x = (rng.standard_normal((m, k)) / np.sqrt(k) / 64).astype(np.float16)
        static_x.copy_(torch.from_numpy(x))
        graph.replay()
        torch.cuda.synchronize()
        eager = run_linear(fmt, static_x, buffers)
        assert np.array_equal(fp16_bits(static_y), fp16_bits(eager))
        assert_within_linear_bounds(static_y, x, w16)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_split_k_decode_on_any_number_of_streams(fmt):
    """Split-K state is per call (cupy_kernels/linear.py): 64 streams used concurrently, then 64 fresh
    ones in sequence, then a graph captured on yet another fresh stream, all give the serial bits. (A
    per-device table of 16 streams refused every stream after the 16th, and a first call in capture.)"""
    n, k = 64, 4096  # split-K across blocks on any GPU of more than 2 SMs
    buffers, w16 = buffers_for(fmt, n, k, "per_tile" if fmt == "nvfp4" else "channel", "cuda", seed=31)
    rng = np.random.default_rng(31)
    xs = [torch.from_numpy((rng.standard_normal((1 + i % 8, k)) / np.sqrt(k)).astype(np.float16)).cuda()
          for i in range(64)]
    serial = [run_linear(fmt, x, buffers) for x in xs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in xs]
    outs = []
    for stream, x in zip(streams, xs, strict=True):  # all queued before any is waited for: concurrent
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outs.append(run_linear(fmt, x, buffers))
    torch.cuda.synchronize()
    for i in range(64):  # 64 more, one after the other
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            y = run_linear(fmt, xs[i], buffers)
        stream.synchronize()
        assert torch.equal(y, serial[i]), f"sequential stream {i} differs from the serial call"
    for i, y in enumerate(outs):
        assert torch.equal(y, serial[i]), f"concurrent stream {i} differs from the serial call"
    capture = torch.cuda.Stream()  # never used before: its first split-K call is inside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        static_y = run_linear(fmt, xs[5], buffers)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, serial[5]), "the captured split-K call differs from the serial one"
    assert_within_linear_bounds(serial[5], xs[5].cpu().numpy(), w16)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("m", M_VALUES + [7, 9, 128])
def test_linear_outputs_are_contiguous_row_major(m, device):
    """Callers slice columns out of the rows (vLLM's q/k/v split) and its CPU attention requires unit
    stride in the last dimension; a column-major result broke tensor-parallel serving in vLLM."""
    rng = np.random.default_rng(m)
    (codes, scales, g), _ = qpn2_buffers(rng, 128, 128, "scalar", device)
    (codes8, group_scales), _ = qpn8_buffers(rng, 128, 128, "channel", device)
    x = torch.from_numpy(rng.standard_normal((m, 128)).astype(np.float16)).to(device)
    for y in (torch.ops.qpn.nvfp4_linear(x, codes, scales, g), torch.ops.qpn.fp8_linear(x, codes8, group_scales),
              torch.ops.qpn.nvfp4_linear(x, codes, scales, g, True)):
        assert y.is_contiguous(), f"M={m}: output strides {y.stride()} for shape {tuple(y.shape)}"
