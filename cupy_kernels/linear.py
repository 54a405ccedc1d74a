"""The decode path: y = x @ W16^T for M in [1, 32] tokens, straight from QPN2 / QPN8 buffers.

- `qpn2_linear(x, codes, scales, global_scale, out=None, gated=False)`
- `qpn8_linear(x, codes, group_scales, out=None, gated=False)`

x: fp16 [M, K] CuPy (C-contiguous); codes / scales / group_scales as qpn2_prepack / qpn8_prepack
return them; global_scale: float32 scalar or one value per 32-column tile ([N/32]), host or
CuPy. Returns fp16 [M, N] (or `out`); with `gated=True` the weight stacks gate rows [0, N/2) and
up rows [N/2, N) and the result is fp16 [M, N/2] = silu_and_mul(gate, up) (DESIGN.md).

Numerics (DESIGN.md): the weights are exactly the contract's W16 (the same values the
dequantize kernels write), products are exact, accumulation is fp32 (tensor cores), one RN16 at
the end. Batch invariance: row i of an M-row call equals row i computed alone, bit for bit, for
every M in [1, 32] -- the K split (`split_k`) depends on N and K only, and every output element
goes through the same fp32 operations whatever M is.

No validation of the data here (it is the per-token hot path, and a value check would cost a
host sync): validate weights once at load time (prepack, or dequantize with check=True).
Shapes, dtypes, devices, contiguity and alignment are checked on every call. Launches go to the
current CuPy stream. Kernel design and measured numbers: cupy_kernels/qpn2_linear.cu.
"""

from __future__ import annotations

import math

import numpy as np

from ..ref.geometry import GROUP_K, TILE_N
from ..ref.qpn2 import PAD_K_FIX, PAD_N_FIX, QPN2_K_MULTIPLE
from ._validate import output_array, require_aligned, require_cupy, require_multiple
from .dequantize import PAD_K16_FIX, prepare_qpn2, prepare_qpn8
from .loader import kernel
from .variants import KernelVariant

MAX_M = 32  # the decode kernels' token limit (4 tensor-core n8 blocks)
TOKENS_PER_BLOCK = 8  # tokens per mma n8 block
# Split-K: warps per tile (K-slices, reduced in shared memory in a fixed order), chosen from N and
# K only. Aim at about TARGET_WARPS warps in all (the H200 holds 132 SMs x ~28 of these warps;
# a T4, 40 x 32), at most MAX_WARPS per block, at least MIN_GROUPS_PER_WARP 16-k groups per warp
# (shorter slices spend more of their time in the reduction). Measured on the H200, M = 1,
# % of the read ceiling (bench_decode.py "variants"): 28672x8192 QPN8 split 2/4/8/16: 67.2 /
# 79.9 / 86.5 / 81.6, QPN2 26.7 / 31.6 / 33.9 / 34.7; 4096x14336 split 8/16: QPN8 45.5 / 68.5.
TARGET_WARPS = 4096
MAX_WARPS = 16
MIN_GROUPS_PER_WARP = 8
TILES_PER_BLOCK = 1  # tile slots per block (a gated slot = gate tile + up tile)
# Groups per load batch. Measured on the H200 (bench_decode.py "variants", % of the read
# ceiling, M = 1): QPN8 unroll 2 vs 4: 79.9 vs 63.0 (28672x8192), 68.5 vs 56.7 (4096x14336):
# fewer registers, more resident warps; QPN2 unroll 4 vs 2: 34.9 vs 31.6, 32.6 vs 30.0 (QPN2 is
# instruction-bound, a longer batch gives the scheduler more independent work). Gated variants
# with 3-4 token blocks hold two tiles' accumulators and keep one batch in flight
# (QPN_DOUBLE_BUFFER=0) to compile without spills under the 128-register bound.
UNROLL = {  # (format, 8-token blocks, gated) -> groups per load batch
    **{("qpn2", nb, False): u for nb, u in ((1, 4), (2, 4), (3, 2), (4, 2))},
    **{("qpn8", nb, False): 2 for nb in (1, 2, 3, 4)},
    **{(fmt, nb, True): u for fmt in ("qpn2", "qpn8") for nb, u in ((1, 2), (2, 2), (3, 1), (4, 1))},
}
QPN8_K_MULTIPLE = GROUP_K


def _macros(fmt: str, nb: int, gated: bool, extra=()) -> tuple[tuple[str, str], ...]:
    return (
        ("QPN_DOUBLE_BUFFER", "0" if (gated and nb > 2) else "1"),
        ("QPN_GATED", str(int(gated))),
        ("QPN_NB", str(nb)),
        ("QPN_TILES", str(TILES_PER_BLOCK)),
        ("QPN_UNROLL", str(UNROLL[fmt, nb, gated])),
        ("QPN_WARPS", str(MAX_WARPS)),
        *extra,
    )


_BLOCKS = range(1, MAX_M // TOKENS_PER_BLOCK + 1)
# ptxas gives every shfl.sync a fallback subroutine for divergent warps (never taken here: all
# shuffles sit in warp-uniform control flow); in some builds that subroutine saves one register
# in an 8-byte stack slot. That is the only local memory these kernels may have.
FALLBACK_STACK_BYTES = 16
QPN2_LINEAR = {
    (nb, gated): KernelVariant("qpn2_linear.cu", "qpn2_linear", _macros("qpn2", nb, gated), archs=("sm_75",),
                               max_stack_bytes=FALLBACK_STACK_BYTES)
    for gated in (False, True)
    for nb in _BLOCKS
}
QPN8_LINEAR = {
    (nb, gated, block): KernelVariant(
        "qpn8_linear.cu", "qpn8_linear", _macros("qpn8", nb, gated, (("QPN8_BLOCK_SCALES", str(int(block))),)), archs=("sm_75",),
        max_stack_bytes=FALLBACK_STACK_BYTES,
    )
    for block in (False, True)
    for gated in (False, True)
    for nb in _BLOCKS
}
KERNEL_VARIANTS = (*QPN2_LINEAR.values(), *QPN8_LINEAR.values())


def split_k(n_tiles: int, groups: int) -> tuple[int, int]:
    """(warps per block, groups per warp) for N/32 tiles and K/16 groups. Never depends on M."""
    want = -(-TARGET_WARPS // max(1, n_tiles))  # warps per block for TARGET_WARPS in all
    split = min(MAX_WARPS, 1 << math.ceil(math.log2(want)), max(1, groups // MIN_GROUPS_PER_WARP))
    groups_per_warp = -(-groups // split)
    return -(-groups // groups_per_warp), groups_per_warp


DECODE_FORMATS = ("nvfp4", "fp8")


def decode_threshold(fmt: str, n: int, k: int) -> int:
    """Largest M that should run the decode kernel (above it: dequantize + cuBLAS) for [N, K].

    Chosen by measurement (benchmarks/results/decode_h200.md, H200): at every M <= 32 and on every
    benchmark shape the decode kernel beats dequantize-then-cuBLAS, by 1.3x to 10x, for both
    formats; extrapolating its time linearly in M, the crossover would come at M ~ 55
    (5120 x 17408) to M ~ 90 (28672 x 8192), past the kernels' range. So the threshold is the
    kernels' limit for every shape; N and K stay in the signature because the crossover is
    shape-dependent and a future kernel (or a Turing measurement) may move it below 32.
    Pure host arithmetic: safe to call on every forward, also during CUDA-graph capture.
    """
    if fmt not in DECODE_FORMATS:
        raise ValueError(f"fmt must be one of {DECODE_FORMATS}, got {fmt!r}")
    if n <= 0 or k <= 0:
        raise ValueError(f"n and k must be positive, got n={n}, k={k}")
    return MAX_M


def _activation(x, k_multiple: int, layout: str, fix: str, dense: str):
    require_cupy("x", x, np.float16, ndim=2)
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(
            f"x has M={m} rows; the {layout} decode kernel handles M in [1, {MAX_M}]: "
            f"use {dense} (the prefill path) for larger M"
        )
    require_multiple("K", k, k_multiple, layout, fix)
    require_aligned("x", x, 8)  # 8-byte loads of 4 consecutive k
    return m, k


def _rows_of(codes, k: int, bytes_per_k: float) -> int:
    """N from a prepacked code buffer ([N, K*bytes_per_k] as prepack returns it, or flat)."""
    require_cupy("codes", codes, np.uint8)
    row = int(k * bytes_per_k)
    if codes.ndim == 2:
        return codes.shape[0]
    if codes.ndim != 1 or codes.size % row:
        raise ValueError(
            f"codes must be [N, {row}] (as the prepack returns it for K={k}) or flat with a multiple of "
            f"{row} bytes, got shape {tuple(codes.shape)}; pass the buffers prepacked for this layer"
        )
    return codes.size // row


def _gated_rows(n: int, gated: bool) -> int:
    if not isinstance(gated, (bool, np.bool_)):
        raise ValueError(f"gated must be a bool, got {type(gated).__name__}")
    if gated and n % (2 * TILE_N):
        raise ValueError(
            f"gated=True needs N/2 % 32 == 0 (gate rows [0, N/2) and up rows [N/2, N) in whole tiles), "
            f"got N={n}; pad each half to a multiple of 32 rows"
        )
    return n // 2 if gated else n


def _launch_shape(n: int, k: int, gated: bool):
    n_slots = n // TILE_N // (2 if gated else 1)
    # the split follows the weight's tile count, gated or not: the gated kernel then sums every
    # tile exactly as the plain kernel does (its gate / up values equal qpn2_linear's, bit for bit)
    split, groups_per_warp = split_k(n // TILE_N, k // GROUP_K)
    grid = (-(-n_slots // TILES_PER_BLOCK),)
    block = (32 * split,)
    return n_slots, groups_per_warp, grid, block


def qpn2_linear(x, codes, scales, global_scale, out=None, gated: bool = False):
    """y = x @ W16^T for a QPN2 (NVFP4) weight, M in [1, 32] (module docstring).

    x: fp16 [M, K], K % 64 == 0; codes uint8 [N, K/2] or flat; scales uint8 [N, K/16] or flat;
    global_scale float32 scalar or [N/32]. Returns fp16 [M, N] ([M, N/2] when gated).
    """
    # validate (shapes, dtypes, devices, alignment) -> allocate -> grid/block -> launch
    m, k = _activation(x, QPN2_K_MULTIPLE, "QPN2", PAD_K_FIX, "qpn2_dense_linear")
    n = _rows_of(codes, k, 0.5)
    require_multiple("N", n, TILE_N, "QPN2", PAD_N_FIX)
    n, k, g, g_stride = prepare_qpn2(codes, scales, global_scale, n, k)
    out_cols = _gated_rows(n, gated)
    y = output_array(out, (m, out_cols), np.float16)
    n_slots, groups_per_warp, grid, block = _launch_shape(n, k, gated)
    fn = kernel(QPN2_LINEAR[-(-m // TOKENS_PER_BLOCK), bool(gated)])
    fn(grid, block, (codes, scales, g, np.int32(g_stride), x, y, np.int32(m), np.int32(n), np.int32(k),
                     np.int32(n_slots), np.int32(groups_per_warp)))
    return y


def qpn8_linear(x, codes, group_scales, out=None, gated: bool = False):
    """y = x @ W16^T for a QPN8 (FP8) weight, M in [1, 32] (module docstring).

    x: fp16 [M, K], K % 16 == 0 (128x128 block scales: K % 128 == 0); codes uint8 [N, K] or flat;
    group_scales fp16 [1, N] (channel / tensor) or [K/128, N/32] (block). Returns fp16 [M, N]
    ([M, N/2] when gated).
    """
    m, k = _activation(x, QPN8_K_MULTIPLE, "QPN8", PAD_K16_FIX, "qpn8_dense_linear")
    n = _rows_of(codes, k, 1.0)
    require_multiple("N", n, TILE_N, "QPN8", PAD_N_FIX)
    n, k, (kb_stride, _, col_stride) = prepare_qpn8(codes, group_scales, n, k)
    block_scales = col_stride == 0
    if not block_scales:
        require_aligned("group_scales", group_scales, 8)  # 8-byte loads of a quad's 4 scales
    out_cols = _gated_rows(n, gated)
    y = output_array(out, (m, out_cols), np.float16)
    n_slots, groups_per_warp, grid, block = _launch_shape(n, k, gated)
    fn = kernel(QPN8_LINEAR[-(-m // TOKENS_PER_BLOCK), bool(gated), block_scales])
    fn(grid, block, (codes, group_scales, np.int32(kb_stride), x, y, np.int32(m), np.int32(n), np.int32(k),
                     np.int32(n_slots), np.int32(groups_per_warp)))
    return y
