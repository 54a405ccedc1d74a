"""CPU-only Turing compile check (cupy_kernels/compile_check.py): no GPU, no CuPy.

Every registered kernel variant must build for sm_75 with 0 spills, no local memory, static
shared memory <= 48 KiB and no instruction outside the Turing rules; every decode build's shared
memory lets a Turing SM hold 32 warps (registers, not shared memory, set its occupancy, computed
from the ptxas report by CUDA's occupancy rules for cc 7.5); and the checker itself must
be able to fail: deliberately bad sources (cp.async, m8n8k4, bf16, a spilling kernel, a local
array, too much shared memory, a missing kernel) are each rejected for the right reason.
Skips (with the reason) only when the NVRTC wheels (cuda-bindings, nvidia-cuda-nvrtc) are absent.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from qpn.cupy_kernels import compile_check, linear, loader
from qpn.cupy_kernels.variants import WRAPPER_MODULES, KernelVariant, all_variants

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import run_child  # noqa: E402  (a hang guard, not a time limit: 121 s alone, longer under load)


@pytest.fixture(scope="module")
def cuda12():
    lib = loader.find_cuda12_nvrtc()
    if lib is None:
        pytest.skip("no CUDA 12 NVRTC (pip install nvidia-cuda-nvrtc-cu12): sm_70 cannot be built with CUDA 13")
    return loader.CtypesNVRTC(lib)


# ----------------------------------------------------------------------------- the real kernels


@pytest.fixture(scope="module")
def checked(nvrtc):
    """(reports, notes) of the compile check over every registered variant (built once per module)."""
    return compile_check.check_variants(nvrtc=nvrtc)


def test_every_registered_variant_passes(checked):
    reports, notes = checked
    table = compile_check.format_table(reports)
    bad = [r for r in reports if not r.ok]
    assert not bad, "\n".join(notes) + "\n" + table
    sm75 = [r for r in reports if r.arch == "sm_75"]
    assert {r.label for r in sm75} == {v.label for v in all_variants()}, table
    assert all(r.stats is not None and r.stats.registers for r in sm75)


# ----------------------------------------------------------------------------- Turing occupancy (issue 25)


def _launch_splits(min_k: int) -> set[int]:
    """Warps per block (the K split) that linear.split_k gives for K >= min_k, over layers of 1-2048
    column tiles and GPUs of 40-132 SMs (it depends on N, K and the SM count only)."""
    return {linear.split_k(tiles, groups, multiple, sms)[1]
            for tiles in (1, 8, 40, 64, 128, 160, 256, 448, 512, 896, 1088, 2048)
            for groups in range(min_k // 16, 1025, 4) for multiple in set(linear.SLICE_MULTIPLE.values())
            for sms in (40, 68, 72, 132)}


def test_the_decode_splits_of_real_layers():
    # layers of K >= 1024 run blocks of 6 to 16 warps (QPN2's slices of whole 4-group batches leave 6
    # or 7 where K / 16 is just above a multiple of 64), large ones 8 or 16; only K < 1024 runs fewer
    assert _launch_splits(1024) <= set(range(6, 17)) and {8, 16} <= _launch_splits(1024)


def test_occupancy_rules_of_a_turing_sm():
    occ = compile_check.occupancy_sm75
    # the buffer this replaced: a 16-warp split-K buffer (17412 B) left 3 blocks of 8 warps, 24 warps
    assert (occ(64, 17412, 8).warps, occ(64, 17412, 8).limit) == (24, "shared")
    assert (occ(96, 34820, 8).warps, occ(96, 34820, 8).limit) == (8, "shared")  # gated: 1 block
    assert (occ(64, 10244, 8).warps, occ(64, 10244, 16).warps) == (32, 32)
    # registers per sub-partition: 96 -> 3072 per warp, 5 warps per sub-partition, 20 per SM: 2 blocks of 8
    assert (occ(96, 0, 8).warps, occ(96, 0, 8).limit) == (16, "registers")
    assert occ(65, 0, 16).warps == 16 and occ(256, 0, 16).blocks == 0  # 65 -> 72 per thread; over the block's
    assert occ(0, 0, 1).warps == 16  # 16 blocks per SM at most


def test_shared_memory_never_limits_a_decode_build_on_turing(checked):
    """Every decode build, at every block size the host launches for K >= 1024: shared memory lets a
    64 KiB Turing SM hold at least as many blocks as its registers, warps and block slots do, so the
    registers decide, and the 64-register builds (M <= 8, the M <= 16 / 24 builds capped at 64, QPN8
    gated M <= 8) hold 32 warps in the blocks of 8 and 16 warps that large layers run."""
    reports, _ = checked
    decode = {v.label for v in linear.DECODE_VARIANTS}
    rows = [r for r in reports if r.arch == "sm_75" and r.label in decode]
    assert len(rows) == len(decode)
    problems = []
    for r in rows:
        for warps in sorted(_launch_splits(1024)):
            occ = compile_check.occupancy_sm75(r.stats.registers, r.stats.smem, warps)
            by = dict(occ.by)
            if by["shared"] < min(by["registers"], by["warps"], by["blocks"]):
                problems.append(f"{r.label} {warps} warps/block: {r.stats.smem} B smem, {occ}")
            if r.stats.registers <= 64 and warps in (8, 16) and occ.warps != 32:
                problems.append(f"{r.label} {warps} warps/block: {occ.warps} warps per SM, not 32 ({occ})")
    assert not problems, "\n".join(problems)


def test_registry_covers_the_wrappers_and_sources_exist():
    variants = all_variants()
    assert variants, "no variants registered"
    for v in variants:
        _, text = loader.read_source(v.source)
        pattern = rf'extern "C" __global__ void (__launch_bounds__\([^)]*\)\s*)?{v.kernel}\s*\('
        assert re.search(pattern, text), f"{v.kernel} not in {v.source}"
        assert "sm_75" in v.archs
    # every .cu of the package (except the ceiling kernels of the benchmark) is registered
    registered = {v.source for v in variants}
    on_disk = {p.name for p in loader.KERNEL_DIR.glob("*.cu")}
    assert on_disk <= registered, f"unregistered kernel files: {sorted(on_disk - registered)}"
    assert {"prepack", "dequantize"} <= set(WRAPPER_MODULES)


def test_cli_prints_the_table_and_exits_zero(nvrtc):
    proc = run_child([sys.executable, "-m", "qpn.cupy_kernels.compile_check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"kernel\s+\| arch\s+\| registers\s*\| smem\s*\| stack\s*\| spills\s*\| status", proc.stdout)
    assert "qpn2_dequantize" in proc.stdout and " failed" in proc.stdout


def test_sm70_builds_with_a_cuda12_nvrtc(nvrtc, cuda12):
    volta = tuple(v for v in all_variants() if "sm_70" in v.archs)
    reports, _ = compile_check.check_variants(volta, nvrtc=nvrtc, cuda12=cuda12)
    sm70 = [r for r in reports if r.arch == "sm_70"]
    assert sm70 and all(r.ok and r.stats is not None for r in sm70), compile_check.format_table(reports)


def test_import_needs_no_cupy():
    # `import qpn.cupy_kernels` and the compile check must work where CuPy is absent (CI).
    code = ("import sys; sys.modules['cupy'] = None; "
            "import qpn.cupy_kernels, qpn.cupy_kernels.compile_check; print('ok')")
    proc = run_child([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ----------------------------------------------------------------------------- the checker can fail

BAD_SOURCES = {
    # name: (source, expected problem regex)
    "cp_async": (
        r'''extern "C" __global__ void bad(const int* src) {
            __shared__ int s[32];
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4;"
                         :: "r"((unsigned)__cvta_generic_to_shared(s + threadIdx.x)), "l"(src + threadIdx.x));
        }''',
        r"forbidden PTX: cp\.async",
    ),
    "m8n8k4": (
        r'''extern "C" __global__ void bad(const unsigned* a, float* d) {
            unsigned x = a[threadIdx.x], y = a[threadIdx.x + 32];
            float c[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            asm volatile("mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 "
                         "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};"
                         : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]),
                           "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7])
                         : "r"(x), "r"(y), "r"(y), "r"(x));
            for (int i = 0; i < 8; ++i) d[8 * threadIdx.x + i] = c[i];
        }''',
        r"forbidden PTX: m8n8k4",
    ),
    "bf16": (
        r'''extern "C" __global__ void bad(const float* a, unsigned short* d) {
            unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(a[threadIdx.x]));
            d[threadIdx.x] = h;
        }''',
        r"forbidden PTX: bf16",
    ),
    "spills": (
        # 1024 threads x 1 block/SM limit registers to 64; 96 live accumulators cannot fit
        r'''extern "C" __global__ void __launch_bounds__(1024, 1) bad(const float* a, float* d, int n) {
            float acc[96];
            #pragma unroll
            for (int i = 0; i < 96; ++i) acc[i] = a[threadIdx.x + i * n];
            for (int j = 0; j < n; ++j) {
                #pragma unroll
                for (int i = 0; i < 96; ++i) acc[i] = acc[i] * acc[(i + 1) % 96] + a[j + i];
            }
            float s = 0;
            #pragma unroll
            for (int i = 0; i < 96; ++i) s += acc[i];
            d[threadIdx.x] = s;
        }''',
        r"register spills in bad",
    ),
    "local_array": (
        r'''extern "C" __global__ void bad(const int* idx, float* d) {
            float table[256];  // too big for registers, indexed at run time: local memory
            for (int i = 0; i < 256; ++i) table[i] = d[i * idx[i]];
            d[threadIdx.x] = table[idx[threadIdx.x] & 255];
        }''',
        r"stack frame \d+ B > 0 B",
    ),
    "too_much_static_smem": (
        r'''extern "C" __global__ void bad(float* d) {
            __shared__ float s[12800];  // 51200 B > 48 KiB
            s[threadIdx.x] = d[threadIdx.x]; __syncthreads();
            d[threadIdx.x] = s[12799 - threadIdx.x];
        }''',
        r"(static shared memory \d+ B > 49152 B|sm_75 build failed)",
    ),
    "missing_kernel": (
        r'''extern "C" __global__ void something_else(float* d) { d[threadIdx.x] = 1.0f; }''',
        r"kernel 'bad' not found",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SOURCES))
def test_checker_rejects_bad_source(nvrtc, case):
    text, expected = BAD_SOURCES[case]
    reports = compile_check.check_module(nvrtc, text, f"{case}.cu", [("bad", "bad", 0)])
    assert len(reports) == 1
    problems = "; ".join(reports[0].problems)
    assert not reports[0].ok and re.search(expected, problems), problems or "accepted"


def test_checker_accepts_a_clean_tiny_kernel(nvrtc):
    text = r'''#include "qpn_common.cuh"
    extern "C" __global__ void good(const float* a, qpn_u16* d) {
        d[threadIdx.x] = qpn_float_to_half_rn(a[threadIdx.x]);
    }'''
    (report,) = compile_check.check_module(nvrtc, text, "good.cu", [("good", "good", 0)])
    assert report.ok, report.problems
    assert report.stats.spill_stores == 0 and report.stats.smem == 0


def test_an_empty_compile_log_leaves_python_bytes_alone(nvrtc):
    """An empty NVRTC log is 1 byte (NUL). Filling a `b" " * 1` buffer would overwrite CPython's
    shared one-byte b" " with NUL for the whole process (seen: NUL-padded safetensors headers in
    later tests); the loader hands NVRTC fresh bytearrays instead."""
    result = loader.compile_text(nvrtc, 'extern "C" __global__ void quiet() {}', "quiet.cu", "sm_75")
    assert result.log.strip("\0") == "" and result.ptx
    assert bytes([32])[0] == 32 and b"{} " * 2 == b"{} {} "


# ----------------------------------------------------------------------------- parsers (no NVRTC)

PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k1' for 'sm_75'
ptxas info    : Function properties for k1
ptxas         .     256 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 70 registers, used 1 barriers, 256 bytes cumulative stack size, 4096 bytes smem, 372 bytes cmem[0]
ptxas info    : Compiling entry function 'k2' for 'sm_75'
ptxas info    : Function properties for k2
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers, 392 bytes cmem[0]
"""


def test_parse_ptxas_log():
    stats = compile_check.parse_ptxas_log(PTXAS_LOG)
    k1, k2 = stats["k1"], stats["k2"]
    assert (k1.registers, k1.smem, k1.stack, k1.spill_stores, k1.spill_loads) == (70, 4096, 256, 8, 4)
    assert (k2.registers, k2.smem, k2.stack, k2.spill_stores, k2.spill_loads) == (12, 0, 0, 0, 0)


SCAN_CASES = [
    ("\tcp.async.cg.shared.global [%r1], [%rd2], 16;", ["cp.async"]),
    ("\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {...};", ["m16n8k16"]),
    ("\tmma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {...};", []),  # Turing's shape: allowed
    ("\tcvt.rn.satfinite.e4m3x2.f32 %rs1, %f1, %f2;", ["fp8"]),
    ("\tcvt.rn.tf32.f32 %r1, %f1;", ["tf32"]),
    ("\tldmatrix.sync.aligned.m8n8.x4.shared.b16 {...}, [%r1];", []),
    ("\t// cp.async in a comment is fine\n\tld.global.cs.v4.u32 {...}, [%rd1];", []),
]


@pytest.mark.parametrize("ptx, expected", SCAN_CASES)
def test_scan_ptx(ptx, expected):
    found = compile_check.scan_ptx(ptx)
    assert len(found) == len(expected) and all(e in f for e, f in zip(expected, found, strict=True)), found


def test_variant_label():
    v = KernelVariant("x.cu", "k", (("A", "1"), ("B", "2")))
    assert v.label == "k[A=1,B=2]" and KernelVariant("x.cu", "k").label == "k"
