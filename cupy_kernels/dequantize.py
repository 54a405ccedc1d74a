"""GPU dequantization: QPN2 / QPN8 buffers -> fp16 W16 [N, K], bytes identical to qpn.ref.

- `qpn2_dequantize(codes, scales, global_scale, n, k, out=None, check=True)`:
  W16 = RN16(RN32(e2m1 * RN32(e4m3 * g(n)))), g a scalar or one fp32 per 32-column tile.
- `qpn8_dequantize(codes, group_scales, n, k, out=None, check=True)`:
  W16 = RN16(e4m3 * 2^-8 * S16).

Global scale (QPN2): a Python float / numpy float32 scalar / numpy float32 [N/32] is validated
on the host and uploaded (one tiny copy per call); a CuPy float32 array of size 1 or [N/32]
is used in place (stride 0 or 1 in the kernel), which is what a module should hold.

`check=True` (the default) rejects what qpn.ref rejects before writing anything: a small check
kernel reads only the scales (QPN2: N*K/16 bytes; QPN8: the codes too, for NaN bytes), ORs a
flag, and the host reads the flag back (one sync), then raises the reference's own error.
`check=False` skips both the kernel and the sync: use it in hot paths (forward passes, CUDA
graphs) for weights validated once at load time; bad scales then give inf/garbage, not an error.

`out`: an fp16 C-contiguous [N, K] CuPy array (16-byte aligned) to write into, or None.
Launches go to the current CuPy stream.
"""

from __future__ import annotations

import numpy as np

from ..ref.formats import QPN2, QPN8, WeightFormat
from ..ref.geometry import GROUP_K, TILE_N
from ..ref.qpn8 import qpn8_group_scales_format
from ._validate import (
    CupyArray,
    global_scale_on_device,
    launch_blocks,
    output_array,
    raise_reference_error,
    require_aligned,
    require_cupy,
    require_packed,
)
from .loader import kernel
from .variants import KernelVariant

# Groups one lane decodes (all their loads in flight at once: QPN2 2 x 9 B, QPN8 2 x 16 B)
# and groups staged per shared-memory phase (2: each store instruction writes 8 rows x 64 B).
# Measured on the H200 (benchmarks/results/h200.md, section "sweep"; 28672x8192, % of the
# streaming-read ceiling): QPN2 (2,2) 86.7, (4,2) 81.7, (8,2) 79.1, (4,4) 85.0, (8,4) 81.4;
# QPN8 (2,2) 84.2, (4,2) 81.9, (4,4) 85.0. (2,2) is best or within noise everywhere and keeps
# 16 KiB of staging per block (32 KiB would halve Turing's resident warps).
GROUPS_PER_THREAD = 2
STAGE_GROUPS = 2
WARPS_PER_BLOCK = 8  # 16 KiB of staging per block: 4 blocks (32 warps) fit a Turing SM
THREADS_PER_BLOCK = 32 * WARPS_PER_BLOCK
DEQUANTIZE_MACROS = (
    ("QPN_GROUPS_PER_THREAD", str(GROUPS_PER_THREAD)),
    ("QPN_STAGE_GROUPS", str(STAGE_GROUPS)),
    ("QPN_WARPS_PER_BLOCK", str(WARPS_PER_BLOCK)),
)

QPN2_DEQUANTIZE = KernelVariant("qpn2_dequantize.cu", "qpn2_dequantize", DEQUANTIZE_MACROS)
QPN2_CHECK_SCALES = KernelVariant("qpn2_dequantize.cu", "qpn2_check_scales", DEQUANTIZE_MACROS)
QPN8_DEQUANTIZE = KernelVariant("qpn8_dequantize.cu", "qpn8_dequantize", DEQUANTIZE_MACROS)
QPN8_CHECK = KernelVariant("qpn8_dequantize.cu", "qpn8_check", DEQUANTIZE_MACROS)
KERNEL_VARIANTS = (QPN2_DEQUANTIZE, QPN2_CHECK_SCALES, QPN8_DEQUANTIZE, QPN8_CHECK)

CHECK_MAX_BLOCKS = 1024  # the check kernels are grid-stride loops; 1024 x 256 threads fill any GPU


def prepare_qpn2(codes: CupyArray, scales: CupyArray, global_scale: float | np.ndarray | CupyArray, n: int, k: int
                 ) -> tuple[int, int, CupyArray, int]:
    """Validate QPN2 dequantize inputs; returns (n, k, device global scale, its tile stride)."""
    n, k = QPN2.require_int_dims(n, k)
    require_packed(QPN2, "codes", codes, n, k)
    require_packed(QPN2, "scales", scales, n, k)
    require_qpn2_aligned(codes, scales)
    g, g_stride = global_scale_on_device(global_scale, n)
    return n, k, g, g_stride


def require_qpn2_aligned(codes: CupyArray, scales: CupyArray) -> None:
    """The GPU's rule on QPN2 buffers, which a torch op's metadata checks cannot see."""
    require_aligned("codes", codes, 8)  # 8-byte loads
    require_aligned("scales", scales, 4)  # the check kernel reads 4 bytes at a time


def check_qpn2(codes: CupyArray, scales: CupyArray, g: CupyArray, g_stride: int, n: int, k: int,
               global_scale: float | np.ndarray | CupyArray) -> None:
    """The reference's value rules on the GPU; raises the reference's ValueError (one host sync)."""
    import cupy  # noqa: PLC0415

    n_tiles, groups = n // TILE_N, k // GROUP_K
    flags = cupy.zeros(1, dtype=cupy.int32)
    check_grid = (min(launch_blocks(n_tiles * groups * 8, THREADS_PER_BLOCK), CHECK_MAX_BLOCKS),)
    kernel(QPN2_CHECK_SCALES)(
        check_grid, (THREADS_PER_BLOCK,), (scales, g, np.int32(g_stride), np.int32(n_tiles), np.int32(groups), flags)
    )
    if int(flags.get()[0]):  # the one sync of a checked call
        from ..ref.qpn2 import qpn2_dequantize as reference  # noqa: PLC0415

        raise_reference_error(
            reference, codes, scales, global_scale, n, k,
            flagged="a NaN scale byte, an overflowing block or a bad global scale",
        )


def launch_qpn2_dequantize(codes: CupyArray, scales: CupyArray, g: CupyArray, g_stride: int, out: CupyArray, n: int,
                           k: int, variant: KernelVariant = QPN2_DEQUANTIZE) -> None:
    """grid -> launch for validated arguments (no checks, no sync); `variant`: the NVFP4 build, or MXFP4's
    (cupy_kernels/mxfp4.py: g the tiles' 2^T)."""
    n_tiles, groups = n // TILE_N, k // GROUP_K
    # grid: one warp per (tile, GROUPS_PER_THREAD groups)
    chunks = -(-groups // GROUPS_PER_THREAD)
    grid = (launch_blocks(n_tiles * chunks * 32, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)
    args = (codes, scales, g, np.int32(g_stride), out, np.int32(n_tiles), np.int32(groups))
    kernel(variant)(grid, block, args)


def qpn2_dequantize(codes: CupyArray, scales: CupyArray, global_scale: float | np.ndarray | CupyArray, n: int, k: int,
                    out: CupyArray | None = None, check: bool = True) -> CupyArray:
    """QPN2 buffers (CuPy) -> fp16 [n, k] under the qpn contract (= qpn.ref.qpn2_dequantize).

    codes: uint8 [n, k/2] or flat; scales: uint8 [n, k/16] or flat (as qpn2_prepack returns);
    global_scale: float32 scalar or [n/32] (host or CuPy). See the module docstring for `check`.
    """
    # validate; allocate (or validate the caller's buffer) before any launch
    n, k, g, g_stride = prepare_qpn2(codes, scales, global_scale, n, k)
    out = output_array(out, (n, k), np.float16)
    if check:
        check_qpn2(codes, scales, g, g_stride, n, k, global_scale)
    launch_qpn2_dequantize(codes, scales, g, g_stride, out, n, k)
    return out


def qpn8_strides(wf: WeightFormat, n: int) -> tuple[int, int, int]:
    """(kb stride, tile stride, column stride) the kernels read the group scales of layout `wf` with."""
    if wf is QPN8:
        return 0, TILE_N, 1  # S16[0, n]: n = 32 t + col
    return n // TILE_N, 1, 0  # 128x128 blocks: S16[g // 8, t]


def prepare_qpn8(codes: CupyArray, group_scales: CupyArray, n: int, k: int) -> tuple[int, int, tuple[int, int, int]]:
    """Validate QPN8 dequantize inputs; returns (n, k, (kb stride, tile stride, column stride))."""
    n, k = QPN8.require_int_dims(n, k)
    require_packed(QPN8, "codes", codes, n, k)
    require_cupy("group_scales", group_scales, QPN8.buffer("group_scales").dtype, ndim=2)
    strides = qpn8_strides(qpn8_group_scales_format(group_scales.shape, n, k), n)
    require_qpn8_aligned(codes)
    return n, k, strides


def require_qpn8_aligned(codes: CupyArray) -> None:
    """The GPU's rule on QPN8 codes, which a torch op's metadata checks cannot see."""
    require_aligned("codes", codes)  # 16-byte loads


def check_qpn8(codes: CupyArray, group_scales: CupyArray, n: int, k: int) -> None:
    """The reference's value rules on the GPU; raises the reference's ValueError (one host sync)."""
    import cupy  # noqa: PLC0415

    flags = cupy.zeros(1, dtype=cupy.int32)
    units = n * k // 16
    check_grid = (min(launch_blocks(units, THREADS_PER_BLOCK), CHECK_MAX_BLOCKS),)
    kernel(QPN8_CHECK)(
        check_grid, (THREADS_PER_BLOCK,), (codes, np.int64(units), group_scales, np.int64(group_scales.size), flags)
    )
    if int(flags.get()[0]):  # the one sync of a checked call
        from ..ref.qpn8 import qpn8_dequantize as reference  # noqa: PLC0415

        raise_reference_error(reference, codes, group_scales, n, k,
                              flagged="a NaN code byte or a bad / overflowing group scale")


def launch_qpn8_dequantize(codes: CupyArray, group_scales: CupyArray, strides: tuple[int, int, int], out: CupyArray,
                           n: int, k: int) -> None:
    """grid -> launch for validated arguments (no checks, no sync)."""
    kb_stride, tile_stride, col_stride = strides
    n_tiles, groups = n // TILE_N, k // GROUP_K
    # grid: one warp per (tile, GROUPS_PER_THREAD groups)
    chunks = -(-groups // GROUPS_PER_THREAD)
    grid = (launch_blocks(n_tiles * chunks * 32, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)
    kernel(QPN8_DEQUANTIZE)(
        grid,
        block,
        (codes, group_scales, np.int64(kb_stride), np.int32(tile_stride), np.int32(col_stride), out,
         np.int32(n_tiles), np.int32(groups)),
    )


def qpn8_dequantize(codes: CupyArray, group_scales: CupyArray, n: int, k: int, out: CupyArray | None = None,
                    check: bool = True) -> CupyArray:
    """QPN8 buffers (CuPy) -> fp16 [n, k], W16 = RN16(e4m3 * 2^-8 * S16) (= qpn.ref.qpn8_dequantize).

    codes: uint8 [n, k] or flat; group_scales: float16 [1, n] or [k/128, n/32] (as
    qpn8_prepack returns). See the module docstring for `check`.
    """
    # validate; allocate (or validate the caller's buffer) before any launch
    n, k, strides = prepare_qpn8(codes, group_scales, n, k)
    out = output_array(out, (n, k), np.float16)
    if check:
        check_qpn8(codes, group_scales, n, k)
    launch_qpn8_dequantize(codes, group_scales, strides, out, n, k)
    return out
